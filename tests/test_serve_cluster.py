"""The pieces of `statekv serve --ray` without a Ray cluster: leases and their fencing (a replica that lost a stream
writes nothing of it), two replicas in one process handing a stream over through the shared folder with nothing
lost, the damaged streams of the folder listed by every replica and deleted from any, saves in object storage
through fsspec, the request router's choices, autoscaling on streams, the metrics of several replicas as one
exposition, and the options Ray Serve is given (the CLI's and a Serve config file's). tests/test_serve_ray.py runs
the whole on a real local Ray cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")

import statekv  # noqa: E402
from statekv.errors import ConfigurationError  # noqa: E402
from statekv.serve.auth import owner_of  # noqa: E402
from statekv.serve.cluster.board import merged  # noqa: E402
from statekv.serve.cluster.deployment import ClusterSettings, deployment_options  # noqa: E402
from statekv.serve.cluster.leases import LeaseLost, Leases  # noqa: E402
from statekv.serve.cluster.router import PLACING_PATIENCE_SECONDS, StreamRouter, request_target  # noqa: E402
from statekv.serve.cluster.scaling import StreamsPolicy  # noqa: E402
from statekv.serve.cluster.shared import LeasedPlacement, SharedRegistry, SharedStreamFiles  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.errors import ServiceError  # noqa: E402
from statekv.serve.metrics import Metrics  # noqa: E402
from statekv.serve.worker import ModelWorker  # noqa: E402

from conftest import random_frames  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STREAM = "st_" + "0" * 24
SIZE = (48, 64)  # the frames a client sends: height, width
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."


class Clock:
    """Wall time that a test moves on."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(stream_id: str = STREAM, owner: str = "owner") -> dict:
    return {"id": stream_id, "owner": owner, "settings": {}, "horizon_frames": 4, "max_fps": 1.0, "name": "s",
            "created": 0.0}


# -- leases ---------------------------------------------------------------------------------------------------
def test_a_lease_is_held_by_one_replica_and_each_taking_raises_its_token(tmp_path):
    clock = Clock()
    first, second = (Leases(tmp_path, name, seconds=10, clock=clock) for name in ("first", "second"))
    held = first.acquire(STREAM)
    assert held.token == 1 and held.holder == "first" and second.acquire(STREAM) is None
    assert Leases(tmp_path, clock=clock).holder_of(STREAM) == "first"  # what a router reads
    second.ask_handoff(STREAM)
    assert first.renew(held, extend=False).handoff == "second"  # the holder sees who asks
    clock.now += 9
    assert first.renew(held).expires == clock.now + 10 and second.acquire(STREAM) is None
    clock.now += 10.5  # the holder stalled (or died) past its lease
    taken = second.acquire(STREAM)
    assert taken.token == 2 and taken.holder == "second" and taken.lapsed  # frames since its last save: lost
    assert first.renew(held) is None  # the stale holder finds its token gone
    with pytest.raises(LeaseLost, match="moved to another replica; retry"):
        with first.fenced(held):
            pass
    second.release(taken)
    assert Leases(tmp_path, clock=clock).holder_of(STREAM) is None
    again = first.acquire(STREAM)
    assert again.token == 3 and not again.lapsed  # let go: saved first, nothing lost
    history = first.history(STREAM)
    assert [(line["event"], line["holder"], line["token"]) for line in history] == [
        ("taken", "first", 1), ("taken", "second", 2), ("let go", "second", 2), ("taken", "first", 3)]
    assert history[1]["at"] >= history[1]["before"]["expires"]  # taken only once the first lease had lapsed


