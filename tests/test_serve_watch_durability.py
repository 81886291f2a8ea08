"""Watches of `statekv serve` as durable as they are answered: a deletion answered 200 is in the stream's record
before it is answered, and one whose record cannot be written is refused, the watch left as it was in memory and on
disk, across restarts and kills."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from statekv.serve.store import StreamFiles  # noqa: E402

import test_serve_watches as serve_tests  # noqa: E402
from test_serve_watches import COUNT, Running, push  # noqa: E402

qa, pictures = serve_tests.qa, serve_tests.pictures  # its module's fixtures


def _disk_full(files, record):
    raise OSError(errno.ENOSPC, "No space left on device")


def _recorded(state, stream_id: str) -> list[str]:
    return [watch["id"] for watch in json.loads((state / "streams" / f"{stream_id}.json").read_text())["watches"]]


def test_a_watch_deletion_whose_record_cannot_be_written_is_refused_and_the_watch_stays(tmp_path, qa, pictures,
                                                                                      monkeypatch):
    """Before: a DELETE whose record write failed (a full disk) answered 200 with the watch closed in memory only, so
    a kill or restart brought the deleted watch back. Now it answers 503 in one line, the watch open and evaluated as
    before; once the record can be written the deletion is answered, and a kill after it keeps it deleted."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    real_write = StreamFiles.write_record
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches",
                            json={"question": COUNT, "every": 3, "max_new_tokens": 4}).json()["id"]
        url = f"/v1/streams/{stream_id}/watches/{watch}"
        monkeypatch.setattr(StreamFiles, "write_record", _disk_full)
        refused = client.delete(url)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "No space left on device" in message and "\n" not in message and refused.headers["Retry-After"]
        push(client, stream_id, pictures, 3, 6)  # still evaluated on its cadence
        assert client.get(url).json()["evaluations"] == 2
        monkeypatch.setattr(StreamFiles, "write_record", real_write)
        assert _recorded(state, stream_id) == [watch]
        shutil.copytree(state, killed)  # a kill: what the disk holds now
        deleted = client.delete(url)
        assert deleted.status_code == 200 and _recorded(state, stream_id) == [], deleted.text
        shutil.copytree(state, tmp_path / "killed-after")
    with Running(killed, qa) as server, server.client() as client:
        assert [item["id"] for item in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]] == [watch]
    with Running(tmp_path / "killed-after", qa) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}/watches").json()["data"] == []


def test_a_watch_refused_for_its_record_has_its_first_evaluation_counted(tmp_path, qa, pictures, monkeypatch):
    """Before: a new watch's evaluations were counted only as its events were sent, once its record was written,
    so the first answer of one refused for its record (503) was run on the model and counted nowhere, though a
    failed one is counted (``statekv_watch_failures_total``). Now every evaluation is counted as it is made."""
    from test_serve_watches import metric

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        before = metric(client, "statekv_watch_evaluations_total")
        monkeypatch.setattr(StreamFiles, "write_record", _disk_full)
        refused = client.post(f"/v1/streams/{stream_id}/watches", json={"question": COUNT, "every": 3})
        monkeypatch.undo()
        assert refused.status_code == 503 and "it was not opened" in refused.text, refused.text
        assert metric(client, "statekv_watch_evaluations_total") - before == 1
        assert metric(client, "statekv_watch_events_total") == 1  # its first answer: an event, never sent
