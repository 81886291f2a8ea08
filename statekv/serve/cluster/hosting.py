"""`ReplicaHosting`: how one replica of several holds its streams (the service's `Hosting` for a replica): a
`StreamRegistry` placed by leases (`LeasedPlacement`) over the shared state, its leases kept beside the server,
its metrics posted to the replicas' board, streams handed over when it holds more than its share, clients' feeds of
watch events ended once the deployment is stopping, every lease released at shutdown once the streams are saved.

The shared state is a folder every node mounts (``--state-dir``: `SharedStreamFiles`, saved streams optionally in
an object store) or an object store alone (``--store`` without ``--state-dir``: `StoreStreamFiles`, where keys,
records, leases, the quarantine and the saved streams all are)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError
from ..app import Hosting, check_owners
from ..auth import KeyRing, owner_of
from ..config import ServeConfig
from ..entries import failure_reason, remove_tier
from ..registry import StreamRegistry
from ..store import join_state_folder
from .board import POST_SECONDS, ReplicaBoard, StoreBoard
from .dead_tiers import DeadTiers
from .folder import SharedStreamFiles
from .leases import LEASE_SECONDS, Leases
from .objects import ObjectStore, StoreError
from .shared import LeasedPlacement
from .store_files import StoreKeyFile, StoreStreamFiles
from .uploads import ReplicaUploads, uploads_root

log = logging.getLogger("statekv.serve")
STOP_CHECK_SECONDS = 2.0  # how often a replica asks whether its deployment is stopping (Ray Serve's
# drain looks every 2 s)
PROBE_SECONDS = 5.0  # the longest the store's check at a start waits for an answer, once


class ReplicaHosting(Hosting):
    """Replica ``replica`` (its id among the deployment's replicas) over ``config.state_dir``, or, when that is
    None, over the object store ``store`` alone; ``store`` with a state folder: an fsspec URL for the saved
    streams (None: the state folder); ``tier_root``: with ``--offload disk``, the folder whose subfolder per
    replica holds its streams' disk-tier file sets (that of a replica gone from the board is removed); ``stopping``:
    says whether the deployment is being stopped (None: never asked).

    Ray Serve stops a replica by draining it, waiting for every request under way to end, before its destructor
    saves the streams; a feed of watch events never ends by itself, so a replica whose clients follow events
    would wait out the graceful timeout and be killed unsaved. The feeds end once ``stopping`` says so."""

    def __init__(self, config: ServeConfig, replica: str, lease_seconds: float = LEASE_SECONDS,
                 store: str | None = None, tier_root: Path | None = None,
                 stopping: Callable[[], bool] | None = None):
        self.replica, self.tier_root, self.stopping = replica, tier_root, stopping
        self.lock = None
        if config.state_dir is None:
            objects = open_store(store)
            self.files: Any = StoreStreamFiles(objects, replica, lease_seconds)
            self.board: Any = StoreBoard(objects, replica)
        else:
            if store is not None:
                open_store(store)  # its saves go there: refused at the start, not at the first save
            self.lock = join_state_folder(config.state_dir)  # refused while a lone server holds the folder
            try:
                self.files = SharedStreamFiles(config.state_dir, Leases(config.state_dir, replica, lease_seconds),
                                               store)
                self.board = ReplicaBoard(config.state_dir, replica)
            except BaseException:
                self.lock.release()
                raise
        self.check_seconds = min(1.0, lease_seconds / 5)
        self.shared: StreamRegistry | None = None
        self.own_uploads = ReplicaUploads(uploads_root(config.state_dir), replica)  # opened with the service
        self.passed = time.monotonic()  # when the lease loop last finished a pass
        self.dead_tiers = DeadTiers(tier_root, replica, self.board)

    def open(self, config: ServeConfig) -> KeyRing:
        if config.state_dir is not None:
            keys = super().open(config)
        else:
            keys = store_keys(self.files.store, config.api_keys)
            check_owners(config, keys, self.files)
        self.own_uploads = ReplicaUploads(uploads_root(config.state_dir), self.replica).open()
        return keys

    def uploads(self, config: ServeConfig) -> Path:
        return self.own_uploads.folder

    def registry(self, config: ServeConfig, qa: Any, worker: Any) -> StreamRegistry:
        self.shared = StreamRegistry(config, qa, worker, files=self.files, placement=LeasedPlacement(self.files))
        return self.shared

    @property
    def streams(self) -> int:
        return len(self.shared.entries) if self.shared is not None else 0

    def holds(self, stream_id: str) -> bool:
        return self.shared is not None and stream_id in self.shared.entries

    def held(self) -> list[str]:
        """The ids of the streams this replica holds."""
        return list(self.shared.entries) if self.shared is not None else []

    async def run(self, service: Any) -> None:
        self.passed = time.monotonic()
        loops = [self._keep_leases(), self._post(service)]
        if isinstance(self.files, StoreStreamFiles):  # one session holds every stream: renewed on its own
            loops.append(self._keep_session())
        if self.stopping is not None:
            loops.append(self._end_feeds_when_stopping(service))
        await asyncio.gather(*loops)

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                await self.shared.keep_leases()
                self.passed = time.monotonic()
            except Exception:  # the loop must outlive one bad pass; a stalled one fails the health check
                log.exception("keeping the leases failed")

    async def _keep_session(self) -> None:
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                await asyncio.to_thread(self.files.keep_session)
            except Exception:  # the loop must outlive one bad renewal (the store's own errors are logged in it)
                log.exception("renewing the session failed")

    async def _end_feeds_when_stopping(self, service: Any) -> None:
        failing = False  # warned of once a failure starts, not at every check while it lasts
        while not service.watch_hub.closed:
            try:
                if await asyncio.to_thread(self.stopping):
                    log.info("the deployment is stopping: ending the clients' feeds of watch events and of files")
                    service.watch_hub.close()
                    service.registry.feeds.stop_all()
                failing = False
            except Exception as error:  # noqa: BLE001 - asked again next time (the controller may be restarting)
                (log.debug if failing else log.warning)("cannot tell whether the deployment is stopping (asked "
                                                        "again every %g s): %s", STOP_CHECK_SECONDS, error)
                failing = True
            await asyncio.sleep(STOP_CHECK_SECONDS)

    async def _post(self, service: Any) -> None:
        while True:
            try:
                await asyncio.to_thread(self.board.post, self.streams, service.metrics.exposition())
                await asyncio.to_thread(self.board.forget_silent)
                loads = {posted["replica"]: int(posted.get("streams") or 0)
                         for posted in await asyncio.to_thread(self.board.replicas) if posted.get("replica")}
            except OSError as error:
                log.error("cannot post to the replicas' board: %s", error)
                loads = None
            except Exception:  # the loop must outlive one bad pass
                log.exception("posting to the replicas' board failed")
                loads = None
            if loads is not None:
                try:
                    await self.shared.placement.rebalance(self.shared, loads)
                except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                    log.exception("balancing the streams between the replicas failed")
                try:
                    await asyncio.to_thread(self.dead_tiers.sweep, set(loads))
                except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                    log.exception("removing dead replicas' disk-tier folders failed")
            await asyncio.sleep(POST_SECONDS)

    def exposition(self, service: Any) -> bytes:
        return self.board.exposition(service.metrics.exposition())

    def close(self, service: Any) -> None:
        try:
            self.shared.let_all_go()
            self.board.remove()
            self._remove_saved_tiers()
            self.own_uploads.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _remove_saved_tiers(self) -> None:
        """At a clean stop, once every stream is saved and let go: the disk-tier file sets of the streams saved
        whole (whoever takes them next loads them from their saves into a folder of its own), then this
        replica's folder if nothing is left in it. A stream whose last save failed keeps its file set."""
        if self.tier_root is None or self.shared is None:
            return
        for entry in list(self.shared.entries.values()):
            if not entry.dirty and (error := remove_tier(entry)) is not None:
                log.error("stream %s is saved, but not all its disk-tier files in %s could be removed at the stop "
                          "(%s); remove them by hand", entry.id, entry.tier, failure_reason(error))
        with contextlib.suppress(OSError):
            (self.tier_root / self.replica).rmdir()  # only when empty

    def check(self) -> None:
        """Ray Serve's health check: fails when the leases have not been kept for a lease's length (the shared
        state unreachable, or the replica stuck), so Ray replaces the replica."""
        stalled = time.monotonic() - self.passed
        if stalled > self.files.lease_seconds:
            raise RuntimeError(f"the leases of replica {self.replica} have not been kept for {stalled:.0f} s")


def open_store(url: str | None) -> ObjectStore:
    """The object store at ``url``, checked (a probe written, read and removed): one-line `ConfigurationError`
    when it cannot be used."""
    if not url:
        raise ConfigurationError("with no --state-dir, give --store URL: the object store replicas keep streams in")
    try:
        ObjectStore(url, answer_seconds=PROBE_SECONDS, tries=1).check()  # a store that does not answer: one line soon
        store = ObjectStore(url)
    except StoreError as error:
        raise ConfigurationError(f"--store {url}: cannot use it ({error.strerror}); give a bucket (and prefix) "
                                 "these credentials can list, read and write") from None
    return store


def store_keys(store: ObjectStore, keys: tuple[str, ...] | list[str]) -> KeyRing:
    """The ``keys`` given and the key made for the object store (if any)."""
    stored = [entry["owner"] for entry in StoreKeyFile(store).stored()]
    return KeyRing([*map(owner_of, keys), *stored])
