"""The OpenAI chat route's stop sequences and answers not streamed, reviewed: a stop sequence met is left out of the
answer not streamed as it is out of the streamed one, and a chat question not streamed answered in a batch that
fails is answered again alone, as it was before it took a streamer.

Each server is built in this process (the built-in model, FastAPI's TestClient). Each case says what the route did
before.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

import statekv  # noqa: E402
import statekv.api.asking as asking  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve import ServeConfig, create_app  # noqa: E402

from conftest import png_bytes, random_frames  # noqa: E402

KEY = "review-openai-key"
QUESTION = "What colour was the triangle?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A client, the served `VideoQA` and the ids of two streams of three frames."""
    options = ModelOptions(model="builtin", budget=64)
    qa = statekv.VideoQA.from_options(options)
    config = ServeConfig(options=options, state_dir=tmp_path_factory.mktemp("review") / "state", api_keys=(KEY,),
                         page=False, save_every_seconds=600)
    with TestClient(create_app(config, qa=qa), headers={"Authorization": f"Bearer {KEY}"}) as client:
        ids = []
        for seed in (7, 8):
            stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
            for frame in random_frames(3, seed=seed):
                pushed = client.post(f"/v1/streams/{stream_id}/frames", content=png_bytes(frame),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            ids.append(stream_id)
        yield client, qa, ids


def _completion(client, stream_id: str, streamed: bool, **fields) -> tuple[str, str]:
    """The answer's text and its finish_reason, streamed or not."""
    body = {"model": "builtin", "max_tokens": 12, "messages": [{"role": "user", "content": QUESTION}],
            "statekv": {"stream_id": stream_id}, "stream": streamed, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text[:300]
    if not streamed:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [chunk for chunk in chunks if chunk.get("choices")]
    assert chunks, response.text[:300]
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks), \
        chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stop", ["B: ", "A: "])
def test_a_stop_sequence_ending_in_whitespace_is_left_out_of_an_answer_not_streamed(served, stop):
    """Before: the answer not streamed was cut from its text stripped of whitespace, where a stop sequence met on
    its last token (ending in a space) was no longer found: the answer held the stop sequence's text ("A: B:" for
    the stop "B: "), though its generation stopped there and its finish_reason said so; streamed, it did not."""
    client, qa, ids = served
    tokenizer = qa.adapter.tokenizer
    tokens = {tokenizer.decode([token]): token for token in range(len(tokenizer))}
    script = [tokens["A"], tokens[": "], tokens["B"], tokens[": "], tokens["C"]]  # the answer "A: B: C"
    made: list[int] = []

    def scripted(module, inputs, logits):  # each answer token the script's next
        forced = torch.full_like(logits, -1e4)
        forced[..., script[min(len(made), len(script) - 1)]] = 1e4
        made.append(1)
        return forced

    hook = qa.adapter.model.get_output_embeddings().register_forward_hook(scripted)
    try:
        made.clear()
        assert _completion(client, ids[0], False, max_tokens=5) == ("A: B: C", "length")
        made.clear()
        whole = _completion(client, ids[0], False, max_tokens=5, stop=stop)
        made.clear()
        streamed = _completion(client, ids[0], True, max_tokens=5, stop=stop)
    finally:
        hook.remove()
    before = "A: B: C"[:"A: B: C".find(stop)]
    assert streamed == (before, "stop")
    assert whole == (before.strip(), "stop")  # an answer not streamed is stripped of whitespace, as ever


def test_a_chat_question_not_streamed_in_a_batch_that_fails_is_answered_alone(served, monkeypatch):
    """Before: a chat answer not streamed took a streamer (to stop once its client leaves, or at a stop sequence),
    and a question with a streamer whose batch failed was not answered again alone, as one with none is: the
    question that was answered alone before the streamer came was a 500. A streamed one whose batch failed before
    its first token is answered alone too (none of its text was sent)."""
    client, qa, ids = served
    alone = [_completion(client, stream_id, False) for stream_id in ids]
    streamed_alone = _completion(client, ids[0], True, stop="red red")
    together = asking.answer_together

    def failing(questions):  # a batch of more than one fails (a device out of memory, say); one alone does not
        if len(questions) > 1:
            raise RuntimeError("the batch does not fit")
        return together(questions)

    monkeypatch.setattr(asking, "answer_together", failing)
    worker = client.app.state.service.worker
    started, release = threading.Event(), threading.Event()
    busy = threading.Thread(target=worker.run_blocking, args=(lambda: (started.set(), release.wait(30)),))
    busy.start()  # the model's thread is busy while the questions arrive: they are answered together
    assert started.wait(30)
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(_completion, client, stream_id, False) for stream_id in ids]
            answers.append(pool.submit(_completion, client, ids[1], True, stop="red red"))
            deadline = time.monotonic() + 30
            while worker.queued < 3:
                assert time.monotonic() < deadline, worker.queued
                time.sleep(0.01)
            release.set()
            answers = [answer.result(timeout=60) for answer in answers]
    finally:
        release.set()
        busy.join(30)
    assert answers[:2] == alone
    assert answers[2][1] == streamed_alone[1] == "stop" and answers[2][0] == alone[1][0][:alone[1][0].find("red red")]
