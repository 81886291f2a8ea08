"""Replicas that share nothing but an object store (``--store s3://bucket/prefix``, no ``--state-dir``), against a
real S3 server on 127.0.0.1 (moto's server mode, `tests/s3.py`): leases fenced by the store's conditional writes
(a stale replica writes nothing), keys, records, the quarantine and saved streams all in the store; two replicas
in this process creating, feeding, asking, handing a stream over, one cut off from the store and its streams
taken over with only the unsaved tail lost; a bucket that refuses writes answered in one line with nothing lost.
`tests/test_serve_nodes.py` runs the same on a Ray cluster of three nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="statekv[ray] brings s3fs")
pytest.importorskip("moto.server", reason="moto[server] is part of .[test]")
pytest.importorskip("fastapi")

import statekv  # noqa: E402
from conftest import answered_alone, png_bytes, random_frames  # noqa: E402
from statekv.serve.auth import owner_of  # noqa: E402
from statekv.serve.cluster.leases import LeaseLost, Leases  # noqa: E402
from statekv.serve.cluster.objects import ObjectStore, StoreError  # noqa: E402
import statekv.serve.cluster.shared as shared  # noqa: E402
from statekv.serve.cluster.shared import LeasedPlacement, SharedStreamFiles  # noqa: E402
from statekv.serve.cluster.store_files import TOMBSTONE_SECONDS, StoreStreamFiles  # noqa: E402
from statekv.serve.cluster.versions import CHECK_WAITS, KEEP, StreamVersions  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.errors import ServiceError  # noqa: E402

from s3 import BUCKET, S3Server  # noqa: E402

STREAM = "st_" + "0" * 24
KEY = "store-key"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def aws(s3, monkeypatch):
    """The standard AWS environment pointing at the local server, as a replica's node would have it."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(stream_id: str = STREAM, name: str = "s") -> dict:
    return {"id": stream_id, "owner": "owner", "settings": {}, "horizon_frames": 4, "max_fps": 1.0, "name": name,
            "created": 0.0}


def _frames(seed: int, count: int) -> list[np.ndarray]:
    return list(random_frames(count, seed, 48, 64))


def _alone(qa, frames: list[np.ndarray]) -> str:
    return answered_alone(qa, frames, QUESTION, 6)


def _holder_and_other(url: str, clock: Clock, names: tuple[str, str], saved: bytes):
    """Two replicas' files over the store at ``url``: the first holds `STREAM`, its record written and ``saved``."""
    holder, other = (StoreStreamFiles(ObjectStore(url), name, 10, clock) for name in names)
    holder.claim(STREAM)
    holder.write_record(_record())
    holder.save_state(STREAM, lambda path: path.write_bytes(saved))
    return holder, other


# -- leases fenced by conditional writes -----------------------------------------------------------------------
def test_a_stream_in_the_store_is_written_by_one_replica_and_a_stale_one_is_fenced_out(aws):
    clock, url = Clock(), aws.url()
    stale, fresh = _holder_and_other(url, clock, ("stale", "fresh"), b"saved by stale")
    assert stale.read_record(STREAM)["lease"] == {"holder": "stale", "token": 1}
    assert fresh.take(STREAM) is None and fresh.holder_of(STREAM) == "stale"  # held: nobody else may take it
    clock.now += 11  # the stale replica's session ran out (it stalled, or lost the store): the stream is free
    taken = fresh.take(STREAM)
    assert taken.token == 2 and taken.lapsed
    fresh.save_state(STREAM, lambda path: path.write_bytes(b"saved by fresh"))
    fresh.write_record(_record(name="fresh"))
    for write in (lambda: stale.write_record(_record(name="stale")),
                  lambda: stale.save_state(STREAM, lambda path: path.write_bytes(b"late write")),
                  lambda: stale.remove(STREAM)):
        with pytest.raises(LeaseLost):  # its token is no longer the newest version's: refused, nothing written
            write()
    with fresh.local_state(STREAM) as path:
        assert path.read_bytes() == b"saved by fresh"
    assert fresh.read_record(STREAM)["name"] == "fresh"
    assert fresh.read_record(STREAM)["lease"] == {"holder": "fresh", "token": 2}
    assert [name for name in aws.names(url) if name.startswith("saves/")] == [
        f"saves/{STREAM}/{name.split('/')[-1]}" for name in aws.names(url) if name.startswith(f"saves/{STREAM}/2-")]
    history = fresh.history(STREAM)
    assert [(line["event"], line["holder"], line["token"]) for line in history] == [
        ("taken", "stale", 1), ("taken", "fresh", 2)]
    assert history[1]["before"]["holder"] == "stale" and history[1]["at"] >= history[1]["before"]["expires"]
    fresh.remove(STREAM)
    assert fresh.read_record(STREAM) is None and fresh.records() == []
    left = aws.names(url)
    assert [name for name in left if name.startswith(("saves/", "holders/", "asks/"))] == []
    assert [name for name in left if name.startswith("streams/")] == [f"streams/{STREAM}/v{7:012d}.json"]
    with pytest.raises(Exception, match="no stream"):
        fresh.take(STREAM)  # the tombstone stays: nobody brings a deleted stream back


def test_a_stream_withdrawn_leaves_nothing_in_the_store_unless_another_replica_took_it(aws):
    """A creation that fails after its stream was taken (its record not written) withdraws it: before, the command
    failed with an AttributeError (500) and the taken version stayed."""
    clock, url = Clock(), aws.url()
    first = StoreStreamFiles(ObjectStore(url), "first", 10, clock)
    second = StoreStreamFiles(ObjectStore(url), "second", 10, clock)
    first.claim(STREAM)
    first.withdraw(STREAM)
    assert [name for name in aws.names(url) if STREAM in name] == [] and first.held == {}
    first.claim(STREAM)
    clock.now += 11
    assert second.take(STREAM).token == 2
    first.withdraw(STREAM)  # too late: the stream is the second replica's now
    assert second.holder_of(STREAM) == "second" and second.renew(STREAM) is not None


