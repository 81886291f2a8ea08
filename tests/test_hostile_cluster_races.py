"""Two replicas sharing a state folder, acting on one stream at the same moment: a deletion on the holder while
another replica asks for the stream, pushes queued on the holder as it hands the stream over, a frame still waiting
for its step when the stream moves, a watch deleted as its stream moves, requests taking a stream while the first
taking fails, a lease lost while its stream loads, a stream taken while the shared folder is full, a replica killed
in the middle of a save. Each replica is a `SharedRegistry` of its own in this process (as
tests/test_serve_cluster.py drives them; one case drives two apps); each race is made to run one way every time
(the model's thread held, a public function wrapped), and each case says what happened before."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")

import statekv  # noqa: E402
import statekv.api.stream_file as stream_file  # noqa: E402
from statekv.serve.auth import owner_of  # noqa: E402
from statekv.serve.cluster.leases import Leases  # noqa: E402
from statekv.serve.cluster.shared import SharedRegistry, SharedStreamFiles  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.errors import ServiceError  # noqa: E402
from statekv.serve.metrics import Metrics  # noqa: E402
from statekv.serve.worker import ModelWorker  # noqa: E402

from conftest import png_bytes, random_frames  # noqa: E402

OWNER = owner_of("key")
WAIT_SECONDS = 2.0  # the longest one side waits for the other to arrive (where it never comes, once fixed)


class Clock:
    """Wall time that a test moves on (the replicas' leases compare it)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


def _replica(state, qa, name: str, clock=None, lease_seconds: float = 60) -> SharedRegistry:
    config = ServeConfig(options=qa.options, state_dir=state, save_every_frames=1000, max_streams=4)
    leases = Leases(state, name, seconds=lease_seconds, **({"clock": clock} if clock else {}))  # no loop renews
    registry = SharedRegistry(config, qa, ModelWorker(), SharedStreamFiles(state, leases))
    registry.metrics = Metrics(lambda: 0, lambda: 0)
    return registry


def _files_of(state, stream_id: str) -> list[str]:
    return sorted(path.name for path in state.rglob(f"{stream_id}*"))


async def _queued(worker: ModelWorker, count: int) -> None:
    """Until ``count`` pieces of work wait for (or hold) the model's thread: the tasks that queue them have run."""
    while worker.queued < count:
        await asyncio.sleep(0)


async def _asked_for(holder: SharedRegistry, stream_id: str) -> None:
    """Until another replica has asked the holder to hand the stream over."""
    while holder.files.leases.peek(stream_id).handoff is None:
        await asyncio.sleep(0.02)


async def _deleted_while_taken(first: SharedRegistry, second: SharedRegistry, entry) -> ServiceError:
    """``entry`` deleted on ``first`` once ``second`` has asked for it; the error ``second``'s taking ends with (the
    replicas' model threads stopped)."""
    taking = asyncio.ensure_future(second.find(OWNER, entry.id))
    await _asked_for(first, entry.id)
    await first.delete(entry)
    with pytest.raises(ServiceError) as taken:
        await taking
    for registry in (first, second):
        registry.worker.close()
    return taken.value


def test_a_stream_deleted_while_it_is_handed_over_is_deleted_whole(tmp_path, qa):
    """Before: a hand-over (another replica asked for the stream) that ran while a deletion had written its note let
    the lease go under the deletion, which then answered 503 "moved to another replica; retry" and left the
    stream's record, save, deletion note and lease in the shared folder; every replica answered 404 for it, and
    only a replica's next start removed its files."""
    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        for index, image in enumerate(random_frames(2, 31, 48, 64)):
            await first.push(entry, image, float(index))
        loop, handed = asyncio.get_running_loop(), threading.Event()
        hand_over, begin_removal = first.placement.hand_over, first.files.begin_removal

        async def hand_over_told(registry, stream):
            await hand_over(registry, stream)
            handed.set()

        def begin_removal_then_hand_over(stream_id, tier):  # the holder's pass over its leases comes in between
            begin_removal(stream_id, tier)
            asyncio.run_coroutine_threadsafe(first.keep_leases(), loop).result()
            handed.wait(WAIT_SECONDS)

        first.placement.hand_over, first.files.begin_removal = hand_over_told, begin_removal_then_hand_over
        return entry.id, await _deleted_while_taken(first, second, entry)

    stream_id, taken = asyncio.run(scenario())
    assert taken.status == 404 and "no stream" in str(taken)
    assert _files_of(tmp_path, stream_id) == []


def test_a_stream_deleted_while_another_replica_waits_to_take_it_leaves_no_lease_behind(tmp_path, qa):
    """Before: the replica waiting for the stream's lease took a new one once the deletion had removed the old,
    found no record (404) and let that lease go, leaving it and its history in the shared folder for good."""
    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        return entry.id, await _deleted_while_taken(first, second, entry)

    stream_id, taken = asyncio.run(scenario())
    assert taken.status == 404
    assert _files_of(tmp_path, stream_id) == []


def test_pushes_queued_behind_a_hand_over_are_refused_rather_than_lost(tmp_path, qa):
    """Before: a push queued on the holder behind another of the stream's pushes was streamed there after the
    hand-over's save and answered 200, then lost with the stream: the replica that took it over held one frame
    fewer than its client was told, and nothing said so."""
    frames = random_frames(3, 31, 48, 64)

    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, frames[0], 0.0)
        free = threading.Event()
        busy = asyncio.ensure_future(first.worker.run(free.wait, 30))  # the model's thread busy: work queues
        pushes = [asyncio.ensure_future(first.push(entry, frames[index], float(index))) for index in (1, 2)]
        last_answered, retire = threading.Event(), entry.retire
        pushes[-1].add_done_callback(lambda _: last_answered.set())

        def retire_after_the_last_push(**state):  # the stream marked moved only once the last push had its turn
            last_answered.wait(WAIT_SECONDS)
            retire(**state)

        entry.retire = retire_after_the_last_push
        await _queued(first.worker, 3)
        handing = asyncio.ensure_future(first.placement.hand_over(first, entry))
        await _queued(first.worker, 4)  # its save waits behind the first drain of pushes
        free.set()
        await asyncio.gather(busy, handing)
        answers = await asyncio.gather(*pushes, return_exceptions=True)
        taken = await second.find(OWNER, entry.id)
        for registry in (first, second):
            registry.worker.close()
        return answers, taken.stream.pushed

    answers, pushed = asyncio.run(scenario())
    told = 1 + sum(answer is True for answer in answers)
    assert pushed == told, answers
    for refused in (answer for answer in answers if answer is not True):
        assert isinstance(refused, ServiceError) and refused.status == 503 and "retry" in str(refused)


