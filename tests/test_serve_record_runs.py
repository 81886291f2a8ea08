"""`statekv serve` when its state folder cannot take a stream's record as a start brings the stream back: the ids of
its watch events are never sent twice, across restarts."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from statekv.serve.store import StreamFiles  # noqa: E402

import test_serve_watches as serve_tests  # noqa: E402
from test_hostile_watch_resume import watched_and_stopped  # noqa: E402
from test_serve_watches import Running, followed, push  # noqa: E402

qa, pictures = serve_tests.qa, serve_tests.pictures  # its module's fixtures


def _first_sent(server: Running, stream_id: str, last_event_id: str) -> tuple[str, dict]:
    """The first event a client following again with ``last_event_id`` is sent: its kind and data."""
    kind = None
    with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events",
                                                  headers={"Last-Event-ID": last_event_id}) as events:
        for line in events.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                return kind, json.loads(line[len("data: "):])
    raise AssertionError("the feed ended without an event")


def test_a_run_of_events_whose_record_cannot_be_written_is_not_sent_and_never_numbered_twice(
        tmp_path, qa, pictures, monkeypatch):
    """A start whose state folder is full cannot record the new run of a stream's events (`new_run`). Before: it
    sent that run's events all the same, so after a kill the next start numbered its run the same and sent other
    events under ids a client had read (``1:15.w_...`` twice). Now its events are sent once their run is recorded:
    until then a feed ends in one line saying why, and follows once the record can be written."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    stream_id, watch = watched_and_stopped(state, qa, pictures)
    real_write = StreamFiles.write_record

    def disk_full(files, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StreamFiles, "write_record", disk_full)
    with Running(state, qa) as server, server.client() as client:
        push(client, stream_id, pictures, 6, 15)
        kind, data = _first_sent(server, stream_id, f"0.{watch}")
        assert kind == "error" and "(No space left on device)" in data["error"]["message"], data
        assert "\n" not in data["error"]["message"]
        monkeypatch.setattr(StreamFiles, "write_record", real_write)  # room again
        count = len(client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()["events"])
        read = followed(server, stream_id, count, f"0.{watch}")
        assert len(read) == count and read[-1][0].startswith("1:"), read
        shutil.copytree(state, killed)  # killed here: its save holds frame 6, its record the run
    with Running(killed, qa) as server, server.client() as client:
        push(client, stream_id, pictures, 6, 15)
        count = len(client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()["events"])
        every = followed(server, stream_id, count, f"0.{watch}")
    again = {key for key, data in every if data["frame"] > 6}
    assert again and not again & {key for key, _ in read}, (every, read)