def test_a_deletion_cut_short_after_its_last_version_is_finished_at_the_next_start(aws):
    url = aws.url()
    files = StoreStreamFiles(ObjectStore(url), "a", 10, Clock())
    files.claim(STREAM)
    files.write_record(_record())
    files.save_state(STREAM, lambda path: path.write_bytes(b"saved"))
    assert files.removals() == []  # a live stream is no deletion
    files.begin_removal(STREAM, None)  # killed here: deleted, its saves and older versions left behind
    later = StoreStreamFiles(ObjectStore(url), "b", 10, Clock())
    assert later.read_record(STREAM) is None and later.removals() == [{"id": STREAM, "tier": None, "deleted": True}]
    LeasedPlacement(later).restore(None, None)  # as a replica's start does
    assert later.removals() == [] and [name for name in aws.names(url) if name.startswith("saves/")] == []
    assert len([name for name in aws.names(url) if name.startswith(f"streams/{STREAM}/")]) == 1  # the tombstone


def test_a_store_serving_for_months_keeps_no_trace_of_streams_deleted_long_ago(aws, monkeypatch):
    """Before: every deleted stream's last version (its tombstone) stayed in the store for good, read again by each
    listing of the store. Now one past `TOMBSTONE_SECONDS`, its deletion whole, is removed at a replica's start
    (after the deletions cut short are finished) and by its passes; a younger one stays, fencing late writers."""
    clock, url = Clock(), aws.url()
    files = StoreStreamFiles(ObjectStore(url), "a", 10, clock)
    old, cut, young, live = (f"st_{digit * 24}" for digit in "1234")
    for stream_id in (old, cut, young, live):
        files.claim(stream_id)
        files.write_record(_record(stream_id))
        files.save_state(stream_id, lambda path: path.write_bytes(b"saved"))

    def streams() -> set[str]:
        return {name.split("/")[1] for name in aws.names(url) if name.startswith("streams/")}

    files.remove(old)
    files.begin_removal(cut, None)  # killed here: its save and older versions are left
    clock.now += TOMBSTONE_SECONDS
    files.remove(young)
    assert files.forget_deletions() == 0 and streams() == {old, cut, young, live}  # none past its time yet
    clock.now += 1
    assert files.forget_deletions() == 1 and streams() == {cut, young, live}  # the cut deletion waits for its end
    placement = LeasedPlacement(StoreStreamFiles(ObjectStore(url), "b", 10, clock))
    placement.restore(None, None)  # as a replica's start does: the cut deletion finished, then forgotten
    assert streams() == {young, live} and files.read_record(live)["id"] == live
    assert not [name for name in aws.names(url) if name.startswith("saves/") and live not in name]
    clock.now += TOMBSTONE_SECONDS
    monkeypatch.setattr(shared, "FORGET_SECONDS", 0.0)

    async def passes() -> None:
        for _ in range(200):
            await placement.keep(SimpleNamespace(entries={}))
            if young not in streams():
                return
            await asyncio.sleep(0.05)

    asyncio.run(passes())
    assert streams() == {live}


def test_a_writer_that_stalled_while_its_version_was_removed_writes_nothing(aws):
    """A replica that read version N and stalled until N+1 had been written and removed (older versions are
    pruned) creates N+1 again: the chain has moved on past it, so the write is undone and refused."""
    url = aws.url()
    store = ObjectStore(url)
    versions = StreamVersions(store)
    first = versions.commit(None, STREAM, "taken", holder="a", token=1)
    seen = versions.commit(first, STREAM, "recorded", record=_record())
    current = seen
    for index in range(KEEP + 3):
        current = versions.commit(current, STREAM, "recorded", record=_record(name=str(index)))
    stale_number = f"v{seen.number + 1:012d}"
    assert not any(stale_number in name for name in aws.names(url))  # removed by the pruning
    assert versions.commit(seen, STREAM, "recorded", record=_record(name="stale")) is None
    assert not any(stale_number in name for name in aws.names(url))
    assert StreamVersions(store).current(STREAM).record["name"] == str(KEEP + 2)


def test_a_save_and_a_taking_of_one_version_number_cannot_both_be_written(aws, monkeypatch):
    """The holder stalls inside a save's commit past its session, another replica takes the stream, then the
    holder creates its version. Before: a version's name held its event, so the save and the taking of the same
    number were both created; the save's writer pruned the save the taking named, and the stream could not be
    loaded again (its only save named by no version)."""
    clock, url = Clock(), aws.url()
    holder, taker = _holder_and_other(url, clock, ("holder", "taker"), b"first save")
    commit = holder.versions.commit

    def stalled(base, stream_id, event, **changes):
        clock.now += 11  # the holder's session runs out while it stalls with the version it read
        assert taker.take(STREAM).token == 2
        return commit(base, stream_id, event, **changes)
    monkeypatch.setattr(holder.versions, "commit", stalled)
    with pytest.raises(LeaseLost):
        holder.save_state(STREAM, lambda path: path.write_bytes(b"second save"))
    assert [name.split("/")[-1] for name in aws.names(url) if name.startswith(f"streams/{STREAM}/")] == [
        f"v{number:012d}.json" for number in (1, 2, 3, 4)]
    with taker.local_state(STREAM) as path:
        assert path.read_bytes() == b"first save"
    assert taker.holder_of(STREAM) == "taker" and taker.renew(STREAM) is not None
    versions = StreamVersions(ObjectStore(url))
    base = versions.current(STREAM)
    assert versions.commit(base, STREAM, "saved", state="x") is not None
    assert versions.commit(base, STREAM, "taken", holder="else", token=3) is None  # the number is taken


