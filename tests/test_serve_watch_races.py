"""Watches of `statekv serve` whose record and memory agree whatever runs beside their creation or deletion: another
record write (an answer) at the exact moment a watch's own write runs, a client gone while a deletion is recorded.
Each interleaving is forced by wrapping the record writes, never by waiting for it."""

from __future__ import annotations

import errno
import json
import shutil
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from statekv.serve import watch_routes  # noqa: E402
from statekv.serve.entries import StreamEntry  # noqa: E402
from statekv.serve.store import StreamFiles  # noqa: E402

import test_serve_watches as serve_tests  # noqa: E402
from test_serve_watches import COUNT, Running, push  # noqa: E402

qa, pictures = serve_tests.qa, serve_tests.pictures  # its module's fixtures
WATCH = {"question": COUNT, "every": 3, "max_new_tokens": 4}


class FullDisk:
    """`StreamFiles.write_record` failing with a full disk while ``full``, or on the threads that ask it to
    (`failing`)."""

    def __init__(self, monkeypatch):
        self.here, self.full, real = threading.local(), False, StreamFiles.write_record

        def write_record(files, record):
            if self.full or getattr(self.here, "full", False):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(files, record)

        monkeypatch.setattr(StreamFiles, "write_record", write_record)

    def failing(self, write, *args):
        """``write(*args)`` with this thread's record writes failing."""
        self.here.full = True
        try:
            return write(*args)
        finally:
            self.here.full = False


def _recorded(state, stream_id: str) -> list[str]:
    return [watch["id"] for watch in json.loads((state / "streams" / f"{stream_id}.json").read_text())["watches"]]


def _listed(client, stream_id: str) -> list[str]:
    return [item["id"] for item in client.get(f"/v1/streams/{stream_id}/watches").json()["data"]]


@pytest.mark.parametrize("answered", ["before", "after"])
def test_a_creation_refused_for_its_record_never_leaves_a_record_written_meanwhile_naming_the_watch(
        tmp_path, qa, pictures, monkeypatch, answered):
    """Before: a creation whose record write failed answered 503 ("it was not opened") and closed the watch, but an
    answer recorded between the opening and the close (``before`` the creation's own write, or ``after`` it failed)
    had written a record naming the watch, so a kill brought back a watch the client was told was not opened. Now
    what it answers is what the disk holds: an answer recorded before names the watch, which stands (201); one
    after its write failed leaves it out (503, no watch anywhere)."""
    state, killed = tmp_path / "state", tmp_path / "killed"
    disk, real = FullDisk(monkeypatch), StreamEntry.write_record
    creating = threading.Event()
    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)

        def write_record(entry, files, *args, **kwargs):
            if not creating.is_set():
                return real(entry, files, *args, **kwargs)
            creating.clear()  # the creation's own write, the watch open

            def answer() -> None:  # an answer's record write (`keep_record`), from another thread, at this moment
                thread = threading.Thread(target=entry.write_record, args=(files,))
                thread.start()  # (a real /ask would wait for the model's thread, which runs this creation)
                thread.join(30)
                assert not thread.is_alive()

            if answered == "before":
                answer()
            try:
                return disk.failing(real, entry, files, *args, **kwargs)
            finally:
                if answered == "after":
                    answer()

        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        creating.set()
        made = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH)
        assert not creating.is_set() and made.status_code in (201, 503), made.text
        shutil.copytree(state, killed)  # a kill: what the disk holds now
        listed, recorded = _listed(client, stream_id), _recorded(state, stream_id)
    expected = [made.json()["id"]] if made.status_code == 201 else []
    assert (made.status_code, listed, recorded) == ({"before": 201, "after": 503}[answered], expected, expected)
    with Running(killed, qa) as server, server.client() as client:
        assert _listed(client, stream_id) == expected