def test_a_stream_handed_over_for_weeks_keeps_its_last_history_and_no_lock_of_a_lease_long_gone(tmp_path,
                                                                                                  monkeypatch):
    """Before: each taking and letting go added a line to the stream's history for good, and the process kept a
    thread lock for every lease file it ever locked (a server creating streams for weeks grew with both)."""
    import threading

    import statekv.serve.cluster.leases as leases

    monkeypatch.setattr(leases, "HISTORY_LINES", 6)
    monkeypatch.setattr(leases, "HISTORY_BYTES", 1200)
    clock = Clock()
    first, second = (Leases(tmp_path, name, seconds=10, clock=clock) for name in ("first", "second"))
    history_file = tmp_path / "leases" / f"{STREAM}.history"
    for turn in range(40):
        holder = (first, second)[turn % 2]
        holder.release(holder.acquire(STREAM))
        assert history_file.stat().st_size <= 1200 + 200
    history = first.history(STREAM)
    assert 3 <= len(history) <= 16 and history[-1] == {"event": "let go", "holder": "second", "token": 40,
                                                       "at": clock.now}
    assert [line["token"] for line in history] == sorted(line["token"] for line in history)
    assert sorted(path.name for path in tmp_path.joinpath("leases").iterdir()) == [STREAM, f"{STREAM}.history"]
    history_file.with_suffix(".history.kept").write_text("")  # as a crash while cutting it leaves it
    first.forget(first.acquire(STREAM))
    assert not any(tmp_path.joinpath("leases").iterdir())

    def churn(index: int) -> None:
        for round_ in range(20):  # two threads at a time on each stream: its thread lock shared, then let go
            stream = f"st_{index // 2:02d}{round_:022d}"
            with contextlib.suppress(LeaseLost):
                first.forget(first.acquire(stream))
    threads = [threading.Thread(target=churn, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert leases.THREAD_LOCKS == {}


def test_a_lease_withdrawn_is_removed_unless_another_replica_took_the_stream(tmp_path):
    clock = Clock()
    first, second = (Leases(tmp_path, name, seconds=10, clock=clock) for name in ("first", "second"))
    held = first.acquire(STREAM)
    first.withdraw(STREAM)  # its creation failed: nothing of it stays
    assert first.renew(held) is None and first.release(held) is None and second.peek(STREAM) is None
    second.ask_handoff(STREAM)
    with pytest.raises(LeaseLost):
        with first.fenced(held):
            pass
    assert not list(first.folder.iterdir())  # nor does a renewal under way, or a request for it, make it again
    first.acquire(STREAM)
    clock.now += 11
    taken = second.acquire(STREAM)
    first.withdraw(STREAM)  # too late: the stream is the second replica's now
    assert Leases(tmp_path, clock=clock).holder_of(STREAM) == "second" and second.renew(taken) is not None


def test_an_unreadable_lease_is_refused_rather_than_restarted_at_token_one(tmp_path):
    leases = Leases(tmp_path, "first")
    leases.path(STREAM).write_bytes(b"{garbage")
    with pytest.raises(ServiceError, match="lease in the shared state folder is unreadable"):
        leases.acquire(STREAM)


def test_a_replica_that_lost_a_stream_writes_nothing_of_it(tmp_path):
    clock = Clock()
    stale = SharedStreamFiles(tmp_path, Leases(tmp_path, "stale", seconds=10, clock=clock))
    fresh = SharedStreamFiles(tmp_path, Leases(tmp_path, "fresh", seconds=10, clock=clock))
    stale.claim(STREAM)
    stale.write_record(_record())
    stale.save_state(STREAM, lambda path: path.write_bytes(b"saved by stale"))
    assert stale.read_record(STREAM)["lease"] == {"holder": "stale", "token": 1}
    assert not fresh.take(STREAM)  # held: nobody else may
    clock.now += 11
    assert fresh.take(STREAM)
    fresh.save_state(STREAM, lambda path: path.write_bytes(b"saved by fresh"))
    fresh.write_record({**_record(), "name": "fresh"})
    for write in (lambda: stale.write_record({**_record(), "name": "stale"}),
                  lambda: stale.save_state(STREAM, lambda path: path.write_bytes(b"late write")),
                  lambda: stale.remove(STREAM)):
        with pytest.raises(LeaseLost):
            write()
    assert fresh.state_path(STREAM).read_bytes() == b"saved by fresh"
    assert fresh.read_record(STREAM)["name"] == "fresh"
    assert fresh.read_record(STREAM)["lease"] == {"holder": "fresh", "token": 2}
    assert not list(tmp_path.glob("streams/*.partial"))  # nothing left half-written
    assert stale.renew(STREAM) is None and STREAM not in stale.held
    with pytest.raises(LeaseLost):
        stale.check(STREAM)


def test_saves_in_object_storage_are_found_through_the_fenced_pointer(tmp_path):
    pytest.importorskip("fsspec")
    clock = Clock()
    url = (tmp_path / "bucket").as_uri()
    stale = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", "stale", 10, clock), store=url)
    fresh = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", "fresh", 10, clock), store=url)
    stale.claim(STREAM)
    assert not stale.has_state(STREAM)
    with stale.local_state(STREAM) as path:
        assert path is None
    stale.save_state(STREAM, lambda path: path.write_bytes(b"one"))
    stale.save_state(STREAM, lambda path: path.write_bytes(b"two"))
    assert len(list((tmp_path / "bucket").iterdir())) == 1  # each save a new object; the older one pruned
    clock.now += 11
    assert fresh.take(STREAM)
    with fresh.local_state(STREAM) as path:
        assert path.read_bytes() == b"two"
    with pytest.raises(LeaseLost):
        stale.save_state(STREAM, lambda path: path.write_bytes(b"stale"))  # uploaded, but never pointed at
    fresh.save_state(STREAM, lambda path: path.write_bytes(b"three"))
    with fresh.local_state(STREAM) as path:
        assert path.read_bytes() == b"three"
    assert not (tmp_path / "state" / "streams" / f"{STREAM}.safetensors").exists()
    fresh.write_record(_record())
    fresh.remove(STREAM)
    assert list((tmp_path / "bucket").iterdir()) == [] and not fresh.has_state(STREAM)


def test_a_holder_that_stalled_before_pruning_its_objects_keeps_the_next_holders_save(tmp_path, monkeypatch):
    """Before: a holder stalled between pointing at its new save and pruning its older objects, while another
    replica took the stream and saved: the pruning removed every object of the stream but its own, the new
    holder's too, and the stream could not be loaded."""
    pytest.importorskip("fsspec")
    clock, url = Clock(), (tmp_path / "bucket").as_uri()
    stale = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", "stale", 10, clock), store=url)
    fresh = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", "fresh", 10, clock), store=url)
    stale.claim(STREAM)
    stale.save_state(STREAM, lambda path: path.write_bytes(b"one"))
    names, stalled = stale.store.objects.names, []

    def listing(prefix, start=""):
        if not stalled:  # the pruning lists the objects: the holder stalls there
            stalled.append(prefix)
            clock.now += 11
            assert fresh.take(STREAM)
            fresh.save_state(STREAM, lambda path: path.write_bytes(b"fresh"))
        return names(prefix, start)
    monkeypatch.setattr(stale.store.objects, "names", listing)
    stale.save_state(STREAM, lambda path: path.write_bytes(b"two"))
    assert stalled
    with fresh.local_state(STREAM) as path:
        assert path.read_bytes() == b"fresh"


def test_a_save_uploaded_to_a_local_folder_store_is_on_the_disk_before_it_has_its_name(tmp_path, monkeypatch):
    """Before: fsspec's copy, never flushed, while the version naming it is: a power loss could leave a name on a
    torn save with the older one already pruned."""
    pytest.importorskip("fsspec")
    from statekv.serve.cluster import objects

    flushed = []
    monkeypatch.setattr(objects, "flush_file", lambda path: flushed.append(Path(path)))
    store, local = objects.ObjectStore((tmp_path / "bucket").as_uri()), tmp_path / "save.safetensors"
    local.write_bytes(b"saved")
    store.upload(local, "saves/one.safetensors")
    assert (tmp_path / "bucket" / "saves" / "one.safetensors").read_bytes() == b"saved"
    assert len(flushed) == 1 and flushed[0].parent == tmp_path / "bucket" / "saves" and not flushed[0].exists()
    assert sorted(path.name for path in (tmp_path / "bucket" / "saves").iterdir()) == ["one.safetensors"]


def test_a_holders_wall_clock_stepped_back_still_renews_its_leases(tmp_path):
    """Before: renewal was due by the wall clock alone, so after the holder's clock stepped back its lease was never
    renewed while its own hold on it (timed by the monotonic clock) ran out: the stream answered 503."""
    clock = Clock()
    holder = SharedStreamFiles(tmp_path, Leases(tmp_path, "holder", seconds=3, clock=clock))
    holder.claim(STREAM)
    clock.now -= 60  # NTP stepped the clock back a minute
    time.sleep(1.2)  # over a third of the lease gone by the monotonic clock
    assert holder.renew(STREAM) is not None
    time.sleep(2.0)  # past the first hold: only a renewal keeps it
    holder.check(STREAM)


def test_a_lease_that_cannot_be_read_holds_up_none_of_the_others(tmp_path, caplog):
    """Before: the pass renewing a replica's leases ended at the first it could not read (a torn file on a slow
    share), every pass met it first, and the streams after it lapsed."""
    clock = Clock()
    files = SharedStreamFiles(tmp_path, Leases(tmp_path, "holder", seconds=10, clock=clock))
    streams = ["st_torn", "st_one", "st_two"]
    for stream in streams:
        files.claim(stream)
    files.leases.path("st_torn").write_bytes(b'{"stream": "st_to')
    clock.now += 8  # every lease due for renewal
    placement = LeasedPlacement(files)
    for _ in range(2):
        asyncio.run(placement.keep(SimpleNamespace(entries={})))
    clock.now += 8
    assert [files.leases.peek(stream).live(clock.now) for stream in streams[1:]] == [True, True]
    assert sum("cannot renew the lease of stream st_torn" in message for message in caplog.messages) == 1


# -- two replicas in one process ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_two_replicas_hand_a_stream_over_through_the_shared_folder_with_nothing_lost(tmp_path, qa, tier):
    if tier == "disk":  # each replica's streams keep their detailed cache in file sets of its own folder
        qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
    config = ServeConfig(options=qa.options, state_dir=tmp_path, save_every_frames=1000, max_streams=4)
    owner, frames = owner_of("key"), random_frames(3, 31, *SIZE)

    async def scenario():
        replicas = []
        for name in ("first", "second"):
            files = SharedStreamFiles(tmp_path, Leases(tmp_path, name, seconds=60))  # no loop renews them here
            registry = SharedRegistry(config, qa, ModelWorker(), files)
            registry.metrics = Metrics(lambda: 0, lambda: 0)
            replicas.append(registry)
        first, second = replicas
        ended = []  # the feeds of watch events of a stream that moved away end, saying so
        first.end_watch_feeds = lambda stream_id, message: ended.append((stream_id, message))
        entry = await first.create(owner, {"horizon_frames": 16, "max_fps": None})
        for index, image in enumerate(frames):
            await first.push(entry, image, float(index))
        assert not first.files.has_state(entry.id)  # nothing saved yet: all three frames are unsaved

        with pytest.raises(ServiceError, match="no stream"):
            await second.find(owner_of("another key"), entry.id)  # another key's request moves nothing
        assert first.files.leases.peek(entry.id).handoff is None
        listed = second.owned(owner)
        assert [(item.id, item.describe()["replica"]) for item in listed] == [(entry.id, "first")]
        assert set(listed[0].describe()) == set(entry.describe()) | {"replica"}  # the same fields, told or not
        assert listed[0].describe()["settings"] == entry.describe()["settings"]  # only what its method reads

        taking = asyncio.ensure_future(second.find(owner, entry.id))
        await asyncio.sleep(0.5)
        assert not taking.done()  # asked: the holder lets go at its next pass over its leases
        await first.keep_leases()
        taken = await asyncio.wait_for(taking, 10)
        assert entry.moved and entry.id not in first.entries
        assert ended == [(entry.id, f"stream {entry.id} moved to another replica; follow its events again")]
        if tier == "disk":  # the file set it had here is gone; the stream has a new one where it went
            assert not entry.stream.durability.folder.exists() and taken.stream.durability.folder.exists()
        assert taken.replica == "second" and taken.stream.frames == 3 and taken.stream.pushed == 3
        answer = await second.ask(taken, QUESTION, 6, None)
        for registry in replicas:
            registry.worker.close()
        return answer, second.files.leases.history(entry.id)

    answer, history = asyncio.run(scenario())
    with qa.stream(horizon_frames=16, max_fps=None) as alone:
        for index, image in enumerate(frames):
            alone.push(image, float(index))
        assert answer["answer"] == alone.ask(QUESTION, max_new_tokens=6)
    assert [(line["event"], line["holder"], line["token"]) for line in history] == [
        ("taken", "first", 1), ("let go", "first", 1), ("taken", "second", 2)]


def test_streams_taken_together_count_against_the_replicas_limit(tmp_path, qa):
    owner = owner_of("key")

    async def scenario():
        def replica(name: str, streams: int) -> SharedRegistry:
            config = ServeConfig(options=qa.options, state_dir=tmp_path, save_every_frames=1000, max_streams=streams)
            registry = SharedRegistry(config, qa, ModelWorker(), SharedStreamFiles(tmp_path, Leases(tmp_path, name)))
            registry.metrics = Metrics(lambda: 0, lambda: 0)
            return registry

        first, second = replica("first", 4), replica("second", 1)
        made = [await first.create(owner, {"horizon_frames": 16, "max_fps": None}) for _ in range(2)]
        for entry in made:
            await first.push(entry, random_frames(1, 31, *SIZE)[0], 0.0)
            await first.worker.run(first.save_now, entry)
        first.let_all_go()  # both lie free in the shared folder: each take needs no wait
        results = await asyncio.gather(*(second.find(owner, entry.id) for entry in made), return_exceptions=True)
        for registry in (first, second):
            registry.worker.close()
        return results, len(second.entries), second.arriving

    results, held, arriving = asyncio.run(scenario())
    refused = [r for r in results if isinstance(r, ServiceError)]
    assert len(refused) == 1 and refused[0].status == 429 and "limit of 1 streams" in str(refused[0])
    assert held == 1 and arriving == 0


@pytest.mark.parametrize("full", ["streams", "leases"])
def test_a_creation_the_shared_folder_cannot_record_leaves_no_lease_behind(tmp_path, qa, monkeypatch, full):
    """Before: a creation refused because its record could not be written kept its stream's lease, let go, in the
    shared folder for good, and one refused as its lease was written kept a lease taken by no stream."""
    import errno
    import os

    config = ServeConfig(options=qa.options, state_dir=tmp_path, save_every_frames=1000, max_streams=4)
    files = SharedStreamFiles(tmp_path, Leases(tmp_path, "first"))
    registry = SharedRegistry(config, qa, ModelWorker(), files)
    registry.metrics = Metrics(lambda: 0, lambda: 0)
    leases, flush = files.leases.folder, os.fsync

    def filling(handle):  # the disk under one folder fills as a file there is flushed
        if os.readlink(f"/proc/self/fd/{handle}").startswith(str(tmp_path / full)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        flush(handle)

    async def scenario():
        with monkeypatch.context() as patched:
            patched.setattr(os, "fsync", filling)
            with pytest.raises(ServiceError) as refused:
                await registry.create(owner_of("key"), {"horizon_frames": 16, "max_fps": None})
        made = await registry.create(owner_of("key"), {"horizon_frames": 16, "max_fps": None})
        registry.worker.close()
        return refused.value, made

    refused, made = asyncio.run(scenario())
    assert refused.status == 503 and "no space left on device" in str(refused).lower(), refused
    assert "no stream was made" in str(refused)
    assert sorted(path.name for path in leases.iterdir()) == sorted([made.id, f"{made.id}.history"])
    assert [path.name for path in (tmp_path / "streams").iterdir()] == [f"{made.id}.json"]
    assert list(registry.entries) == [made.id]


def _png(image: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_replica_lists_the_damaged_streams_of_the_shared_folder_and_any_deletes_them(tmp_path, qa, monkeypatch):
    """Before: a stream a replica could not load was answered 409 by that replica alone and listed as ready by
    every replica, and a stream whose record could not be read was listed by none."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster import shared
    from statekv.serve.cluster.hosting import ReplicaHosting

    monkeypatch.setattr(shared, "LIST_SECONDS", 0.0)  # each list read afresh (a replica reuses one for 2 s)
    config = ServeConfig(options=qa.options, state_dir=tmp_path, api_keys=("key", "other key"), page=False,
                         save_every_seconds=600)
    mine, theirs = {"Authorization": "Bearer key"}, {"Authorization": "Bearer other key"}
    with TestClient(create_app(config, qa=qa)) as alone:  # streams saved by a server alone, then damaged
        ids = {}
        for name, headers in (("save", mine), ("record", mine), ("good", mine), ("theirs", theirs)):
            made = alone.post("/v1/streams", json={"name": name, "horizon_frames": 8}, headers=headers)
            ids[name] = made.json()["id"]
            alone.post(f"/v1/streams/{ids[name]}/frames?t=0", content=_png(random_frames(1, 31, *SIZE)[0]),
                       headers={**headers, "Content-Type": "image/png"}).raise_for_status()
    streams = tmp_path / "streams"
    saved = streams / f"{ids['save']}.safetensors"
    saved.write_bytes(saved.read_bytes()[:-100])  # the disk lost its tail
    record = json.loads((streams / f"{ids['record']}.json").read_text())
    (streams / f"{ids['record']}.json").write_text(json.dumps({**record, "settings": 7}))  # its owner still named

    apps = [create_app(config, qa=qa, hosting=ReplicaHosting(config, name, lease_seconds=60))
            for name in ("first", "second")]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        refused = second.get(f"/v1/streams/{ids['save']}", headers=mine)  # loaded there: quarantined there
        assert refused.status_code == 409 and "damaged" in refused.json()["error"]["message"]
        for replica in (first, second):  # whichever replica answers: both damaged streams, with their reasons
            listed = {s["id"]: s for s in replica.get("/v1/streams", headers=mine).json()["data"]}
            assert set(listed) == {ids["save"], ids["record"], ids["good"]}
            assert listed[ids["good"]]["state"] == "ready" and listed[ids["good"]]["frames"] == 1
            assert listed[ids["save"]]["name"] == "save"  # as its record says
            assert listed[ids["save"]]["state"] == listed[ids["record"]]["state"] == "damaged"
            assert listed[ids["save"]]["damaged"] in refused.json()["error"]["message"]
            assert "unreadable" in listed[ids["record"]]["damaged"]
            assert [s["id"] for s in replica.get("/v1/streams", headers=theirs).json()["data"]] == [ids["theirs"]]
            for name in ("save", "record"):
                assert replica.get(f"/v1/streams/{ids[name]}", headers=mine).status_code == 409
                assert replica.get(f"/v1/streams/{ids[name]}", headers=theirs).status_code == 404
                assert replica.delete(f"/v1/streams/{ids[name]}", headers=theirs).status_code == 404
        assert first.delete(f"/v1/streams/{ids['save']}", headers=mine).status_code == 200  # not the replica that
        assert second.delete(f"/v1/streams/{ids['record']}", headers=mine).status_code == 200  # quarantined it
        for replica in (first, second):
            assert {s["id"] for s in replica.get("/v1/streams", headers=mine).json()["data"]} == {ids["good"]}
            assert replica.get(f"/v1/streams/{ids['save']}", headers=mine).status_code == 404
        assert first.get(f"/v1/streams/{ids['good']}", headers=mine).json()["frames"] == 1
    for name in ("save", "record"):  # every file gone: record, save, quarantine note, lease
        assert not list(tmp_path.glob(f"*/{ids[name]}*")), list(tmp_path.glob(f"*/{ids[name]}*"))


def test_each_replica_keeps_its_file_sets_apart_and_a_gone_replica_is_forgotten(tmp_path):
    from statekv.serve.cluster.board import FORGET_SECONDS, ReplicaBoard
    from statekv.serve.cluster.deployment import own_tier

    options = statekv.ModelOptions(model="builtin", offload="disk", offload_dir=str(tmp_path / "tier"))
    config, root = own_tier(ServeConfig(options=options, state_dir=tmp_path), "abc")
    assert config.options.offload_dir == str(tmp_path / "tier" / "abc") and root == tmp_path / "tier"
    plain = ServeConfig(options=statekv.ModelOptions(model="builtin"), state_dir=tmp_path)
    assert own_tier(plain, "abc") == (plain, None)
    board, gone = ReplicaBoard(tmp_path, "live"), ReplicaBoard(tmp_path, "gone")
    board.post(1, b"")
    gone.post(2, b"")
    assert [posted["replica"] for posted in board.replicas()] == ["gone", "live"] and board.forget_silent() == []
    stale = json.loads(gone.path.read_text())
    gone.path.write_text(json.dumps({**stale, "updated": stale["updated"] - FORGET_SECONDS - 1}))
    assert [posted["replica"] for posted in board.replicas()] == ["live"]
    assert board.forget_silent() == ["gone"] and not gone.path.exists()


# -- the router, autoscaling, metrics ----------------------------------------------------------------------------
def _pending(path: str, method: str = "GET", model: str = "", request: str | None = None,
             age: float = 0.0) -> SimpleNamespace:
    """A request as Ray Serve's proxy hands it to the router, made ``age`` seconds ago."""
    from ray.serve._private.proxy_request_response import ASGIProxyRequest  # how Ray Serve's proxy sends it on

    asgi = ASGIProxyRequest({"type": "http", "path": path, "method": method, "headers": []}, None, None)
    request = f"{method} {path} {model}" if request is None else request
    metadata = SimpleNamespace(multiplexed_model_id=model, internal_request_id=request)
    return SimpleNamespace(args=[asgi.serialized_replica_arg(proxy_actor_name="proxy")], metadata=metadata,
                           routing_context=SimpleNamespace(should_backoff=False), created_at=time.time() - age)


def _replica(name: str, streams: int) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name),
                           routing_stats={"held": [f"st_{name}{index}" for index in range(streams)], "answered": []})


def test_the_router_sends_a_stream_to_its_holder_and_new_streams_to_the_least_loaded(tmp_path):
    assert request_target(_pending(f"/v1/streams/{STREAM}/frames", "POST")) == ("stream", STREAM)
    assert request_target(_pending("/v1/chat/completions", "POST", model=STREAM)) == ("stream", STREAM)
    assert request_target(_pending("/v1/streams", "POST")) == ("create", None)
    assert request_target(_pending("/v1/streams")) == ("any", None)
    assert request_target(_pending("/ui/_nicegui_ws/socket.io/")) == ("page", None)
    assert request_target(_pending("/v1/streams/../../etc")) == ("any", None)
    assert request_target(SimpleNamespace(args=[b"not a pickle"], metadata=SimpleNamespace(
        multiplexed_model_id=""))) == ("any", None)

    router = StreamRouter.__new__(StreamRouter)  # its state alone: Ray builds the rest when it serves
    router.initialize_state(state_dir=str(tmp_path), max_streams=3)
    busy, idle, full = _replica("busy", 2), _replica("idle", 0), _replica("full", 3)
    replicas = [busy, idle, full]
    choose = lambda request: asyncio.run(router.choose_replicas(replicas, request))  # noqa: E731
    waited = PLACING_PATIENCE_SECONDS + 0.1
    assert choose(_pending("/v1/streams", "POST", age=waited)) == [[idle], [busy], [full]]
    assert choose(_pending("/v1/streams", "POST")) == [[idle]]  # the least-loaded alone at first
    router.on_request_routed(_pending("/v1/streams", "POST"), idle.replica_id, None)
    assert router.load(idle) == 1  # placed since its last report
    Leases(tmp_path, "busy").acquire(STREAM)
    stream = _pending(f"/v1/streams/{STREAM}/ask", "POST")
    assert choose(stream) == [[busy]] and stream.routing_context.should_backoff
    assert choose(_pending(f"/v1/streams/{'st_' + '1' * 24}", age=waited)) == [[idle], [busy], [full]]  # no holder
    assert choose(_pending(f"/v1/streams/{'st_' + '1' * 24}")) == [[idle]]
    page = choose(_pending("/ui/"))
    assert page == [[min(replicas, key=lambda replica: replica.replica_id.unique_id)]] == choose(_pending("/"))
    assert choose(_pending("/health")) == [replicas]


def test_a_stream_sent_to_a_replica_counts_once_until_the_replica_reports_it(tmp_path, monkeypatch):
    """The race a loaded machine showed (four new streams placed 3 and 1 on two replicas): a replica's report taken
    after a request was sent to it but before the stream was taken counted the stream nowhere."""
    from statekv.serve.cluster import router as routing

    router = StreamRouter.__new__(StreamRouter)
    router.initialize_state(state_dir=str(tmp_path))
    first, second = _replica("first", 0), _replica("second", 0)
    choose = lambda request: asyncio.run(router.choose_replicas([first, second], request))  # noqa: E731
    creating = [_pending("/v1/streams", "POST", request=f"create-{index}") for index in range(3)]
    assert choose(creating[0]) == [[first, second]]
    router.on_request_routed(creating[0], first.replica_id, None)
    first.routing_stats = {"held": [], "answered": []}  # reported after the request was sent, before it answered
    assert router.load(first) == 1
    assert choose(creating[1]) == [[second]]
    router.on_request_routed(creating[1], second.replica_id, None)
    first.routing_stats = {"held": ["st_new"], "answered": ["create-0"]}  # taken and answered: the report counts it
    assert router.load(first) == 1
    second.routing_stats = {"held": [], "answered": ["create-1"]}  # refused: no stream, and no longer counted
    assert router.load(second) == 0

    # requests about a stream whose holder the router cannot read (no lease here) are sent to be placed: however
    # many, they count once, and not at all once the replica lists the stream as held (it may have held it already)
    for index in range(5):
        pushing = _pending(f"/v1/streams/{STREAM}/frames", "POST", request=f"push-{index}")
        choose(pushing)
        router.on_request_routed(pushing, second.replica_id, None)
    assert router.load(second) == 1
    second.routing_stats = {"held": [STREAM], "answered": []}
    assert router.load(second) == 1

    choose(creating[2])
    router.on_request_routed(creating[2], second.replica_id, None)
    assert router.load(second) == 2
    later = routing.time.time() + routing.PLACING_SECONDS + 1  # never listed (lost with its replica): not for ever
    monkeypatch.setattr(routing, "time", SimpleNamespace(time=lambda: later))
    assert router.load(second) == 1
    unnamed = _pending("/v1/streams", "POST", request="")
    choose(unnamed)
    router.on_request_routed(unnamed, first.replica_id, None)
    assert router.load(first) == 1  # no id to be listed by: left to the replica's next report
    router.by_load([first])  # second gone: what was sent to it is forgotten once it would count no more
    assert set(router.placed) <= {"first"}


def test_a_replica_lists_a_request_that_may_have_placed_a_stream_on_it_as_it_answers():
    from ray.serve.context import _RequestContext, _serve_request_context

    from statekv.serve.cluster.placing import PlacingLog, RecordPlacing

    held, log, listed_while_answering = {STREAM}, PlacingLog(), []
    brought, failing, chatted = ("st_" + digit * 24 for digit in "123")

    async def app(scope, receive, send):
        if scope["path"].startswith(f"/v1/streams/{brought}"):
            held.add(brought)  # brought here, as the registry does, before the response starts
        if scope["path"].startswith(f"/v1/streams/{failing}"):
            raise RuntimeError("the request failed before answering")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"event", "more_body": True})  # a feed goes on
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    recording = RecordPlacing(app, log=log, held=held.__contains__)

    def call(path: str, method: str = "GET", request: str = "", model: str = "", kind: str = "http") -> None:
        async def send(message):
            if message.get("more_body"):
                listed_while_answering.append(request in log.recent())

        async def run():
            _serve_request_context.set(_RequestContext(_internal_request_id=request, multiplexed_model_id=model))
            await recording({"type": kind, "path": path, "method": method}, None, send)

        asyncio.run(run())

    call("/v1/streams", "POST", "new")
    assert log.recent() == ["new"] and listed_while_answering == [True]  # listed as it answers, not as it ends
    call(f"/v1/streams/{STREAM}/frames", "POST", "held")  # a stream held here as it came: it places nothing
    call("/v1/streams", "GET", "listing")
    call("/health", "GET", "health")
    call("/v1/streams", "POST", "")  # no id to list it by
    call(f"/v1/streams/{STREAM}", kind="websocket", request="socket")
    assert log.recent() == ["new"]
    call(f"/v1/streams/{brought}/ask", "POST", "brought")  # not held as it came: it may have brought it here
    call(f"/v1/streams/{brought}/ask", "POST", "again")  # held by then
    call("/v1/chat/completions", "POST", "asked", model=chatted)
    with pytest.raises(RuntimeError):
        call(f"/v1/streams/{failing}", "GET", "failed")  # ended by an error, never answered: listed all the same
    assert log.recent() == ["new", "brought", "asked", "failed"]