def _fails_after_versions(monkeypatch, store: ObjectStore, failures: int, lost: bool = False) -> None:
    """``store`` fails to answer ``failures`` listings after the next version it creates; with ``lost``, that
    version's creation itself is made and then answered with a failure (its answer lost)."""
    create, names, due, armed = store.create, store.names, [], [True]

    def created(name, data):
        made = create(name, data)
        if made and name.startswith("streams/") and armed:
            armed.clear()
            due.extend([name] * failures)
            if lost:
                raise StoreError(f"the object store cannot write {name} (timed out)")
        return made

    def listing(prefix):
        if due:
            raise StoreError(f"the object store cannot list {prefix} (InternalError, after {due.pop()})")
        return names(prefix)
    monkeypatch.setattr(store, "create", created)
    monkeypatch.setattr(store, "names", listing)


def test_a_save_whose_store_stops_answering_after_its_version_keeps_the_save_it_names(aws, monkeypatch):
    """Before: the store created the save's version, then failed to list (a 500 on the check that it follows its
    chain): the save raised and removed the object its version named, and the stream could not be loaded again."""
    clock, url = Clock(), aws.url()
    holder, other = _holder_and_other(url, clock, ("holder", "other"), b"first save")
    _fails_after_versions(monkeypatch, holder.store, len(CHECK_WAITS))
    holder.save_state(STREAM, lambda path: path.write_bytes(b"second save"))
    clock.now += 11
    assert other.take(STREAM).token == 2
    with other.local_state(STREAM) as path:
        assert path.read_bytes() == b"second save"


@pytest.mark.parametrize("lost", [False, True], ids=["its check", "its own answer"])
def test_a_taking_the_store_did_not_answer_is_held_by_its_taker(aws, monkeypatch, lost):
    """Before: the store created the taking's version, then failed to answer: the take raised, the store named the
    replica as the stream's holder while it held nothing, and no other replica could take it while it lived."""
    clock, url = Clock(), aws.url()
    taker, other = (StoreStreamFiles(ObjectStore(url), name, 10, clock) for name in ("taker", "other"))
    _fails_after_versions(monkeypatch, taker.store, 0 if lost else len(CHECK_WAITS), lost=lost)
    assert taker.take(STREAM).token == 1
    taker.check(STREAM)  # held: its writes go on
    taker.write_record(_record())
    assert other.take(STREAM) is None and other.holder_of(STREAM) == "taker"


@pytest.mark.parametrize("said", [True, False], ids=["read back", "not even read back"])
def test_a_deletion_the_store_made_without_answering_is_a_deletion(aws, monkeypatch, said):
    """Before: the store wrote the stream's tombstone and lost its answer: the client was told nothing was deleted,
    and each retry was told the stream had moved to another replica. Now the tombstone is read back; where it
    cannot be, the retry finds it."""
    clock, url = Clock(), aws.url()
    holder, other = _holder_and_other(url, clock, ("holder", "other"), b"saved")
    _fails_after_versions(monkeypatch, holder.store, 0, lost=True)
    if not said:
        read = holder.store.read
        monkeypatch.setattr(holder.store, "read", lambda name: (_ for _ in ()).throw(StoreError("no answer")))
        with pytest.raises(StoreError, match="cannot write"):
            holder.begin_removal(STREAM, None)
        monkeypatch.setattr(holder.store, "read", read)
    holder.begin_removal(STREAM, None)
    assert holder.held == {} and holder.read_record(STREAM) is None
    with pytest.raises(Exception, match="no stream"):
        other.take(STREAM)


class _Entry:
    """What handing a stream over reads of a served stream: nothing encoded, so nothing to save."""

    def __init__(self, stream_id: str):
        self.id, self.tier, self.lock, self.removal = stream_id, None, asyncio.Lock(), asyncio.Lock()
        self.deleted = self.moved = self.feeding = False
        self.stream = SimpleNamespace(frames=0, pushed=0, close=lambda: None)

    def retire(self, moved: bool = False) -> None:
        self.moved = moved


def _refusing_let_go(monkeypatch, store, refused: list[bool]) -> None:
    """The store refuses every let-go version while ``refused[0]``."""
    create = store.create

    def refusing(name, data):
        if b'"let-go"' in data and refused[0]:
            raise StoreError("the store refused the write (a test)")
        return create(name, data)
    monkeypatch.setattr(store, "create", refusing)


def _registry(entries: dict, restore_one) -> SimpleNamespace:
    async def run(function, *args):
        return function(*args)

    async def heal(entry):
        return None
    return SimpleNamespace(entries=entries, heal=heal, worker=SimpleNamespace(run=run), end_watch_feeds=None,
                           arriving=0, config=SimpleNamespace(max_streams=10), restore_one=restore_one)


def test_a_stream_handed_over_while_the_store_refuses_its_let_go_is_let_go_at_the_next_pass(aws, monkeypatch,
                                                                                           caplog):
    """Before: the stream was dropped here, then the store refused its let-go: the replica forgot the lease while
    the store named it the holder under its live session, so no replica could take the stream while it lived."""
    clock, url = Clock(), aws.url()
    holder, other = _holder_and_other(url, clock, ("holder", "other"), b"saved")
    refused = [True]
    _refusing_let_go(monkeypatch, holder.store, refused)
    registry = _registry({STREAM: _Entry(STREAM)}, None)
    placement = LeasedPlacement(holder)
    asyncio.run(placement.hand_over(registry, registry.entries[STREAM]))
    assert registry.entries == {} and STREAM in holder.held
    assert any(f"cannot let stream {STREAM} go yet" in message for message in caplog.messages)
    assert other.take(STREAM) is None  # still the holder's, which lets it go again
    refused[0] = False
    asyncio.run(placement.keep(registry))
    assert holder.held == {} and other.take(STREAM).token == 2