def test_a_frame_waiting_for_its_step_moves_with_its_stream(tmp_path, tiny_checkpoint):
    """Before: a stream whose first frame waited for its step (two frames a step) was handed over unsaved, so the
    replica that took it had no frame of it and took the next push as the stream's first, its client never told."""
    qa = statekv.VideoQA.from_pretrained(str(tiny_checkpoint("qwen3_vl")))
    frames = random_frames(2, 31, 48, 64)

    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"max_fps": None})
        await first.push(entry, frames[0], 0.0)
        waiting = (entry.stream.frames, len(entry.stream.pending))
        await first.placement.hand_over(first, entry)
        taken = await second.find(OWNER, entry.id)
        await second.push(taken, frames[1], 1.0)
        for registry in (first, second):
            registry.worker.close()
        return waiting, taken.stream.frames

    waiting, frames_held = asyncio.run(scenario())
    assert waiting == (0, 1)
    assert frames_held == 2


def test_requests_that_take_a_stream_after_a_taking_failed_load_it_once(tmp_path, qa):
    """Before: once the first request's taking failed, the request that waited for it and one arriving next took
    the stream at the same time, each loading it from its save: one of the two streams loaded was never served nor
    closed (its memory, and its disk-tier file set, held until the replica stopped)."""
    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        await first.worker.run(first.save_now, entry)
        first.let_all_go()
        loop, waiting, loaded, later = asyncio.get_running_loop(), threading.Event(), [], []
        take, restore_one = second.placement.take, second.restore_one

        async def take_told(registry, stream_id):
            waiting.set()  # this request waits for the taking under way from here on
            await take(registry, stream_id)

        def restore_failing_first(record, *args):  # on the model's thread
            if not later:  # the first taking fails (its save out of reach) once a second request waits for it
                later.append(asyncio.run_coroutine_threadsafe(second.find(OWNER, entry.id), loop))
                waiting.wait(WAIT_SECONDS)
                raise ServiceError(503, "the store cannot be read now; retry")
            if len(later) == 1:  # a third request arrives as the second takes the stream
                later.append(asyncio.run_coroutine_threadsafe(second.find(OWNER, entry.id), loop))
                deadline = time.monotonic() + WAIT_SECONDS
                while second.arriving < 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
            loaded.append(restore_one(record, *args))
            return loaded[-1]

        second.placement.take, second.restore_one = take_told, restore_failing_first
        with pytest.raises(ServiceError) as failed:
            await second.find(OWNER, entry.id)
        while len(later) < 2:
            await asyncio.sleep(0.01)
        found = [await asyncio.wrap_future(request) for request in later]
        for registry in (first, second):
            registry.worker.close()
        return failed.value, found, loaded, list(second.entries.values())

    failed, found, loaded, held = asyncio.run(scenario())
    assert failed.status == 503
    assert len(loaded) == 1 and held == loaded and found == held * 2


