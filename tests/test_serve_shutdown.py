"""Answers still being given when `statekv serve` stops (`statekv.serve.server.AppServer`), on a server in this
process with a tiny random model whose every answer token is slowed down: an answer under way stops between two
tokens shortly before the graceful shutdown's timeout, and a question still waiting for the model is not begun; each
answers a one-line 503."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("uvicorn")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402
from statekv.serve.server import AppServer  # noqa: E402
from statekv.testing import make_tiny_checkpoint  # noqa: E402

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


def test_answers_running_as_the_server_stops_end_in_one_line_503s_before_its_timeout(tmp_path):
    """Before: uvicorn cancelled them at its timeout (a plain-text 500 and a traceback in the log)."""
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "tiny", vision_config={"image_size": 112},
                                      text_config={"max_position_embeddings": 2048})  # room for long answers
    qa = statekv.VideoQA.from_pretrained(checkpoint)
    head = qa.adapter.model.get_output_embeddings()
    head.register_forward_pre_hook(lambda module, inputs: time.sleep(TOKEN_SECONDS))
    config = ServeConfig(options=ModelOptions(model=str(checkpoint)), state_dir=tmp_path / "state", api_keys=(KEY,),
                         page=False, save_every_seconds=600)
    server = AppServer(create_app(config, qa=qa), host="127.0.0.1", port=0, log_level="warning",
                       timeout_graceful_shutdown=GRACE)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
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
            with client.stream("POST", f"/v1/streams/{streams[0]}/ask", json={**ask, "stream": True}) as events:
                replies["events"] = lines = []
                for line in events.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {\"token\""):
                        started.set()

        def plain() -> None:
            replies["plain"] = client.post(f"/v1/streams/{streams[1]}/ask", json=ask)

        asking = [threading.Thread(target=token_by_token), threading.Thread(target=plain)]
        asking[0].start()
        assert started.wait(timeout=60)
        asking[1].start()  # waits for the model, busy with the first answer
        time.sleep(0.5)
        stopping = time.monotonic()
        server.should_exit = True
        thread.join(timeout=60)
        stopped = time.monotonic() - stopping
        for asker in asking:
            asker.join(timeout=60)
    assert not thread.is_alive() and stopped < GRACE + 5, stopped  # before: the answer ran on, the server with it
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