def test_a_stream_taken_again_while_its_let_go_waits_stays_served_here_alone(aws, monkeypatch):
    """Its hint still names this replica, so its next request comes back here and takes it again: before, the next
    pass let it go while it was served, and another replica could take it too."""
    clock, url = Clock(), aws.url()
    holder, other = _holder_and_other(url, clock, ("holder", "other"), b"saved")
    refused = [True]
    _refusing_let_go(monkeypatch, holder.store, refused)
    registry = _registry({STREAM: _Entry(STREAM)}, lambda record: _Entry(STREAM))
    placement = LeasedPlacement(holder)
    asyncio.run(placement.hand_over(registry, registry.entries[STREAM]))
    asyncio.run(placement.take(registry, STREAM))
    refused[0] = False
    asyncio.run(placement.keep(registry))
    assert STREAM in registry.entries and STREAM in holder.held and other.take(STREAM) is None


def test_a_stream_whose_taking_failed_and_whose_let_go_was_refused_is_let_go_later(aws, monkeypatch):
    """Before: the refused let-go hid the taking's own error, and the lease stayed held with nothing served, so no
    replica could take the stream while this one lived."""
    clock, url = Clock(), aws.url()
    holder, other = _holder_and_other(url, clock, ("holder", "other"), b"saved")
    holder.release(STREAM)
    refused = [True]
    _refusing_let_go(monkeypatch, holder.store, refused)

    def restore_one(record):
        raise ServiceError(503, "the save cannot be read now (a test)")
    registry = _registry({}, restore_one)
    placement = LeasedPlacement(holder)
    with pytest.raises(ServiceError, match="the save cannot be read now"):
        asyncio.run(placement.take(registry, STREAM))
    refused[0] = False
    asyncio.run(placement.keep(registry))
    assert holder.held == {} and other.take(STREAM) is not None


def test_a_holder_that_stalled_before_pruning_its_old_saves_keeps_the_next_holders(aws, monkeypatch):
    """Before: a holder that stalled between its save's version and the pruning of older saves, while another
    replica took the stream and saved, removed every save but its own, the new holder's current one too."""
    clock, url = Clock(), aws.url()
    holder, taker = _holder_and_other(url, clock, ("holder", "taker"), b"first save")
    names, stalled = holder.store.names, []

    def listing(prefix):
        if prefix.startswith("saves/") and not stalled:  # the pruning lists the saves: the holder stalls there
            stalled.append(prefix)
            clock.now += 11
            assert taker.take(STREAM).token == 2
            taker.save_state(STREAM, lambda path: path.write_bytes(b"taker's save"))
        return names(prefix)
    monkeypatch.setattr(holder.store, "names", listing)
    holder.save_state(STREAM, lambda path: path.write_bytes(b"second save"))
    assert stalled
    with taker.local_state(STREAM) as path:
        assert path.read_bytes() == b"taker's save"


def test_a_save_the_store_cannot_give_back_now_is_a_retry_and_one_it_lost_is_damage(aws, monkeypatch):
    """Before: any failure to download a save was the stream's damage (quarantined, a 409), a moment's failure of
    the store too."""
    from statekv.errors import InputError

    clock, url = Clock(), aws.url()
    holder, _ = _holder_and_other(url, clock, ("holder", "other"), b"saved")
    download = holder.store.download

    def failing(name, local):
        raise StoreError(f"the object store cannot read {name} (SlowDown)")
    monkeypatch.setattr(holder.store, "download", failing)
    with pytest.raises(ServiceError, match="SlowDown.*retry") as caught, holder.local_state(STREAM):
        pass
    assert caught.value.status == 503
    monkeypatch.setattr(holder.store, "download", download)
    ObjectStore(url).remove(holder.versions.current(STREAM).state)
    with pytest.raises(InputError, match="not in the object store"), holder.local_state(STREAM):
        pass


def test_versions_named_by_an_earlier_statekv_are_read_and_fence_their_number(aws):
    """An earlier statekv named a version with its event (``v...42-saved.json``): such a chain is read as before,
    goes on under names of the number alone, and a number it holds is not created again."""
    url = aws.url()
    store, versions = ObjectStore(url), StreamVersions(ObjectStore(url))
    first = versions.commit(None, STREAM, "taken", holder="a", token=1)
    legacy = f"streams/{STREAM}/v{2:012d}-recorded.json"
    made = versions.commit(first, STREAM, "recorded", record=_record(name="earlier"))
    store.create(legacy, store.read(made.name))
    store.remove(made.name)
    fresh = StreamVersions(ObjectStore(url))
    current = fresh.current(STREAM)
    assert current.record["name"] == "earlier" and current.number == 2
    assert fresh.commit(first, STREAM, "saved", state="x") is None  # number 2 is the earlier statekv's
    assert fresh.commit(current, STREAM, "let-go").name == f"streams/{STREAM}/v{3:012d}.json"
    assert [line["event"] for line in fresh.history(STREAM)] == ["taken", "let go"]


def test_a_stream_handed_over_for_weeks_keeps_only_its_last_history_in_the_store(aws, monkeypatch):
    """Before: every taking and letting go stayed in the store for good, each commit listed them all and the
    history read them all."""
    import statekv.serve.cluster.versions as versions_module

    monkeypatch.setattr(versions_module, "HISTORY_LINES", 6)
    url = aws.url()
    versions = StreamVersions(ObjectStore(url))
    current = versions.commit(None, STREAM, "recorded", record=_record())
    for turn in range(30):
        current = versions.commit(current, STREAM, "taken", holder=f"r{turn % 2}", token=turn + 1)
        current = versions.commit(current, STREAM, "saved", state=f"s{turn}")
        current = versions.commit(current, STREAM, "let-go")
    held = [name for name in aws.names(url) if name.startswith(f"streams/{STREAM}/")]
    assert len(held) <= 6 + KEEP + 5, held
    history = StreamVersions(ObjectStore(url)).history(STREAM)
    assert 6 <= len(history) and history[-1]["event"] == "let go" and history[-1]["token"] == 30
    assert [line["token"] for line in history] == sorted(line["token"] for line in history)
    assert StreamVersions(ObjectStore(url)).current(STREAM).number == 91


