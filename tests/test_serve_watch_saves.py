"""Watches of `statekv serve` and their stream's saves: a record leaves the events its save holds to the save, and
no event is lost to a crash, a restart, a kill after a save, a watch deleted before one, a file set moved, or an
object store that cannot give a save back."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")

import statekv  # noqa: E402

import test_serve_watches as serve_tests  # noqa: E402
from test_serve_watches import COUNT, KEY, Running, push  # noqa: E402

qa, pictures = serve_tests.qa, serve_tests.pictures  # its module's fixtures: one model for both files' tests
def test_a_record_leaves_the_events_its_save_holds_to_the_save_and_a_crash_or_a_restart_loses_none(tmp_path, qa,
                                                                                                   pictures):
    """The record is written at every answer: it holds a watch's events since the stream's last save, not every
    event the watch ever had (before: all of them, up to 10,000 a watch, at each answer). A server killed (its
    state folder as it stood) and one stopped both bring every event back, from the save and the record."""
    state, body = tmp_path / "state", {"question": COUNT, "every": 3, "max_new_tokens": 4}

    def events(client, stream_id: str, key: str) -> list[dict]:
        return client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"]

    def recorded(stream_id: str) -> dict[str, list[dict]]:
        record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
        return {watch["id"]: [{"frame": frame, "seconds": seconds, "answer": answer}
                              for frame, seconds, answer in watch["events"]] for watch in record["watches"]}

    def asked(client, stream_id: str) -> None:  # answered once its record is written
        answer = client.post(f"/v1/streams/{stream_id}/ask", json={"question": COUNT, "max_new_tokens": 3})
        assert answer.status_code == 200, answer.text

    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        first = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at frame 3
        push(client, stream_id, pictures, 3, 9)
    with Running(state, qa, save_every_frames=4) as server, server.client() as client:  # saved at 9 as it stopped
        second = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at 9, unsaved
        push(client, stream_id, pictures, 9, 12)
        asked(client, stream_id)
        before = {key: events(client, stream_id, key) for key in (first, second)}
        assert before[first][0]["frame"] == 3 and before[second][0]["frame"] == 9
        kept = recorded(stream_id)
        assert kept[first] == [event for event in before[first] if event["frame"] > 9]  # the save holds the rest
        assert kept[second] == before[second]
        shutil.copytree(state, tmp_path / "killed")  # a server killed here: its files as they stand
        push(client, stream_id, pictures, 12, 14)  # saved at 13, before the 14th frame
        asked(client, stream_id)
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 13
        after = {key: events(client, stream_id, key) for key in (first, second)}
        assert recorded(stream_id) == {key: [event for event in after[key] if event["frame"] > 13]
                                       for key in (first, second)}
    with Running(tmp_path / "killed", qa) as server, server.client() as client:  # back at its save, frame 9
        for key in (first, second):
            assert events(client, stream_id, key) == [event for event in before[key] if event["frame"] <= 9]
    with Running(state, qa) as server, server.client() as client:  # stopped: saved at 14
        for key in (first, second):
            assert events(client, stream_id, key) == after[key]


def test_a_disk_tier_stream_killed_after_a_save_keeps_the_events_of_a_watch_its_file_set_lacks(tmp_path, qa,
                                                                                                pictures, caplog):
    """A disk-tier stream comes back from its file set, whose last checkpoint can lack a watch (a save makes the
    file set durable and took no checkpoint: its last step had one already): its saves write no copy of the stream,
    so its record keeps that watch's events itself, and a kill loses none of them."""
    state, frames = tmp_path / "a" / "state", pictures * 3
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(state, qa, disk=True, save_every_frames=63) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, frames, 0, 63)  # its 63rd step checkpointed (every 64 steps, from the first)
        key = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # an event at frame 63
        push(client, stream_id, frames, 63, 64)  # saved at 63 first, with no checkpoint
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 63
        before = client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"]
        assert before and before[0]["frame"] == 63
        record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
        assert [len(watch["events"]) for watch in record["watches"]] == [1] and record["saved_watches"] == []
        assert record["tier_saved"] and not (state / "streams" / f"{stream_id}.safetensors").exists()
        shutil.copytree(tmp_path / "a", tmp_path / "killed")  # a server killed here
    with Running(tmp_path / "killed" / "state", qa, disk=True) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}/watches/{key}").json()["events"][:1] == before[:1]
    assert "events up to frame" not in caplog.text


