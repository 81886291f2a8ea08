"""The disk tier of the detailed cache: one stream's keys and values in an append-only, memory-mapped file set.

A stream streamed with ``offload="disk"`` owns a folder (`DiskTier`) holding, per layer, its keys and values
(``layer{i}.detailed.0.{k}.bin``, ``layer{i}.detailed.1.{k}.bin``; quantized: its codes and scales), its step
summaries (``layer{i}.step_means.0.{k}.bin``, ``layer{i}.step_samples.0.{k}.bin``) and its segment index
(``layer{i}.segment_index.0.{k}.bin``), each a `MappedTokenBuffer`: rows of ``[B, H_kv, X]`` in token (step,
segment) order, in files of a block of rows each (block ``k``; format 4: one file a part,
``layer{i}.detailed.0.bin``), appended, so nothing written is rewritten; a block's files are removed once every row
of it was given back, holes punched over the rows given back, once the journal evicting them is forced to the device
(`statekv.core.disk.deferred`). The layer's storage is the usual offloaded (or quantized) one over these buffers (the
storages' ``make_buffer`` factory): a step stages its chunk on the model's device and its data is appended when it
commits. Only the segment index (one row per `SEGMENT_STEPS` steps, what
retrieval ranks segments by) is also kept in RAM (`MirroredTokenBuffer`); the step summaries are read from the
files, for the steps a question scores. Reads map the files afresh each time, so what a question reads is
resident only while the question holds it.

Durability: after each step a line is appended to ``journal`` (its CRC-32, then JSON: the step's length, the
CRC-32 of every byte it appended, the files' lengths, and what the layers above record, e.g. the stream's layout
state). The carried state of every layer (positions, keys and values in the model's dtype, and under bounded
positions each key's placement) and the open segment's accumulators are checkpointed to ``carry.{n % 2}.bin``
(two slots written in turn, so the last checkpoint's slot is intact whatever a kill interrupts), vouched for by
a ``carry`` line: at the first step, every `CHECKPOINT_STEPS` steps after it, and whenever the stream is saved,
synced or closed. A checkpoint falling inside a vision-tower call of the steps a caller marks so (a `Stream`'s
pushes: `commit_step`'s ``ends_vision_call``) waits for the call's last step: a stream resumed
there encodes the frames after it in the calls the stream that never stopped did (a call's features differ by
float rounding from the same frames' in other calls). Data is written before the line that vouches for it. The
contract: a process killed at any point leaves a file set that resumes (`read_file_set`, `resume`) exactly at its
last checkpoint, so a kill loses at most the frames of the last ``CHECKPOINT_STEPS - 1`` steps and of the vision
call the last checkpoint waited for (those after the checkpoint, counted as lost); a stream saved, synced or closed
loses nothing. Written data reaches the kernel at once; each checkpoint forces what its record vouches for to the
device before the record, and the record after (`statekv.core.disk.power_loss`: a power loss, which loses what was
not forced, then loses what a kill does, or the records after the last checkpoint too), as do `DiskTier.sync` and a
close. A step no longer writes the whole carried state (every layer's budget of keys and values): that is paid once
per checkpoint.

Bounded: a stream evicting under a cap gives up its oldest steps' rows, but each step's journal line used to stay,
so the journal (then counted under the cap by its length) grew until it alone filled it. After a checkpoint, once
the journal holds as many whole records of evicted steps as of held ones (and ``checkpoint_steps`` at least),
`compact` rewrites it with the evicted steps' records folded into a record of runs
(`statekv.core.disk.compaction`), beside it and renamed over it. The cap now counts the journal as a fixed share
per step held (`counted_bytes`), not by its length, so a stream evicts the same whatever befell its file set.

One owner: a `DiskTier` holds the exclusive lock of its folder (the folder itself, `statekv.locks.FolderLock`; its
``lock`` file holds the holder's note) from the moment it is made or opened until it is closed, so a second opener
is refused with one line naming the holder, whatever becomes of the ``lock`` file. Before each write that a
resumed stream would read back (each journal record, each description, each checkpoint) the tier checks that its
folder's path still names the folder it locked: once the folder was moved away or replaced, another opener may own
what the path names, so the tier writes nothing more (`lost`, an `OutputError`).

Bound to each other: the manifest names the file set (``file_set``, a random id, and ``created``); every other
descriptive file of the set (each layer file's ``.json``, the stream's ``stream.json``) names it too, and so does
the journal's first record, so a file copied or swapped in from another stream's set is refused when it is read
(`statekv.core.disk.files.check_file_set`). The journal's records vouch for the layers' files and the checkpoint
slots (their CRCs). Each description also records the SHA-256 of its own fields (``checksum``), checked whenever
it is read.

The layers' files are `statekv.core.disk.buffers`'; the descriptions and the journal as read back,
`statekv.core.disk.files`; resuming a cache from them, `statekv.core.disk.resume`; a ``handover`` stream's
backlog (``backlog.bin``) and its successor's file set (a subfolder until its handover),
`statekv.core.disk.successor`.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from ...errors import OutputError, os_reason
from ...flushing import flush_folder
from ...locks import FolderLock
from ..storage.layer_storage import OffloadedStorage
from .buffers import MIRRORED, MappedTokenBuffer, pwrite_all, rows_crc, rows_of
from .compaction import BACKLOG, loaded_record
from .deferred import DeferredTokenBuffer, give_back
from .files import (FILE_SET, FOLLOWED_BY, FORMAT, FORMAT_VERSION, JOURNAL, MANIFEST, compacted_journal, hold,
                    journal_header, journal_line, write_checked)
from .forcing import force, refuse_unforced
from .mirrored import MirroredTokenBuffer
from .open_files import close_all, closed_with, raise_open_files_limit
from .power_loss import SYNCED
from .slots import carried_parts, slot_bytes, tally_parts

log = logging.getLogger("statekv")

CHECKPOINT_STEPS = 64  # steps between two checkpoints of the carried state (read when a tier is made)
# what a cache limit counts of the journal per step held: a step's record and its share of the rest (checkpoints'
# records, evictions, the records of evicted steps not compacted yet)
JOURNAL_STEP_BYTES = 512


class DiskTier:
    """One stream's file set in ``folder`` (see the module docstring): the layers' buffers, the journal, the
    carried-state checkpoints.

    Create a new one with `create`; `open` adopts an existing one (resuming, after `read_file_set`).
    ``checkpoint_steps``: steps between two checkpoints of the carried state (`CHECKPOINT_STEPS`).
    """

    def __init__(self, folder: Path, manifest: dict[str, Any], lock: FolderLock | None = None, *,
                 holder: str = "a stream"):
        """lock: the folder's lock, already held (`hold`); None: taken now for ``holder`` (who is named to a
        second opener)."""
        raise_open_files_limit()  # its layers' files may pass the usual soft limit of 1,024 (a library's too)
        self.lock = lock if lock is not None else hold(folder, holder)
        self.folder, self.manifest = folder, manifest
        self._files: list[int] = closed_with(self, [])  # the journal and the checkpoint slots, while open
        try:
            self._journal = os.open(folder / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._files.append(self._journal)
            (folder / f"{JOURNAL}.partial").unlink(missing_ok=True)  # a compaction a kill cut short
            if manifest.get("version", FORMAT_VERSION) != FORMAT_VERSION:  # what this statekv writes, an earlier
                self.manifest = {**manifest, "version": FORMAT_VERSION}  # one does not read
                write_checked(folder / MANIFEST, self.manifest)
        except OSError as error:
            if lock is None:
                self.lock.release()
            raise OutputError(f"cannot write the disk cache in {folder}: {os_reason(error)}; a stream on the "
                              "disk tier writes into its folder as it goes on: copy the folder somewhere writable "
                              "to resume it there") from None
        self.storages: list[OffloadedStorage] = []
        self.buffers: list[dict[str, MappedTokenBuffer | MirroredTokenBuffer]] = []  # per layer, by name
        self.extra: dict[str, Any] = {}  # more manifest fields, e.g. from the stream (written as ``stream.json``)
        # the records journaled again with each checkpoint: what waits to be streamed (a stream's pending frames,
        # which a resumed file set counts lost) and what the stream keeps beside the file set (its watches)
        self.waiting: Callable[[], list[dict[str, Any]]] = list
        self.after_checkpoint: Callable[[], None] = lambda: None  # told once they are journaled with it
        # forces to the device what else the steps' records vouch for beside the file set's own files (a handover
        # stream's backlog, `statekv.core.disk.successor.BacklogFile`), with them before each checkpoint's record
        self.forced: Callable[[], None] = lambda: None
        self._slots: list[int] = []
        self.checkpoint_steps = CHECKPOINT_STEPS
        self.checkpoints = 0  # written so far (the next goes to slot checkpoints % 2)
        self.checkpointed: int | None = None  # the step of the last checkpoint
        self.last_step: int | None = None  # the last step journaled
        self._cache: Any = None  # the cache whose carried state a checkpoint writes
        self.remembered: list[tuple[torch.Tensor | None, ...]] | None = None  # see `remember`
        # the journal's whole step records (of steps held, of steps evicted): `compact` folds the evicted ones once
        # they are as many as the others (and CHECKPOINT_STEPS at least), from what the journal holds alone, so a
        # resumed stream compacts at the steps the stream that never stopped does
        self.held_records = self.evicted_records = 0
        self.replayed: set[int] = set()  # steps whose records name their embeddings for a successor: kept whole
        self.appends = 0  # records appended and compactions (what a record's withdrawal checks nothing came after)
        self.compact_failed = self.give_back_failed = False  # said once in the log
        self.lost = False  # the folder was moved or replaced under this tier: it writes nothing more there
        self.force_failed: str | None = None  # why a force failed: it checkpoints no more (`statekv.core.disk.forcing`)
        # made here (`create`) and nothing resumable journaled yet: closing then removes the folder, which no
        # `Stream.load` could resume (a stream whose first step or loaded state the disk could not take)
        self.made = False
        self.durable = False

    @classmethod
    def create(cls, offload_dir: str | os.PathLike, name: str, manifest: dict[str, Any]) -> "DiskTier":
        """A new, empty file set in a folder of its own under ``offload_dir`` (created if needed)."""
        safe = "".join(c if c.isascii() and c.isalnum() or c in "-_" else "-" for c in Path(str(name)).name)[:40] \
            or "stream"  # ASCII: what a service's stream record accepts as a folder name
        folder = Path(offload_dir) / f"{safe}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True)
        except OSError as error:
            raise OutputError(f"cannot create the disk cache in {offload_dir}: {os_reason(error)}") from None
        try:
            lock = hold(folder, f"stream {str(name)[:80]!r}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        manifest = {**manifest, FILE_SET: uuid.uuid4().hex, "created": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="microseconds")}
        try:
            write_checked(folder / MANIFEST, {"format": FORMAT, "version": FORMAT_VERSION, **manifest})
            tier = cls(folder, manifest, lock)
        except OSError as error:
            lock.release()
            shutil.rmtree(folder, ignore_errors=True)  # nothing half-made is left behind
            why = str(error) if isinstance(error, OutputError) else os_reason(error)
            raise OutputError(f"cannot create the disk cache in {offload_dir}: {why}") from None
        tier.made = True
        try:
            tier.append(journal_header(tier.file_set))
        except BaseException:
            tier.close()
            raise
        return tier

    @property
    def file_set(self) -> str:
        """This file set's id (its manifest's ``file_set``), which each of its descriptions and its journal name."""
        return self.manifest[FILE_SET]

    def storage(self, index: int, capacity_hint: int | None, on_replace: Callable[[], None],
                kv_cache_dtype: str | None = None, evicts: bool = False) -> OffloadedStorage:
        """The storage of layer ``index`` (the cache's storage factory): the usual offloaded or quantized storage
        over this tier's buffers (the segment index mirrored in RAM, everything else only in the files); for a
        stream that ``evicts`` under a cap, the RAM half holds only the segments it keeps."""
        from ..storage.quantized import QuantizedStorage

        buffers: dict[str, MappedTokenBuffer | MirroredTokenBuffer] = {}
        self.buffers.append(buffers)

        def make_buffer(name: str, parts: int, hint: int | None):
            prefix = self.folder / f"layer{index}.{name}"
            owned = {FILE_SET: self.file_set}
            buffers[name] = (MirroredTokenBuffer(parts, prefix, on_replace, owned, evicts, DeferredTokenBuffer)
                             if name in MIRRORED else DeferredTokenBuffer(parts, hint, prefix, on_replace, owned))
            return buffers[name]

        storage = (QuantizedStorage(kv_cache_dtype, capacity_hint, "cpu", on_replace, make_buffer) if kv_cache_dtype
                   else OffloadedStorage(capacity_hint, "cpu", on_replace, make_buffer))
        self.storages.append(storage)
        return storage

    def layer_files(self, layer: int) -> list[tuple[str, MappedTokenBuffer]]:
        """Layer ``layer``'s files, by name in a fixed order."""
        return sorted((name, getattr(buffer, "mirror", buffer)) for name, buffer in self.buffers[layer].items())

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, reading the steps' rows in order (`rows_crc`) opens each block file once, not once a step."""
        with ExitStack() as stack:
            for layer in range(len(self.buffers)):
                for _, buffer in self.layer_files(layer):
                    stack.enter_context(buffer.reading())
            yield

    def check_owner(self) -> None:
        """An `OutputError` (and `lost` set) when the folder's path no longer names the folder this tier locked (moved
        away, or replaced): what the path names now may be another stream's."""
        if self.lock is None:
            raise OutputError(f"{self.folder}: this stream's disk cache is closed")
        if self.lost or not self.lock.owns():
            self.lost = True
            raise OutputError(f"{self.folder}: the disk cache's folder was moved or replaced while this stream held "
                              "it, so this stream writes nothing more there")

    def describe(self, name: str, fields: dict[str, Any]) -> None:
        """Write ``{name}.json`` beside the manifest (e.g. the stream's setup), replacing it atomically; an
        `OutputError` when it cannot be written."""
        self.check_owner()
        try:
            write_checked(self.folder / f"{name}.json", fields)
        except OSError as error:
            raise OutputError(f"cannot describe the disk cache in {self.folder}: {os_reason(error)}") from None

    def append(self, *records: dict[str, Any]) -> None:
        """Append journal records (JSON objects), each after its CRC-32, in one write: whole, or (an `OutputError`,
        e.g. a full disk, or whatever else raised between two partial writes, a KeyboardInterrupt) not at all."""
        self.check_owner()
        data = memoryview(b"".join(journal_line(record) for record in records))
        end = os.fstat(self._journal).st_size
        try:
            while len(data):
                data = data[os.write(self._journal, data):]
        except BaseException as error:
            try:  # no torn line for the next record to follow: read back, it would damage the whole journal
                os.ftruncate(self._journal, end)
            except OSError:
                pass
            if isinstance(error, OSError):
                raise OutputError(f"cannot write the disk cache in {self.folder}: {os_reason(error)}") from None
            raise
        self.appends += 1
        for record in records:
            if "evict" in record:
                foldable = sum(step not in self.replayed for step in record["evict"])
                self.evicted_records += foldable
                self.held_records -= foldable

    def compact(self) -> None:
        """Replace the journal by itself compacted (`statekv.core.disk.files.compacted_journal`: the records of
        evicted steps folded into runs), written beside it, flushed and renamed over it, so a kill leaves one or the
        other whole. A journal that cannot be rewritten (a full disk) is left as it was, with one line in the
        log."""
        self.check_owner()
        path, partial = self.folder / JOURNAL, self.folder / f"{JOURNAL}.partial"
        self.evicted_records = 0  # folded, or (a journal that cannot be) not tried again until as many more
        try:
            compacted = compacted_journal(path.read_bytes())
            if compacted is None:
                return
            journal = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as error:
            self._compaction_failed(error)
            return
        try:
            pwrite_all(journal, memoryview(compacted), 0)
            os.fsync(journal)
            os.replace(partial, path)
        except OSError as error:
            os.close(journal)
            partial.unlink(missing_ok=True)
            self._compaction_failed(error)
            return
        self._files.remove(self._journal)
        os.close(self._journal)
        self._files.append(journal)
        self._journal, self.appends = journal, self.appends + 1
        try:  # the rename itself made durable: a power cut brings the old journal back no more
            flush_folder(self.folder)
        except OSError as error:  # it may: no checkpoint after it is vouched for (`statekv.core.disk.forcing`)
            self.force_failed = f"the folder's entries: {os_reason(error)}"
            log.error("%s: cannot force the compacted journal's name to the device (%s); the stream is not "
                      "checkpointed again", self.folder, self.force_failed)

    def _compaction_failed(self, error: OSError) -> None:
        if not self.compact_failed:
            self.compact_failed = True
            log.warning("%s: cannot compact the disk cache's journal (%s); it keeps growing with every step",
                        self.folder, os_reason(error))

    def commit_step(self, step: int, tokens: int, cache: Any, extra: dict[str, Any], *,
                    ends_vision_call: bool = True) -> None:
        """Journal step ``step`` (``tokens`` long), once its data is appended: the CRC of what it appended and the
        files' lengths; then, when a checkpoint is due (`checkpoint_due`) and the step ends its vision-tower call
        (``ends_vision_call``), the carried state of every layer of ``cache`` as a checkpoint. Whole or (an
        `OutputError`, or whatever else raised midway) not at all: the journal is then as before the step, and
        `remembered` still holds the carried state the step before left."""
        end, last, held = os.fstat(self._journal).st_size, self.last_step, self.held_records
        try:
            self._cache, self.last_step = cache, step
            lengths = {name: buffer.length for name, buffer in self.layer_files(0)}
            self.append({"step": step, "tokens": tokens, "crc": self._take_crc(), "lengths": lengths, **extra})
            if BACKLOG in extra:
                self.replayed.add(step)
            else:
                self.held_records += 1
            if ends_vision_call and self.checkpoint_due(step):
                self.checkpoint()
        except BaseException:  # a full disk, or anything else raising midway (a MemoryError)
            self.last_step, self.held_records = last, held
            self.replayed.discard(step)
            try:
                os.ftruncate(self._journal, end)  # the step's record goes too, with its checkpoint's
            except OSError:
                pass
            raise
        self.remember(cache.layers)
        self.durable = True

    def checkpoint_due(self, step: int) -> bool:
        """Whether step ``step`` is, or follows, a multiple of ``checkpoint_steps`` steps (the first step
        included) not checkpointed yet: read from the last checkpoint's step alone, so a resumed stream checkpoints
        at the steps the stream that never stopped did."""
        if self.checkpointed is None:
            return True
        return (step + 1) // self.checkpoint_steps > (self.checkpointed + 1) // self.checkpoint_steps

    def remember(self, layers: list[Any]) -> None:
        """Keep a copy of the carried state the last step journaled left (`remembered`: per layer what a
        checkpoint writes), so a step the disk cannot take is undone exactly without a checkpoint per step."""
        self.remembered = [tuple(None if t is None else t.clone() for t in carried_parts(layer)) for layer in layers]

    def adopt(self, cache: Any, last_step: int) -> None:
        """``cache`` as resumed or restored at ``last_step`` (what the next step and checkpoint follow)."""
        self._cache, self.last_step = cache, last_step
        self.remember(cache.layers)

    def checkpoint(self) -> None:
        """Write the carried state after the last step journaled (per layer: positions ``[B, H_kv, K]``, keys and
        values ``[B, H_kv, K, D]``, under bounded positions the placements ``[2, B, H_kv, K]``, and the open
        segment's accumulators ``[B, H_kv, 1, 3 D]``) into the next slot, then the ``carry`` record vouching for
        it. Nothing to do if that step is checkpointed already."""
        if self.last_step is None or self.checkpointed == self.last_step:
            return
        self.check_owner()
        refuse_unforced(self)
        carried = [carried_parts(layer) for layer in self._cache.layers]
        tally = tally_parts(self._cache)
        data = slot_bytes(carried, tally)
        slot, made = self.checkpoints % 2, not self._slots
        if made:  # kept open and overwritten in place (a record names the bytes it vouches for)
            try:
                self._slots = [os.open(self.folder / f"carry.{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644) for i in (0, 1)]
            except OSError as error:
                raise OutputError(f"cannot write the disk cache in {self.folder}: {os_reason(error)}") from None
            self._files.extend(self._slots)
        pwrite_all(self._slots[slot], memoryview(data), 0)
        # on the device before the record vouching for them (the journal's steps, the layers' rows, the slot; their
        # names): a record a power loss leaves vouches for durable data, and the other slot is overwritten only
        # once this record is durable too
        self._force(self._slots[slot], self._journal, folder=made)
        # the records after it in the same write, counted in it (what they vouch for is written first, beside what
        # the last checkpoint's vouch for): a kill, even one that tears the write, leaves the checkpoint with them
        # or the last one with its own
        followers = self.waiting()
        end = os.fstat(self._journal).st_size
        self.append({"carry": self.last_step, "slot": slot, "carried": [list(parts[1].shape) for parts in carried],
                     "placed": carried[0][3] is not None if carried else False,
                     "segment": list(carried[0][-1].shape) if carried and carried[0][-1] is not None else None,
                     "carry_crc": zlib.crc32(data),
                     "carried_dtype": str(carried[0][1].dtype).removeprefix("torch.") if carried else "float32",
                     **({"tally": len(tally[0])} if tally else {}),
                     **({FOLLOWED_BY: len(followers)} if followers else {}), SYNCED: True}, *followers)
        try:
            self._force(self._journal, layers=False)
        except OutputError:  # the record may not be on the device: none resumes from it (`forcing`)
            with suppress(OSError):
                os.ftruncate(self._journal, end)
            raise
        give_back(self)  # the rows evicted since the last time: their records are on the device now
        self.after_checkpoint()
        self.checkpoints += 1
        self.checkpointed = self.last_step
        if self.evicted_records >= max(self.checkpoint_steps, self.held_records):
            self.compact()

    def journal_loaded(self, cache: Any, step_frames: Sequence[int], extra: dict[str, Any],
                       placements: Sequence[Sequence[int]] | None = None) -> None:
        """Journal every step of a state just loaded into this tier (a saved stream resumed on disk), so the
        file set can itself be resumed: ``step_frames`` the frames of each step, ``extra`` what the last step's
        record adds (see `commit_step`), ``placements`` each step's bounded positions ``[first, span, base]`` (or
        the three as `StepValues`: the firsts, spans and bases; read a run at a time, as the other lists)."""
        self.check_owner()
        os.ftruncate(self._journal, 0)
        self.append(journal_header(self.file_set))
        step_lengths, count = cache.chunk_lengths, len(cache.chunk_lengths)
        # the evicted steps but the last, folded at once as `compact` would fold their records (one each before)
        folded = cache.evicted_steps.below(count - 1)
        if folded:
            self.append(loaded_record(folded.runs(), step_lengths, step_frames, placements))
        later = [count - 1] if count - 1 in cache.evicted_steps else []
        if later:
            self.append({"evict": later})
        per_segment = cache.layers[0].storage.segment_steps if cache.layers else 1
        self._force()  # what the checkpoint vouches for, while the blocks written are open (the pass closes them)
        with self.reading():
            for step, start in _held_starts(folded.held_runs(count), step_lengths):
                length = step_lengths[step]
                for layer in range(len(self.buffers)):
                    for name, buffer in self.layer_files(layer):
                        rows = rows_of(name, step, start, length, per_segment)
                        buffer.crc = rows_crc(buffer, *rows) if rows else 0
                record = {"frames": step_frames[step]}
                if placements is not None:
                    record["placed"] = [part[step] for part in placements] if isinstance(placements, tuple) else \
                        placements[step]
                self._cache, self.last_step = cache, step
                lengths = {name: buffer.length for name, buffer in self.layer_files(0)}
                if step == count - 1:
                    record.update(extra)
                self.append({"step": step, "tokens": length, "crc": self._take_crc(), "lengths": lengths, **record})
        self.evicted_records = len(later)
        self.held_records = count - len(cache.evicted_steps)
        self.checkpoint()
        self.remember(cache.layers)
        self.durable = True

    def _take_crc(self) -> int:
        """CRC-32 of what every file was appended since the last call (layer by layer, files by name)."""
        crc = 0
        for layer in range(len(self.buffers)):
            for _, buffer in self.layer_files(layer):
                crc = zlib.crc32(buffer.crc.to_bytes(4, "little"), crc)
                buffer.crc = 0
        return crc

    @staticmethod
    def counted_bytes(cache: Any) -> int:
        """What a cache limit counts of the file set holding ``cache`` besides its layers' files:
        `JOURNAL_STEP_BYTES` for each step held (not evicted). Read from the cache's steps alone, not from the
        files (`nbytes`), whose lengths follow the stream's history (when it was saved or synced, whether it was
        loaded or handed over), so a stream evicts the same whatever befell its file set. The checkpoint slots are
        not counted: they hold the carried state (twice), which the carry rule bounds, as the carried state on the
        model's device is not counted either."""
        return (len(cache.chunk_lengths) - len(cache.evicted_steps)) * JOURNAL_STEP_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of the journal and the checkpoint slots (what the file set holds beside the layers' files)."""
        total = os.fstat(self._journal).st_size if self._journal >= 0 else 0
        return total + sum(os.fstat(fd).st_size for fd in self._slots)

    def sync(self) -> None:
        """Checkpoint the carried state (if the last step is not yet) and force everything written so far to the
        storage device: a kill or a power loss after this loses nothing (an `OutputError` when the device fails it)."""
        self.checkpoint()
        self._force(*self._slots, self._journal)
        give_back(self)

    def _force(self, *fds: int, layers: bool = True, folder: bool = False) -> None:
        """Force ``fds`` (the journal, the slots) and the layers' files or the folder's names to the storage device
        (`statekv.core.disk.forcing.force`); an `OutputError` when the device fails it, and from then on."""
        names = {self._journal: JOURNAL, **{fd: f"carry.{i}.bin" for i, fd in enumerate(self._slots)}}
        force(self, {fd: names[fd] for fd in fds}, layers=layers, folder=folder)

    @property
    def journal_bytes(self) -> int:
        """The journal's length."""
        return os.fstat(self._journal).st_size

    def truncate_journal(self, end: int) -> None:
        """Drop what the journal holds after byte ``end`` (resuming after the last checkpoint)."""
        os.ftruncate(self._journal, end)

    @property
    def nothing_resumable(self) -> bool:
        """Whether this tier made its folder and journaled nothing a resume starts from (`close` removes it)."""
        return self.made and not self.durable

    def close(self, *, keep_lock: bool = False, checkpoint: bool = True) -> FolderLock | None:
        """Close the files and give the lock back; the files stay, for the next owner, unless this tier made them
        and never journaled anything resumable (then the folder is removed). ``keep_lock``: the lock is not given
        back but returned, for the next tier in the folder (a handover, `statekv.core.disk.successor`);
        ``checkpoint``: False closes without checkpointing the last step (files about to be replaced or removed).
        The tier is closed for good either way (closing it again does nothing)."""
        if self.lock is None:
            return None
        if self.nothing_resumable:
            self._close_files()
            self.lock.release()
            self.lock = None
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        refused = None
        if self._journal >= 0 and checkpoint:
            try:
                self.checkpoint()  # a closed stream resumes with nothing lost, even after a power loss
                self._force(self._journal)  # the records its close appended after the checkpoint
                give_back(self)
            except OutputError as error:
                if keep_lock and not self.lost:
                    raise
                # a folder moved away is not written to, even on close; a full disk still closes: the folder
                # resumes from its last checkpoint, as after a kill, and a lock kept would refuse that resume
                refused = None if self.lost else error
        self._close_files()
        lock, self.lock = self.lock, None
        if keep_lock:
            return lock
        lock.release()  # the files stay, for the next owner
        if refused is not None:
            raise OutputError(f"{refused}; the stream is closed and {self.folder} resumes from its last checkpoint "
                              "(Stream.load), without the frames after it") from None
        return None

    def discard(self) -> None:
        """Close the files, give the lock back and remove the folder (a file set nothing resumes: a successor's
        before its handover), unless its path no longer names the folder this tier locked. Nothing is written."""
        if self.lock is None:
            return
        self._close_files()
        lock, self.lock = self.lock, None
        if not self.lost and lock.owns():
            shutil.rmtree(self.folder, ignore_errors=True)
        lock.release()

    @property
    def owned(self) -> bool:
        """Whether this tier is open and its folder's path still names the folder it locked."""
        return self.lock is not None and not self.lost and self.lock.owns()

    def _close_files(self) -> None:
        close_all(self._files)
        self._journal, self._slots = -1, []
        self.storages, self.remembered = [], None  # a closed stream still referenced holds none of its cache
        for layer in range(len(self.buffers)):
            for _, buffer in self.layer_files(layer):
                buffer.close()


def remove_unclosed(folder: Path, lock: FolderLock) -> None:
    """Remove the file set of an encoding collected (or left at exit) without being closed, while its lock still
    holds that folder: its own files, which nothing resumes."""
    if lock.held and lock.owns():
        shutil.rmtree(folder, ignore_errors=True)
    lock.release()


def _held_starts(held: list[tuple[int, int]], lengths: Any):
    """``(step, its first token)`` for every step of the runs ``held`` (``[start, end)``, ascending), given every
    step's length (`StepValues`): a run's first token summed from the runs of lengths, not step by step."""
    for first, end in held:
        start = lengths.total(0, first)
        for step in range(first, end):
            yield step, start
            start += lengths[step]