def test_a_session_whose_hold_ran_out_while_its_renewal_hung_starts_a_new_epoch(aws, monkeypatch):
    """A renewal whose write hangs past the hold it renews may find its streams taken by another replica in
    between. Before: the late write kept the old epoch, so the replica went on serving streams it may have lost
    (their pushes accepted, then lost at the next save); now it starts a new epoch and they are never its again
    unless taken anew. A renewal in time keeps the epoch."""
    from statekv.serve.cluster.sessions import Session

    store = ObjectStore(aws.url())
    session = Session(store, "replica", 6)  # long enough that a slow store's write on a loaded machine stays in it
    first = session.keep()
    time.sleep(2.1)  # a third of the hold gone: the next keep renews
    assert session.keep() == first and session.valid()
    put, writes = store.put, []

    def hung(name, data):
        writes.append(name)
        if len(writes) == 1:
            time.sleep(6.2)  # past the hold (6 s less the clocks' margin)
        put(name, data)
    monkeypatch.setattr(store, "put", hung)
    time.sleep(2.1)
    second = session.keep()
    assert second != first and session.valid()
    assert json.loads(store.read("sessions/replica.json"))["epoch"] == second


def test_a_replica_whose_store_listings_hang_keeps_its_session_and_its_streams(aws, qa, monkeypatch):
    """Reading the asks for its streams (a listing) waited on the store inside the pass that also renewed the
    session: a listing hung for less than a lease lapsed the session and dropped every stream (its next push
    refused, the frames since its save lost). The session is now renewed on a loop of its own."""
    url, frames = aws.url(), _frames(5, 3)
    hostings, clients = _replicas(qa, url, ("only",), lease_seconds=3, save_every_frames=100)
    with clients[0] as client:
        made = _call(client, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None})
        stream_id = made.json()["id"]
        assert _push(client, stream_id, frames[0], 0).status_code == 200
        store, names, hanging = hostings[0].files.store, hostings[0].files.store.names, []

        def hung(prefix):
            if prefix.startswith("asks/") and not hanging:
                hanging.append(prefix)
                time.sleep(2.5)
            return names(prefix)
        monkeypatch.setattr(store, "names", hung)
        assert _until(lambda: hanging, 10)
        time.sleep(3)
        for index in (1, 2):
            pushed = _push(client, stream_id, frames[index], index)
            assert pushed.status_code == 200, pushed.text
        assert _call(client, "GET", f"/v1/streams/{stream_id}").json()["frames"] == 3
        assert [line["event"] for line in hostings[0].files.history(stream_id)] == ["taken"]


def test_a_stream_whose_record_cannot_be_read_while_taken_is_a_503_and_let_go(aws, qa, monkeypatch):
    """Before: the store failing to read the record of a stream being taken raised a TypeError (a 500) and left
    the stream's lease held with no entry serving it."""
    url, frames = aws.url(), _frames(6, 2)
    hostings, clients = _replicas(qa, url, ("first", "second"), lease_seconds=3, save_every_frames=1)
    with clients[0] as first, clients[1] as second:
        stream_id = _call(first, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None}).json()["id"]
        assert _push(first, stream_id, frames[0], 0).status_code == 200
        read, reads = hostings[1].files.read_record, []

        def failing(wanted):  # read to check its owner, then again once its lease is taken: that read fails
            reads.append(wanted)
            if len(reads) == 1:
                return read(wanted)
            raise StoreError(f"the object store {url} cannot read streams/{wanted} (unreachable)")
        monkeypatch.setattr(hostings[1].files, "read_record", failing)
        moved = _call(second, "GET", f"/v1/streams/{stream_id}")
        assert moved.status_code == 503 and "cannot read" in moved.json()["error"]["message"], moved.text
        assert stream_id not in hostings[1].files.held
        monkeypatch.setattr(hostings[1].files, "read_record", read)
        again = _call(second, "GET", f"/v1/streams/{stream_id}")
        assert again.status_code == 200 and again.json()["frames"] == 1, again.text


def test_a_silent_replica_is_forgotten_by_the_name_of_its_post_never_by_what_it_says(aws, tmp_path):
    """Before: the id a stale post held was taken as the replica to forget, and its disk tier's folder was removed
    by it: a post saying ``"replica": ""`` had the whole tier root removed, live replicas' streams included."""
    from statekv.serve.cluster.board import ReplicaBoard, StoreBoard

    store = ObjectStore(aws.url())
    store.put("replicas/blank.json", json.dumps({"replica": "", "updated": 0}).encode())
    store.put("replicas/up.json", json.dumps({"replica": "../..", "updated": 0}).encode())
    store.put("replicas/.hidden.json", json.dumps({"replica": "x", "updated": 0}).encode())
    assert sorted(StoreBoard(store, "me").forget_silent()) == ["blank", "up"]
    assert store.names("replicas/") == ["replicas/.hidden.json"]
    folder = tmp_path / "state"
    board = ReplicaBoard(folder, "me")
    board.folder.mkdir(parents=True, exist_ok=True)
    (board.folder / "blank.json").write_text(json.dumps({"replica": "", "updated": 0}))
    (board.folder / "..json").write_text(json.dumps({"replica": "..", "updated": 0}))
    assert board.forget_silent() == ["blank"]
    assert sorted(path.name for path in board.folder.iterdir()) == ["..json"]