def _deleted_before_a_later_save(tmp_path, qa, pictures) -> tuple[Path, str, str, list[dict]]:
    """A state folder whose record left both watches' events to the save at 6, one watch deleted since and the
    stream saved at 8 without it, the records since never written (a kill, a full disk). Its folder, the stream,
    the watch kept and its events up to that save."""
    state, body = tmp_path / "state", {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        gone = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
        kept = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
        push(client, stream_id, pictures, 3, 6)
    record = state / "streams" / f"{stream_id}.json"
    with Running(state, qa, save_every_frames=2) as server, server.client() as client:
        old = record.read_bytes()  # leaves both watches' events up to frame 6 to the save
        assert json.loads(old)["saved_watches"] == sorted([gone, kept])
        assert client.delete(f"/v1/streams/{stream_id}/watches/{gone}").status_code == 200
        push(client, stream_id, pictures, 6, 9)  # saved at 8, before the 9th frame, without it
        assert client.get(f"/v1/streams/{stream_id}").json()["saved"]["frames"] == 8
        events = client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"]
        shutil.copytree(state, tmp_path / "killed")
    (tmp_path / "killed" / "streams" / f"{stream_id}.json").write_bytes(old)
    return tmp_path / "killed", stream_id, kept, [event for event in events if event["frame"] <= 8]


def test_a_watch_deleted_before_a_save_whose_record_was_never_written_stays_deleted(tmp_path, qa, pictures):
    """A record that left a watch's events to the save, the watch deleted, the stream saved again, and neither
    record after it written: the latest save lacks the watch, so it was deleted before that save and stays deleted
    (before: it came back from the old record, without its events)."""
    killed, stream_id, kept, events = _deleted_before_a_later_save(tmp_path, qa, pictures)
    with Running(killed, qa) as server, server.client() as client:
        assert [watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]] == [kept]
        assert client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"] == events


def test_a_stream_brought_back_from_its_save_reads_it_once_and_a_second_read_failing_brings_back_no_deleted_watch(
        tmp_path, qa, pictures, monkeypatch):
    """The stream comes back from its save, so what the save holds of its watches is known: reading the save again
    costs a second whole download from an object store (`local_state` downloads the whole file, tensors too), and
    a store that does not answer it for a moment (a 503, as `StoreStreamFiles.local_state` raises) brought the
    deleted watch back, without its events."""
    from statekv.serve.errors import ServiceError
    from statekv.serve.store import StreamFiles

    killed, stream_id, kept, events = _deleted_before_a_later_save(tmp_path, qa, pictures)
    reads: list[str] = []
    local_state = StreamFiles.local_state

    @contextlib.contextmanager
    def counted(self, key):
        reads.append(key)
        if len(reads) > 1:  # an object store that does not answer for a moment
            raise ServiceError(503, "the save cannot be read from the object store now; retry")
        with local_state(self, key) as path:
            yield path

    monkeypatch.setattr(StreamFiles, "local_state", counted)
    with Running(killed, qa) as server, server.client() as client:
        assert [watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]] == [kept]
        assert client.get(f"/v1/streams/{stream_id}/watches/{kept}").json()["events"] == events
    assert reads == [stream_id]


def test_a_save_the_object_store_cannot_give_back_now_loses_no_event_of_a_watch_a_file_set_lacks(caplog):
    """A stream brought back from its file set (as a stopped handover's heal does on a replica) that lacks a watch
    whose events up to the save are in the save: the object store not answering for a moment (503) is a retry,
    never those events reopened without, for good (the next save keeps the watch as reopened)."""
    from types import SimpleNamespace

    from statekv.serve.errors import ServiceError
    from statekv.serve.watches import with_saved_events

    class Store:
        @contextlib.contextmanager
        def local_state(self, stream_id):
            raise ServiceError(503, f"stream {stream_id}'s save cannot be read from the object store now; retry")
            yield

    entry = SimpleNamespace(id="st_0123456789abcdef01234567", stream=SimpleNamespace(watches=[]), from_save=False)
    watch = {"id": "w_0123456789abcdef", "events": [[70, 69.0, "B"]]}
    record = {"saved_watches": [watch["id"]], "watches": [watch], "saved": {"frames": 63}}
    with pytest.raises(ServiceError) as refused:
        with_saved_events(entry, record, Store())
    assert refused.value.status == 503 and "are lost" not in caplog.text