def test_a_stream_whose_lease_is_lost_while_it_loads_is_not_kept_unservable(tmp_path, qa):
    """Before: a replica whose hold on a stream lapsed while the stream loaded, another replica taking it meanwhile,
    kept the stream it loaded as held: every request for it there answered 503 ("moved to another replica; retry")
    and no pass over the leases ever dropped it, so the requests routed there never reached the stream again."""
    clock = Clock()

    async def scenario():
        first, second = _replica(tmp_path, qa, "first", clock), _replica(tmp_path, qa, "second", clock)
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        await first.worker.run(first.save_now, entry)
        await first.placement.hand_over(first, entry)
        loop, restore_one = asyncio.get_running_loop(), second.restore_one

        def restore_outlasting_the_lease(record, *args):  # on the model's thread
            clock.now += 120  # the load outlasts the lease: the first replica takes the stream back meanwhile
            assert first.files.take(record["id"]) is not None
            asyncio.run_coroutine_threadsafe(second.keep_leases(), loop).result()
            return restore_one(record, *args)

        second.restore_one = restore_outlasting_the_lease
        with pytest.raises(ServiceError) as refused:
            await second.find(OWNER, entry.id)
        await second.keep_leases()
        held = list(second.entries)
        for registry in (first, second):
            registry.worker.close()
        return refused.value, held

    refused, held = asyncio.run(scenario())
    assert refused.status == 503 and "retry" in str(refused)
    assert held == []


