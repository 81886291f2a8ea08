"""One replica's streams when several replicas share a state folder: the files it may write (`SharedStreamFiles`:
only those of streams whose lease it holds, each write committed under the lease's fencing) and its registry
(`SharedRegistry`: a stream is taken from the shared state when a request for it arrives, and let go when another
replica asks for it, at shutdown, or when its lease is lost). A stream that cannot be loaded is quarantined with a
note in the folder's ``quarantine/`` (`store.StreamFiles.write_note`), so every replica lists it as damaged and
any may delete it.

Saved streams can live in object storage instead of the folder (``store``: an fsspec URL such as
``s3://bucket/statekv``): each save is a new object named by the stream, its lease's token and a sequence number,
and the stream's pointer in the folder (``streams/ID.state``, fenced like every write there) names the current
one, so an object written by a replica that lost its lease is never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InputError, StateKVError
from ..errors import ServiceError
from ..registry import STREAM_ID, DamagedStream, StreamEntry, StreamRegistry, reason_of, remove_tier, unreadable
from ..store import StreamFiles
from .leases import Lease, LeaseLost, Leases

log = logging.getLogger("statekv.serve")

TAKE_POLL_SECONDS = 0.2  # how often a replica waiting for a stream's lease tries again
TAKE_MARGIN_SECONDS = 5.0  # how much longer than a lease it waits before answering 503
LIST_SECONDS = 2.0  # how long the listing of the other replicas' streams is reused
RENEW_FRACTION = 1 / 3  # a lease is renewed once this much of it is gone
CLOCK_MARGIN_SECONDS = 1.0  # how far apart the replicas' clocks may be


class SharedStreamFiles(StreamFiles):
    """The state folder's stream files as one replica (``leases.holder``) may write them: a stream's only while
    it holds the stream's lease, each write made beside the file and renamed over it under `Leases.fenced`."""

    def __init__(self, state_dir: Path | str, leases: Leases, store: str | None = None):
        super().__init__(state_dir)
        self.leases = leases
        self.held: dict[str, Lease] = {}
        self._valid: dict[str, float] = {}  # stream -> monotonic time until which its lease is surely ours
        self.store = ObjectStore(store) if store else None

    @property
    def holder(self) -> str:
        return self.leases.holder

    # -- leases -----------------------------------------------------------------------------------------------
    def take(self, stream_id: str) -> Lease | None:
        """Acquire the stream's lease; None when another replica holds a live one."""
        started = time.monotonic()
        lease = self.leases.acquire(stream_id)
        if lease is not None:
            self._keep(lease, started)
        return lease

    def claim(self, stream_id: str) -> None:
        if not self.take(stream_id):
            raise ServiceError(409, f"stream id {stream_id} is taken; retry")

    def renew(self, stream_id: str) -> Lease | None:
        """The stream's lease, renewed once a third of it is gone; None when it was lost (taken over)."""
        lease = self.held.get(stream_id)
        if lease is None:
            return None
        started = time.monotonic()
        due = lease.expires - self.leases.clock() < self.leases.seconds * (1 - RENEW_FRACTION)
        current = self.leases.renew(lease, extend=due)
        if current is None:
            self.held.pop(stream_id, None)
            self._valid.pop(stream_id, None)
            return None
        if due:
            self._keep(current, started)
        else:
            self.held[stream_id] = current
        return current

    def release(self, stream_id: str) -> None:
        lease = self.held.pop(stream_id, None)
        self._valid.pop(stream_id, None)
        if lease is not None:
            self.leases.release(lease)

    def check(self, stream_id: str) -> None:
        """`LeaseLost` unless this replica surely still holds the stream (its lease renewed in time)."""
        if time.monotonic() >= self._valid.get(stream_id, 0.0):
            raise LeaseLost(stream_id)

    def lease(self, stream_id: str) -> Lease:
        try:
            return self.held[stream_id]
        except KeyError:
            raise LeaseLost(stream_id) from None

    def _keep(self, lease: Lease, asked: float) -> None:
        self.held[lease.stream] = lease
        # timed from before the lease was written, less a margin for the machines' clocks: never later than
        # the moment another replica may take the stream
        self._valid[lease.stream] = asked + self.leases.seconds - min(CLOCK_MARGIN_SECONDS, self.leases.seconds / 10)

    # -- writing ----------------------------------------------------------------------------------------------
    def write_record(self, record: dict[str, Any]) -> None:
        lease = self.lease(record["id"])
        document = {**record, "lease": {"holder": lease.holder, "token": lease.token}}
        self._commit(lease, self.record_path(record["id"]), json.dumps(document, indent=1).encode())

    def save_state(self, stream_id: str, write: Callable[[Path], Any]) -> None:
        lease = self.lease(stream_id)
        final = self.state_path(stream_id)
        partial = final.with_name(f"{final.name}.{self.holder}.partial")
        try:
            write(partial)
            _sync(partial)
            if self.store is None:
                with self.leases.fenced(lease):
                    os.replace(partial, final)
                return
            name = self.store.put(partial, stream_id, lease.token)
            self._commit(lease, self.pointer_path(stream_id), json.dumps({"object": name}).encode())
            self.store.prune(stream_id, keep=name)
        finally:
            partial.unlink(missing_ok=True)

    def remove(self, stream_id: str) -> None:
        lease = self.lease(stream_id)
        with self.leases.fenced(lease):
            super().remove(stream_id)  # its record, its save or pointer, what was set aside, its quarantine
        if self.store is not None:
            self.store.prune(stream_id, keep=None)
        self.leases.forget(lease)
        self.held.pop(stream_id, None)
        self._valid.pop(stream_id, None)

    def set_aside(self, stream_id: str) -> str:
        lease = self.lease(stream_id)
        with self.leases.fenced(lease):
            if self.store is None:
                return super().set_aside(stream_id)
            pointer = self.pointer_path(stream_id)
            aside = pointer.with_name(f"{pointer.name}.unreadable-{int(time.time())}")
            os.replace(pointer, aside)
            return aside.name

    def write_note(self, note: dict[str, Any]) -> None:
        self.quarantine.mkdir(exist_ok=True)
        self._commit(self.lease(note["id"]), self.note_path(note["id"]), json.dumps(note, indent=1).encode())

    def remove_note(self, stream_id: str) -> None:
        with self.leases.fenced(self.lease(stream_id)):
            super().remove_note(stream_id)

    def _commit(self, lease: Lease, path: Path, data: bytes) -> None:
        partial = path.with_name(f"{path.name}.{self.holder}.partial")
        try:
            with open(partial, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            with self.leases.fenced(lease):
                os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    # -- reading ----------------------------------------------------------------------------------------------
    def pointer_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.state"

    def has_state(self, stream_id: str) -> bool:
        return (self.pointer_path(stream_id) if self.store else self.state_path(stream_id)).exists()

    @contextlib.contextmanager
    def local_state(self, stream_id: str) -> Iterator[Path | None]:
        if self.store is None:
            with super().local_state(stream_id) as path:
                yield path
            return
        try:
            name = json.loads(self.pointer_path(stream_id).read_text())["object"]
        except FileNotFoundError:
            yield None
            return
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InputError(f"{stream_id}: its pointer to object storage is unreadable ({error})") from None
        folder = Path(tempfile.mkdtemp(prefix="statekv-load-"))
        try:
            local = folder / f"{stream_id}.safetensors"
            self.store.get(name, local)
            yield local
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class ObjectStore:
    """Saved streams in object storage, through fsspec (``s3://``, ``gs://``, ``az://``, ``file://``...)."""

    def __init__(self, url: str):
        import fsspec

        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)  # a folder where there are folders; nothing in object storage
        self._sequence = time.time_ns()

    def put(self, local: Path, stream_id: str, token: int) -> str:
        """Upload a saved stream as a new object; returns its name."""
        self._sequence += 1
        name = f"{self.root}/{stream_id}.{token}.{self._sequence}.safetensors"
        try:
            self.fs.put_file(str(local), name)
        except OSError as error:
            log.error("cannot save stream %s to %s: %s", stream_id, self.url, error)
            raise ServiceError(503, f"cannot save stream {stream_id} to the object store "
                               f"({type(error).__name__}); the server log has the details") from None
        return name

    def get(self, name: str, local: Path) -> None:
        try:
            self.fs.get_file(name, str(local))
        except OSError as error:
            log.error("cannot read %s from %s: %s", name, self.url, error)
            raise InputError(f"cannot read {name.rsplit('/', 1)[-1]} from the object store "
                             f"({type(error).__name__})") from None

    def prune(self, stream_id: str, keep: str | None) -> None:
        """Remove the stream's other objects (all of them with ``keep=None``); a failure only leaves garbage."""
        try:
            for name in self.fs.glob(f"{self.root}/{stream_id}.*.safetensors"):
                if name != keep:
                    self.fs.rm_file(name)
        except OSError as error:
            log.warning("cannot prune old objects of stream %s in %s: %s", stream_id, self.url, error)


