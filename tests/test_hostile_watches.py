"""Watches under careless use (the hunt of watches): a watch opened or deleted while a file is fed to its stream,
one whose question fits an empty stream but not the state it soon carries, and one too long for its stream."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from statekv.synthetic.benchmark import make_benchmark  # noqa: E402

import test_hostile_service as service_tests  # noqa: E402
from test_hostile_service import Running, _png  # noqa: E402

options, qa = service_tests.options, service_tests.qa  # its module's fixtures: one model for both files' tests

QUESTION = "How many times did the video show blue?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer with the letter."


def _slow_feed(server, seconds: float) -> None:
    """Each frame of a feed waits ``seconds`` before its push (a long file, or a slow model, in a short test)."""
    worker = server.service.worker
    push = worker.push

    async def slowly(*args, **kwargs):
        await asyncio.sleep(seconds)
        return await push(*args, **kwargs)

    worker.push = slowly


def test_a_watch_is_deleted_and_made_while_its_stream_is_fed_without_waiting_for_the_feed(qa, tmp_path):
    """Before: a watch's DELETE (and a POST of a new one) waited for the whole file being fed to end: the deleted
    watch went on being evaluated (and its events sent to followers) for every frame of the feed, and the new one
    missed every frame of it, its request holding one of --max-asks all the while."""
    media = tmp_path / "media"
    make_benchmark(media, videos=1, seed=4245, num_frames=12)
    video = str(next(media.rglob("*.mp4")).relative_to(media))
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        made = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 1,
                                                                      "max_new_tokens": 2})
        assert made.status_code == 201, made.text
        watch_id = made.json()["id"]
        _slow_feed(server, 0.3)  # 12 frames: about 3.6 s of feed
        fed = {}
        feeding = threading.Thread(target=lambda: fed.update(reply=server.client().post(
            f"/v1/streams/{stream_id}/frames", json={"source": video})))
        feeding.start()
        try:
            deadline = time.monotonic() + 30
            while (client.get(f"/v1/streams/{stream_id}").json().get("feed") or {}).get("offered", 0) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            started = time.monotonic()
            gone = client.delete(f"/v1/streams/{stream_id}/watches/{watch_id}")
            took = time.monotonic() - started
            assert gone.status_code == 200, gone.text
            assert client.get(f"/v1/streams/{stream_id}").json()["feed"]["running"], \
                f"the DELETE answered only once the feed had ended ({took:.1f} s)"
            started = time.monotonic()
            new = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 1,
                                                                         "max_new_tokens": 2})
            took = time.monotonic() - started
            assert new.status_code == 201, new.text
            assert client.get(f"/v1/streams/{stream_id}").json()["feed"]["running"], \
                f"the new watch was made only once the feed had ended ({took:.1f} s)"
        finally:
            feeding.join(60)
        assert fed["reply"].status_code == 200, fed["reply"].text
        frames = fed["reply"].json()["frames"]
        watch = client.get(f"/v1/streams/{stream_id}/watches/{new.json()['id']}").json()
        assert watch["evaluations"] > 1, watch  # it read the frames of the feed pushed after it was made
        assert frames >= 8, frames


def test_a_watch_question_too_long_for_the_stream_is_a_413_as_for_a_question_asked(qa, tmp_path):
    """Before: the same question that `ask` refuses with a 413 (docs/serving.md, "Errors and limits": a question
    whose tokens and answer do not fit the room its stream keeps for them) was a 409 as a watch's."""
    question = "word " * 1500  # under 8000 characters, over the model's 4096 positions in tokens
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        for seconds in (0.0, 1.0):
            pushed = client.post(f"/v1/streams/{stream_id}/frames?t={seconds}", content=_png(int(seconds)),
                                 headers={"Content-Type": "image/png"})
            assert pushed.status_code == 200, pushed.text
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": question, "max_new_tokens": 4})
        assert asked.status_code == 413, asked.text
        watched = client.post(f"/v1/streams/{stream_id}/watches", json={"question": question, "every": 1,
                                                                         "max_new_tokens": 4})
        assert watched.status_code == 413, watched.text
        assert "\n" not in watched.json()["error"]["message"]
        assert client.get(f"/v1/streams/{stream_id}/watches").json()["data"] == []


def test_a_watch_made_on_an_empty_stream_is_refused_if_it_cannot_be_evaluated_once_the_stream_carries(qa, tmp_path):
    """Before: a watch whose question and answer fit beside an empty stream's carried state (none) but not beside
    the budget it carries after a few frames was made (201), and then never evaluated: every push logged a
    warning, its followers heard nothing, and the same question asked was a 413."""
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        watches = f"/v1/streams/{stream_id}/watches"

        def made(length: int):
            return client.post(watches, json={"question": "x" * length, "every": 1, "max_new_tokens": 1})

        low, high = 1, 7999  # the longest question a watch of the empty stream is made with
        while low < high:
            middle = (low + high + 1) // 2
            reply = made(middle)
            if reply.status_code == 201:
                assert client.delete(f"{watches}/{reply.json()['id']}").status_code == 200
                low = middle
            else:
                high = middle - 1
        reply = made(low)
        if reply.status_code == 201:  # then it must be answered once the stream has frames
            watch_id = reply.json()["id"]
            for seconds in range(8):
                pushed = client.post(f"/v1/streams/{stream_id}/frames?t={seconds}", content=_png(seconds),
                                     headers={"Content-Type": "image/png"})
                assert pushed.status_code == 200, pushed.text
            watch = client.get(f"{watches}/{watch_id}").json()
            assert watch["error"] is None and watch["evaluations"] > 0, watch["error"]
        else:
            assert reply.status_code == 413, reply.text