def test_a_stream_taken_while_the_shared_folder_is_full_is_refused_in_one_line_and_taken_once_it_is_not(
        tmp_path, qa, monkeypatch):
    """Before: its lease could not be written, and the request answered 500 ("internal error (OSError)"), its
    traceback in the log, where a creation refused by the same folder answers a one-line 503."""
    flush = os.fsync

    def filling(handle):  # the disk under the leases fills as a lease is flushed
        if os.readlink(f"/proc/self/fd/{handle}").startswith(str(tmp_path / "leases")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        flush(handle)

    async def scenario():
        first, second = _replica(tmp_path, qa, "first"), _replica(tmp_path, qa, "second")
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        await first.worker.run(first.save_now, entry)
        first.let_all_go()
        with monkeypatch.context() as patched:
            patched.setattr(os, "fsync", filling)
            with pytest.raises(ServiceError) as refused:
                await second.find(OWNER, entry.id)
        taken = await second.find(OWNER, entry.id)
        for registry in (first, second):
            registry.worker.close()
        return refused.value, taken.stream.frames

    refused, frames = asyncio.run(scenario())
    assert refused.status == 503 and "no space left on device" in str(refused).lower() and "\n" not in str(refused)
    assert frames == 1


async def _frozen_in_a_save(replica: SharedRegistry, entry, killed: threading.Event, monkeypatch) -> asyncio.Future:
    """A save of ``entry`` on ``replica`` that stops dead once its file is written, before its rename (as a replica
    killed there), returned once it is there; it ends with a RuntimeError once ``killed`` is set."""
    stuck, save_file = threading.Event(), stream_file.save_file

    def save_then_freeze(*args, **kwargs):
        save_file(*args, **kwargs)
        stuck.set()
        killed.wait(30)
        raise RuntimeError("killed")

    with monkeypatch.context() as patched:
        patched.setattr(stream_file, "save_file", save_then_freeze)
        saving = asyncio.ensure_future(replica.worker.run(replica.save_now, entry))
        await asyncio.to_thread(stuck.wait, 30)
    return saving


def test_a_stream_whose_replica_was_killed_in_a_save_is_deleted_whole_by_the_next(tmp_path, qa, monkeypatch):
    """Before: what the killed save left in the shared folder (its partial folder) could not be removed, so the
    deletion of the stream by the replica that took it over stopped half way, leaving its record, deletion note and
    lease, and every later start of a replica failed to finish it again."""
    clock, killed = Clock(), threading.Event()

    async def scenario():
        first, second = _replica(tmp_path, qa, "first", clock), _replica(tmp_path, qa, "second", clock)
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        saving = await _frozen_in_a_save(first, entry, killed, monkeypatch)
        clock.now += 120  # the first replica is gone: its lease lapses
        await second.remove(OWNER, entry.id)
        left = _files_of(tmp_path, entry.id)
        killed.set()
        with pytest.raises(RuntimeError):
            await saving
        for registry in (first, second):
            registry.worker.close()
        return left

    assert asyncio.run(scenario()) == []


def test_what_a_save_killed_midway_left_is_removed_by_the_next_holders_save(tmp_path, qa, monkeypatch):
    """Before: the partial folder of a replica killed in a save stayed in the shared folder for as long as the
    stream lived (only its deletion removed it), however often the replica that took it over saved it."""
    clock, killed = Clock(), threading.Event()

    async def scenario():
        first, second = _replica(tmp_path, qa, "first", clock), _replica(tmp_path, qa, "second", clock)
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        saving = await _frozen_in_a_save(first, entry, killed, monkeypatch)
        clock.now += 120  # the first replica is gone (its process stopped dead): its lease lapses
        left_by_kill = [name for name in _files_of(tmp_path, entry.id) if ".partial" in name]
        taken = await second.find(OWNER, entry.id)
        with pytest.raises(ServiceError, match="came back from its last save"):  # the pushes it lost, said once
            await second.push(taken, random_frames(1, 32, 48, 64)[0], 1.0)
        await second.push(taken, random_frames(1, 32, 48, 64)[0], 0.0)
        await second.worker.run(second.save_now, taken)
        files = _files_of(tmp_path, entry.id)
        killed.set()
        with pytest.raises(RuntimeError):
            await saving
        for registry in (first, second):
            registry.worker.close()
        return left_by_kill, files, taken.stream.frames

    left_by_kill, files, frames = asyncio.run(scenario())
    assert left_by_kill and frames == 1
    assert not [name for name in files if ".partial" in name], files


@pytest.mark.parametrize("request_kind", ["question", "push"])
def test_a_request_waiting_while_its_replicas_hold_lapses_is_refused_for_a_retry(tmp_path, qa, request_kind):
    """Before: a request found its stream held here and waited for the model's thread past the moment another
    replica may take the stream (this one stalled: no renewal). A question was answered from this replica's copy,
    which no longer sees the frames pushed to the new holder; a push was answered 200 and streamed into a copy that
    could no longer be saved."""
    lease_seconds = 2.0

    async def scenario():
        first = _replica(tmp_path, qa, "first", lease_seconds=lease_seconds)
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        taken = time.monotonic()
        await first.push(entry, random_frames(1, 31, 48, 64)[0], 0.0)
        entry = await first.find(OWNER, entry.id)  # held here, surely
        lapse = max(0.0, taken + lease_seconds - time.monotonic())
        stalled = asyncio.ensure_future(first.worker.run(time.sleep, lapse))
        await _queued(first.worker, 1)
        with pytest.raises(ServiceError) as refused:
            if request_kind == "question":
                await first.ask(entry, "What colour was the triangle?", 4, None)
            else:
                await first.push(entry, random_frames(1, 32, 48, 64)[0], 1.0)
        await stalled
        assert entry.stream.frames == 1
        first.worker.close()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 503 and "moved to another replica; retry" in str(refused)


def test_a_watch_deleted_as_its_stream_moves_stays_deleted_on_the_replica_that_takes_it(tmp_path, qa):
    """Before: the deletion recorded the watch's end after letting go of the stream, so a hand-over waiting for the
    stream went first and moved it with a record still naming the watch; the replica that took it over served the
    watch again, though its deletion had been answered 200."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    config = ServeConfig(options=qa.options, state_dir=tmp_path, api_keys=("key",), page=False,
                         save_every_seconds=600)
    headers = {"Authorization": "Bearer key"}
    apps = [create_app(config, qa=qa, hosting=ReplicaHosting(config, name, lease_seconds=60))
            for name in ("first", "second")]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        stream_id = first.post("/v1/streams", json={"max_fps": None}, headers=headers).json()["id"]
        first.post(f"/v1/streams/{stream_id}/frames?t=0", content=png_bytes(random_frames(1, 31, 48, 64)[0]),
                   headers={**headers, "Content-Type": "image/png"}).raise_for_status()
        made = first.post(f"/v1/streams/{stream_id}/watches", headers=headers,
                          json={"question": "Is there a red square?", "every": 1, "max_new_tokens": 2})
        watch_id = made.json()["id"]
        registry, handed = apps[0].state.service.registry, threading.Event()
        entry = registry.entries[stream_id]
        registry.worker.run_blocking(registry.save_now, entry)  # saved: the hand-over writes nothing more of it
        hand_over, write_record = registry.placement.hand_over, entry.write_record

        async def hand_over_told(holder, stream):
            await hand_over(holder, stream)
            handed.set()

        def write_once_handed_over(files, *leaving):  # another replica asks for the stream as the record is written
            entry.write_record = write_record
            apps[1].state.service.registry.files.ask_handoff(stream_id)
            first.portal.call(registry.keep_leases)  # the holder's pass over its leases, now
            handed.wait(WAIT_SECONDS)
            return write_record(files, *leaving)

        registry.placement.hand_over, entry.write_record = hand_over_told, write_once_handed_over
        deleted = first.delete(f"/v1/streams/{stream_id}/watches/{watch_id}", headers=headers)
        assert deleted.status_code == 200, deleted.text
        listed = second.get(f"/v1/streams/{stream_id}/watches", headers=headers)
        assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
        assert second.get(f"/v1/streams/{stream_id}", headers=headers).json()["replica"] == "second"
