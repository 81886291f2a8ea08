"""What the service knows of each stream: a live one (`StreamEntry`: its owner, settings, the `Stream`, what is
saved, what it is doing) and one that could not be brought back (`DamagedStream`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api.stream import Stream
from ..api.watch_saving import records as watch_records
from ..errors import InputError, StateKVError
from .feeding import Feed
from .page_record import page_fields
from .store import remove_folder
from .stream_settings import made_with, read_settings
from .watches import watch_order

log = logging.getLogger("statekv.serve")
ANSWERS = 50  # a stream's last answers, kept in its record
RECORD_FAILURE_LOG_SECONDS = 60.0  # a record write failing again and again (a full disk) is logged this often at most


@dataclass
class StreamEntry:
    """One stream: its owner (a key digest), settings, the live `Stream`, what is on disk, what it is doing."""

    id: str
    owner: str
    settings: dict[str, Any]
    horizon_frames: int | None
    max_fps: float | None
    name: str
    created: float
    stream: Stream
    last_seconds: float | None = None
    saved: dict[str, Any] = field(default_factory=lambda: {"pushed": 0, "frames": 0, "seconds": None})
    saved_at: float = field(default_factory=time.monotonic)
    save_error: str | None = None  # why its last save failed, as a client may see it (None once it saves again)
    save_failure: str | None = None  # that failure's reason without the file it names (`failure_reason`)
    save_tried_at: float = 0.0  # when that save was tried (monotonic): the next is tried a save period later
    record_failure: dict[str, Any] | None = None  # record writes failing (`keep_record`): the reason, what was not
    # recorded, how many failed and when it was last logged (None once a record is written again)
    saved_watches: frozenset[str] = frozenset()  # the watches its last save holds (their events up to it are there)
    from_save: bool = False  # brought back from its save (whose watches it then holds), not from a file set
    lost: dict[str, int] | None = None  # what its record had seen that this start brought it back without
    # (`lost_at_start`)
    event_runs: list[dict[str, Any]] = field(default_factory=list)  # the runs its watch events were made in, as
    # their ids say (`statekv.serve.watches.new_run`)
    run_unrecorded: bool = False  # the run this start began is in no record yet: none of its events is sent (a
    # kill would have the next start number its run the same, and send other events under those ids)
    history: list[dict[str, float]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    removal: asyncio.Lock = field(default_factory=asyncio.Lock)  # one deletion at a time (`StreamRegistry.delete`)
    feed: Feed | None = None
    pushing: int = 0  # pushes queued and not yet answered: a feed waits for them, its frames placed after theirs
    last_frame: Any = None  # the last kept frame (RGB uint8 [H, W, 3]), for the page
    last_frame_at: dict[str, Any] | None = None  # where it is: ``index`` (1-based among the kept frames, so above
    # ``frames`` while it waits to be encoded), ``pushed`` (the pushes then) and ``seconds``
    updated: float | None = None  # when a frame last arrived (unix time)
    used: float = field(default_factory=time.monotonic)  # when a request last found it (monotonic)
    deleted: bool = False
    deleting: threading.Event = field(default_factory=threading.Event, repr=False)  # set once deleted: an answer
    # under way stops at its next token (`answering.answer_arguments`)
    moved: bool = False  # let go to another replica sharing the state folder
    quarantined: str | None = None  # why it was found damaged while served (then deleted too: no longer served)
    replica: str | None = None  # the replica holding it, when several share the state folder
    stopped: bool = False  # saved with every frame it took as the server stopped (its disk-tier file set not needed)
    tier_saved: bool = False  # its last save is its disk-tier file set made durable: no save of its own holds it
    owned: bool = True  # its files name its id and owner (False: brought back from files saved before they did)
    closed: bool = False  # closed at shutdown, once saved
    recording: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one write of its record at a time
    changes: list[int] = field(default_factory=lambda: [0, 0])  # changes asked to be recorded; recorded
    counting: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards ``changes``, ``leaving``
    # watches being deleted (by how many changes at once): its records leave them out (`write_record`)
    leaving: Counter[str] = field(default_factory=Counter)
    recorded_watches: frozenset[str] = frozenset()  # those the last record this start wrote names (under ``recording``)
    # watches opened whose record is not written yet: in no follower's backlog till it is (`missed_events`)
    opening: set[str] = field(default_factory=set)

    @property
    def frames(self) -> int:
        return self.stream.frames

    @property
    def dirty(self) -> bool:
        return self.stream.pushed != self.saved["pushed"]

    @property
    def feeding(self) -> bool:
        return self.feed is not None and self.feed.running

    @property
    def state(self) -> str:
        """``feeding``, ``failed`` (its last feed stopped on an error, not as asked), ``empty`` (no frame yet) or
        ``ready``."""
        if self.feeding:
            return "feeding"
        if self.feed is not None and self.feed.error and not self.feed.stopped:
            return "failed"
        return "ready" if self.stream.frames else "empty"

    def describe(self) -> dict[str, Any]:
        stream, stats = self.stream, self.stream.stats
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created),
                "updated": None if self.updated is None else int(self.updated), "state": self.state,
                "settings": read_settings(self.settings), "horizon_frames": self.horizon_frames,
                "max_fps": self.max_fps, "frames": stream.frames, "pushed": stream.pushed,
                "pending": len(stream.pending),
                "seconds": self.last_seconds, "tokens": stream.tokens, "carried": stats.carried_tokens,
                "handover": getattr(stream, "handover", None),  # its successor engine (statekv.api.handover)
                "cache_bytes": stats.cache_bytes, "encode_seconds": stats.seconds, "feeding": self.feeding,
                "feed": None if self.feed is None else self.feed.describe(), "saved": dict(self.saved),
                "save_error": self.save_error, "lost": None if self.lost is None else dict(self.lost),
                "resume_from": stream.pushed, "resume_after_seconds": self.last_seconds,
                **({"replica": self.replica} if self.replica else {})}

    @property
    def tier(self) -> Path | None:
        """The folder of its disk-tier file set (None: it keeps its detailed cache elsewhere)."""
        folder = getattr(getattr(self.stream, "durability", None), "folder", None)  # RecentFrames keeps no cache
        return None if folder is None else Path(folder)

    def write_record(self, files: Any, leaving: str | None = None, opening: str | None = None) -> bool:
        """Write its record through ``files`` (`StreamFiles.write_record`) as it is when written, from any thread,
        after a change: one write at a time, so the last written is the newest, and none for a change a write begun
        after it already holds; none once it is deleted, moved or closed (`retire`): then False, the change in no
        record (True: it is in one on the disk). ``leaving``: a watch to be closed once this returns True (`left`),
        left out of this record and of every one after it; when this one cannot be written (raised, or False), none
        written has left it out, and the next names it again. ``opening``: a watch just opened; when this one cannot
        be written and no record written names it (`recorded_watches`), none after it does either until it is closed
        (`left`): a watch refused for its record is never on the disk."""
        with self.counting:
            if leaving is not None:
                self.leaving[leaving] += 1
            self.changes[0] += 1
            change = self.changes[0]
        with self.recording:
            if self.changes[1] >= change:
                return True
            if self.deleted or self.moved or self.closed:
                if leaving is not None:
                    self.left(leaving)
                return False
            with self.counting:  # the changes it holds and the watches it leaves out, as one
                holding, left = self.changes[0], frozenset(self.leaving)
            record = self.record(left)
            try:
                files.write_record(record)
            except BaseException:
                if leaving is not None:
                    self.left(leaving)
                if opening is not None and opening not in self.recorded_watches:
                    with self.counting:
                        self.leaving[opening] += 1
                raise
            self.changes[1] = holding
            self.run_unrecorded = False
            self.recorded_watches = frozenset(data["id"] for data in record["watches"])
        return True

    def left(self, watch_id: str) -> None:
        """Its records leave watch ``watch_id`` out no longer: closed (then no record names it), or its deletion
        refused."""
        with self.counting:
            if self.leaving[watch_id] > 1:  # another change leaving it out too: its records still do
                self.leaving[watch_id] -= 1
            else:
                self.leaving.pop(watch_id, None)

    async def keep_record(self, files: Any, what: str) -> None:
        """`write_record` off the event loop, for a change already made and answered (``what``: which, for the
        log): a failure is logged, the change stands."""
        try:
            await asyncio.to_thread(self.write_record, files)
        except (OSError, StateKVError) as error:  # a full or read-only state folder: one line, not one per change
            self.note_record_failure(what, error)
        except Exception:  # noqa: BLE001 -- answered already: a failure to note it must not fail the request
            log.exception("cannot record %s of stream %s", what, self.id)
        else:
            failure, self.record_failure = self.record_failure, None
            if failure is not None:
                log.warning("stream %s's record is written again (%d writes had failed since %s could not be "
                            "recorded: %s)", self.id, failure["failed"], failure["first"], failure["reason"])

    def note_record_failure(self, what: str, error: BaseException) -> None:
        """A write of its record failed: logged the first time, then when the reason changes, else at most once
        every `RECORD_FAILURE_LOG_SECONDS` (with how many failed meanwhile); `keep_record` says when it recovers."""
        now, reason = time.monotonic(), failure_reason(error)
        failure = self.record_failure
        if failure is None or failure["reason"] != reason:
            failure = self.record_failure = {"reason": reason, "first": what, "failed": 0, "logged": None,
                                             "unlogged": 0}
        failure["failed"] += 1
        if failure["logged"] is not None and now - failure["logged"] < RECORD_FAILURE_LOG_SECONDS:
            failure["unlogged"] += 1
            return
        again = (f" ({failure['unlogged']} more failed the same way since it was last logged)"
                 if failure["unlogged"] else "")
        log.error("cannot record %s of stream %s: %s%s; it stands, and the stream's next change writes its record "
                  "again (logged again at most every %g s until it is written)", what, self.id, error, again,
                  RECORD_FAILURE_LOG_SECONDS)
        failure["logged"], failure["unlogged"] = now, 0

    def retire(self, **state: Any) -> None:
        """Set ``deleted``, ``moved`` or ``closed`` (as keywords): its record is not written again, and a write
        under way ends first, so none lands after its files are removed, another replica took it, or it was
        closed (a closed stream's record would name none of its watches)."""
        with self.recording:
            for name, value in state.items():
                setattr(self, name, value)
        if state.get("deleted"):
            self.deleting.set()

    def record(self, leaving: frozenset[str] | None = None) -> dict[str, Any]:
        """What the state folder keeps of it (besides the saved stream itself). ``owned``: its saved files and
        file set name its id and owner (checked when they are loaded; records written before hold no ``owned``).
        ``watches``: the events a watch had by the last save are left to the save when it holds that watch (those
        named in ``saved_watches``; a restart puts them back, from the save where the stream comes back from its
        disk-tier file set, whose checkpoint may lack that watch: `with_saved_events`); those in ``leaving``
        (default: the watches being deleted) are left out."""
        tier = self.tier
        if leaving is None:
            with self.counting:
                leaving = frozenset(self.leaving)
        watches = [data for data in watch_records(self.stream, self.saved_watches, self.saved["frames"])
                   if data["id"] not in leaving]
        return {"id": self.id, "owner": self.owner, "settings": self.settings, "horizon_frames": self.horizon_frames,
                "max_fps": self.max_fps, "name": self.name, "created": self.created, "saved": self.saved,
                "answers": self.answers, "owned": self.owned, "tier": None if tier is None else tier.name,
                "engine": made_with(self.stream), "stopped": self.stopped, "tier_saved": self.tier_saved,
                "seen": {"pushed": self.stream.pushed, "frames": self.stream.frames},  # as the record is written
                "watches": watches,
                "saved_watches": sorted(self.saved_watches),
                "watch_order": watch_order(self.stream), "event_runs": self.event_runs, **page_fields(self)}


@dataclass
class DamagedStream:
    """A stream of the state folder that could not be brought back (its record, its save or its file set is
    damaged, or names another stream or owner): listed as ``damaged`` with the reason, never served, its files left
    where they are. ``owner``: None when the record names none that can be read (then every key sees it)."""

    id: str
    owner: str | None
    reason: str
    record: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False
    frames: int = 0
    state: str = "damaged"
    setup: str | None = None  # the setup it was refused by (`OtherSetupError`): damaged for replicas of that one
    sound: bool = False  # its files are sound, saved with another setup than this start's (`OtherSetupError`)

    @property
    def name(self) -> str:
        name = self.record.get("name")
        return name if isinstance(name, str) else self.id

    @property
    def created(self) -> float:
        created = self.record.get("created")
        return float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created), "state": self.state,
                "damaged": self.reason, "frames": 0, "feeding": False, "feed": None}

    def note(self) -> dict[str, Any]:
        """What the state folder's quarantine keeps of it (`store.StreamFiles.write_note`)."""
        return {"id": self.id, "owner": self.owner, "reason": self.reason, "name": self.name, "created": self.created,
                "at": int(time.time()), **({"setup": self.setup} if self.setup is not None else {})}


