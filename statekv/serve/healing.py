"""Disk-tier streams brought back from their folders under the server (`StreamHealer`): those a stopped handover
closed, and those a failed force to the device left unable to checkpoint.

On the disk tier, a handover stopped once it was marked (the successor's files not moved into the stream's folder:
a full disk, in a push or a quiet moment's replay; `statekv.errors.HandoverError`) closes the stream, and resuming
its folder finishes the handover. A stream whose files could not be forced to the device (`unforced`) is never
checkpointed again (`statekv.core.disk.forcing`): the server closes it and resumes its folder at its last checkpoint
forced, the frames pushed after it lost. The server does either on the next request for the stream; until then work
on it answers 503 (`check_here`), never "this stream was closed".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from ..errors import HandoverError, OutputError, StateKVError
from .bringing_back import (BROUGHT_BACK, closed_by_handover, closed_when, own_unforced, to_bring_back,
                            unforced)
from .entries import StreamEntry
from .errors import ServiceError, StorageError, reason_of
from .watches import new_run

if TYPE_CHECKING:
    from .registry import StreamRegistry

log = logging.getLogger("statekv.serve")
HEAL_RETRY_SECONDS = 5.0  # a stream that could not be brought back is not tried sooner


class StreamHealer:
    """Brings back the streams of ``registry`` that a stopped handover closed or whose force failed
    (`to_bring_back`). ``unhealed``: stream id -> when its last try failed, and why."""

    def __init__(self, registry: StreamRegistry):
        self.registry = registry
        self.unhealed: dict[str, tuple[float, str]] = {}

    async def heal(self, entry: StreamEntry) -> None:
        """Bring back ``entry``'s stream if a stopped handover closed it or its force failed: its own folder resumed
        (`restore_one` healing, which finishes the handover; on a replica too) from its record as it is in memory
        (its watches as they stood), the stream put in place in ``entry``, which keeps its id, owner, settings,
        history and answers, and the closed stream's watches closed. Frames that waited for their step are lost
        (the stopped handover closed the stream without keeping them): the stream's next push is refused once (409,
        saying where to push again from). A stream whose force failed (`unforced`) is closed first (its engines: its
        watches stay open for its record) and comes back at its last checkpoint forced, the frames pushed after it
        lost and its next push refused once the same way. A folder that cannot be written yet answers a one-line
        503, and so does every request for `HEAL_RETRY_SECONDS` after, without trying; one found damaged (or gone)
        quarantines the stream (409), as at the start, for whoever holds it too. An open stream is left as it is."""
        registry = self.registry
        if not to_bring_back(entry):
            return
        async with entry.lock:
            if not to_bring_back(entry):  # brought back meanwhile, or deleted, moved or quarantined
                return
            failed = self.unhealed.get(entry.id)
            if failed is not None and time.monotonic() - failed[0] < HEAL_RETRY_SECONDS:
                # tried moments ago: requests polling it do not keep the model's thread busy
                raise self.not_yet(entry, HEAL_RETRY_SECONDS - (time.monotonic() - failed[0]))
            old, why = entry.stream, unforced(entry)
            if why is not None and not old.prefill.closed:  # its folder's lock given back, for the resume
                await registry.worker.run(close_engines, old)
            try:
                healed = await registry.worker.run(registry.restore_one, entry.record(), True)
            except (OutputError, ServiceError, StorageError) as error:  # a full disk; the store not answering
                if isinstance(error, ServiceError) and error.status != 503:
                    raise
                self.unhealed[entry.id] = (time.monotonic(), reason_of(error))
                log.error("stream %s, closed %s, cannot be brought back yet: %s", entry.id, closed_when(entry), error)
                raise self.not_yet(entry, HEAL_RETRY_SECONDS) from None
            except Exception as error:  # noqa: BLE001 -- whatever a damaged file set raises, as at the start
                await asyncio.to_thread(entry.retire, deleted=True)  # whoever holds it lets it go
                damaged = registry.quarantine(entry.id, entry.owner, reason_of(error), entry.record())
                entry.quarantined = damaged.reason
                registry.entries.pop(entry.id, None)
                if registry.end_watch_feeds is not None:  # at once, as for a deletion, not at their next keep-alive
                    registry.end_watch_feeds(entry.id, f"stream {entry.id} is damaged ({damaged.reason}); it is no "
                                                       "longer served")
                self.unhealed.pop(entry.id, None)
                await self.close_quietly(old)
                await registry.placement.let_go_damaged(registry, entry.id)
                registry.check_damaged(entry.owner, entry.id)
                raise
            if entry.deleted or entry.moved:  # deleted, or lost to another replica, while it was brought back
                await self.close_quietly(healed.stream)
                check_here(entry)
            # not under entry.recording, which a record's write holds through its I/O: the loop would wait on it;
            # a record written between these lines is written again below (keep_record)
            entry.stream, entry.saved, entry.saved_at = healed.stream, healed.saved, healed.saved_at
            entry.saved_watches = healed.saved_watches  # none: its record cuts at the file set's frames, not the save's
            if why is not None:  # the save that met the failure: the stream is now what its folder holds forced
                entry.save_error = entry.save_failure = None
            self.unhealed.pop(entry.id, None)
            if healed.stream.last_timestamp is not None:  # the push that stopped had its frame taken
                entry.last_seconds = healed.stream.last_timestamp
            lost = old.pushed - healed.stream.pushed if why is not None else 0
            if lost > 0:  # their events, if sent, are not those of the frames pushed again: a new run's (`new_run`)
                entry.event_runs = new_run(entry.event_runs, healed.stream)
                registry.placement.refuse_next_push(
                    entry.id, f"lost {lost} frames pushed after its last checkpoint forced to the device when it was "
                    f"brought back from its folder, a force having failed ({why})")
            elif healed.stream.frames_lost:
                registry.placement.refuse_next_push(
                    entry.id, f"lost {healed.stream.frames_lost} frames that waited for their step when it was "
                    "brought back after its handover stopped")
            await self.close_quietly(old)  # its watches, reopened on the stream brought back
            await entry.keep_record(registry.files, "the stream brought back")  # its folder, as loading would
            log.info("stream %s, closed %s, was brought back from its folder (%s)", entry.id,
                     "when a force failed" if why is not None else "by its stopped handover", healed.stream.handover)

    def not_yet(self, entry: StreamEntry, wait: float) -> ServiceError:
        """The 503 for a stream whose heal failed (`unhealed`), to be tried again in ``wait`` seconds."""
        return ServiceError(503, f"stream {entry.id} was closed {closed_when(entry)}, and cannot be brought back yet "
                            f"({self.unhealed[entry.id][1]}); retry once its folder can be written",
                            headers={"Retry-After": str(max(1, math.ceil(wait)))})

    async def close_quietly(self, stream: Any) -> None:
        """Close a stream that is no longer served (on the model's thread); it may be closed already."""
        try:
            await self.registry.worker.run(stream.close)
        except Exception as error:  # noqa: BLE001 -- nothing of it is served any more
            log.warning("a stream no longer served did not close cleanly: %s", error)

    @staticmethod
    async def stopped_handover(entry: StreamEntry, answer: Any) -> bool:
        """A push's answer; a handover stopped once marked (which closed the stream), or a force that failed in its
        step, as a one-line 503."""
        try:
            return await answer
        except HandoverError as error:
            back = (", and its next request brings it back from its folder: do not push this frame again, unless "
                    "its next push answers 409 saying where to push again from") if closed_by_handover(entry) else ""
            raise ServiceError(503, f"stream {entry.id}: its handover to its successor's file set stopped "
                               f"({error.cause}); it was closed{back}", headers={"Retry-After": "5"}) from None
        except OutputError as error:
            if unforced(entry) is None:
                raise
            raise ServiceError(503, f"{reason_of(error)}; {BROUGHT_BACK}", headers={"Retry-After": "1"}) from None


def check_has_frames(entry: StreamEntry) -> None:
    """Refuse (409) a question to a stream with no frame."""
    if entry.stream.frames == 0 and not entry.stream.pending:
        raise ServiceError(409, "the stream has no frame yet: push frames (or feed a video) first")


def check_can_ask(entry: StreamEntry) -> None:
    """What a question's route checks before an answer token by token begins (the reply's status is sent then):
    the stream is here and has a frame. The model's thread checks again, with the question's length."""
    check_here(entry)
    check_has_frames(entry)


def check_here(entry: StreamEntry, stream: Any = None) -> None:
    """Refuse work on a stream quarantined (409), deleted (404) or gone to another replica (503: the retry reaches
    it there) while the request waited; and work on ``stream`` (the entry's when the work was queued) once a
    stopped handover closed it (503, nothing done: the retry finds it brought back, `StreamHealer.heal`)."""
    if entry.quarantined is not None:
        raise ServiceError(409, f"stream {entry.id} is damaged ({entry.quarantined}); it is no longer served")
    if entry.deleted:
        raise ServiceError(404, f"no stream {entry.id!r}")
    if entry.moved:
        raise ServiceError(503, f"stream {entry.id} moved to another replica; retry", headers={"Retry-After": "1"})
    if stream is not None and (stream is not entry.stream or to_bring_back(entry)):
        raise ServiceError(503, f"stream {entry.id} was closed {closed_when(entry)} and is brought back from its "
                           "folder; nothing was done: retry", headers={"Retry-After": "1"})


def unforced_at_stop(entry: StreamEntry, files: Any) -> bool:
    """At shutdown (`StreamRegistry.save_all`): whether ``entry``'s stream is one whose force failed (`unforced`),
    which no save can make durable: said in one line, its record written (what it keeps: watches, answers, the
    counts the next start tells its loss by), the stream not saved. One whose successor's force alone failed is
    saved as any other: its own files are sound."""
    why = own_unforced(entry)
    if why is None:
        return False
    log.error("cannot save stream %s at shutdown: its files could not be forced to the device (%s); the next start "
              "resumes it from its disk-tier folder at its last checkpoint forced, the frames pushed after it lost "
              "(that start says how many)", entry.id, why)
    with contextlib.suppress(OSError, StateKVError):
        entry.write_record(files)
    return True


def close_engines(stream: Any) -> None:
    """Close the engines of ``stream``, whose force failed (on the model's thread), giving its folder's lock back
    for its resume; its watches stay open, for its record, until it is brought back. Its successor's file set goes
    (the resumed stream rebuilds it from the backlog); the refused checkpoint of its close is what is expected."""
    try:
        if stream.successor is not None:
            stream.close_successor()
    finally:
        with contextlib.suppress(OutputError):
            stream.prefill.close()