def test_a_deletion_whose_client_left_once_it_was_recorded_closes_the_watch_all_the_same(tmp_path, qa, pictures,
                                                                                     monkeypatch):
    """Before: a DELETE cancelled (its client gone) once its record, written without the watch, was on the disk left
    the watch open and evaluated in memory while every record left it out, so a restart dropped a watch still
    served. Now the close runs whatever happens to the request: memory, record and restart agree it is gone."""
    state = tmp_path / "state"
    real_write, real_close = StreamEntry.write_record, watch_routes.close_recorded
    deleting: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []

    async def close_recorded(*args, **kwargs):  # the request's task, to cancel as a client gone would
        deleting.append((asyncio.get_running_loop(), asyncio.current_task()))
        return await real_close(*args, **kwargs)

    def write_record(entry, files, *args, **kwargs):
        written = real_write(entry, files, *args, **kwargs)
        if deleting and args and args[0] is not None:  # the deletion's write, on the disk: its client leaves now
            loop, task = deleting.pop()
            loop.call_soon_threadsafe(task.cancel)
        return written

    with Running(state, qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH).json()["id"]
        monkeypatch.setattr(watch_routes, "close_recorded", close_recorded)
        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        client.delete(f"/v1/streams/{stream_id}/watches/{watch}")  # its answer is lost with its client
        assert not deleting
        push(client, stream_id, pictures, 3, 6)  # a record written again, as the watch is evaluated or not
        client.post(f"/v1/streams/{stream_id}/ask", json={"question": COUNT, "max_new_tokens": 2})
        assert (_listed(client, stream_id), _recorded(state, stream_id)) == ([], [])
    with Running(state, qa) as server, server.client() as client:
        assert _listed(client, stream_id) == []


def test_a_watch_refused_for_its_record_sends_its_followers_no_event(tmp_path, qa, pictures, monkeypatch):
    """Before: a new watch's first event (its first answer, at once) was sent to the stream's followers before its
    record was written, so when that write failed (503, "it was not opened") they had been sent an event of a watch
    that never was. Now a watch's events wait for its record: the refused one's are never sent, the next watch's
    are, first of all."""
    disk = FullDisk(monkeypatch)
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        heard: list[dict] = []
        following, arrived = threading.Event(), threading.Event()

        def follow() -> None:  # every event, till the server stops
            with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                following.set()  # its headers come once it follows: every event made from now on is its
                for line in events.iter_lines():
                    if line.startswith("data: "):
                        heard.append(json.loads(line[len("data: "):]))
                        arrived.set()

        threading.Thread(target=follow, daemon=True).start()
        assert following.wait(30)
        disk.full = True
        refused = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH)
        disk.full = False
        assert refused.status_code == 503 and "it was not opened" in refused.text, refused.text
        made = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH).json()["id"]
        while made not in [item["watch"] for item in heard]:  # its first event, sent after the refused one's
            assert arrived.wait(30)
            arrived.clear()
        assert [item["watch"] for item in heard] == [made]


def test_two_deletions_of_one_watch_at_once_one_failing_leave_it_out_of_the_others_record(monkeypatch):
    """Two DELETEs of one watch at once (a feed runs: the watches are not locked): the first's record write fails
    while the second waits to write; the second's record still leaves the watch out, as its 200 says."""
    entry = StreamEntry(id="s", owner="o", settings={}, horizon_frames=None, max_fps=None, name="s", created=0.0,
                        stream=None)
    monkeypatch.setattr(entry, "record", lambda leaving=None: {"watches": [{"id": w} for w in ("w1", "w2")
                                                                          if w not in (leaving or ())]})
    second_waits, written = threading.Event(), []

    class Counting:
        """The entry's ``counting`` lock, telling how often it was taken."""

        def __init__(self):
            self.lock, self.taken = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()
            self.taken += 1

        def __exit__(self, *exc):
            self.lock.release()

    entry.counting = Counting()

    class Files:
        def write_record(self, record):
            if not written and not second_waits.is_set():
                second_waits.wait(10)  # the second deletion has marked the watch and waits for this write
                written.append(None)
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append([watch["id"] for watch in record["watches"]])

    first_failed = []

    def first():
        try:
            entry.write_record(Files(), "w1")
        except OSError:
            first_failed.append(True)

    thread = threading.Thread(target=first)
    thread.start()
    while not entry.recording.locked():
        pass
    second = threading.Thread(target=entry.write_record, args=(Files(), "w1"))
    second.start()
    while entry.counting.taken < 3:  # the first's mark and its record's; the second's mark
        pass
    second_waits.set()
    thread.join(10)
    second.join(10)
    assert first_failed == [True]
    assert written[-1] == ["w2"]  # the second deletion's record, answered 200: without the watch


def test_a_deletion_the_shutdown_left_unrecorded_is_refused_and_the_watch_comes_back(tmp_path, qa, pictures,
                                                                                   monkeypatch):
    """Before: a DELETE whose record write came once the server, stopping, had saved and closed the stream (its
    last record, naming the watch, written) answered 200, though no record could leave the watch out any more, so
    the next start brought it back. Now it is refused with a one-line 503 (Retry-After), and the watch is back."""
    state, real = tmp_path / "state", StreamEntry.write_record
    with Running(state, qa) as server, server.client() as client:
        registry = server.app.state.service.registry
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH).json()["id"]

        def write_record(entry, files, *args, **kwargs):
            if args and args[0] is not None:  # the deletion's write: the shutdown saves and closes first
                registry.save_all()
                registry.close_all()
            return real(entry, files, *args, **kwargs)

        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        refused = client.delete(f"/v1/streams/{stream_id}/watches/{watch}")
        monkeypatch.setattr(StreamEntry, "write_record", real)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert "\n" not in refused.json()["error"]["message"]
        assert _recorded(state, stream_id) == [watch]
    with Running(state, qa) as server, server.client() as client:
        assert _listed(client, stream_id) == [watch]


