"""A replica's streams when several replicas share their state (`LeasedPlacement`, the placement a replica's
`StreamRegistry` is given): a stream is taken from the shared state when a request for it arrives, and let go when
another replica asks for it, at shutdown, or when its lease is lost. A stream that cannot be loaded is quarantined
with a note in the shared quarantine (`store.StreamFiles.write_note`), so every replica lists it as damaged and
any may delete it.

The shared state is a folder every node mounts (`folder.SharedStreamFiles`, leases under POSIX locks) or an object
store (`objects.StoreStreamFiles`, leases under the store's conditional writes); the placement is the same over
either.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import OtherSetupError, StateKVError
from ...settings.values import is_finite_number
from ..entries import DamagedStream, StreamEntry, failure_reason, remove_tier
from ..errors import ServiceError, StorageError, reason_of
from ..loading import unreadable
from ..placement import Placement
from ..registry import StreamRegistry
from ..store import STREAM_ID, remove_folder
from ..stream_settings import read_settings
from .folder import SharedStreamFiles
from .leases import Lease, LeaseLost

log = logging.getLogger("statekv.serve")

TAKE_POLL_SECONDS = 0.2  # how often a replica waiting for a stream's lease tries again
REBALANCE_IDLE_SECONDS = 10.0  # a stream handed over to balance the replicas has had no request this long
HANDED_SECONDS = 600.0  # how long a stream handed over to balance the replicas counts as on its way to another
KEEP_AT_ONCE = 8  # leases a pass renews (or lets go) at once
TAKE_MARGIN_SECONDS = 5.0  # how much longer than a lease it waits before answering 503
LIST_SECONDS = 2.0  # how long the listing of the other replicas' streams is reused
FORGET_SECONDS = 3600.0  # how often the passes look for deleted streams' tombstones past their time


@dataclass
class HeldElsewhere:
    """A stream of the shared state that this replica does not hold, as its record says (as of its last save)."""

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
        """The record's ``saved``, its counts and time as a load takes them (`StreamLoader.load`): one that is no
        count or no stream time (text, a list, negative: a record edited by hand) as none."""
        saved = self.record.get("saved")
        saved = saved if isinstance(saved, dict) else {}
        counts = {name: saved[name] if type(saved.get(name)) is int and saved[name] >= 0 else 0
                  for name in ("pushed", "frames")}
        seconds = saved.get("seconds")
        return {**saved, **counts, "seconds": seconds if is_finite_number(seconds) and seconds >= 0 else None}

    @property
    def frames(self) -> int:
        return self.saved["frames"]

    @property
    def state(self) -> str:
        return "ready" if self.frames else "empty"

    def describe(self) -> dict[str, Any]:
        record, saved = self.record, self.saved
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created), "updated": None,
                "state": self.state, "settings": read_settings(record["settings"]),
                "horizon_frames": record["horizon_frames"],
                "max_fps": record["max_fps"], "frames": self.frames, "pushed": saved.get("pushed", 0),
                "pending": None, "seconds": saved.get("seconds"), "tokens": None, "carried": None, "handover": None,
                "cache_bytes": None, "encode_seconds": None, "feeding": False, "feed": None, "saved": dict(saved),
                "save_error": None, "lost": None,
                "resume_from": saved.get("pushed", 0), "resume_after_seconds": saved.get("seconds"),
                "replica": self.holder}


class LeasedPlacement(Placement):
    """One replica of several over shared state ``files`` (`folder.SharedStreamFiles` or
    `objects.StoreStreamFiles`). Nothing is loaded at start: a request for a stream this replica does not hold
    takes it (`bring`: its lease once free, then its last save), so a dead replica's streams come back wherever
    their next request is routed. `keep` renews the leases held and lets a stream go to a replica that asks for
    it (saved first)."""

    resume_tiers = False  # a stream taken here loads from its save: file sets are each replica's own
    repair = "repair them (it is tried again when next asked for)"

    def __init__(self, files: Any):
        super().__init__()
        self.files = files
        self.replica = files.holder
        self._taking: dict[str, asyncio.Lock] = {}
        self._takers: Counter = Counter()  # stream -> the requests taking it or waiting for its lock in `_taking`
        self._handing: dict[str, asyncio.Task] = {}  # streams being saved to be handed over
        self._listed: tuple[float, list[HeldElsewhere]] = (0.0, [])
        self._handed: dict[str, float] = {}  # streams handed over to balance the replicas, not yet taken elsewhere
        self._unrenewed: set[str] = set()  # streams whose lease could not be renewed at the last pass (said once)
        self._letting_go: set[str] = set()  # streams dropped here whose lease the shared state would not release yet
        self._forgot_at = time.monotonic()  # the last look for tombstones past their time
        self.leftovers: dict[Path, str] = {}  # disk-tier folders of streams gone from here, not removed whole yet -> id
        self._forgetting: asyncio.Task | None = None

    def restore(self, registry: StreamRegistry, owners: Any) -> int:
        """Nothing is loaded (streams are taken when asked for); deletions cut short are finished, each under
        its lease (one another replica holds is left to it), or at once when the stream is already deleted (an
        object store's tombstone: only its garbage is left)."""
        for removal in self.files.removals():
            try:
                if removal.get("deleted") or self.files.take(removal["id"]) is not None:
                    self.files.remove(removal["id"])  # its disk-tier folder was the replica's own, gone with it
                    log.info("finished deleting stream %s", removal["id"])
            except (OSError, StateKVError) as error:
                log.error("cannot finish deleting stream %s: %s", removal["id"], error)
        self._forget_deletions()
        return 0

    def _forget_deletions(self) -> None:
        """What the streams deleted long ago left in the shared state (`StoreStreamFiles.forget_deletions`), at
        start and then every `FORGET_SECONDS`."""
        self._forgot_at = time.monotonic()
        try:
            forgotten = self.files.forget_deletions()
        except (OSError, StateKVError) as error:
            log.warning("cannot look for deleted streams' tombstones past their time: %s", error)
            return
        if forgotten:
            log.info("removed the tombstones of %d streams deleted long ago", forgotten)

    # -- finding, taking, listing -------------------------------------------------------------------------------
    async def bring(self, registry: StreamRegistry, owner: str, stream_id: str) -> None:
        known = isinstance(stream_id, str) and STREAM_ID.match(stream_id) is not None
        if known and stream_id not in registry.entries:
            record = await asyncio.to_thread(self.files.read_record, stream_id)
            if record is not None and record["owner"] == owner:  # another key's request never moves a stream
                await self.take(registry, stream_id)  # one that cannot be loaded is quarantined here (409)
            elif record is None:
                await self.look_for_damage(registry, stream_id)  # an unreadable record: 409 to the owner it names

    def check(self, entry: StreamEntry) -> None:
        self.files.check(entry.id)

    async def take(self, registry: StreamRegistry, stream_id: str) -> None:
        """Bring a stream here: its lease (asking its holder to let it go, or waiting for the lease to lapse when
        the holder died), then its last save."""
        lock = self._taking.setdefault(stream_id, asyncio.Lock())
        self._takers[stream_id] += 1
        try:
            await self._take_locked(registry, stream_id, lock)
        finally:
            self._takers[stream_id] -= 1
            if not self._takers[stream_id]:  # kept while a request waits for it: one taking at a time, always
                del self._takers[stream_id], self._taking[stream_id]

    async def _take_locked(self, registry: StreamRegistry, stream_id: str, lock: asyncio.Lock) -> None:
        async with lock:
            if stream_id in registry.entries:
                return
            # counted before the first await, with creations: streams arriving together cannot all pass the check
            if len(registry.entries) + registry.arriving >= registry.config.max_streams:
                raise ServiceError(429, f"this replica holds its limit of {registry.config.max_streams} streams; "
                                   "retry later", headers={"Retry-After": "30"})
            registry.arriving += 1
            try:
                lease = await self.wait_for_lease(stream_id)
                record = None
                try:
                    record = await asyncio.to_thread(self.files.read_record, stream_id)  # as its last holder left it
                    if record is None:
                        await asyncio.to_thread(self._withdraw_if_gone, stream_id)
                        raise ServiceError(404, f"no stream {stream_id!r}")
                    entry = await registry.worker.run(registry.restore_one, record)
                    try:
                        self.files.check(stream_id)  # its hold lost, or run out, while it loaded: another's now
                    except LeaseLost:
                        await registry.healer.close_quietly(entry.stream)
                        await asyncio.to_thread(self.remove_tier, entry)
                        raise
                except BaseException as error:
                    damaged = None
                    if record is not None and isinstance(error, Exception) and \
                            not isinstance(error, (ServiceError, StorageError)):  # the store failing is a 503
                        # noted under the lease, so every replica lists it as damaged
                        # one of another setup is damaged for replicas of this setup alone: its files are sound
                        setup = setup_of(registry) if isinstance(error, OtherSetupError) else None
                        damaged = await asyncio.to_thread(registry.quarantine, stream_id, record["owner"],
                                                          reason_of(error), record, setup, setup is not None)
                    await self._let_go(stream_id)
                    if damaged is not None:
                        registry.check_damaged(damaged.owner, stream_id)  # its 409
                    raise
            finally:
                registry.arriving -= 1
            entry.replica = self.replica
            registry.entries[stream_id] = entry
            if lease.lapsed:  # the frames pushed there since its last save are lost
                self.refuse_next_push(stream_id, "came back from its last save after its replica stopped")
            log.info("took stream %s (%d frames saved%s)", stream_id, entry.stream.pushed,
                     ", its replica having stopped" if lease.lapsed else "")

    async def wait_for_lease(self, stream_id: str) -> Lease:
        deadline = time.monotonic() + self.files.lease_seconds + TAKE_MARGIN_SECONDS
        asked = False
        while (lease := await self._changing(self.files.take, stream_id)) is None:
            if not asked:
                await self._changing(self.files.ask_handoff, stream_id)
                asked = True
            if time.monotonic() > deadline:
                raise ServiceError(503, f"stream {stream_id} is held by another replica that has not let it go; "
                                   "retry shortly", headers={"Retry-After": "2"})
            await asyncio.sleep(TAKE_POLL_SECONDS)
        self._letting_go.discard(stream_id)  # taken again (its let-go refused, the hint still named this replica)
        return lease

    async def _changing(self, change: Callable[[str], Any], stream_id: str) -> Any:
        """``change(stream_id)``, a change of the shared state made off the event loop; a shared folder that cannot
        be written (full, read-only) refuses it in one line (503), as it refuses a creation."""
        try:
            return await asyncio.to_thread(change, stream_id)
        except StorageError:  # an object store's: a 503 already
            raise
        except OSError as error:
            raise ServiceError(503, f"cannot take stream {stream_id} here: {self.files.where} cannot be changed "
                               f"({error.strerror or type(error).__name__}); retry shortly",
                               headers={"Retry-After": "5"}) from None

    def _withdraw_if_gone(self, stream_id: str) -> None:
        """The lease just taken on a stream deleted while this replica waited for it, removed as its deletion removed
        the one before (a lease let go would be left behind for good)."""
        try:
            self.files.record_or_error(stream_id)
        except FileNotFoundError:
            self.files.withdraw(stream_id)
        except (OSError, StateKVError) as error:  # the shared state out of reach: let go, as before
            log.warning("cannot tell whether stream %s was deleted: %s", stream_id, error)

    def listed(self, registry: StreamRegistry, owner: str) -> list[Any]:
        """The owner's streams on every replica: those held here live, the others as of their last save, then the
        damaged ones, whichever replica quarantined them (their notes, or their unreadable records)."""
        listed_at, elsewhere = self._listed
        if time.monotonic() - listed_at > LIST_SECONDS:
            elsewhere, damaged = [], {}
            for stream_id, record, note, holder in self.files.listing():
                if stream_id in registry.entries:
                    continue
                if not self._applies(registry, note):
                    note = None
                if note is not None or isinstance(record, Exception):
                    damaged[stream_id] = self._damaged(registry, stream_id, record, note)
                else:
                    elsewhere.append(HeldElsewhere(record, holder))
            registry.damaged = damaged
            self._listed = (time.monotonic(), elsewhere)
        here = registry.held(owner)  # held here, and damaged
        held = {entry.id for entry in here}
        elsewhere = [entry for entry in elsewhere
                     if entry.owner == owner and entry.id not in held and entry.id not in registry.entries]
        live = [entry for entry in here if not isinstance(entry, DamagedStream)]
        return sorted([*live, *elsewhere], key=lambda entry: entry.created, reverse=True) + [
            entry for entry in here if isinstance(entry, DamagedStream)]

    async def look_for_damage(self, registry: StreamRegistry, stream_id: str) -> None:
        """``damaged`` brought up to date for one stream from the shared state: quarantined by any replica (its
        note), or its record unreadable."""
        def look() -> DamagedStream | None:
            note = self.files.read_note(stream_id)
            note = note if self._applies(registry, note) else None
            try:
                record = self.files.record_or_error(stream_id)
            except FileNotFoundError:
                return None  # deleted
            return self._damaged(registry, stream_id, record, note) if note or isinstance(record, Exception) else None

        known = STREAM_ID.match(stream_id) is not None and stream_id not in registry.entries
        damaged = await asyncio.to_thread(look) if known else None
        if damaged is None:
            registry.damaged.pop(stream_id, None)
        else:
            registry.damaged[stream_id] = damaged

    @staticmethod
    def _applies(registry: StreamRegistry, note: dict[str, Any] | None) -> bool:
        """Whether a quarantine note holds for this replica: one written because the stream was saved with another
        setup than its replica's (`OtherSetupError`) holds only for replicas of that setup."""
        return note is not None and note.get("setup") in (None, setup_of(registry))

    def _damaged(self, registry: StreamRegistry, stream_id: str, record: Any,
                 note: dict[str, Any] | None) -> DamagedStream:
        """A damaged stream as the shared state tells it: its note (the reason it was quarantined), else its
        record's (unreadable)."""
        if note is not None:  # one noted for this replica's setup (`_applies`) is sound, saved with another one
            return DamagedStream(note["id"], note["owner"], note["reason"], note, setup=note.get("setup"),
                                 sound=note.get("setup") is not None)
        reason = unreadable(self.files.record_name(stream_id), record)
        return registry.loader.damaged(stream_id, self.files.owner_named(stream_id), reason, {})

    async def let_go_damaged(self, registry: StreamRegistry, stream_id: str) -> None:
        """Its lease released, as `take` releases a stream it cannot load: every replica lists it as damaged."""
        await self._let_go(stream_id)
        self._listed = (0.0, [])

    async def remove_files(self, registry: StreamRegistry, stream_id: str, tier: Path | None = None) -> None:
        """A damaged stream's files removed under its lease (taken first, from whichever replica tried it last);
        ``tier`` is always None: replicas resume no file sets."""
        await self.wait_for_lease(stream_id)
        try:
            await registry.begin_removal(stream_id, None)
            await asyncio.to_thread(self.files.remove, stream_id)  # the lease goes with it
        except BaseException:
            await self._let_go(stream_id)
            raise
        self._listed = (0.0, [])

    # -- keeping and letting go ---------------------------------------------------------------------------------
    async def keep(self, registry: StreamRegistry) -> None:
        """One pass over the leases held: renew those due, drop streams whose lease was lost, hand over those
        another replica asked for, and let go again those dropped here whose lease the shared state would not
        release. Each lease on its own, `KEEP_AT_ONCE` at a time: one that cannot be read or locked for a while (a
        torn file, a slow share) is tried again at the next pass and holds up none of the others."""
        room = asyncio.Semaphore(KEEP_AT_ONCE)  # the rest of the service shares the threads these run on

        async def one(pass_over: Callable[[str], Awaitable[Any]], stream_id: str) -> None:
            async with room:
                await pass_over(stream_id)

        if time.monotonic() - self._forgot_at >= FORGET_SECONDS and (self._forgetting is None
                                                                     or self._forgetting.done()):
            # beside the pass, not in it: a slow listing of the whole store holds up no renewal
            self._forgetting = asyncio.create_task(asyncio.to_thread(self._forget_deletions))
        if self.leftovers:
            await asyncio.to_thread(self._remove_leftovers)
        letting_go = [stream_id for stream_id in self._letting_go if stream_id not in registry.entries]
        self._letting_go.intersection_update(letting_go)  # one served here again is no longer to let go
        await asyncio.gather(*(one(self._let_go, stream_id) for stream_id in letting_go),
                             *(one(lambda stream_id: self._keep(registry, stream_id), stream_id)
                               for stream_id in list(self.files.held) if stream_id not in self._letting_go))

    async def _let_go(self, stream_id: str) -> bool:
        """Release the stream's lease, so another replica takes it; one the shared state refuses for now is let go
        again at each pass (`keep`), rather than left held by a replica that dropped it. Never raises: a caller
        handling another error raises that one."""
        self._unrenewed.discard(stream_id)
        try:
            await asyncio.to_thread(self.files.release, stream_id)
        except (StateKVError, OSError) as error:
            if stream_id not in self._letting_go:
                log.error("cannot let stream %s go yet: %s; tried again at each pass", stream_id, error)
            self._letting_go.add(stream_id)
            return False
        self._letting_go.discard(stream_id)
        return True

    async def _keep(self, registry: StreamRegistry, stream_id: str) -> None:
        try:
            lease = await asyncio.to_thread(self.files.renew, stream_id)
        except (StateKVError, OSError) as error:
            if stream_id not in self._unrenewed:
                log.warning("cannot renew the lease of stream %s: %s; tried again at each pass (held here while it "
                            "lasts)", stream_id, error)
            self._unrenewed.add(stream_id)
            return
        self._unrenewed.discard(stream_id)
        entry = registry.entries.get(stream_id)
        if lease is None:
            if entry is not None:
                log.warning("lost the lease of stream %s (its hold lapsed, the shared state out of reach or this "
                            "replica stalled for too long, or another replica took it); dropped here, its next "
                            "request takes it from its last save", stream_id)
                await self._drop(registry, entry)
            return
        if entry is not None and lease.handoff and not entry.feeding and stream_id not in self._handing:
            # beside the pass: a long save must not hold up the other leases' renewals
            task = asyncio.ensure_future(self.hand_over(registry, entry))
            self._handing[stream_id] = task
            task.add_done_callback(lambda _, stream_id=stream_id: self._handing.pop(stream_id, None))

    async def rebalance(self, registry: StreamRegistry, loads: dict[str, int]) -> None:
        """Hand one stream over when this replica holds at least two more than the least-loaded live replica
        (``loads``: the streams each holds, as posted to the board), so a replica that joins (a node back)
        takes a share: the stream idle longest (no request for `REBALANCE_IDLE_SECONDS`), saved and let go, so
        its next request is routed to the least-loaded replica, which takes it from that save. Nothing is lost.
        Streams handed over and not taken yet count as the least-loaded replica's: they go there when asked for."""
        others = [count for replica, count in loads.items() if replica != self.replica]
        if not others:
            return
        on_their_way = await asyncio.to_thread(self._still_free)
        if len(registry.entries) - (min(others) + on_their_way) < 2:
            return
        now = time.monotonic()
        idle = [entry for entry in registry.entries.values() if not entry.feeding and not entry.moved
                and not entry.deleted and now - entry.used >= REBALANCE_IDLE_SECONDS]
        if idle:
            entry = min(idle, key=lambda entry: entry.used)
            log.info("handing stream %s over to balance the replicas (%d held here, %d on the least-loaded)",
                     entry.id, len(registry.entries), min(others))
            await self.hand_over(registry, entry)
            if entry.moved:
                self._handed[entry.id] = time.monotonic()

    def _still_free(self) -> int:
        """How many streams handed over to balance the replicas no replica has taken yet (nor deleted)."""
        for stream_id, handed in list(self._handed.items()):
            if time.monotonic() - handed > HANDED_SECONDS or self.files.holder_of(stream_id) is not None \
                    or self.files.read_record(stream_id) is None:
                del self._handed[stream_id]
        return len(self._handed)

    async def hand_over(self, registry: StreamRegistry, entry: StreamEntry) -> None:
        """Save the stream and let it go, for the replica that asked for it (kept if the save fails), once the
        request under way on it (a push, a question) is done. One that a stopped handover closed is brought back
        first (`StreamRegistry.heal`): one that cannot be yet is kept (the asking replica retries), one found
        damaged is let go quarantined."""
        try:
            await registry.heal(entry)
        except (StateKVError, OSError) as error:
            log.error("cannot hand stream %s over: %s", entry.id, error)
            return
        # a deletion under way goes first: its note is written under the lease, so the lease must not go before
        # it ends (or the stream would be neither served nor deleted)
        async with entry.removal, entry.lock:
            if entry.deleted or entry.moved or entry.feeding:
                return
            try:
                await registry.worker.run(_saved_and_moved, registry, entry)
            except (StateKVError, OSError) as error:  # kept: the asking replica asks again
                log.error("cannot save stream %s to hand it over: %s", entry.id, error)
                return
            await self._drop(registry, entry)
            if await self._let_go(entry.id):
                log.info("handed stream %s over", entry.id)

    async def _drop(self, registry: StreamRegistry, entry: StreamEntry) -> None:
        """Forget a stream handed over or lost: closed, and its disk-tier file set (if any) removed, since
        whoever holds it now loaded it from its save."""
        await asyncio.to_thread(entry.retire, moved=True)
        registry.entries.pop(entry.id, None)
        if registry.end_watch_feeds is not None:
            registry.end_watch_feeds(entry.id, f"stream {entry.id} moved to another replica; follow its events again")
        await registry.worker.run(entry.stream.close)
        await asyncio.to_thread(self.remove_tier, entry)

    def remove_tier(self, entry: StreamEntry) -> None:
        """The disk-tier file set of a stream gone from here (closed), removed; what cannot be is noted in one line
        and tried again at each pass over the leases (`keep`), rather than left to fill the disk unseen."""
        error = remove_tier(entry)
        if error is not None:
            self.leftovers[entry.tier] = entry.id
            log.error("stream %s left this replica, but not all its disk-tier files in %s could be removed (%s); "
                      "tried again at each pass", entry.id, entry.tier, failure_reason(error))

    def _remove_leftovers(self) -> None:
        """Try again to remove the disk-tier folders `remove_tier` could not remove whole (each a folder of its
        own: a stream taken here again loads into a new one)."""
        for folder, stream_id in list(self.leftovers.items()):
            try:
                remove_folder(folder)
            except OSError:
                continue
            del self.leftovers[folder]
            log.info("removed what was left of stream %s's disk-tier files in %s", stream_id, folder)

    def let_go(self, registry: StreamRegistry) -> None:
        """At shutdown, once every stream is saved: release every lease, so the streams come back at once
        wherever they are asked for next."""
        for stream_id in list(self.files.held):
            try:
                self.files.release(stream_id)
            except (OSError, StateKVError) as error:
                log.error("cannot release the lease of stream %s: %s", stream_id, error)
        self.files.end()


def _saved_and_moved(registry: StreamRegistry, entry: StreamEntry) -> None:
    """On the model's thread, in one go: the stream saved (its frames waiting for their step too) and marked moved,
    so a push queued behind the save finds it moved (503: its retry reaches the new holder) instead of being
    streamed here after the save and lost with the stream."""
    if entry.stream.pushed:  # nothing pushed: nothing to save
        registry.save_now(entry)
    entry.retire(moved=True)


def setup_of(registry: StreamRegistry) -> str:
    """A digest of the model and settings the replica's streams are loaded with (not its own --offload-dir)."""
    options = {name: value for name, value in registry.settings.qa.options.to_dict().items() if name != "offload_dir"}
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:16]


def SharedRegistry(config: Any, qa: Any, worker: Any, files: SharedStreamFiles) -> StreamRegistry:  # noqa: N802
    """A replica's `StreamRegistry` over shared state ``files``: placed by leases (`LeasedPlacement`)."""
    return StreamRegistry(config, qa, worker, files=files, placement=LeasedPlacement(files))
