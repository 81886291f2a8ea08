"""What a video on the disk tier journals so that it can resume after its process is killed, and resuming it.

The disk tier's file set (`statekv.core.disk.tier.DiskTier`: the layers' files, the journal, the carried-state slots)
is the engine's; the engine journals each step once its data is written, with the record the video gives it.
`Durability` is the one object through which a video (`EncodedVideo`, `Stream`) writes into the file set: its
setup (``stream.json``, `statekv.api.stream_disk`), each frame pushed (so a resumed stream can count the frames it
lost), each step's record (the layout state after it, its frames and, for a stream, its last frame), and the
state of a saved stream loaded into the tier, and under the ``handover`` layout each step's embeddings (the
backlog a resumed stream rebuilds its successor from) and the handover of the folder to the successor's file set
(`statekv.core.disk.successor`). `resume_stream` is `Stream.load` of a file set.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from ..core.disk.compaction import JournalSteps
from ..core.disk.files import (FILE_SET, check_file_set, check_plain_files, hold, read_checked, read_file_set,
                               read_manifest)
from ..core.disk.successor import (BACKLOG, BACKLOG_FILE, HANDOVER_MARKER, BacklogFile, finish_handover,
                                   kept_record, kept_successor, mark_handover, read_backlog, remove_successors)
from ..core.disk.resume import check_durable
from ..core.disk.tier import DiskTier
from ..core.stream.prefill import cache_geometry
from ..settings.engine import EngineSettings
from ..settings.values import printable
from .stats import EncodingStats
from ..errors import HandoverError, InputError, OutputError, os_reason
from ..models import LayoutState
from .handover import StoredStep, resumed_disk_engine
from .stream_disk import (CLOCK, SETUP, WAITING, WATCHES, WATCHES_FILES, frames_lost, kept_watches_files,
                          read_stream_setup, read_waiting, read_watches, watches_file, write_waiting, write_watches)
from .stream_file import check_against_model, check_same_setup
from .stream_identity import check_ownership
from .watch import run_on_cadence
from .watch_saving import restore as restore_watches
from ..video import Frame
from ..video.sampling import tick
from ..weak import weakly

log = logging.getLogger("statekv")

# of a saved stream's last step loaded into the tier: its last encoded frame's time (the last kept, once any frames
# that waited for their batch are gone)
KEPT_TIMESTAMP = "kept_timestamp"
LOADED_SUCCESSOR = "loaded_successor"  # a loaded stream's successor keeps in memory the steps it has yet to replay
LOADED_FROM_FILE = ("it was loaded from a saved file, which keeps the embeddings of only the steps its successor had "
                    "yet to replay, not of every step it is rebuilt from")
REPLAYED = ("state", "frames", "last_frame")  # of a step's record, what its successor's replay journals too


class Durability:
    """The journal records of one video's disk tier (``tier``; None: not on the disk tier, nothing is written).

    records_frames: a step's record names its last frame (a `Stream`, which resumes after it).
    """

    def __init__(self, tier: DiskTier | None, *, records_frames: bool = False):
        self.tier, self.records_frames = tier, records_frames
        self.backlog = None if tier is None else BacklogFile(tier)  # a handover stream's, before its handover
        self.waiting: Callable[[], Sequence[Frame]] = list  # the video's frames kept but not yet streamed
        # the last push record: its frame, the journal's length before and after, the tier and its appends then
        self.last_push: tuple[Any, ...] | None = None
        self.kept_waiting: dict[str, Any] | None = None  # the record of the frames a close kept beside the file set
        # the records and tensors of a stream's open watches (`statekv.api.watch_saving.records`, `tensors`),
        # written beside the file set at each checkpoint; the file of them the last record journaled names (None:
        # none open), with what it holds (folder, records, record); and those of the records not yet known to be
        # journaled
        self.open_watches: Callable[[], tuple[list[dict[str, Any]], dict[str, torch.Tensor]]] = lambda: ([], {})
        self.watches_file: str | None = None
        self.watches_written: tuple[Path, list[dict[str, Any]], dict[str, Any]] | None = None
        self.watches_next: tuple[str | None, tuple | None] | None = None

    def watch(self, waiting: Callable[[], Sequence[Frame]]) -> None:
        """``waiting``: the video's frames kept but not yet streamed, journaled again after every checkpoint (so a
        resumed file set counts them lost, `frames_lost`)."""
        self.waiting = waiting
        if self.tier is not None:
            self.tier.waiting, self.tier.after_checkpoint = self.tier_callbacks()

    def tier_callbacks(self) -> tuple[Callable[..., list[dict[str, Any]]], Callable[[], None]]:
        """`waiting_records` and `watches_journaled` for the disk tier to call, holding this weakly (it holds the
        tier)."""
        return (weakly(self, lambda durability, *folder: durability.waiting_records(*folder), []),
                weakly(self, lambda durability: durability.watches_journaled()))

    def waiting_records(self, folder: Path | None = None) -> list[dict[str, Any]]:
        """The records journaled again with a checkpoint (of the file set in ``folder``, default the video's): a
        push record per frame waiting for its batch, while those are the frames a close kept beside the file set
        the record vouching for them, and the open watches' (`watches_records`)."""
        waiting = self.waiting()
        records = [push_record(frame) for frame in waiting]
        kept = self.kept_waiting
        if kept is not None and [frame.index for frame in waiting] == [index for index, _ in kept[WAITING]]:
            records.append(kept)
        return records + self.watches_records(self.tier.folder if folder is None else folder)

    def watches_records(self, folder: Path) -> list[dict[str, Any]]:
        """The open watches written beside the file set in ``folder`` (as they stand, into the one of
        `WATCHES_FILES` the last record journaled does not name, which stays whole), so that a resume from the
        checkpoint they follow reopens them, and the record vouching for them (the last one again if none was
        evaluated since); with none open, a record saying so where the last one named a file. Files no record
        journaled names go. What the records say holds once they are journaled (`watches_journaled`). An
        `OutputError` when the file cannot be written."""
        records, tensors = self.open_watches()
        named = self.watches_file if self.tier is not None and folder == self.tier.folder else None
        try:
            if records:
                written = self.watches_written
                if named is not None and written is not None and written[:2] == (folder, records):
                    self.watches_next = (named, written)
                    return [written[2]]
                name = WATCHES_FILES[named == WATCHES_FILES[0]]
                record = write_watches(folder, name, records, tensors)
                self.watches_next = (name, (folder, records, record))
            else:
                self.watches_next, record = (None, None), {WATCHES: 0}
                name = None
            for path in kept_watches_files(folder):
                if path.name not in (name, named):
                    path.unlink()
        except OSError as error:
            raise OutputError(f"cannot write the disk cache in {printable(folder)}: {os_reason(error)}") from None
        return [record] if records or named is not None else []

    def journal_watches(self) -> bool:
        """Journal the open watches (`watches_records`) if they changed since the last record journaled of them,
        after the last checkpoint, so a resume from it reopens them as they stand (a watch opened or closed since
        its step, or evaluated by `Watch.evaluate`); whether a record was appended."""
        if self.tier is None:
            return False
        records, written = self.open_watches()[0], self.watches_written
        never_any = not records and self.watches_file is None
        if never_any or (written is not None and written[:2] == (self.tier.folder, records)):
            return False
        self.tier.check_owner()  # before its watches file is written there: the path may name another's folder now
        self.tier.append(*self.watches_records(self.tier.folder))
        self.watches_journaled()
        return True

    def watches_journaled(self) -> None:
        """The records `watches_records` last gave are journaled: the file they name is the one to keep."""
        if self.watches_next is not None:
            self.watches_file, self.watches_written = self.watches_next
            self.watches_next = None

    @property
    def enabled(self) -> bool:
        return self.tier is not None

    @property
    def folder(self) -> Path | None:
        """The file set's folder (None: not on the disk tier)."""
        return None if self.tier is None else self.tier.folder

    def describe(self, setup: dict[str, Any]) -> None:
        """Write the stream's setup (``stream.json``) into the file set, naming the file set it belongs to."""
        if self.tier is not None:
            self.tier.describe(SETUP, {**setup, "file_set": self.tier.file_set})

    def pushed(self, frame: Frame) -> None:
        """Journal a kept frame: a resumed stream counts it lost unless a step journals it."""
        if self.tier is not None:
            before = self.tier.journal_bytes
            self.tier.append(push_record(frame))
            self.last_push = (frame.index, before, self.tier.journal_bytes, self.tier, self.tier.appends)

    def closing(self, frames: list[Frame], pushed: int, last_timestamp: float | None,
                watches: tuple[list[dict[str, Any]], dict[str, torch.Tensor]] = ([], {})) -> None:
        """At close, after a checkpoint: ``frames`` (waiting for their batch) and the open ``watches`` (their
        records and tensors) written beside the file set, each with a record vouching for it, so resuming the
        folder takes them back (`statekv.api.stream_disk.read_waiting`, `read_watches`), and the push clock
        (``pushed`` frames, the last at ``last_timestamp``: later ones may have been dropped); an `OutputError` when
        they cannot be (the frames then count as lost, and the watches are not reopened, as before)."""
        if self.tier is None:
            return
        self.tier.check_owner()  # nothing written into a folder this stream no longer holds
        live, self.open_watches = self.open_watches, lambda: watches  # closed by now: kept as they stood
        try:
            self._closing(frames, pushed, last_timestamp)
        except BaseException as error:
            if not isinstance(error, OutputError):  # not the disk's refusal (a MemoryError): the stream stays open
                self.open_watches = live
            raise

    def _closing(self, frames: list[Frame], pushed: int, last_timestamp: float | None) -> None:
        taken = self.tier.checkpoints
        self.tier.checkpoint()
        folder = self.tier.folder
        try:
            if frames:
                record = write_waiting(folder, frames)
                self.tier.append(record)
                self.kept_waiting = record
            if last_timestamp is not None:
                self.tier.append({CLOCK: [pushed, last_timestamp]})
        except OSError as error:
            raise OutputError(f"cannot write the disk cache in {printable(folder)}: {os_reason(error)}") from None
        if self.tier.checkpoints == taken:  # no checkpoint now: the last one's record of the watches is not this
            records = self.watches_records(folder)
            if records:
                self.tier.append(*records)
            self.watches_journaled()

    def withdrawn(self, frame: Frame) -> None:
        """The frame just journaled as pushed was not taken (its step refused, at the cap say): its record goes,
        if nothing was journaled after it, so refused frames do not grow the journal."""
        if self.tier is not None and self.last_push is not None:
            index, before, after, tier, appends = self.last_push
            if (index == frame.index and tier is self.tier and tier.appends == appends and tier.owned
                    and tier.journal_bytes == after):  # nothing written to the journal since
                try:
                    self.tier.truncate_journal(before)
                except OSError:  # kept: a resume then counts the frame lost, which it was
                    pass
            self.last_push = None

    def step_record(self, after: LayoutState, frames: int, last: Frame | None) -> dict[str, Any] | None:
        """What the engine journals with a step of ``frames`` frames (``last`` the step's last frame, None for
        text) so the video can resume after it: the layout state ``after`` it (None: not on the disk tier)."""
        if self.tier is None:
            return None
        record: dict[str, Any] = {"state": after.to_dict(), "frames": frames}
        if self.records_frames and last is not None:
            record["last_frame"] = [last.index, last.timestamp]
        return record

    # -- a handover stream's successor (`statekv.core.disk.successor`) ------------------------------------------
    def backlog_written(self, inputs_embeds: torch.Tensor) -> list[int]:
        """Write a step's embeddings ``[1, T, D]`` to the backlog; returns what its journal record names of them."""
        return self.backlog.write(inputs_embeds)

    def backlog_booked(self, entry: list[int]) -> None:
        """The step whose embeddings ``entry`` names was taken."""
        self.backlog.booked(entry)

    def backlog_step(self, entry: list[int], inputs_embeds: torch.Tensor) -> StoredStep:
        """A step of the backlog as stored in the backlog file (``entry``, its embeddings ``inputs_embeds``'s)."""
        return StoredStep(entry, inputs_embeds.shape, inputs_embeds.dtype, self.backlog.read)

    def restore_backlog(self, backlog: Any, records: list[dict[str, Any]], embeddings: torch.Tensor) -> str | None:
        """Fill ``backlog`` (a `statekv.api.handover.Backlog`) with every step the journal's step ``records``
        vouch for, as stored in the backlog file (checked against it), each with the record its replay journals;
        None, or why it cannot (the stream then goes on without a successor)."""
        hidden, dtype = embeddings.shape[1], embeddings.dtype
        read = read_backlog(self.tier.folder, records, hidden * dtype.itemsize)
        if isinstance(read, str):
            return read
        entries, self.backlog.end = read
        for entry, record in zip(entries, records):
            shape = torch.Size([1, int(record["tokens"]), hidden])
            backlog.add(StoredStep(entry, shape, dtype, self.backlog.read),
                        {key: record[key] for key in REPLAYED if key in record})
        return None

    def keep_successor(self, successor: Any) -> bool:
        """At close, after `closing`: whether ``successor`` (which replayed steps) is kept beside the stream, its
        file set synced and then named in the journal (`statekv.core.disk.successor.kept_record`), for a resume to
        go on with it as it was (`resume_kept`) instead of replaying those steps again. The caller closes it,
        keeping its files; a successor not kept it discards."""
        steps = len(successor.cache.chunk_lengths)
        if self.tier is None or successor.disk is None or not steps or not successor.disk.owned:
            return False
        successor.sync()
        self.tier.append(kept_record(successor.disk, steps))
        return True

    def remove_successors(self) -> None:
        """Remove the successor file sets left in the stream's folder, but one a resume holds (`resume_kept`): they
        are rebuilt from the backlog."""
        remove_successors(self.tier.folder)

    def no_successor(self) -> None:
        """The stream, resumed, goes on without a successor: what an earlier run kept for one goes (its file sets,
        the backlog), if the folder is still the one this stream holds (they go at the next resume otherwise)."""
        if self.backlog is not None:
            self.backlog.close()
        if self.tier.owned:
            try:
                remove_successors(self.tier.folder, backlog=True)
            except OSError as error:
                log.warning("%s: cannot remove what was kept for a successor: %s", self.tier.folder, error)

    def hand_over(self, first: Any, successor: Any, engine_on: Callable[[DiskTier], Any]) -> Any:
        """The stream's folder given to its ``successor``'s file set (its backlog replayed; ``first``: the stream's
        engine until now; the frames waiting for their steps journaled in the successor's file set, so that a crash
        still counts them lost), in the order `statekv.core.disk.successor` describes; returns the
        stream's engine from now on, ``engine_on`` the folder's file set, resumed from it. Before the handover is
        marked, an error leaves the stream as it was (an `OutputError`, a full disk: its successor too, the caller
        putting the handover off; any other: its successor dropped by the caller); after, both engines are closed
        and a `HandoverError` says that resuming the folder finishes the handover."""
        folder = self.tier.folder
        described = folder / f"{SETUP}.json"
        if described.is_file():  # a stream's own description, naming the successor's file set from now on
            successor.disk.describe(SETUP, {**read_checked(described), FILE_SET: successor.disk.file_set})
        successor.disk.checkpoint()  # at its last step, the frames waiting for theirs and the watches after it
        successor.disk.append(*self.waiting_records(successor.disk.folder))
        successor.sync()
        mark_handover(folder, successor.disk.folder, successor.disk.file_set)
        self.watches_journaled()  # the folder's journal is the successor's from now on
        lock = tier = engine = None
        try:
            successor.close()
            self.backlog.close()
            lock = first.disk.close(keep_lock=True, checkpoint=False)  # its files are about to go
            finish_handover(folder)
            journal = read_file_set(folder)
            tier = DiskTier(folder, journal.manifest, lock)
            tier.waiting, tier.after_checkpoint = self.tier_callbacks()
            engine = engine_on(tier)
            engine.resume(journal, just_written=True)  # the pending frames' records kept
        except Exception as error:
            cleanups = [engine.close if engine is not None else tier.close if tier is not None
                        else lock.release if lock is not None else None, first.close]
            for cleanup in filter(None, cleanups):
                try:
                    cleanup()
                except Exception:  # noqa: BLE001 -- the handover's own error is the one to tell
                    pass
            raise HandoverError(folder, str(error)) from None
        self.tier, self.backlog = tier, None
        return engine

    def sync(self) -> None:
        """Force the backlog's writes to the storage device (the file set's are the engine's to sync)."""
        if self.backlog is not None:
            self.backlog.sync()

    def close(self) -> None:
        if self.backlog is not None:
            self.backlog.close()

    def loaded(self, prefill: Any, step_frames: list[int], record: dict[str, Any], pending: list[Frame], *,
               successor: bool) -> None:
        """Journal a saved stream just loaded into this tier (by its engine ``prefill``: the frames of each of its
        steps, ``record`` what its last step's record adds, `loaded_record`), and its ``pending`` frames as pushed,
        so the file set can itself be resumed; ``successor``: whether it was loaded with its successor beside it
        (which then keeps in memory the steps it has yet to replay, `statekv.api.saving.resume_successor`)."""
        if self.tier is None:
            return
        prefill.journal_loaded(step_frames, {**record, LOADED_SUCCESSOR: True} if successor else record)
        for frame in pending:  # waiting in the file, not in the file set
            self.pushed(frame)


def resume_kept(stream: Any, kept: tuple[Path, str, int, Any], steps: JournalSteps) -> Any:
    """The successor ``stream`` kept at its close (`statekv.core.disk.successor.kept_successor`: its folder, file
    set, steps and lock) resumed in place of the new one, and the steps it replayed gone from the backlog, if its
    file set resumes as it was journaled (its steps the first of the stream's ``steps``); returns its lock when it
    does not (the new successor then replays the backlog), else None."""
    path, file_set, count, lock = kept
    engine = None
    try:
        journal = read_file_set(path)
        if journal.manifest.get(FILE_SET) != file_set or len(journal.steps) != count or count > len(steps) or any(
                map(operator.ne, journal.steps.tokens, islice(steps.tokens, count))):
            log.warning("%s: its successor's files in %s are not the %d steps its close named; it replays its "
                        "backlog again", stream.name, path, count)
            return lock
        engine = stream.engine_on(DiskTier(path, journal.manifest, lock))
        engine.resume(journal)
    except Exception as error:  # noqa: BLE001 -- however its files fail, the backlog rebuilds it
        log.warning("%s: its successor's files in %s do not resume (%s); it replays its backlog again",
                    stream.name, path, str(error).splitlines()[0] if str(error) else type(error).__name__)
        if engine is None:
            return lock
        engine.disk.discard()
        engine.close()
        return None
    stream.close_successor()  # the new one, unwritten
    stream.successor = engine
    for _ in range(count):
        stream.backlog.replayed_first()
    return None


def loaded_record(state: LayoutState, last_frame: list, encoded_timestamp: float | None) -> dict[str, Any]:
    """What the journal record of a loaded stream's last step adds (with its placements): its layout ``state``,
    the last frame it streamed ``[index, timestamp]`` and the time of the last it kept."""
    return {"state": state.to_dict(), "last_frame": last_frame, KEPT_TIMESTAMP: encoded_timestamp}


def push_record(frame: Frame) -> dict[str, Any]:
    """The journal record of a frame kept and not yet streamed (what `frames_lost` counts)."""
    return {"push": frame.index, "t": frame.timestamp}


def resume_stream(cls: type, folder: Path, qa: Any, allow_other_weights: bool, *, stream_id: str | None = None,
                  owner: str | None = None, engine: EngineSettings | None = None) -> Any:
    """A stream of class ``cls`` resumed from the disk-tier file set in ``folder`` (see `Stream.load`): its lock
    taken first (a file set another stream lives in is refused, naming it), then everything checked, against
    ``engine`` (default: the VideoQA's settings), which it then streams with (its positions the stream's own; on
    the disk tier in ``folder`` whatever the settings' own ``offload``)."""
    engine = qa.engine if engine is None else engine
    if engine.offload != "disk":
        engine = engine.with_changes(offload="disk", offload_dir=str(folder.parent))
    check_plain_files(folder)
    if (folder / HANDOVER_MARKER).is_file():  # a handover stopped midway: finished first, by its owner
        check_ownership(folder, read_stream_setup(folder), stream_id, owner)
        lock = hold(folder, "a stream finishing its handover")
        try:
            finish_handover(folder)
        finally:
            lock.release()
    manifest = read_manifest(folder)  # before a lock file is made
    setup = read_stream_setup(folder)
    check_file_set(folder, f"{SETUP}.json", setup, manifest[FILE_SET])  # not another stream's description
    check_ownership(folder, setup, stream_id, owner)
    lock = hold(folder, f"stream {setup['name'][:80]!r}")
    try:
        journal = read_file_set(folder)
        check_same_setup(folder, {**setup, "cache": {"kv_cache_dtype": setup["kv_cache_dtype"]}}, qa,
                         allow_other_weights, engine)
        geometry = cache_geometry(qa.adapter.model)
        made = journal.manifest.get("geometry")
        if made != geometry.to_dict():
            raise InputError(f"{printable(folder)}: made for a cache of {made}, but this model's is "
                             f"{geometry.to_dict()}")
        check_durable(folder, journal)
        last = journal.steps[-1]
        if not isinstance(last.get("state"), dict):
            raise InputError(f"{printable(folder)}: the disk cache's journal is damaged: its last step lacks the "
                             "stream's state")
        check_against_model(folder, {"horizon": setup["horizon"], "horizon_frames": setup["horizon_frames"],
                                     "engine": setup["engine"], "max_fps": setup["max_fps"],
                                     "prefix_tokens": setup["prefix_tokens"],
                                     "cache": {"chunk_lengths": journal.steps.tokens},
                                     "state": {"frames": last["state"].get("frames")}}, qa.adapter)
        tier = DiskTier(folder, journal.manifest, lock)
    except BaseException:
        lock.release()
        raise
    recorded = setup["engine"].get("settings", {})
    try:
        engine, handed_over = resumed_disk_engine(engine.with_changes(positions=recorded.get("positions") or "stream"),
                                                  recorded.get("bounded_layout"),
                                                  journal.manifest.get("bounded_layout"), folder)
    except BaseException:
        tier.close()
        raise
    kept = kept_successor(folder, journal.after)  # its lock held: the stream's new successor leaves it
    kept_lock = None if kept is None else kept[3]
    try:
        stream = cls(qa, setup["horizon_frames"], max_fps=setup["max_fps"], name=setup["name"],
                     vision_batch=setup["vision_batch"], reserve_tokens=setup["engine"]["reserve_tokens"],
                     prefix_tokens=setup["prefix_tokens"], engine=engine,
                     disk_tier=tier, stream_id=setup.get("stream_id"), owner=owner, created=setup.get("created"))
    except BaseException:
        tier.close()
        if kept_lock is not None:
            kept_lock.release()
        raise
    try:
        stream.prefill.resume(journal)
        stream.state = LayoutState.from_dict(last["state"])
        if handed_over:
            stream.handover = "handed over"
        if stream.successor is not None and last.get(LOADED_SUCCESSOR) is True:
            stream.drop_successor(LOADED_FROM_FILE)
        elif stream.successor is not None and (BACKLOG not in last or not (folder / BACKLOG_FILE).is_file()):
            stream.drop_successor("it had no successor when it stopped", warn=False)  # or predates them
        elif stream.successor is not None:  # rebuilt from the backlog: it replays every step again
            why = stream.durability.restore_backlog(stream.backlog, journal.steps.through_first_folded(),
                                                    stream.adapter.language_embeddings.weight)
            if why is not None:
                stream.drop_successor(why)
            elif kept is not None:
                kept_lock = resume_kept(stream, kept, journal.steps)
            stream.keep_to_cap()
        if kept_lock is not None:  # not resumed: it goes with the others
            kept_lock.release()
            kept_lock = None
            stream.durability.remove_successors()
        if stream.successor is None:  # resumed whole: what an earlier run kept for a successor goes
            stream.durability.no_successor()
    except BaseException:
        if kept_lock is not None:
            kept_lock.release()
        stream.close()
        raise
    stream.step_frames = journal.steps.frames
    engine = stream.prefill.stats
    stream.stats = EncodingStats(frames=stream.state.frames, tokens=engine.tokens, chunks=engine.steps,
                                 carried_tokens=engine.max_carried_tokens, cache_bytes=engine.detailed_bytes,
                                 evicted_frames=sum(journal.steps.frames.total(start, end)
                                                    for start, end in journal.evicted.runs()))
    framed = journal.steps.last_frame()
    if framed:
        index, timestamp = framed
        stream.pushed, stream.last_timestamp = int(index) + 1, float(timestamp)
        stream.kept_timestamp = stream.encoded_timestamp = stream.last_timestamp
        stream.encoded_pushed = stream.pushed
        if stream.max_fps is not None:
            stream.next_tick = tick(timestamp, stream.max_fps) + 1
    if isinstance(last.get(KEPT_TIMESTAMP), (int, float)):  # loaded from a file: its last pushed frame may not be
        stream.kept_timestamp = stream.encoded_timestamp = float(last[KEPT_TIMESTAMP])
    waiting = next((record for record in reversed(journal.after) if WAITING in record), None)
    frames = None if waiting is None else read_waiting(folder, waiting, stream.pushed)
    if frames:  # kept at its close: waiting for their batch again, journaled as pushed, the file vouched for again
        for frame in frames:
            stream.durability.pushed(frame)
        stream.durability.tier.append(waiting)
        stream.durability.kept_waiting = waiting
        stream.pending = frames
        stream.pushed, stream.last_timestamp = frames[-1].index + 1, frames[-1].timestamp
        stream.kept_timestamp = stream.last_timestamp
        if stream.max_fps is not None:
            stream.next_tick = tick(stream.last_timestamp, stream.max_fps) + 1
    reopen_watches(stream, folder, journal.after)
    stream.frames_lost, durable = frames_lost(journal.after, stream.pushed, journal.frames_beyond), stream.pushed
    clock = next((record[CLOCK] for record in reversed(journal.after) if CLOCK in record), None)
    if (isinstance(clock, list) and len(clock) == 2 and type(clock[0]) is int and clock[0] >= stream.pushed
            and type(clock[1]) in (int, float) and clock[1] >= (stream.last_timestamp or 0.0)):
        stream.pushed, stream.last_timestamp = clock[0], float(clock[1])  # frames dropped after the last kept
    if journal.unsynced:  # a power loss, not a kill: lost what had not reached the device, dropped as after one
        log.warning("%s: %s lost writes not yet on the storage device when it stopped (a power loss?): %s; it "
                    "resumes at its checkpoint of step %d, the %d step(s) journaled after it lost", stream.name,
                    folder, journal.unsynced, len(journal.steps) - 1, journal.steps_after,
                    extra={"steps_lost": journal.steps_after})
    if stream.frames_lost:
        # pushable again: the clock stands before them (after a close it may stand past them; a command replaying a
        # file, which pushes them again then, says so instead of this line)
        again = stream.pushed == durable
        log.warning("%s: resumed from %s at frame %d; %d frame(s) pushed after it were not durable and are lost%s",
                    stream.name, folder, stream.frames, stream.frames_lost,
                    " (the stream goes on from before them: push them again to keep them)" if again else "",
                    extra={"frames_lost": stream.frames_lost, "pushable_again": again})
    else:
        log.info("%s: resumed from %s at frame %d, nothing lost", stream.name, folder, stream.frames)
    return stream


def reopen_watches(stream: Any, folder: Path, after: list[dict[str, Any]]) -> None:
    """Reopen the watches kept beside the file set (the last ``watches`` record among the journal's records
    ``after`` its last checkpoint: the checkpoint's own, or the close's), as they stood, and journal the record
    again (the resume cut the journal after the checkpoint's own records), so a kill before the next checkpoint
    still reopens them; then evaluate those due (a checkpoint taken inside a batch of steps kept them as they stood
    before the batch's evaluations). Ones that cannot be reopened are logged, and the stream goes on without them."""
    kept = next((record for record in reversed(after) if WATCHES in record), None)
    if kept is not None and not kept[WATCHES]:  # none open: what files of them are left go
        for path in kept_watches_files(folder):
            try:
                path.unlink()
            except OSError:  # left: no record vouches for it
                pass
        stream.durability.tier.append(kept)  # the last word again: the close's was cut, the checkpoint's names a file
        return
    if kept is None:
        for path in kept_watches_files(folder):
            log.warning("%s: the watches in %s are not reopened: no record after the checkpoint it resumed from "
                        "vouches for them", stream.name, path.name)
        return
    read = read_watches(folder, kept)
    try:
        if isinstance(read, str):
            raise InputError(read)
        restore_watches(stream, *read, where=f"{printable(folder)}: {watches_file(kept)}")
    except InputError as error:
        log.warning("%s: the %d watch(es) open at its last checkpoint are not reopened: %s", stream.name,
                    kept[WATCHES], error)
        return
    stream.durability.tier.append(kept)
    stream.durability.watches_file, stream.durability.watches_written = watches_file(kept), None
    due = [watch for watch in stream.watches if watch.due(stream.frames, stream.watching.seconds)]
    if due:
        with torch.no_grad():
            run_on_cadence(due)