def saved_whole(state: Path, stream_id: str, qa) -> None:
    """Give a stopped disk-tier stream of ``state`` a whole save, its record saying its saves are not its file set
    (as one saved before saves made the file set durable instead), so a start without its file set loads it from
    that save."""
    record = state / "streams" / f"{stream_id}.json"
    data, tiers = json.loads(record.read_text()), state.parent / "tiers"
    whole = statekv.Stream.load(tiers / data["tier"], qa.with_options(offload="disk", offload_dir=str(tiers)),
                                stream_id=stream_id, owner=data["owner"])
    whole.save(state / "streams" / f"{stream_id}.safetensors")
    whole.close()
    record.write_text(json.dumps({**data, "tier_saved": False}))


def test_a_stream_moved_to_a_new_file_set_records_the_watches_its_record_reopened(tmp_path, qa, pictures):
    """A disk-tier stream whose file set is gone comes back from its save into a new one, and its record is written
    at once to name it: that record names the watches made since the save too (before: it was written before they
    were reopened from the old record, so a kill then lost them for good)."""
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    with Running(tmp_path / "a" / "state", qa, disk=True) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        saved = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]
    saved_whole(tmp_path / "a" / "state", stream_id, qa)
    with Running(tmp_path / "a" / "state", qa, disk=True) as server, server.client() as client:
        made = client.post(f"/v1/streams/{stream_id}/watches", json=body).json()["id"]  # after the save at 3
        shutil.copytree(tmp_path / "a" / "state", tmp_path / "b" / "state")  # killed; its file set lost with its disk
    record = tmp_path / "b" / "state" / "streams" / f"{stream_id}.json"
    tier = json.loads(record.read_text())["tier"]
    with Running(tmp_path / "b" / "state", qa, disk=True) as server, server.client() as client:
        written = json.loads(record.read_text())  # as a kill now would leave it
        assert written["tier"] != tier and {watch["id"] for watch in written["watches"]} == {saved, made}
        assert {watch["id"] for watch in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]} == \
            {saved, made}


def test_a_heal_the_object_store_cannot_serve_now_leaves_the_file_set_free_for_its_retry(tmp_path, qa, pictures,
                                                                                       monkeypatch):
    """Bringing a disk-tier stream back from its file set (a stopped handover's heal: healing) that lacks a watch
    its save holds, the object store not giving the save back now (503): a retry, so the stream resumed for it is
    closed again and the retry resumes the file set. Before: it was left open, holding the file set's lock, so the
    retry found the folder held and the stream was quarantined."""
    from statekv import ModelOptions
    from statekv.serve import ServeConfig
    from statekv.serve.errors import ServiceError
    from statekv.serve.registry import StreamRegistry
    from statekv.serve.store import StreamFiles
    from statekv.serve.worker import ModelWorker

    state, frames = tmp_path / "a" / "state", pictures * 3
    body = {"question": COUNT, "every": 3, "max_new_tokens": 4}
    monkeypatch.setattr("statekv.serve.registry.saved_in_tier", lambda entry, resume_tiers: False)  # saved whole,
    # as a replica sharing the state folder saves it
    with monkeypatch.context() as earlier:  # a save's sync journals a watch opened since the last step: a file set
        # lacking a watch its save holds is one an earlier statekv saved
        earlier.setattr("statekv.api.durability.Durability.journal_watches", lambda self: False)
        with Running(state, qa, disk=True, save_every_frames=63) as server, server.client() as client:
            stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
            push(client, stream_id, frames, 0, 63)  # its 63rd step checkpointed
            client.post(f"/v1/streams/{stream_id}/watches", json=body)
            push(client, stream_id, frames, 63, 64)  # saved at 63 with no checkpoint: the file set lacks the watch
            shutil.copytree(tmp_path / "a", tmp_path / "b")  # its files as a closed stream leaves them
    tier = tmp_path / "b" / "tiers"
    options = ModelOptions(model="builtin", offload="disk", offload_dir=str(tier))
    config = ServeConfig(options=options, state_dir=tmp_path / "b" / "state", api_keys=(KEY,), page=False,
                         save_every_seconds=600)
    registry = StreamRegistry(config, qa.with_options(offload="disk", offload_dir=str(tier)), ModelWorker())
    record = registry.files.read_record(stream_id)
    try:
        @contextlib.contextmanager
        def unanswered(self, key):
            raise ServiceError(503, f"stream {key}'s save cannot be read from the object store now; retry")
            yield

        with monkeypatch.context() as patched:
            patched.setattr(StreamFiles, "local_state", unanswered)
            with pytest.raises(ServiceError):
                registry.worker.run_blocking(registry.restore_one, record, True)
        healed = registry.worker.run_blocking(registry.restore_one, record, True)  # its retry
        assert healed.stream.frames == 63  # as its file set holds it
        registry.worker.run_blocking(healed.stream.close)
    finally:
        registry.worker.close()