def test_keys_and_a_probe_need_a_bucket_the_credentials_may_write(aws, capsys, caplog, monkeypatch, tmp_path):
    from statekv.cli import main
    from statekv.serve import auth
    from statekv.serve.cluster.store_files import StoreKeyFile

    url = aws.url()
    drawn = iter(["-Yx3dash", "Yx3plain", "Yx3other"])
    monkeypatch.setattr(auth.secrets, "token_urlsafe", lambda size: next(drawn))
    made = StoreKeyFile(ObjectStore(url)).make()
    assert made == "Yx3plain"  # never a key a command line reads as a flag
    assert StoreKeyFile(ObjectStore(url)).make() is None  # one key per store, whoever is first
    assert StoreKeyFile(ObjectStore(url)).stored()[0]["owner"] == owner_of(made)
    status = main(["serve", "--ray", "auto", "--store", "s3://no-such-bucket/x", "--api-key", "k"])
    printed = capsys.readouterr()
    assert status == 2 and printed.err.count("\n") == 1 and "Traceback" not in printed.err, printed.err
    assert "--store s3://no-such-bucket/x: cannot use it" in printed.err and "NoSuchBucket" in printed.err
    assert not [record for record in caplog.records if "object store" in record.getMessage()]  # said once
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    status = main(["serve", "--ray", "auto", "--store", aws.url("no-credentials"), "--api-key", "k"])
    printed = capsys.readouterr()  # before: botocore's NoCredentialsError, a traceback, status 1
    assert status == 2 and printed.err.count("\n") == 1 and "Traceback" not in printed.err, printed.err
    assert "cannot use it" in printed.err and "credentials" in printed.err


# -- two replicas in one process over one store -----------------------------------------------------------------
def _replicas(qa, url: str, names: tuple[str, ...], lease_seconds: float, **settings):
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    config = ServeConfig(options=qa.options, state_dir=None, api_keys=(KEY,), page=False, save_every_seconds=600,
                         **settings)
    hostings = [ReplicaHosting(config, name, lease_seconds=lease_seconds, store=url) for name in names]
    return hostings, [TestClient(create_app(config, qa=qa, hosting=hosting)) for hosting in hostings]


def _push(client, stream_id: str, image: np.ndarray, index: int):
    return client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=png_bytes(image),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "image/png"})


def _call(client, method: str, path: str, **kwargs):
    return client.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kwargs)


def _until(check, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def test_two_replicas_over_an_object_store_move_a_stream_and_take_over_from_one_cut_off(aws, qa, monkeypatch):
    url, frames = aws.url(), _frames(7, 7)
    # a lease of a few seconds: one of 2 s lapsed between two pushes on a loaded CI machine (the stream moved early)
    hostings, clients = _replicas(qa, url, ("first", "second"), lease_seconds=4, save_every_frames=2)
    with clients[0] as first, clients[1] as second:
        made = _call(first, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None})
        assert made.status_code == 201, made.text
        stream_id = made.json()["id"]
        assert made.json()["replica"] == "first"
        for index in range(3):
            assert _push(first, stream_id, frames[index], index).status_code == 200
        assert _call(first, "POST", f"/v1/streams/{stream_id}/ask", json={
            "question": QUESTION, "max_new_tokens": 6}).json()["answer"] == _alone(qa, frames[:3])

        # a stream moved: asked for on the second replica, the first saves it and lets it go
        moved = _call(second, "GET", f"/v1/streams/{stream_id}")
        assert moved.status_code == 200 and moved.json()["replica"] == "second" and moved.json()["frames"] == 3
        assert _call(first, "GET", "/v1/streams").json()["data"][0]["replica"] == "second"
        for index in range(3, 6):
            assert _push(second, stream_id, frames[index], index).status_code == 200

        # the second replica cut off from the store: its session lapses, it stops serving the stream, and the
        # first takes it from its last save (frames 0-4: saved before the push of frame 5)
        def unreachable():
            raise StoreError(f"the object store {url} cannot write sessions/second.json (unreachable)")

        monkeypatch.setattr(hostings[1].files.session, "keep", unreachable)
        refused = _until(lambda: _call(second, "GET", f"/v1/streams/{stream_id}").status_code == 503, 15)
        assert refused, "the cut-off replica kept serving a stream it may have lost"
        taken = _until(lambda: _call(first, "GET", f"/v1/streams/{stream_id}").json().get("replica") == "first")
        assert taken
        stats = _call(first, "GET", f"/v1/streams/{stream_id}").json()
        assert stats["frames"] == stats["resume_from"] == 5  # only the unsaved tail (frame 5) lost
        resumed = _push(first, stream_id, frames[6], 6)
        assert resumed.status_code == 409 and "push again from frame 5" in resumed.json()["error"]["message"]
        for index in range(5, 7):
            assert _push(first, stream_id, frames[index], index).status_code == 200
        answer = _call(first, "POST", f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                             "max_new_tokens": 6})
        assert answer.json()["answer"] == _alone(qa, frames) and answer.json()["frames"] == 7

        # the stale replica writes nothing: its late save is refused, the store keeps the first's
        entry = hostings[1].shared.entries.get(stream_id)
        if entry is not None:  # not yet dropped by its lease loop
            with pytest.raises(LeaseLost):
                hostings[1].files.save_state(stream_id, entry.stream.save)
        record = hostings[0].files.read_record(stream_id)
        assert record["lease"]["holder"] == "first" and record["saved"]["frames"] in (5, 7)
        tokens = [line["token"] for line in hostings[0].files.history(stream_id) if line["event"] == "taken"]
        assert tokens == list(range(1, len(tokens) + 1)) and len(tokens) == 3
        assert _call(first, "DELETE", f"/v1/streams/{stream_id}").status_code == 200
        # the cut-off replica answers 503 for the stream until its lease loop drops it (later on a loaded machine)
        assert _until(lambda: _call(second, "GET", f"/v1/streams/{stream_id}").status_code == 404, 15)
    assert not [name for name in aws.names(url) if name.startswith("saves/")]


