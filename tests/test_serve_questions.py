"""Questions over HTTP answered together: questions to several streams that arrive while the model's thread is busy
are answered as one batch (``statekv_question_batch_size`` in ``/metrics``), each with the answer its stream gives
alone."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.synthetic.prompts import question_prompt  # noqa: E402

from test_serve_watches import Running, pictures, push  # noqa: E402,F401 -- the in-process server and its frames

COLOUR = question_prompt("What colour was the circle?", ["red", "green", "blue", "yellow"])
COUNT = question_prompt("How many times did the video show red?", ["1", "2", "3", "4"])


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin"))


def question_batches(client) -> dict[str, float]:
    """``statekv_question_batch_size``'s buckets (upper bound -> count) and its count."""
    text = client.get("/metrics").text
    found = dict(re.findall(r'^statekv_question_batch_size_bucket\{le="([^"]+)"\} (\S+)$', text, re.MULTILINE))
    found["count"] = re.search(r"^statekv_question_batch_size_count (\S+)$", text, re.MULTILINE).group(1)
    return {bound: float(value) for bound, value in found.items()}


def test_questions_arriving_together_are_answered_in_one_batch_as_alone(tmp_path, qa, pictures):
    server = Running(tmp_path / "state", qa)
    worker = server.app.state.service.worker
    lengths = (3, 7, 5, 9)
    questions = [(COLOUR, 4), (COUNT, 6), (COLOUR + " Think.", 3), (COUNT, 2)]
    try:
        with server.client() as client:
            ids = []
            for count in lengths:
                stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
                push(client, stream_id, pictures, 0, count)
                ids.append(stream_id)
            before = question_batches(client)
        started, release = threading.Event(), threading.Event()
        busy = threading.Thread(target=worker.run_blocking, args=(lambda: (started.set(), release.wait(60)),))
        busy.start()  # the model's thread is busy while the questions arrive
        assert started.wait(30)

        def ask(index: int) -> str:
            question, tokens = questions[index]
            with server.client() as client:
                answered = client.post(f"/v1/streams/{ids[index]}/ask",
                                       json={"question": question, "max_new_tokens": tokens})
                assert answered.status_code == 200, answered.text
                return answered.json()["answer"]

        with ThreadPoolExecutor(len(ids)) as pool:
            answers = [pool.submit(ask, index) for index in range(len(ids))]
            deadline = time.monotonic() + 30
            while worker.queued < len(ids):  # every question waits behind the busy thread
                assert time.monotonic() < deadline, worker.queued
                time.sleep(0.01)
            release.set()
            answers = [answer.result(timeout=120) for answer in answers]
        busy.join()
        with server.client() as client:
            after = question_batches(client)
    finally:
        server.stop()
    assert after["count"] - before["count"] == 1  # one batch answered the four questions
    assert after["4.0"] - after["2.0"] - (before["4.0"] - before["2.0"]) == 1
    for count, (question, tokens), answer in zip(lengths, questions, answers):
        with qa.stream(max_fps=1) as alone:
            for k, picture in enumerate(pictures[:count]):
                alone.push(_decoded(picture), float(k))
            assert answer == alone.ask(question, max_new_tokens=tokens)


def _decoded(picture: bytes):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(picture)).convert("RGB"))
