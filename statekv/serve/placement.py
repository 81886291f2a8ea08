"""Where a server's streams are held (`Placement`, the strategy `StreamRegistry` is given): this process alone, over
its own state folder (this module), or one replica of several sharing their state under leases
(`statekv.serve.cluster.shared.LeasedPlacement`). The registry does the streams' work the same way under either;
it asks its placement at the few points where they differ: bringing streams back at start, bringing one here
before a request about it, checking it is still this server's, listing, and what runs beside the server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.disk.files import hold
from ..errors import InputError
from .errors import ServiceError
from .store import remove_folder

if TYPE_CHECKING:
    from .entries import StreamEntry
    from .registry import StreamRegistry

log = logging.getLogger("statekv.serve")


class Placement:
    """A server alone: every stream of its state folder is loaded at start (`StreamRegistry.load_all`) and stays
    here until deleted. ``replica``: this server's name among replicas (None: alone). ``resume_tiers``: resume a
    stream in the disk-tier file set its record names. ``repair``: how a damaged stream is brought back."""

    replica: str | None = None
    resume_tiers = True
    repair = "repair them and restart"

    def __init__(self) -> None:
        self.refusing: dict[str, str] = {}  # stream id -> how it lost pushed frames (its next push is refused)

    def restore(self, registry: StreamRegistry, owners: Any) -> int:
        """Bring back the streams at start (``owners``: of these owner digests only); returns how many."""
        return registry.load_all(owners)

    async def bring(self, registry: StreamRegistry, owner: str, stream_id: str) -> None:
        """Make the caller's stream ``stream_id`` one of ``registry.entries`` if it can be (alone: it is already)."""

    def check(self, entry: StreamEntry) -> None:
        """Refuse (503) work on a stream that may no longer be this server's (alone: it always is)."""

    def admit_push(self, entry: StreamEntry) -> None:
        """Refuse a push (or a feed) the client must redo from elsewhere first: the first push to a stream that
        lost pushed frames (`refuse_next_push`) is refused, once, so the client pushes again from ``resume_from``
        rather than go on."""
        why = self.refusing.pop(entry.id, None)
        if why is not None:
            raise ServiceError(409, f"stream {entry.id} {why}: it holds {entry.stream.pushed} pushed frames; push "
                               f"again from frame {entry.stream.pushed} (resume_from)")

    def refuse_next_push(self, stream_id: str, why: str) -> None:
        """Refuse the stream's next push once (`admit_push`); ``why``: how it lost frames, after its id."""
        self.refusing[stream_id] = why

    def forget(self, stream_id: str) -> None:
        """A stream deleted here: nothing is kept of it (a refusal of its next push, which never comes, goes)."""
        self.refusing.pop(stream_id, None)

    async def let_go_damaged(self, registry: StreamRegistry, stream_id: str) -> None:
        """Let go of a stream held here and quarantined while served (alone: nothing to let go)."""

    def listed(self, registry: StreamRegistry, owner: str) -> list[Any]:
        """The owner's streams as listed (alone: those held here, newest first, then the damaged ones)."""
        return registry.held(owner)

    async def look_for_damage(self, registry: StreamRegistry, stream_id: str) -> None:
        """Bring ``registry.damaged`` up to date for one stream (alone: it knows them all already)."""

    async def remove_files(self, registry: StreamRegistry, stream_id: str, tier: Path | None = None) -> None:
        """Remove every file of a stream that is not held (a damaged one), with ``tier``, its disk-tier file set
        left in --offload-dir: whole, or refused (409: another process holds that file set; 503) with nothing
        removed."""
        try:
            lock = None if tier is None else hold(tier, None)
        except InputError as error:
            raise ServiceError(409, f"cannot delete stream {stream_id}: {error}; nothing was deleted") from None
        try:
            await registry.begin_removal(stream_id, tier)  # a kill from here on: the next start finishes it
            if tier is not None:
                await asyncio.to_thread(remove_folder, tier)
            await asyncio.to_thread(registry.files.remove, stream_id)
        except OSError as error:  # begun: never served again, and finished at the next start
            log.error("stream %s is deleted, but not all its files could be removed (%s); the rest are removed at "
                      "the next start", stream_id, error)
        finally:
            if lock is not None:
                lock.release()

    async def rebalance(self, registry: StreamRegistry, loads: dict[str, int]) -> None:
        """Hand streams over when this server holds more than its share (``loads``: the streams each replica
        holds); alone: nothing to balance."""

    async def keep(self, registry: StreamRegistry) -> None:
        """One pass of the work that keeps the placement (alone: none; a replica renews its leases)."""

    def let_go(self, registry: StreamRegistry) -> None:
        """At shutdown, once every stream is saved: let every stream go to whoever serves it next."""