def test_autoscaling_on_streams_asks_for_the_replicas_the_streams_need():
    policy = StreamsPolicy(target=8)
    context = lambda held: SimpleNamespace(aggregated_metrics={"streams": held}, current_num_replicas=2)  # noqa: E731
    assert policy(context({"a": 8.0, "b": 9.0}))[0] == 3
    assert policy(context({"a": 3.0, "b": 0.0}))[0] == 1
    assert policy(SimpleNamespace(aggregated_metrics=None, current_num_replicas=1))[0] == 0  # Ray keeps the least
    with pytest.raises(ValueError):
        StreamsPolicy(target=0)


def test_metrics_of_several_replicas_are_one_exposition_labelled_by_replica():
    from prometheus_client.parser import text_string_to_metric_families

    expositions = []
    for name, streams in (("one", 2), ("two", 5)):
        metrics = Metrics(lambda streams=streams: streams, lambda: 0)
        metrics.frame_done()
        expositions.append((name, metrics.exposition().decode()))
    families = {family.name: family for family in text_string_to_metric_families(merged(expositions).decode())}
    streams = {sample.labels["replica"]: sample.value for sample in families["statekv_streams"].samples}
    assert streams == {"one": 2.0, "two": 5.0}
    assert sum(sample.value for sample in families["statekv_frames"].samples
               if sample.name == "statekv_frames_total") == 2.0