def test_a_creation_the_shutdown_left_unrecorded_is_refused(tmp_path, qa, pictures, monkeypatch):
    """Before: a watch opened once the stopping server had saved the stream, its record write coming once the
    stream was closed, answered 201 though no record named it, so the next start had no such watch. Now it is
    refused with a one-line 503 (Retry-After), as one whose record cannot be written is."""
    state, real = tmp_path / "state", StreamEntry.write_record
    with Running(state, qa) as server, server.client() as client:
        registry = server.app.state.service.registry
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)

        stopping: list[threading.Thread] = []

        def write_record(entry, files, *args, **kwargs):
            if len(args) > 1 and args[1] is not None:  # the creation's write: the shutdown has closed the stream
                stopping.append(threading.Thread(target=registry.close_all))
                stopping[0].start()  # its streams' close waits for the model's thread, which runs this creation
                while not entry.closed:  # (retired first, before it waits)
                    assert stopping[0].is_alive()
                    time.sleep(0.01)
            return real(entry, files, *args, **kwargs)

        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        refused = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH)
        monkeypatch.setattr(StreamEntry, "write_record", real)
        stopping[0].join(30)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert "\n" not in refused.json()["error"]["message"] and _recorded(state, stream_id) == []
    with Running(state, qa) as server, server.client() as client:
        assert _listed(client, stream_id) == []


def test_a_watch_refused_for_its_record_is_in_no_backlog_of_a_follower_come_back_meanwhile(tmp_path, qa, pictures,
                                                                                         monkeypatch):
    """Before: a client following again (with Last-Event-ID) while a new watch's record was written was sent, among
    the events it missed, that watch's first event, though the live feed held it back till the record; when the
    write then failed (503, "it was not opened") the client had an event of a watch that never was. Now the backlog
    leaves out the events of a watch not yet recorded."""
    disk, real = FullDisk(monkeypatch), StreamEntry.write_record
    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        first = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH).json()["id"]
        heard: list[str] = []
        backlog_sent = threading.Event()

        def follow() -> None:  # missed every event, till the stream is deleted
            with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events",
                                                          headers={"Last-Event-ID": f"0.{first}"}) as events:
                for line in events.iter_lines():
                    if line.startswith("data: "):
                        heard.append(json.loads(line[len("data: "):]).get("watch"))
                        backlog_sent.set()  # its backlog is read whole before any of it is sent

        def write_record(entry, files, *args, **kwargs):
            if len(args) < 2 or args[1] is None:
                return real(entry, files, *args, **kwargs)
            reader.start()  # the new watch opened, its record not yet written: a follower comes back now
            assert backlog_sent.wait(30)
            return disk.failing(real, entry, files, *args, **kwargs)

        reader = threading.Thread(target=follow, daemon=True)
        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        refused = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH)
        assert refused.status_code == 503 and "it was not opened" in refused.text, refused.text
        assert client.delete(f"/v1/streams/{stream_id}").status_code in (200, 204)  # its followers' feeds end
        reader.join(30)
        assert not reader.is_alive() and heard[0] == first and set(heard) == {first, None}, heard


def test_a_deletion_failing_after_its_client_left_is_logged(tmp_path, qa, pictures, monkeypatch, caplog):
    """Before: a change to a watch whose client left while it ran (`settled` runs it to its end) had its unexpected
    error (a bug: not a refusal, which is logged where it is made) taken and dropped, logged nowhere: the watch's
    state was wrong and nothing said so. Now it is logged with its traceback."""
    from statekv.api.watch import Watch

    real_write, real_close = StreamEntry.write_record, watch_routes.close_recorded
    deleting: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []

    async def close_recorded(*args, **kwargs):
        deleting.append((asyncio.get_running_loop(), asyncio.current_task()))
        return await real_close(*args, **kwargs)

    def write_record(entry, files, *args, **kwargs):
        written = real_write(entry, files, *args, **kwargs)
        if deleting and args and args[0] is not None:  # the deletion's record on the disk: its client leaves now
            loop, task = deleting.pop()
            loop.call_soon_threadsafe(task.cancel)
        return written

    def broken_close(watch):
        raise RuntimeError("a bug in closing the watch")

    with Running(tmp_path / "state", qa) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1}).json()["id"]
        push(client, stream_id, pictures, 0, 3)
        watch = client.post(f"/v1/streams/{stream_id}/watches", json=WATCH).json()["id"]
        monkeypatch.setattr(watch_routes, "close_recorded", close_recorded)
        monkeypatch.setattr(StreamEntry, "write_record", write_record)
        monkeypatch.setattr(Watch, "close", broken_close)
        client.delete(f"/v1/streams/{stream_id}/watches/{watch}")  # its answer is lost with its client
        monkeypatch.undo()
    assert not deleting
    assert any(record.exc_info and "a bug in closing the watch" in str(record.exc_info[1])
               for record in caplog.records), [record.getMessage() for record in caplog.records]