@dataclass
class HeldElsewhere:
    """A stream of the state folder that this replica does not hold, as its record says (as of its last save)."""

    record: dict[str, Any]
    holder: str | None = None  # the replica holding it now (None: none; it comes back where next asked for)
    deleted: bool = False
    moved: bool = False
    feeding: bool = False

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def owner(self) -> str:
        return self.record["owner"]

    @property
    def name(self) -> str:
        return self.record["name"]

    @property
    def created(self) -> float:
        return self.record["created"]

    @property
    def saved(self) -> dict[str, Any]:
        saved = self.record.get("saved")
        return saved if isinstance(saved, dict) else {"pushed": 0, "frames": 0, "seconds": None}

    @property
    def frames(self) -> int:
        return int(self.saved.get("frames") or 0)

    @property
    def state(self) -> str:
        return "ready" if self.frames else "empty"

    def describe(self) -> dict[str, Any]:
        record, saved = self.record, self.saved
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created), "updated": None,
                "state": self.state, "settings": record["settings"], "horizon_frames": record["horizon_frames"],
                "max_fps": record["max_fps"], "frames": self.frames, "pushed": saved.get("pushed", 0),
                "pending": None, "seconds": saved.get("seconds"), "tokens": None, "carried": None,
                "cache_bytes": None, "encode_seconds": None, "feeding": False, "feed": None, "saved": dict(saved),
                "resume_from": saved.get("pushed", 0), "resume_after_seconds": saved.get("seconds"),
                "replica": self.holder}


