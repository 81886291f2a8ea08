"""Answers still being given when `statekv serve` stops (`statekv.serve.server.AppServer`), on a server in this
process with a tiny random model whose every answer token is slowed down: an answer under way stops between two
tokens shortly before the graceful shutdown's timeout (at once after a second Ctrl-C), and a question still waiting for
the model is not begun; each answers a one-line 503. An answer made whole as the stop came is given."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import types

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("uvicorn")
prometheus_client = pytest.importorskip("prometheus_client")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.answering import ServerStopped, answer_arguments, check_answer  # noqa: E402
from statekv.serve.server import AppServer  # noqa: E402
from statekv.testing import make_tiny_checkpoint, write_test_video  # noqa: E402

KEY = "shutdown-key"
GRACE = 3  # the graceful shutdown's timeout: answers stop at half of it (`ANSWER_MARGIN_SECONDS` is longer)
TOKEN_SECONDS = 0.05  # each answer token takes at least this long: 400 tokens take 20 s, far past the grace


def _frame(seed: int) -> bytes:
    import io

    from PIL import Image

    picture = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return buffer.getvalue()


def _checkpoint(tmp_path):
    return make_tiny_checkpoint("internvl", tmp_path / "tiny", vision_config={"image_size": 112},
                                text_config={"max_position_embeddings": 2048})  # room for long answers


def _serving(tmp_path, checkpoint, qa, **settings):
    """``(app, server, its thread, its URL)``: a server of ``qa`` in this process, started, stopping with a graceful
    timeout of `GRACE` seconds."""
    config = ServeConfig(options=ModelOptions(model=str(checkpoint)), state_dir=tmp_path / "state", api_keys=(KEY,),
                         page=False, save_every_seconds=600, **settings)
    app = create_app(config, qa=qa)
    server = AppServer(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=GRACE)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return app, server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("case", ["batched", "alone", "a second ctrl-c"])
def test_answers_running_as_the_server_stops_end_in_one_line_503s_before_its_timeout(tmp_path, case):
    """Before: uvicorn cancelled them at its timeout (a plain-text 500 and a traceback in the log), and the server
    waited for the model's thread to finish the answer anyway. ``alone``: answered by ``generate`` (a repetition
    penalty takes a question out of the batched path); ``a second ctrl-c``: uvicorn's shutdown cut short, the
    answer must stop all the same."""
    checkpoint = _checkpoint(tmp_path)
    qa = statekv.VideoQA.from_pretrained(checkpoint)
    if case == "alone":
        qa.adapter.model.generation_config.repetition_penalty = 1.1
    head = qa.adapter.model.get_output_embeddings()
    head.register_forward_pre_hook(lambda module, inputs: time.sleep(TOKEN_SECONDS))
    app, server, thread, url = _serving(tmp_path, checkpoint, qa)
    replies: dict[str, object] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        streams = []
        for seed in (1, 2):
            stream = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            for index in range(2):
                pushed = client.post(f"/v1/streams/{stream}/frames", content=_frame(10 * seed + index),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            streams.append(stream)
        ask = {"question": "What is shown?", "max_new_tokens": 400}
        started = threading.Event()

        def token_by_token() -> None:
            replies["events"] = lines = []
            with contextlib.suppress(httpx.HTTPError), client.stream(  # a second Ctrl-C closes the connections
                    "POST", f"/v1/streams/{streams[0]}/ask", json={**ask, "stream": True}) as events:
                for line in events.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {\"token\""):
                        started.set()

        def plain() -> None:
            try:
                replies["plain"] = client.post(f"/v1/streams/{streams[1]}/ask", json=ask)
            except httpx.HTTPError as error:  # a second Ctrl-C closes the connections
                replies["plain"] = error

        worker = app.state.service.worker
        asking = [threading.Thread(target=token_by_token), threading.Thread(target=plain)]
        asking[0].start()
        assert started.wait(timeout=60)
        asking[1].start()
        deadline = time.monotonic() + 60
        while worker.queued < 2:  # the second question waits for the model, busy with the first answer
            assert time.monotonic() < deadline and asking[1].is_alive()
            time.sleep(0.02)
        stopping = time.monotonic()
        server.should_exit = True
        if case == "a second ctrl-c":
            time.sleep(0.3)
            server.force_exit = True
        thread.join(timeout=60)
        stopped = time.monotonic() - stopping
        for asker in asking:
            asker.join(timeout=60)
    assert not thread.is_alive() and stopped < GRACE + 5, stopped  # before: the answer ran on, the server with it
    if case == "a second ctrl-c":
        return  # the requests were cancelled, their connections closed: nothing to read
    counted = prometheus_client.generate_latest(app.state.service.metrics.registry).decode()
    assert "statekv_answers_stopped_total 2.0" in counted, counted
    events = [line for line in replies["events"] if line]
    assert events[-2] == "event: error", events
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == 503 and error["message"].startswith("the server is stopping: the answer was stopped "
                                                                "after "), error
    assert error["message"].endswith(" tokens and is not recorded; ask again once the server is back")
    assert 0 < int(error["message"].split("stopped after ")[1].split()[0]) < 400
    waiting = replies["plain"]
    assert waiting.status_code == 503 and waiting.headers["retry-after"] == "10", waiting.text
    assert waiting.json()["error"]["message"] == ("the server is stopping: the question was not answered; ask again "
                                                  "once the server is back")


def test_an_answer_made_whole_as_the_stop_came_is_not_refused():
    """``generate`` asks its stopping criteria after the last token too: an answer ended by its end token, or by
    ``max_new_tokens``, as the server stopped is whole and given; one cut before either is refused."""
    stopping = threading.Event()
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[7, 9]))
    for tokens, refused in (([3, 9], False), ([3, 4, 5], False), ([3, 4], True), ([], True)):
        kwargs = {"max_new_tokens": 3, **answer_arguments(stopping)}
        stopping.set()
        kwargs["stopping_criteria"](torch.tensor([[1, 2, *tokens]]), None)  # the stop seen at the last token
        if refused:
            with pytest.raises(ServerStopped, match=f"stopped after {len(tokens)} tokens"):
                check_answer(kwargs, torch.tensor([tokens], dtype=torch.long).reshape(1, -1), model)
        else:
            check_answer(kwargs, torch.tensor([tokens]), model)
        stopping.clear()
    with pytest.raises(ServerStopped, match="the question was not answered"):
        stopping.set()
        check_answer({"max_new_tokens": 3, **answer_arguments(stopping)})


def test_a_chat_question_over_a_file_being_encoded_as_the_server_stops_ends_in_a_503(tmp_path):
    """Before: the file's encoding ran on past the graceful timeout (uvicorn's 500, a traceback), the server held
    until it and the answer ended. Each of its steps is slowed: the stop comes while it encodes."""
    checkpoint = _checkpoint(tmp_path)
    qa = statekv.VideoQA.from_pretrained(checkpoint)
    qa.adapter.model.get_input_embeddings().register_forward_pre_hook(lambda module, inputs: time.sleep(0.05))
    media = tmp_path / "media"
    media.mkdir()
    write_test_video(media / "long.mp4", frames=200, fps=1.0, size=(112, 112))  # about 10 s to encode
    _, server, thread, url = _serving(tmp_path, checkpoint, qa, media_root=media)
    replies = []
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": f"file://{media / 'long.mp4'}"}},
        {"type": "text", "text": "What is shown?"}]}], "max_tokens": 400}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        asking = threading.Thread(target=lambda: replies.append(client.post("/v1/chat/completions", json=body)))
        asking.start()
        time.sleep(1.0)
        stopping = time.monotonic()
        server.should_exit = True
        thread.join(timeout=60)
        stopped = time.monotonic() - stopping
        asking.join(timeout=60)
    assert not thread.is_alive() and stopped < GRACE + 5, stopped
    assert replies[0].status_code == 503, replies[0].text
    assert replies[0].json()["error"]["message"] == ("the server is stopping: the question was not answered; ask "
                                                     "again once the server is back")
