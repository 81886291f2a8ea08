"""Many clients acting on one stream at the same moment (a camera pushing, a dashboard asking, an operator deleting,
a follower reconnecting): each request is answered with one line or its result, and the stream is left whole or
wholly gone. Each case makes one side wait where the other must overtake it (a public function monkeypatched), so
the race is run the same way every time, and says what the service did before."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402

from test_serve_watches import Running, pictures, push  # noqa: E402,F401 -- the in-process server and its frames

WAIT_SECONDS = 3.0  # the longest one side waits for the other to arrive (where it never comes, once fixed)


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin"))


def _one_line(response) -> str:
    message = response.json()["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return message


def test_two_deletes_of_one_stream_at_once_delete_it_once_and_the_other_is_a_404(tmp_path, qa, pictures):
    """Before: both deletes went through the whole deletion (both 200), and the first one's removal of the
    stream's files took the second's half-written deletion note with them, so the second answered a 503 "the
    state folder cannot be changed (No such file or directory); nothing was deleted and the stream is as it was"
    for a stream that was gone."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        push(client, stream_id, pictures, 0, 2)
        files = server.app.state.service.registry.files
        begin_removal, both = files.begin_removal, threading.Barrier(2, timeout=WAIT_SECONDS)

        def begin_removal_together(stream, tier):  # each deletion waits here for the other (for a while)
            begin_removal(stream, tier)
            with contextlib.suppress(threading.BrokenBarrierError):
                both.wait()

        files.begin_removal = begin_removal_together
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: client.delete(f"/v1/streams/{stream_id}"), range(2)))
        assert sorted(answer.status_code for answer in answers) == [200, 404], [answer.text for answer in answers]
        assert "no stream" in _one_line(next(answer for answer in answers if answer.status_code == 404))
        assert client.get(f"/v1/streams/{stream_id}").status_code == 404
        assert sorted(path.name for path in (state / "streams").iterdir() if path.name.startswith(stream_id)) == []