class SharedRegistry(StreamRegistry):
    """A replica's streams over a shared state folder. Nothing is loaded at start: a request for a stream this
    replica does not hold takes it (`find`: its lease once free, then its last save), so a dead replica's streams
    come back wherever their next request is routed. `keep_leases` renews the leases held and lets a stream go
    to a replica that asks for it (saved first)."""

    files: SharedStreamFiles

    def __init__(self, config: Any, qa: Any, worker: Any, files: SharedStreamFiles):
        super().__init__(config, qa, worker, files=files)
        self.replica = files.holder
        self._taking: dict[str, asyncio.Lock] = {}
        self._resumed: set[str] = set()  # streams taken after their replica stopped, not yet pushed to
        self._handing: dict[str, asyncio.Task] = {}  # streams being saved to be handed over
        self._listed: tuple[float, list[HeldElsewhere]] = (0.0, [])

    resume_tiers = False  # a stream taken here loads from its save: file sets are each replica's own
    repair = "repair them (it is tried again when next asked for)"

    def restore(self, owners: Any = None) -> int:
        return 0  # streams are taken when asked for

    # -- finding, taking, listing -------------------------------------------------------------------------------
    async def find(self, owner: str, stream_id: str) -> StreamEntry:
        known = isinstance(stream_id, str) and STREAM_ID.match(stream_id) is not None
        if known and stream_id not in self.entries:
            record = await asyncio.to_thread(self.files.read_record, stream_id)
            if record is not None and record["owner"] == owner:  # another key's request never moves a stream
                await self.take(stream_id)  # one that cannot be loaded is quarantined here (409)
            elif record is None:
                await self.look_for_damage(stream_id)  # an unreadable record: 409 to the owner it names
        entry = self.get(owner, stream_id)
        self.files.check(entry.id)
        return entry

    async def take(self, stream_id: str) -> None:
        """Bring a stream here: its lease (asking its holder to let it go, or waiting for the lease to lapse when
        the holder died), then its last save."""
        lock = self._taking.setdefault(stream_id, asyncio.Lock())
        try:
            await self._take_locked(stream_id, lock)
        finally:
            self._taking.pop(stream_id, None)  # whoever still waits holds the lock itself

    async def _take_locked(self, stream_id: str, lock: asyncio.Lock) -> None:
        async with lock:
            if stream_id in self.entries:
                return
            # counted before the first await, with creations: streams arriving together cannot all pass the check
            if len(self.entries) + self.arriving >= self.config.max_streams:
                raise ServiceError(429, f"this replica holds its limit of {self.config.max_streams} streams; retry "
                                   "later", headers={"Retry-After": "30"})
            self.arriving += 1
            try:
                lease = await self._wait_for_lease(stream_id)
                record = None
                try:
                    record = await asyncio.to_thread(self.files.read_record, stream_id)  # as its last holder left it
                    if record is None:
                        raise ServiceError(404, f"no stream {stream_id!r}")
                    entry = await self.worker.run(self.restore_one, record)
                except BaseException as error:
                    damaged = None
                    if isinstance(error, Exception) and not isinstance(error, ServiceError):
                        # noted under the lease, so every replica lists it as damaged
                        damaged = await asyncio.to_thread(self.quarantine, stream_id, record["owner"],
                                                          reason_of(error), record)
                    await asyncio.to_thread(self.files.release, stream_id)
                    if damaged is not None:
                        self.check_damaged(damaged.owner, stream_id)  # its 409
                    raise
            finally:
                self.arriving -= 1
            entry.replica = self.replica
            self.entries[stream_id] = entry
            if lease.lapsed:
                self._resumed.add(stream_id)
            log.info("took stream %s (%d frames saved%s)", stream_id, entry.stream.pushed,
                     ", its replica having stopped" if lease.lapsed else "")

    async def _wait_for_lease(self, stream_id: str) -> Lease:
        deadline = time.monotonic() + self.files.leases.seconds + TAKE_MARGIN_SECONDS
        asked = False
        while (lease := await asyncio.to_thread(self.files.take, stream_id)) is None:
            if not asked:
                await asyncio.to_thread(self.files.leases.ask_handoff, stream_id)
                asked = True
            if time.monotonic() > deadline:
                raise ServiceError(503, f"stream {stream_id} is held by another replica that has not let it go; "
                                   "retry shortly", headers={"Retry-After": "2"})
            await asyncio.sleep(TAKE_POLL_SECONDS)
        return lease

    async def push(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        self._check_resumed(entry)
        return await super().push(entry, image, seconds)

    async def feed(self, entry: StreamEntry, path: Path, start: float | None, **kwargs: Any) -> dict[str, Any]:
        self._check_resumed(entry)
        return await super().feed(entry, path, start, **kwargs)

    def _check_resumed(self, entry: StreamEntry) -> None:
        """The first push to a stream taken after its replica stopped is refused, once: the frames pushed there
        since its last save are lost, and the client must push again from ``resume_from`` rather than go on."""
        if entry.id in self._resumed:
            self._resumed.discard(entry.id)
            raise ServiceError(409, f"stream {entry.id} came back from its last save after its replica stopped: "
                               f"it holds {entry.stream.pushed} pushed frames; push again from frame "
                               f"{entry.stream.pushed} (resume_from)")

    async def create(self, owner: str, body: dict[str, Any]) -> StreamEntry:
        entry = await super().create(owner, body)
        entry.replica = self.replica
        return entry

    def owned(self, owner: str) -> list[Any]:
        """The owner's streams on every replica: those held here live, the others as of their last save, then the
        damaged ones, whichever replica quarantined them (their notes in the folder, or their unreadable records)."""
        listed_at, elsewhere = self._listed
        if time.monotonic() - listed_at > LIST_SECONDS:
            notes, elsewhere, damaged = self.files.notes(), [], {}
            for path, record in self.files.records():
                if path.stem in self.entries:
                    continue
                if path.stem in notes or isinstance(record, Exception):
                    damaged[path.stem] = self._damaged_in_folder(path, record, notes.get(path.stem))
                else:
                    elsewhere.append(HeldElsewhere(record, self._holder(record["id"])))
            self.damaged = damaged
            self._listed = (time.monotonic(), elsewhere)
        here = super().owned(owner)  # held here, and damaged
        held = {entry.id for entry in here}
        elsewhere = [entry for entry in elsewhere
                     if entry.owner == owner and entry.id not in held and entry.id not in self.entries]
        live = [entry for entry in here if not isinstance(entry, DamagedStream)]
        return sorted([*live, *elsewhere], key=lambda entry: entry.created, reverse=True) + [
            entry for entry in here if isinstance(entry, DamagedStream)]

    async def look_for_damage(self, stream_id: str) -> None:
        """``damaged`` brought up to date for one stream from the shared folder: quarantined by any replica (its
        note), or its record unreadable."""
        def look() -> DamagedStream | None:
            path = self.files.record_path(stream_id)
            note = self.files.read_note(stream_id)
            try:
                record = self.files.record_at(path)
            except FileNotFoundError:
                return None  # deleted
            return self._damaged_in_folder(path, record, note) if note or isinstance(record, Exception) else None

        known = STREAM_ID.match(stream_id) is not None and stream_id not in self.entries
        damaged = await asyncio.to_thread(look) if known else None
        if damaged is None:
            self.damaged.pop(stream_id, None)
        else:
            self.damaged[stream_id] = damaged

    def _damaged_in_folder(self, path: Path, record: Any, note: dict[str, Any] | None) -> DamagedStream:
        """A damaged stream as the folder tells it: its note (the reason it was quarantined), else its record's
        (unreadable)."""
        if note is not None:
            return DamagedStream(note["id"], note["owner"], note["reason"], note)
        return self.damaged_stream(path.stem, self.files.owner_named(path), unreadable(path, record), {})

    async def remove_files(self, stream_id: str) -> None:
        """A damaged stream's files removed under its lease (taken first, from whichever replica tried it last)."""
        await self._wait_for_lease(stream_id)
        try:
            await asyncio.to_thread(self.files.remove, stream_id)  # the lease goes with it
        except BaseException:
            await asyncio.to_thread(self.files.release, stream_id)
            raise
        self._listed = (0.0, [])

    def _holder(self, stream_id: str) -> str | None:
        lease = self.files.leases.peek(stream_id)
        return lease.holder if lease is not None and lease.live(self.files.leases.clock()) else None

    # -- keeping and letting go ---------------------------------------------------------------------------------
    async def keep_leases(self) -> None:
        """One pass over the leases held: renew those due, drop streams whose lease was lost, and hand over those
        another replica asked for."""
        for stream_id in list(self.files.held):
            lease = await asyncio.to_thread(self.files.renew, stream_id)
            entry = self.entries.get(stream_id)
            if lease is None:
                if entry is not None:
                    log.warning("lost the lease of stream %s to another replica; dropped here", stream_id)
                    await self._drop(entry)
                continue
            if entry is not None and lease.handoff and not entry.feeding and stream_id not in self._handing:
                # beside the pass: a long save must not hold up the other leases' renewals
                task = asyncio.ensure_future(self.hand_over(entry))
                self._handing[stream_id] = task
                task.add_done_callback(lambda _, stream_id=stream_id: self._handing.pop(stream_id, None))

    async def hand_over(self, entry: StreamEntry) -> None:
        """Save the stream and let it go, for the replica that asked for it (kept if the save fails), once the
        request under way on it (a push, a question) is done."""
        async with entry.lock:
            if entry.deleted or entry.moved or entry.feeding:
                return
            try:
                if entry.stream.frames:  # nothing encoded yet: nothing to save (pending frames go, as on a restart)
                    await self.worker.run(self.save_now, entry)
            except StateKVError as error:
                log.error("cannot save stream %s to hand it over: %s", entry.id, error)
                return
            await self._drop(entry)
            await asyncio.to_thread(self.files.release, entry.id)
            log.info("handed stream %s over", entry.id)

    async def delete(self, entry: Any) -> None:
        if isinstance(entry, HeldElsewhere):  # brought here first (or found damaged on the way)
            await self.remove(entry.owner, entry.id)
            return
        await super().delete(entry)  # its disk-tier file set too

    async def _drop(self, entry: StreamEntry) -> None:
        """Forget a stream handed over or lost: closed, and its disk-tier file set (if any) removed, since
        whoever holds it now loaded it from its save."""
        entry.moved = True
        self.entries.pop(entry.id, None)
        await self.worker.run(entry.stream.close)
        remove_tier(entry)

    def let_all_go(self) -> None:
        """At shutdown, once every stream is saved: release every lease, so the streams come back at once
        wherever they are asked for next."""
        for stream_id in list(self.files.held):
            try:
                self.files.release(stream_id)
            except (OSError, StateKVError) as error:
                log.error("cannot release the lease of stream %s: %s", stream_id, error)


def _sync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