class Quarantined(InputError):
    """A stream whose disk-tier file set cannot be resumed: moved into the state folder's quarantine (then the
    stream is damaged until it is deleted), or left where it is when it cannot be moved (then it is tried again at
    the next start)."""

    sound = False  # its file set is sound, saved with another setup: left for a start with that one


def remove_tier(entry: StreamEntry) -> OSError | None:
    """Remove a closed stream's disk-tier file set (if it has one), as much of it as can go; the `OSError` that left
    a part of it (None: removed whole, or it had none), for the caller to note and try again."""
    folder = entry.tier
    if folder is None:
        return None
    try:
        remove_folder(folder)
    except OSError as error:
        return error
    return None


def failure_reason(error: BaseException) -> str:
    """What failed, to tell one failure from another: an `OSError`'s reason without the file it names (each write
    has a partial file of its own name, so the same full disk would otherwise read as a new reason each time)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def lost_at_start(record: dict[str, Any], stream: Any) -> dict[str, int] | None:
    """What a stream brought back from its ``record`` lacks of what that record had seen (None: nothing known
    lost): ``pushed`` and ``frames`` taken before the server stopped (a kill: the record, written at each answer,
    watch change and save, notes the stream's counts then; an older record, the frames its answers were given
    over) that its save or file set does not hold, and ``answers``, how many of its kept answers were given over
    frames it no longer holds. A lower bound: pushes after the record's last write leave no trace."""
    answered = [note["frames"] for note in record.get("answers") or []
                if isinstance(note, dict) and type(note.get("frames")) is int]
    seen = record.get("seen")
    if isinstance(seen, dict):  # the counts at its last write: its answers are before them, their loss told by them
        pushed, frames = (seen.get(name) if type(seen.get(name)) is int else 0 for name in ("pushed", "frames"))
    else:  # a record from before it noted them: the frames its answers were given over
        pushed, frames = 0, max(answered, default=0)
    lost = {"pushed": max(0, pushed - stream.pushed), "frames": max(0, frames - stream.frames)}
    if not any(lost.values()):
        return None
    return {**lost, "answers": sum(1 for count in answered if count > stream.frames)}