def test_an_object_store_failing_as_it_lists_a_save_loses_no_event_of_a_watch_a_file_set_lacks(caplog):
    """As the 503 of the download: the store failing as its versions are listed or read (`StorageError`, what
    `StoreStreamFiles.local_state` raises then) is a retry, never those events reopened without, for good."""
    from types import SimpleNamespace

    from statekv.serve.errors import StorageError
    from statekv.serve.watches import with_saved_events

    class Store:
        @contextlib.contextmanager
        def local_state(self, stream_id):
            raise StorageError("the object store cannot list streams/st_0123456789abcdef01234567/: 503")
            yield

    entry = SimpleNamespace(id="st_0123456789abcdef01234567", stream=SimpleNamespace(watches=[]), from_save=False)
    watch = {"id": "w_0123456789abcdef", "events": [[70, 69.0, "B"]]}
    record = {"saved_watches": [watch["id"]], "watches": [watch], "saved": {"frames": 63}}
    with pytest.raises(StorageError):
        with_saved_events(entry, record, Store())
    assert "are lost" not in caplog.text


def test_a_recorded_watch_no_watch_opens_with_now_is_left_out_and_the_others_come_back(tmp_path, qa, pictures,
                                                                                       caplog):
    """Before: one watch in a stream's record that could not be reopened (a setting refused since, here ``every``
    0) left the stream without any of its watches, and the record written at the start then lost the others for
    good. Now that one is left out, logged in one line naming it, and the others come back, also at the next
    start."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 2)
        made = [client.post(f"/v1/streams/{stream_id}/watches",
                            json={"question": COUNT, "every": every, "max_new_tokens": 2}).json()["id"]
                for every in (2, 3)]
        shutil.copytree(state, killed)  # a server killed before any save: its watches are in its record alone
    path = killed / "streams" / f"{stream_id}.json"
    record = json.loads(path.read_text())
    assert [watch["id"] for watch in record["watches"]] == made
    record["watches"][0]["every"] = 0
    path.write_text(json.dumps(record))
    for start in (0, 3):  # the frames lost to the kill pushed again, then more after a restart
        with Running(killed, qa) as server, server.client() as client:
            listed = client.get(f"/v1/streams/{stream_id}/watches").json()["data"]
            assert [(watch["id"], watch["every"]) for watch in listed] == [(made[1], 3)]
            push(client, stream_id, pictures, start, start + 3)
            assert client.get(f"/v1/streams/{stream_id}/watches/{made[1]}").json()["evaluations"] == start // 3 + 1
    lines = [record.getMessage() for record in caplog.records if made[0] in record.getMessage()]
    assert len(lines) == 1 and "every (frames between evaluations) must be a positive integer, got 0" in lines[0]
    assert "\n" not in lines[0] and made[1] not in lines[0]


def test_a_stream_saved_at_shutdown_whose_record_fails_is_not_said_to_lose_frames(tmp_path, qa, pictures, caplog,
                                                                                   monkeypatch):
    """Before: its save written, its record refused (a full disk), the shutdown logged "the 0 frames pushed since its
    last save are lost"; it now says that no frame is lost, and the next start serves every frame."""
    from statekv.serve.entries import StreamEntry

    state, write_record = tmp_path / "state", StreamEntry.write_record
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={}).json()["id"]
        push(client, stream_id, pictures, 0, 3)

        def refused(entry, files):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(StreamEntry, "write_record", refused)
    monkeypatch.setattr(StreamEntry, "write_record", write_record)
    said = [record.getMessage() for record in caplog.records if "at shutdown" in record.getMessage()]
    assert said and "no frame is lost" in said[0] and "are lost" not in said[0], said
    with Running(state, qa) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3