def test_a_watch_made_while_a_file_is_fed_sends_its_first_event_before_the_feeds_later_ones(tmp_path, qa,
                                                                                          monkeypatch):
    """Before: a watch made while a file was fed (its stream not locked) held its first event (frame N) till its
    record was written, off the model's thread, while the feed went on pushing: another watch's events of frames
    N+1.. were sent meanwhile, the held one after them, so event ids went back, and a follower coming back with the
    last id it read was sent them again or never sent the held one. Now the creation, its record and the release
    run on the model's thread as one: no push runs between them, and the follower reads the ids in order."""
    import statekv.api.watch
    from statekv.synthetic.benchmark import make_benchmark

    real_evaluate, flips = statekv.api.watch.evaluate, {}

    def changing(evaluations, head):  # every evaluation's answer differs from the one before: an event a frame
        outcomes = list(real_evaluate(evaluations, head))
        for number, evaluation in enumerate(evaluations):
            flips[id(evaluation.question)] = flipped = not flips.get(id(evaluation.question), False)
            if flipped:
                outcomes[number] = torch.cat([outcomes[number], outcomes[number][:, -1:]], dim=1)
        return outcomes

    monkeypatch.setattr(statekv.api.watch, "evaluate", changing)
    media = tmp_path / "media"
    make_benchmark(media, videos=1, seed=4249, num_frames=60)
    video = str(next(media.rglob("*.mp4")).relative_to(media))
    heard: list[tuple[str, dict]] = []
    arrived, creating, real_write = threading.Condition(), threading.Event(), StreamFiles.write_record

    def heard_past(frames: int) -> bool:
        return any(item["frame"] > frames for _, item in heard)

    def write_record(files, record):  # the new watch's record waits till the feed's events go past its frame
        if creating.is_set() and len(record["watches"]) == 2:
            creating.clear()
            with arrived:  # (where no push can run meanwhile, it waits in vain: the fix)
                arrived.wait_for(lambda: heard_past(record["seen"]["frames"]), timeout=5)
        return real_write(files, record)

    monkeypatch.setattr(StreamFiles, "write_record", write_record)
    with Running(tmp_path / "state", qa, media_root=media) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        first = client.post(f"/v1/streams/{stream_id}/watches", json={**WATCH, "every": 1}).json()["id"]
        following = threading.Event()

        def follow() -> None:
            with server.client() as reader, reader.stream("GET", f"/v1/streams/{stream_id}/events") as events:
                following.set()
                sent_id = None
                for line in events.iter_lines():
                    if line.startswith("id: "):
                        sent_id = line[len("id: "):]
                    elif line.startswith("data: "):
                        with arrived:
                            heard.append((sent_id, json.loads(line[len("data: "):])))
                            arrived.notify_all()

        def feed() -> int:
            with server.client() as feeder:
                return feeder.post(f"/v1/streams/{stream_id}/frames", json={"source": video}).status_code

        threading.Thread(target=follow, daemon=True).start()
        assert following.wait(30)
        with ThreadPoolExecutor(1) as pool:
            fed = pool.submit(feed)
            with arrived:
                assert arrived.wait_for(lambda: len(heard) >= 2, timeout=60)  # the feed runs
            creating.set()
            made = client.post(f"/v1/streams/{stream_id}/watches", json={**WATCH, "every": 1})
            assert made.status_code == 201 and not creating.is_set(), made.text
            assert fed.result(timeout=300) == 200
        with arrived:
            assert arrived.wait_for(lambda: made.json()["id"] in [item["watch"] for _, item in heard], timeout=30)
    frames = [item["frame"] for _, item in heard]
    assert {item["watch"] for _, item in heard} == {first, made.json()["id"]}
    assert frames == sorted(frames), [sent_id for sent_id, _ in heard]