def test_a_replica_stopped_cleanly_leaves_no_disk_tier_files_behind(aws, tmp_path):
    """Before: every clean stop left each stream's file set in the replica's own folder of the tier root, which no
    later replica (each with an id of its own) resumes or removes: a full copy of each stream's detailed cache per
    stop. The streams come back from their saves."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    url, frames, root = aws.url(), _frames(8, 2), tmp_path / "tier"
    disk = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(root / "first"))
    config = ServeConfig(options=disk.options, state_dir=None, api_keys=(KEY,), page=False, save_every_seconds=600)
    hosting = ReplicaHosting(config, "first", lease_seconds=10, store=url, tier_root=root)
    with TestClient(create_app(config, qa=disk, hosting=hosting)) as client:
        stream_id = _call(client, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None}).json()["id"]
        for index in range(2):
            assert _push(client, stream_id, frames[index], index).status_code == 200
        assert [path.name for path in (root / "first").iterdir()]  # its file set, while it runs
    assert not (root / "first").exists()
    again = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(root / "again"))
    config = ServeConfig(options=again.options, state_dir=None, api_keys=(KEY,), page=False, save_every_seconds=600)
    hosting = ReplicaHosting(config, "again", lease_seconds=10, store=url, tier_root=root)
    with TestClient(create_app(config, qa=again, hosting=hosting)) as client:
        answer = _call(client, "POST", f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                             "max_new_tokens": 6})
        assert answer.status_code == 200 and answer.json()["frames"] == 2
        assert answer.json()["answer"] == _alone(disk, frames)


def test_a_bucket_that_refuses_writes_is_one_line_and_nothing_is_lost(aws, qa, monkeypatch):
    frames = _frames(3, 4)
    with aws.writes_refused_to(monkeypatch) as refuse:
        url = aws.url()
        hostings, clients = _replicas(qa, url, ("only",), lease_seconds=60, save_every_frames=2)
        with clients[0] as client:
            stream_id = _call(client, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None}).json()["id"]
            for index in range(2):
                assert _push(client, stream_id, frames[index], index).status_code == 200
            refuse(True)
            for response, status in ((_call(client, "POST", "/v1/streams", json={}), 503),
                                     (_push(client, stream_id, frames[2], 2), 503),
                                     (_call(client, "DELETE", f"/v1/streams/{stream_id}"), 503)):
                assert response.status_code == status, response.text
                message = response.json()["error"]["message"]
                assert "\n" not in message and "AccessDenied" in message and "Traceback" not in message, message
            assert "this frame was not streamed" in _push(client, stream_id, frames[2], 2).json()["error"]["message"]
            stats = _call(client, "GET", f"/v1/streams/{stream_id}").json()
            assert (stats["frames"], stats["resume_from"]) == (2, 2)  # as it was
            asked = _call(client, "POST", f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                                 "max_new_tokens": 6})
            assert asked.status_code == 200 and asked.json()["answer"] == _alone(qa, frames[:2])
            assert [s["id"] for s in _call(client, "GET", "/v1/streams").json()["data"]] == [stream_id]
            refuse(False)
            for index in range(2, 4):
                assert _push(client, stream_id, frames[index], index).status_code == 200
        # a restart (every replica gone, a new one) brings the stream back whole: its shutdown saved it
        hostings, clients = _replicas(qa, url, ("again",), lease_seconds=60)
        with clients[0] as client:
            stats = _call(client, "GET", f"/v1/streams/{stream_id}").json()
            assert stats["frames"] == 4 and stats["replica"] == "again"
            asked = _call(client, "POST", f"/v1/streams/{stream_id}/ask", json={"question": QUESTION,
                                                                                 "max_new_tokens": 6})
            assert asked.json()["answer"] == _alone(qa, frames)


def test_a_store_failing_one_save_at_shutdown_still_saves_the_others_and_lets_go(aws, qa, monkeypatch):
    """Before: the store's failure (an `OSError`, not a statekv error) on the first stream's save at shutdown ended
    the shutdown there: the other streams were not saved, none was let go, the replica's session stayed."""
    url, frames = aws.url(), _frames(8, 3)
    hostings, clients = _replicas(qa, url, ("only",), lease_seconds=60, save_every_frames=100)
    with clients[0] as client:
        ids = [_call(client, "POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None}).json()["id"]
               for _ in range(2)]
        for stream_id in ids:
            for index, frame in enumerate(frames):
                assert _push(client, stream_id, frame, index).status_code == 200
        upload, failed = hostings[0].files.store.upload, []

        def once(local, name):
            if not failed:
                failed.append(name)
                raise StoreError(f"the object store {url} cannot write {name} (connection reset)")
            return upload(local, name)
        monkeypatch.setattr(hostings[0].files.store, "upload", once)
    assert failed and failed[0].startswith(f"saves/{ids[0]}/")
    versions = StreamVersions(ObjectStore(url))
    assert versions.current(ids[1]).record["saved"]["pushed"] == 3 and versions.current(ids[1]).state
    assert [version.holder for version in map(versions.current, ids)] == [None, None]  # both let go
    assert not [name for name in aws.names(url) if name.startswith("sessions/")]


def test_a_version_the_store_holds_damaged_does_not_keep_replicas_from_starting(aws, qa):
    """Before: one unreadable version object stopped every replica's start (and `statekv serve --store`'s)."""
    url, damaged = aws.url(), "st_" + "d" * 24
    ObjectStore(url).put(f"streams/{damaged}/v{1:012d}.json", b"{not json")
    hostings, clients = _replicas(qa, url, ("only",), lease_seconds=60)
    with clients[0] as client:
        made = _call(client, "POST", "/v1/streams", json={"horizon_frames": 16})
        assert made.status_code == 201, made.text
        listed = _call(client, "GET", "/v1/streams")
        assert listed.status_code == 200 and made.json()["id"] in [s["id"] for s in listed.json()["data"]]


def test_the_documented_rayservice_builds_the_object_store_application_and_its_policy_allows_what_it_does(aws):
    """docs/serving.md's KubeRay recipe: its serveConfigV2 is a Serve config whose application builds with the store
    alone (no state folder), and the bucket policy it shows allows every request statekv makes."""
    from pathlib import Path

    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from statekv.commands.serve import ray_app

    yaml = pytest.importorskip("yaml")
    serving = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    documents = [yaml.safe_load(block.split("```")[0]) for block in serving.split("```yaml\n")[1:]]
    service = next(document for document in documents if isinstance(document, dict)
                   and document.get("kind") == "RayService")
    schema = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    application = schema.applications[0]
    assert "state_dir" not in application.args and application.args["store"].startswith("s3://")
    import torch

    url = aws.url()
    args = {**application.args, "store": url,  # the local S3 server; CPU where this machine has no GPU
            **({} if torch.cuda.is_available() else {"device": "cpu"})}
    for name, value in application.runtime_env["env_vars"].items():
        os.environ[name] = value
    try:
        built = build_app(ray_app(args), name=application.name).deployments[0]
    finally:
        for name in application.runtime_env["env_vars"]:
            os.environ.pop(name, None)
    config, cluster = built.init_args
    assert config.state_dir is None and cluster.store == url and (cluster.replicas, cluster.max_replicas) == (2, 8)
    assert built._deployment_config.request_router_config.request_router_kwargs == {"store": url,
                                                                                   "max_streams": 64}
    policy = next(document for document in documents if isinstance(document, dict) and "Statement" in document)
    allowed = {action for statement in policy["Statement"] for action in
               ([statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"])}
    assert allowed == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    prefix = service["spec"]["serveConfigV2"].split("store: s3://", 1)[1].split()[0]
    assert any(statement["Resource"] == f"arn:aws:s3:::{prefix}/*" for statement in policy["Statement"])


def test_a_save_beside_a_shared_folder_lists_only_its_own_streams_objects(aws, tmp_path, caplog):
    """Before: pruning a stream's older saves (``--state-dir`` with ``--store``) listed every object of every
    stream in the store, at each save of each stream: a listing the store bills and pages by what it returns."""
    url, other = aws.url(), "st_" + "1" * 24
    files = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", "one", 60), store=url)
    for stream in (other, STREAM):
        files.claim(stream)
        files.save_state(stream, lambda path: path.write_bytes(b"first"))
    caplog.set_level(logging.INFO, logger="werkzeug")  # the S3 server's log of the requests it answered
    files.save_state(STREAM, lambda path: path.write_bytes(b"second"))
    listings = [record.getMessage() for record in caplog.records if "list-type=2" in record.getMessage()]
    prefix = url.split(f"s3://{BUCKET}/", 1)[1]
    assert listings and all(f"prefix={prefix}/{STREAM}." in listing for listing in listings), listings
    assert [name.split(".")[0] for name in aws.names(url)] == sorted([other, STREAM])
    with files.local_state(STREAM) as path:
        assert path.read_bytes() == b"second"


def test_a_replica_keeps_nothing_of_the_streams_it_made_and_deleted(tmp_path):
    """A replica kept a lock for each stream it ever took (one commit at a time per stream), for good: one more per
    stream made and deleted, for weeks. Counted as the memory the module allocates (tracemalloc): flat after the
    first streams."""
    import tracemalloc

    import statekv.serve.cluster.store_files as store_files

    files = StoreStreamFiles(ObjectStore(f"file://{tmp_path}"), "a", 10, Clock())

    def cycles(first: int, count: int) -> None:
        for number in range(first, first + count):
            stream_id = f"st_{number:024x}"
            files.claim(stream_id)
            files.write_record(_record(stream_id))
            files.remove(stream_id)

    tracemalloc.start()
    try:
        cycles(0, 50)
        before = tracemalloc.take_snapshot()
        cycles(50, 200)
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename")
                    if stat.traceback[0].filename == store_files.__file__)
    finally:
        tracemalloc.stop()
    assert files.held == {} and grown < 1000, grown  # before: about 25 bytes a stream


def test_a_store_that_accepts_connections_and_never_answers_fails_in_seconds_not_minutes(monkeypatch, capsys):
    """An endpoint that takes the connection and never answers (a stalled proxy, a store cut off behind its load
    balancer). Before: botocore's minute a read, tried again by botocore and again by s3fs, held `statekv serve
    --store` at its start ten minutes without a line, and each push whose save was due, with the questions and
    health checks behind it, for minutes."""
    import threading

    from statekv.cli import main

    held: list[socket.socket] = []
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)

        def take() -> None:  # each connection is taken and held open; nothing is ever read or answered
            with contextlib.suppress(OSError):
                while True:
                    held.append(silent.accept()[0])

        threading.Thread(target=take, daemon=True).start()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        with socket.socket() as closed:  # no Ray cluster: the store is checked before Ray is reached
            closed.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{closed.getsockname()[1]}"
        started = time.monotonic()
        assert main(["serve", "--ray", address, "--store", "s3://silent/x", "--api-key", "k"]) == 2
        assert time.monotonic() - started < 20 and len(held) == 1  # the probe's one try
        error = capsys.readouterr().err
        assert "--store s3://silent/x: cannot use it (the object store s3://silent/x cannot write probes/" in error
        assert "timed out" in error and error.count("\n") == 1, error
        store = ObjectStore("s3://silent/x", answer_seconds=1.0)
        for doing, request in (("read", lambda: store.read("holders/st_1.json")),  # botocore's read limit
                               ("write", lambda: store.put("holders/st_1.json", b"{}")),  # a whole time given
                               ("write", lambda: store.create("versions/st_1/0", b"{}"))):
            before, started = len(held), time.monotonic()
            with pytest.raises(StoreError, match=rf"^the object store s3://silent/x cannot {doing} [^\n]+ \("):
                request()
            assert time.monotonic() - started < 10  # two tries of a second each, or a write's whole time (4 s)
            tries = len(held) - before  # a read: two, not botocore's and s3fs's in turn; a write waits for its
            assert tries == (2 if doing == "read" else 1), (doing, tries)  # "100 Continue" until its time is up
        for connection in held:
            connection.close()
