"""`ReplicaHosting`: how one replica of several holds its streams over the shared state folder (the service's
`Hosting` for a replica): a `StreamRegistry` placed by leases (`LeasedPlacement`) over `SharedStreamFiles`, its leases kept beside the server, its
metrics posted to the `ReplicaBoard`, every lease released at shutdown once the streams are saved."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from ..app import Hosting
from ..config import ServeConfig
from ..store import join_state_folder
from .board import POST_SECONDS, ReplicaBoard
from .leases import LEASE_SECONDS, Leases
from ..registry import StreamRegistry
from .folder import SharedStreamFiles
from .shared import LeasedPlacement

log = logging.getLogger("statekv.serve")


class ReplicaHosting(Hosting):
    """Replica ``replica`` (its id among the deployment's replicas) over ``config.state_dir``; ``store``: an
    fsspec URL for the saved streams (None: the state folder); ``tier_root``: with ``--offload disk``, the
    folder whose subfolder per replica holds its streams' disk-tier file sets (that of a replica gone from the
    board is removed)."""

    def __init__(self, config: ServeConfig, replica: str, lease_seconds: float = LEASE_SECONDS,
                 store: str | None = None, tier_root: Path | None = None):
        self.replica, self.tier_root = replica, tier_root
        self.lock = join_state_folder(config.state_dir)  # refused while a lone server holds the folder
        try:
            self.files = SharedStreamFiles(config.state_dir, Leases(config.state_dir, replica, lease_seconds), store)
            self.board = ReplicaBoard(config.state_dir, replica)
        except BaseException:
            self.lock.release()
            raise
        self.check_seconds = min(1.0, lease_seconds / 5)
        self.shared: StreamRegistry | None = None
        self.passed = time.monotonic()  # when the lease loop last finished a pass

    def registry(self, config: ServeConfig, qa: Any, worker: Any) -> StreamRegistry:
        self.shared = StreamRegistry(config, qa, worker, files=self.files, placement=LeasedPlacement(self.files))
        return self.shared

    @property
    def streams(self) -> int:
        return len(self.shared.entries) if self.shared is not None else 0

    async def run(self, service: Any) -> None:
        self.passed = time.monotonic()
        await asyncio.gather(self._keep_leases(), self._post(service))

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(self.check_seconds)
            try:
                await self.shared.keep_leases()
                self.passed = time.monotonic()
            except Exception:  # the loop must outlive one bad pass; a stalled one fails the health check
                log.exception("keeping the leases failed")

    async def _post(self, service: Any) -> None:
        while True:
            try:
                await asyncio.to_thread(self.board.post, self.streams, service.metrics.exposition())
                for gone in await asyncio.to_thread(self.board.forget_silent):
                    if self.tier_root is not None:  # its streams came back elsewhere, from their saves
                        await asyncio.to_thread(shutil.rmtree, self.tier_root / gone, True)
            except OSError as error:
                log.error("cannot post to the replicas' board: %s", error)
            await asyncio.sleep(POST_SECONDS)

    def exposition(self, service: Any) -> bytes:
        return self.board.exposition(service.metrics.exposition())

    def close(self, service: Any) -> None:
        try:
            self.shared.let_all_go()
            self.board.remove()
        finally:
            self.lock.release()

    def check(self) -> None:
        """Ray Serve's health check: fails when the leases have not been kept for a lease's length (the state
        folder unreachable, or the replica stuck), so Ray replaces the replica."""
        stalled = time.monotonic() - self.passed
        if stalled > self.files.leases.seconds:
            raise RuntimeError(f"the leases of replica {self.replica} have not been kept for {stalled:.0f} s")