# -- what Ray Serve is given -------------------------------------------------------------------------------------
def test_the_deployment_options_follow_the_flags(tmp_path):
    config = ServeConfig(options=statekv.ModelOptions(model="builtin"), state_dir=tmp_path, max_streams=10)
    fixed = deployment_options(config, ClusterSettings(replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["request_router_config"].request_router_kwargs == {"state_dir": str(tmp_path), "max_streams": 10}
    streams = deployment_options(config, ClusterSettings(replicas=1, max_replicas=4))["autoscaling_config"]
    assert (streams["min_replicas"], streams["max_replicas"]) == (1, 4)
    assert streams["policy"]["policy_kwargs"] == {"target": 5.0}
    requests = deployment_options(config, ClusterSettings(max_replicas=3, scale_on="requests", scale_target=4))
    assert requests["autoscaling_config"]["target_ongoing_requests"] == 4
    for wrong, message in (({"replicas": 0}, "--replicas"), ({"replicas": 3, "max_replicas": 2}, "fewer than"),
                           ({"scale_on": "cpu"}, "--scale-on"), ({"lease_seconds": 0.5}, "--lease-seconds"),
                           ({"scale_on": "requests"}, "--scale-on sets autoscaling: add --max-replicas"),
                           ({"scale_target": 3.0}, "--scale-target sets autoscaling: add --max-replicas"),
                           ({"replica_gpus": float("nan")}, "--replica-gpus"),
                           ({"replica_cpus": 0.0}, "--replica-cpus")):
        with pytest.raises(ConfigurationError, match=message):
            ClusterSettings(**wrong)


def test_ray_flags_need_ray_and_a_serve_config_file_builds_the_same_application(tmp_path, capsys, monkeypatch):
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from statekv.cli import main
    from statekv.commands.serve import ray_app

    assert main(["serve", "--replicas", "2", "--state-dir", str(tmp_path), "--api-key", "k"]) == 2
    assert "--replicas is for a Ray cluster: add --ray auto" in capsys.readouterr().err
    assert main(["serve", "--ray", "auto", "--store", "nosuch://bucket", "--state-dir", str(tmp_path),
                 "--api-key", "k"]) == 2
    assert "--store nosuch://bucket: fsspec cannot open it" in capsys.readouterr().err
    with socket.socket() as closed:  # a port nothing listens on: refused at once, not waited for
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    assert main(["serve", "--ray", address, "--state-dir", str(tmp_path), "--api-key", "k"]) == 2
    assert f"--ray {address}: no Ray cluster answers there" in capsys.readouterr().err
    bucket = "file:///proc/no-such-bucket"  # a store beside the state folder is checked too (before: at the first save)
    assert main(["serve", "--ray", address, "--store", bucket, "--state-dir", str(tmp_path), "--api-key", "k"]) == 2
    assert f"--store {bucket}: cannot use it" in capsys.readouterr().err
    monkeypatch.delenv("STATEKV_API_KEYS", raising=False)
    fresh = tmp_path / "fresh"
    assert main(["serve", "--ray", address, "--state-dir", str(fresh)]) == 2  # refused: no key kept, none shown
    printed = capsys.readouterr()
    assert "no Ray cluster answers there" in printed.err and "API key" not in printed.out + printed.err
    assert not (fresh / "keys.json").exists()  # before: written, so the next start showed no key at all
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for url, message in (("s3:/bucket/x", "not a URL"), ("bucket/x", "not a URL"), ("s3://", "names no bucket"),
                         ("memory://streams", "a memory:// store lives in one process"),  # before: each replica its own
                         ("file://shared/streams", "a relative folder")):  # before: each process's working folder
        assert main(["serve", "--ray", "auto", "--store", url, "--api-key", "k"]) == 2
        assert f"--store {url}: {message}" in capsys.readouterr().err
    assert sorted(path.name for path in elsewhere.iterdir()) == []  # before: ./s3:/bucket/x/keys.json made here
    built = build_app(ray_app({"state_dir": str(tmp_path), "api_key": ["k1", "k2"], "replicas": 2,
                               "lease_seconds": 4, "no_page": True}), name="statekv")
    deployment = built.deployments[0]
    assert deployment._deployment_config.num_replicas == 2
    config, cluster = deployment.init_args
    assert config.api_keys == ("k1", "k2") and not config.page and cluster.lease_seconds == 4
    assert config.state_dir == tmp_path.resolve() and config.options.budget == 64  # the built-in model's default
    with pytest.raises(ConfigurationError, match="not options of statekv serve"):
        ray_app({"state_dir": str(tmp_path), "replicaz": 2})
    with pytest.raises(ConfigurationError, match="set by Ray Serve"):
        ray_app({"state_dir": str(tmp_path), "port": 9000})

    serving = (REPO / "docs" / "serving.md").read_text()
    yaml = pytest.importorskip("yaml")
    documented = [block for block in serving.split("```yaml\n")[1:]]
    assert documented, "docs/serving.md shows a Serve config file"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(documented[0].split("```")[0]))
    application = schema.applications[0]
    assert application.import_path == "statekv.commands.serve:ray_app"
    for name, value in application.runtime_env["env_vars"].items():  # as the application's runtime_env sets them
        monkeypatch.setenv(name, value)
    args = {**application.args, "state_dir": str(tmp_path / "documented"), "media_root": str(tmp_path)}
    documented = build_app(ray_app(args), name=application.name).deployments[0]
    config, cluster = documented.init_args
    assert documented.name == "statekv" and config.api_keys == ("replace-with-your-key",)
    assert (cluster.replicas, cluster.max_replicas, cluster.scale_on) == (2, 8, "streams")
    assert documented._deployment_config.autoscaling_config.max_replicas == 8


def test_a_lone_server_and_a_deployment_never_serve_one_folder_at_once(tmp_path, capsys):
    """Before: a lone server held its folder against other lone servers only, so a --ray deployment could be
    started on it (or it on the deployment's folder), and both wrote the same streams' files."""
    from statekv.cli import main
    from statekv.commands.serve import ray_app
    from statekv.serve.cluster.hosting import ReplicaHosting
    from statekv.serve.store import hold_state_folder, join_state_folder

    state = tmp_path / "state"
    config = SimpleNamespace(state_dir=state)
    lone = hold_state_folder(state, "statekv serve on http://127.0.0.1:1")
    try:
        with socket.socket() as closed:  # no Ray cluster there: the folder must be refused before it is reached
            closed.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{closed.getsockname()[1]}"
        assert main(["serve", "--ray", address, "--state-dir", str(state)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert captured.err.startswith(f"statekv serve: error: the state folder {state} is in use by statekv serve on "
                                       "http://127.0.0.1:1 (process "), captured.err
        assert "stop it, or give the deployment another --state-dir" in captured.err
        assert not (state / "keys.json").exists()  # no key made for a folder another server holds
        with pytest.raises(ConfigurationError, match="in use by statekv serve on http://127.0.0.1:1"):
            ray_app({"state_dir": str(state)})  # Ray's own tools build the application: refused there
        assert not (state / "keys.json").exists()
        with pytest.raises(ConfigurationError, match="in use by statekv serve on http://127.0.0.1:1"):
            ReplicaHosting(config, "replica-1", lease_seconds=60)
    finally:
        lone.release()
    deployment = [join_state_folder(state), ReplicaHosting(config, "replica-1", lease_seconds=60),
                  ReplicaHosting(config, "replica-2", lease_seconds=60)]  # any number share the folder
    with pytest.raises(ConfigurationError, match=rf"^the state folder {re.escape(str(state))} is in use by the "
                                                 "replicas of a --ray deployment; a folder served on Ray is served "
                                                 "by its replicas alone"):
        hold_state_folder(state, "statekv serve on http://127.0.0.1:2")
    deployment[0].release()
    for hosting in deployment[1:]:
        hosting.lock.release()
    hold_state_folder(state, "statekv serve on http://127.0.0.1:2").release()  # the refused server held nothing


def test_a_replica_ends_its_clients_feeds_of_watch_events_once_its_deployment_is_stopping(tmp_path, qa, monkeypatch,
                                                                                          caplog):
    """Ray Serve drains a replica (every request under way ends) before its destructor saves the streams; a feed
    of watch events never ends by itself, so before this a replica whose clients followed events waited out the
    drain's timeout and was killed unsaved. A failed check (the controller restarting) is asked again, warned of
    once while it fails, and again once it fails after an answer."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster import hosting
    from statekv.serve.cluster.hosting import ReplicaHosting

    monkeypatch.setattr(hosting, "STOP_CHECK_SECONDS", 0.05)
    answers = iter([False, RuntimeError("the controller is restarting"), RuntimeError("still"), False,
                    RuntimeError("again")])
    asked = []

    def stopping() -> bool:
        asked.append(time.monotonic())
        answer = next(answers, True)
        if isinstance(answer, Exception):
            raise answer
        return answer

    config = ServeConfig(options=qa.options, state_dir=tmp_path, api_keys=("key",), page=False,
                         save_every_seconds=600)
    app = create_app(config, qa=qa, hosting=ReplicaHosting(config, "replica-1", lease_seconds=60, stopping=stopping))
    headers = {"Authorization": "Bearer key"}
    with caplog.at_level("DEBUG", logger="statekv.serve"), TestClient(app) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
        hub = app.state.service.watch_hub
        deadline = time.monotonic() + 30
        while not hub.closed:
            assert time.monotonic() < deadline, f"asked {len(asked)} times"
            time.sleep(0.05)
        assert len(asked) == 6  # asked again after each failure, and no more once it said so
        with client.stream("GET", f"/v1/streams/{stream_id}/events", headers=headers) as events:
            assert events.status_code == 200
            assert list(events.iter_lines()) == [f": following the watches of stream {stream_id}", ""]  # then ends
    said = [(record.levelname, record.getMessage()) for record in caplog.records
            if "is stopping" in record.getMessage()]
    assert [level for level, _ in said] == ["WARNING", "DEBUG", "WARNING", "INFO"]
    assert "the controller is restarting" in said[0][1] and "again" in said[2][1]


def test_a_replica_takes_only_its_application_being_deleted_for_a_stop(monkeypatch):
    from types import SimpleNamespace

    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from statekv.serve.cluster.deployment import application_deleted

    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(app_name="cams"))
    deleted = application_deleted()
    for applications, expected in (({"cams": ApplicationStatus.RUNNING}, False),
                                   ({"cams": ApplicationStatus.DELETING}, True),
                                   ({"other": ApplicationStatus.DELETING}, False),
                                   ({}, False)):  # what an unreachable controller answers
        status = SimpleNamespace(applications={name: SimpleNamespace(status=value)
                                               for name, value in applications.items()})
        monkeypatch.setattr(serve, "status", lambda: status)
        assert deleted() is expected
