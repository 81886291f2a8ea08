"""The disk tier of the detailed cache: one stream's keys and values in an append-only, memory-mapped file set.

A stream streamed with ``offload="disk"`` owns a folder (`DiskTier`) holding, per layer, its keys and values
(``layer{i}.detailed.0.bin``, ``layer{i}.detailed.1.bin``; quantized: its codes and scales), its step summaries
(``layer{i}.step_means.0.bin``, ``layer{i}.step_samples.0.bin``) and its segment index
(``layer{i}.segment_index.0.bin``), each a `MappedTokenBuffer`: rows of ``[B, H_kv, X]`` in token (step, segment)
order, so the files only grow and nothing written is rewritten. The layer's storage is the usual offloaded (or
quantized) one over these buffers (the storages' ``make_buffer`` factory): a step stages its chunk on the model's
device and its data is appended when it commits. Only the segment index (one row per `SEGMENT_STEPS` steps, what
retrieval ranks segments by) is also kept in RAM (`MirroredTokenBuffer`); the step summaries are read from the
files, for the steps a question scores. Reads map the files afresh each time, so what a question reads is
resident only while the question holds it.

Durability: after each step a line is appended to ``journal`` (its CRC-32, then JSON: the step's length, the
CRC-32 of every byte it appended, the files' lengths, and what the layers above record, e.g. the stream's layout
state). The carried state of every layer (positions, keys and values in the model's dtype, and under bounded
positions each key's placement) and the open segment's accumulators are checkpointed to ``carry.{n % 2}.bin``
(two slots written in turn, so the last checkpoint's slot is intact whatever a kill interrupts), vouched for by
a ``carry`` line: at the first step, every `CHECKPOINT_STEPS` steps after it, and whenever the stream is saved,
synced or closed. Data is written before the line that vouches for it. The contract: a process killed at any
point leaves a file set that resumes (`read_file_set`, `resume`) exactly at its last checkpoint, so a kill loses
at most the frames of the last ``CHECKPOINT_STEPS - 1`` steps (those after the checkpoint, counted as lost); a
stream saved, synced or closed loses nothing. Written data reaches the kernel at once; `DiskTier.sync` forces it
to the device. A step no longer writes the whole carried state (every layer's budget of keys and values): that is
paid once per checkpoint.

One owner: a `DiskTier` holds the exclusive lock of its folder (``lock``, `statekv.locks`) from the moment it is
made or opened until it is closed, so a second opener is refused with one line naming the holder. Every
descriptive file of the set (``manifest.json``, each layer file's ``.json``, the stream's ``stream.json``) records
the SHA-256 of its own fields (``checksum``), checked whenever it is read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import math
import os
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, OutputError
from ..locks import FileLock
from . import persistence
from .buffers import TokenBuffer
from .storage import OffloadedStorage

FORMAT = "statekv-disk-cache"
FORMAT_VERSION = 2  # 1: the carried state journaled with every step, summaries mirrored in RAM
MANIFEST = "manifest.json"
JOURNAL = "journal"
CHECKPOINT_STEPS = 64  # steps between two checkpoints of the carried state (read when a tier is made)
LOCK = "lock"  # held by the one stream living in the file set
CHECKSUM = "checksum"  # the field of a description holding the SHA-256 of the others
_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class MappedTokenBuffer:
    """`TokenBuffer`'s interface over files: ``parts`` files ``{prefix}.{p}.bin`` of rows ``[B, H_kv, X]``.

    ``tensors`` maps the files (copy-on-write, so nothing written through a view reaches them) as
    ``[B, H_kv, capacity, X]`` views; writes append rows with ``pwrite``. ``nbytes`` counts the committed
    rows. The capacity grows geometrically by extending the files (sparse until written).
    """

    GROWTH = 2.0
    MIN_CAPACITY = 64

    def __init__(self, parts: int, capacity_hint: int | None, prefix: Path,
                 on_replace: Callable[[], None] | None = None):
        self.parts, self.capacity_hint, self.on_replace = parts, capacity_hint, on_replace
        self.device = torch.device("cpu")
        self.paths = [Path(f"{prefix}.{part}.bin") for part in range(parts)]
        self.prefix = Path(prefix)
        self.length = 0
        self.row: tuple[int, int, int] | None = None  # (B, H_kv, X)
        self.dtype: torch.dtype | None = None
        self._capacity = 0
        self._fds: list[int] = []
        self.crc = 0  # CRC-32 of the bytes written since the owner last reset it
        self.adopted = False  # opened over rows already there (see load)

    # -- TokenBuffer's interface ----------------------------------------------------------------------------
    @property
    def tensors(self) -> list[torch.Tensor] | None:
        if self.row is None or not self._capacity:
            return None
        b, h, x = self.row
        return [torch.from_file(str(path), shared=False, size=self._capacity * b * h * x, dtype=self.dtype)
                .view(self._capacity, b, h, x).permute(1, 2, 0, 3) for path in self.paths]

    @property
    def keys(self) -> torch.Tensor | None:
        tensors = self.tensors
        return None if tensors is None else tensors[0]

    @property
    def values(self) -> torch.Tensor | None:
        tensors = self.tensors
        return None if tensors is None else tensors[1]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row in one part."""
        return 0 if self.row is None else math.prod(self.row) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.length * self.row_bytes * self.parts

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        if self.row is None:
            self.open(tuple(like.shape[:2]) + (like.shape[3],), like.dtype)
        if needed <= self._capacity:
            return False
        self._grow(max(needed, expected, math.ceil(self._capacity * self.GROWTH), self.MIN_CAPACITY))
        if self.on_replace is not None:
            self.on_replace()
        return True

    def write(self, start: int, *parts: torch.Tensor) -> None:
        """Append ``[B, H_kv, T, X]`` tensors (from any device) as rows ``[start, start + T)``."""
        self.reserve(parts[0], start + parts[0].shape[2])
        for fd, part in zip(self._fds, parts):
            rows = part.detach().to("cpu").permute(2, 0, 1, 3).contiguous().reshape(-1).view(torch.uint8).numpy()
            data = memoryview(rows)
            self.crc = zlib.crc32(data, self.crc)
            _pwrite_all(fd, data, start * self.row_bytes)

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        raise NotImplementedError("a disk-tier buffer is written by appending (write), never on the device")

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, :, start:end] for t in self.tensors)

    def load(self, *parts: torch.Tensor) -> None:
        """Replace the contents with ``parts`` ``[B, H_kv, length, X]`` (the files are rewritten from empty),
        except just after `open` adopted that many rows already there (resuming: ``parts`` are their views)."""
        if self.adopted and parts[0].shape[2] == self.length:
            self.adopted = False
            return
        if self.row is not None:
            for fd in self._fds:
                os.ftruncate(fd, 0)
            self._capacity = 0
        self.length = 0
        self.crc = 0
        if parts[0].shape[2]:
            self.write(0, *parts)
            self.length = parts[0].shape[2]

    def synchronize(self) -> None:
        """Writes are synchronous (``pwrite``): nothing to wait for."""

    # -- the disk's own ---------------------------------------------------------------------------------------
    def open(self, row: tuple[int, int, int], dtype: torch.dtype, length: int = 0) -> None:
        """Open (creating if needed) the files for rows ``row`` of ``dtype``; ``length`` rows already there are
        committed (resuming)."""
        self.row, self.dtype, self.length, self.adopted = tuple(int(n) for n in row), dtype, length, length > 0
        try:
            if not length:  # what a resumed stream reopens the files as
                _write_json(Path(f"{self.paths[0]}.json"), {"row": list(self.row),
                                                            "dtype": str(dtype).removeprefix("torch.")})
            self._fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o644) for path in self.paths]
        except OSError as error:
            raise OutputError(f"cannot write the disk cache in {self.paths[0].parent}: "
                              f"{error.strerror or error}") from None
        sizes = [os.fstat(fd).st_size for fd in self._fds]
        self._capacity = min(sizes) // self.row_bytes if self.row_bytes else 0
        if self._capacity < length:
            raise InputError(f"{self.paths[0]}: holds {self._capacity} rows, fewer than the {length} its journal "
                             "lists")

    def _grow(self, capacity: int) -> None:
        try:
            for fd in self._fds:
                os.ftruncate(fd, capacity * self.row_bytes)
        except OSError as error:
            raise OutputError(f"cannot grow the disk cache in {self.paths[0].parent}: "
                              f"{error.strerror or error}") from None
        self._capacity = capacity

    def read_rows(self, start: int, end: int) -> list[bytes]:
        """The raw bytes of rows ``[start, end)`` of each part (for verifying checksums)."""
        return [os.pread(fd, (end - start) * self.row_bytes, start * self.row_bytes) for fd in self._fds]

    def release(self, start: int, end: int) -> None:
        """Give rows ``[start, end)`` back to the file system (they then read as zeros)."""
        size = (end - start) * self.row_bytes
        for fd in self._fds:
            if _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, ctypes.c_long(start * self.row_bytes),
                               ctypes.c_long(size)) != 0:
                _pwrite_all(fd, memoryview(bytes(size)), start * self.row_bytes)  # no hole punching: zeros

    def sync(self) -> None:
        for fd in self._fds:
            os.fsync(fd)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``; an `OutputError` naming the reason (a full disk...) when it cannot be."""
    try:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
    except OSError as error:
        raise OutputError(f"cannot write the disk cache: {error.strerror or error}") from None


class MirroredTokenBuffer(TokenBuffer):
    """A `TokenBuffer` in RAM (what is read) whose writes are also appended to a `MappedTokenBuffer` (what a
    resumed stream reads back): the step summaries."""

    def __init__(self, parts: int, prefix: Path, on_replace: Callable[[], None] | None = None):
        self.mirror = MappedTokenBuffer(parts, None, prefix)
        self._ram_only = False  # while loading: the file has the rows already
        super().__init__(parts, None, "cpu", on_replace=on_replace)

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value
        if not self._ram_only:
            self.mirror.length = value

    def write(self, start: int, *parts: torch.Tensor) -> None:
        super().write(start, *parts)
        if not self._ram_only:
            self.mirror.write(start, *parts)

    def load(self, *parts: torch.Tensor) -> None:
        self.mirror.load(*parts)
        self._ram_only = True
        try:
            super().load(*(part.clone() for part in parts))
        finally:
            self._ram_only = False

    @property
    def crc(self) -> int:
        return self.mirror.crc

    @crc.setter
    def crc(self, value: int) -> None:
        self.mirror.crc = value


PER_STEP = ("step_means", "step_samples", "key_scales")  # buffers holding a row per step, not per token
PER_SEGMENT = ("segment_index",)  # a row per segment of steps (written by the step that completes it)
MIRRORED = ("segment_index",)  # kept in RAM too (what retrieval ranks segments by)


@dataclass
class Journaled:
    """What a file set's journal says, up to its last checkpoint: the ``steps`` resumed (one record each, in order,
    the last one checkpointed), the ``carry`` record of that checkpoint, the ``evicted`` steps among them, and the
    records written after the checkpoint that are not steps (e.g. frames pushed but not streamed durably)."""

    manifest: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)
    end: int = 0  # byte offset of the journal just after the checkpoint's record
    carry: dict[str, Any] | None = None
    later_evictions: list[int] = field(default_factory=list)  # evicted after the checkpoint (their rows are gone)


class DiskTier:
    """One stream's file set in ``folder`` (see the module docstring): the layers' buffers, the journal, the
    carried-state checkpoints.

    Create a new one with `create`; `open` adopts an existing one (resuming, after `read_file_set`).
    ``checkpoint_steps``: steps between two checkpoints of the carried state (`CHECKPOINT_STEPS`).
    """

    def __init__(self, folder: Path, manifest: dict[str, Any], lock: FileLock | None = None, *,
                 holder: str = "a stream"):
        """lock: the folder's lock, already held (`hold`); None: taken now for ``holder`` (who is named to a
        second opener)."""
        self.lock = lock if lock is not None else hold(folder, holder)
        self.folder, self.manifest = folder, manifest
        self.storages: list[OffloadedStorage] = []
        self.buffers: list[dict[str, MappedTokenBuffer | MirroredTokenBuffer]] = []  # per layer, by name
        self.extra: dict[str, Any] = {}  # more manifest fields, e.g. from the stream (written as ``stream.json``)
        self._journal = os.open(folder / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._slots: list[int] = []
        self.checkpoint_steps = CHECKPOINT_STEPS
        self.checkpoints = 0  # written so far (the next goes to slot checkpoints % 2)
        self.checkpointed: int | None = None  # the step of the last checkpoint
        self.last_step: int | None = None  # the last step journaled
        self._layers: list[Any] = []  # the cache's layers (what a checkpoint writes)
        self.growth = 0  # bytes the journal grew by over the last step (what the next will add, about)
        self.remembered: list[tuple[torch.Tensor | None, ...]] | None = None  # see `remember`
        self._size_before = 0

    @classmethod
    def create(cls, offload_dir: str | os.PathLike, name: str, manifest: dict[str, Any]) -> "DiskTier":
        """A new, empty file set in a folder of its own under ``offload_dir`` (created if needed)."""
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(str(name)).name)[:40] or "stream"
        folder = Path(offload_dir) / f"{safe}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True)
        except OSError as error:
            raise OutputError(f"cannot create the disk cache in {offload_dir}: {error.strerror or error}") from None
        lock = hold(folder, f"stream {str(name)[:80]!r}")
        try:
            _write_json(folder / MANIFEST, {"format": FORMAT, "version": FORMAT_VERSION, **manifest})
        except OSError as error:
            lock.release()
            raise OutputError(f"cannot create the disk cache in {offload_dir}: {error.strerror or error}") from None
        return cls(folder, manifest, lock)

    def storage(self, index: int, capacity_hint: int | None, on_replace: Callable[[], None],
                kv_cache_dtype: str | None = None) -> OffloadedStorage:
        """The storage of layer ``index`` (the cache's storage factory): the usual offloaded or quantized storage
        over this tier's buffers (the segment index mirrored in RAM, everything else only in the files)."""
        from .quantized import QuantizedStorage

        buffers: dict[str, MappedTokenBuffer | MirroredTokenBuffer] = {}
        self.buffers.append(buffers)

        def make_buffer(name: str, parts: int, hint: int | None):
            prefix = self.folder / f"layer{index}.{name}"
            buffers[name] = (MirroredTokenBuffer(parts, prefix, on_replace) if name in MIRRORED
                             else MappedTokenBuffer(parts, hint, prefix, on_replace))
            return buffers[name]

        storage = (QuantizedStorage(kv_cache_dtype, capacity_hint, "cpu", on_replace, make_buffer) if kv_cache_dtype
                   else OffloadedStorage(capacity_hint, "cpu", on_replace, make_buffer))
        self.storages.append(storage)
        return storage

    def _mapped(self, layer: int) -> list[tuple[str, MappedTokenBuffer]]:
        """Layer ``layer``'s files, by name in a fixed order."""
        return sorted((name, getattr(buffer, "mirror", buffer)) for name, buffer in self.buffers[layer].items())

    def describe(self, name: str, fields: dict[str, Any]) -> None:
        """Write ``{name}.json`` beside the manifest (e.g. the stream's setup), replacing it atomically; an
        `OutputError` when it cannot be written."""
        try:
            _write_json(self.folder / f"{name}.json", fields)
        except OSError as error:
            raise OutputError(f"cannot describe the disk cache in {self.folder}: {error.strerror or error}") from None

    def append(self, record: dict[str, Any]) -> None:
        """Append one journal record (a JSON object) after its CRC-32: whole, or (an `OutputError`, e.g. a full
        disk) not at all."""
        text = json.dumps(record, separators=(",", ":"), allow_nan=False)
        data = memoryview(f"{zlib.crc32(text.encode()):08x} {text}\n".encode())
        end = os.fstat(self._journal).st_size
        try:
            while len(data):
                data = data[os.write(self._journal, data):]
        except OSError as error:
            try:
                os.ftruncate(self._journal, end)  # no torn line for the next record to follow
            except OSError:
                pass
            raise OutputError(f"cannot write the disk cache in {self.folder}: {error.strerror or error}") from None

    def commit_step(self, step: int, tokens: int, layers: list[Any], extra: dict[str, Any]) -> None:
        """Journal step ``step`` (``tokens`` long), once its data is appended: the CRC of what it appended and the
        files' lengths; then, at the first step and every ``checkpoint_steps`` steps, the carried state of every
        layer (``layers``: the cache's) as a checkpoint. Whole or (an `OutputError`) not at all: the journal is
        then as before the step, and `remembered` still holds the carried state the step before left."""
        end, last = os.fstat(self._journal).st_size, self.last_step
        try:
            self._layers, self.last_step = layers, step
            lengths = {name: buffer.length for name, buffer in self._mapped(0)}
            self.append({"step": step, "tokens": tokens, "crc": self._take_crc(), "lengths": lengths, **extra})
            if step == 0 or (step + 1) % self.checkpoint_steps == 0:
                self.checkpoint()
        except OutputError:
            self.last_step = last
            try:
                os.ftruncate(self._journal, end)  # the step's record goes too, with its checkpoint's
            except OSError:
                pass
            raise
        self.remember(layers)
        size = os.fstat(self._journal).st_size
        self.growth, self._size_before = size - self._size_before, size

    def remember(self, layers: list[Any]) -> None:
        """Keep a copy of the carried state the last step journaled left (`remembered`: per layer what a
        checkpoint writes), so a step the disk cannot take is undone exactly without a checkpoint per step."""
        self.remembered = [tuple(None if t is None else t.clone() for t in _carried_parts(layer)) for layer in layers]

    def adopt(self, layers: list[Any], last_step: int) -> None:
        """The cache's ``layers`` as resumed or restored at ``last_step`` (what the next step and checkpoint
        follow)."""
        self._layers, self.last_step = layers, last_step
        self.remember(layers)

    def checkpoint(self) -> None:
        """Write the carried state after the last step journaled (per layer: positions ``[B, H_kv, K]``, keys and
        values ``[B, H_kv, K, D]``, under bounded positions the placements ``[2, B, H_kv, K]``, and the open
        segment's accumulators ``[B, H_kv, 1, 3 D]``) into the next slot, then the ``carry`` record vouching for
        it. Nothing to do if that step is checkpointed already."""
        if self.last_step is None or self.checkpointed == self.last_step:
            return
        carried = [_carried_parts(layer) for layer in self._layers]
        data = b"".join(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                        for parts in carried for t in parts if t is not None)
        slot = self.checkpoints % 2
        if not self._slots:  # kept open and overwritten in place (a record names the bytes it vouches for)
            try:
                self._slots = [os.open(self.folder / f"carry.{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644) for i in (0, 1)]
            except OSError as error:
                raise OutputError(f"cannot write the disk cache in {self.folder}: {error.strerror or error}") from None
        _pwrite_all(self._slots[slot], memoryview(data), 0)
        self.append({"carry": self.last_step, "slot": slot, "carried": [list(parts[1].shape) for parts in carried],
                     "placed": carried[0][3] is not None if carried else False,
                     "segment": list(carried[0][-1].shape) if carried and carried[0][-1] is not None else None,
                     "carry_crc": zlib.crc32(data),
                     "carried_dtype": str(carried[0][1].dtype).removeprefix("torch.") if carried else "float32"})
        self.checkpoints += 1
        self.checkpointed = self.last_step

    def journal_loaded(self, cache: Any, step_frames: list[int], extra: dict[str, Any],
                       placements: list[list[int]] | None = None) -> None:
        """Journal every step of a state just loaded into this tier (a saved stream resumed on disk), so the
        file set can itself be resumed: ``step_frames`` the frames of each step, ``extra`` what the last step's
        record adds (see `commit_step`), ``placements`` each step's bounded positions ``[first, span, base]``."""
        os.ftruncate(self._journal, 0)
        if cache.evicted_steps:
            self.append({"evict": sorted(cache.evicted_steps)})
        start = 0
        per_segment = cache.layers[0].storage.segment_steps if cache.layers else 1
        for step, length in enumerate(cache.chunk_lengths):
            for layer in range(len(self.buffers)):
                for name, buffer in self._mapped(layer):
                    rows = _rows_of(name, step, start, length, per_segment)
                    buffer.crc = _rows_crc(buffer, *rows) if rows else 0
            record = {"frames": step_frames[step]}
            if placements is not None:
                record["placed"] = placements[step]
            self._layers, self.last_step = cache.layers, step
            lengths = {name: buffer.length for name, buffer in self._mapped(0)}
            if step == len(cache.chunk_lengths) - 1:
                record.update(extra)
            self.append({"step": step, "tokens": length, "crc": self._take_crc(), "lengths": lengths, **record})
            start += length
        self.checkpoint()
        self.remember(cache.layers)

    def _take_crc(self) -> int:
        """CRC-32 of what every file was appended since the last call (layer by layer, files by name)."""
        crc = 0
        for layer in range(len(self.buffers)):
            for _, buffer in self._mapped(layer):
                crc = zlib.crc32(buffer.crc.to_bytes(4, "little"), crc)
                buffer.crc = 0
        return crc

    @property
    def nbytes(self) -> int:
        """Bytes of the journal and the checkpoint slots (what the file set holds beside the layers' files)."""
        total = os.fstat(self._journal).st_size if self._journal >= 0 else 0
        return total + sum(os.fstat(fd).st_size for fd in self._slots)

    def sync(self) -> None:
        """Checkpoint the carried state (if the last step is not yet) and force everything written so far to the
        storage device: a kill after this loses nothing (an `OutputError` when the device fails it)."""
        self.checkpoint()
        try:
            for layer in range(len(self.buffers)):
                for _, buffer in self._mapped(layer):
                    buffer.sync()
            for fd in (*self._slots, self._journal):
                os.fsync(fd)
        except OSError as error:
            raise OutputError(f"cannot write the disk cache in {self.folder}: {error.strerror or error}") from None

    def truncate_journal(self, end: int) -> None:
        """Drop what the journal holds after byte ``end`` (resuming after the last checkpoint)."""
        os.ftruncate(self._journal, end)

    def close(self) -> None:
        if self._journal >= 0:
            self.checkpoint()  # a closed stream resumes with nothing lost
            os.close(self._journal)
            self._journal = -1
        for fd in self._slots:
            os.close(fd)
        self._slots = []
        for layer in range(len(self.buffers)):
            for _, buffer in self._mapped(layer):
                buffer.close()
        self.lock.release()  # the files stay, for the next owner


def _carried_parts(layer: Any) -> tuple[torch.Tensor | None, ...]:
    """What a checkpoint writes of a layer: its carried positions, keys, values, placements (None unless bounded)
    and open segment (None before the first step)."""
    placements = layer.slots.head_placements() if layer.slots is not None else None
    return (layer.positions(), *layer.carried(), placements, layer.storage.saved_segment())


def _rows_of(name: str, step: int, start: int, length: int, per_segment: int) -> tuple[int, int] | None:
    """The rows of buffer ``name`` that step ``step`` (tokens ``[start, start + length)``) appended (None: none)."""
    if name in PER_STEP:
        return step, step + 1
    if name in PER_SEGMENT:
        return (step // per_segment, step // per_segment + 1) if (step + 1) % per_segment == 0 else None
    return start, start + length


def _rows_crc(buffer: MappedTokenBuffer, start: int, end: int) -> int:
    crc = 0
    for part in buffer.read_rows(start, end):
        crc = zlib.crc32(part, crc)
    return crc


# -- one owner, and descriptions that vouch for themselves -----------------------------------------------------
def hold(folder: Path, holder: str) -> FileLock:
    """The exclusive lock of the file set in ``folder`` for ``holder``; a one-line `InputError` naming whoever
    holds it already."""
    return FileLock.acquire(Path(folder) / LOCK, what=f"the disk cache {folder}", holder=holder,
                            error=InputError)


def _fields_sha256(fields: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in fields.items() if k != CHECKSUM}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _write_json(path: Path, fields: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps({**fields, CHECKSUM: _fields_sha256(fields)}, allow_nan=False))
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_checked(path: Path) -> dict[str, Any]:
    """The fields of a description written by this module (its ``checksum`` removed); a one-line `InputError`
    naming the file when it is unreadable, not a JSON object, or its checksum does not match."""
    try:
        described = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} cannot be read") from None
    if not isinstance(described, dict):
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} is not a JSON object")
    recorded = described.pop(CHECKSUM, None)
    if recorded is None:
        raise InputError(f"{path.parent}: {path.name} records no checksum (made by an earlier statekv, or edited); "
                         "it cannot be verified")
    if recorded != _fields_sha256(described):
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} does not match its checksum")
    return described


def read_description(folder: Path, file: str, form: str, version: int, what: str) -> dict[str, Any]:
    """The JSON object ``folder/file`` if it declares ``form`` at ``version`` and matches its checksum; a one-line
    `InputError` naming ``what`` it is not otherwise."""
    try:
        described = json.loads((folder / file).read_text())
    except (OSError, ValueError, RecursionError):
        raise InputError(f"{folder}: not a {what} (no readable {file})") from None
    if not isinstance(described, dict) or described.get("format") != form:
        raise InputError(f"{folder}: not a {what}")
    if described.get("version") != version:
        raise InputError(f"{folder}: {what} format {described.get('version')!r}; this statekv reads {version}")
    return read_checked(folder / file)


def read_file_set(folder: str | os.PathLike, *, latest: bool = False) -> Journaled:
    """The manifest and journal of the file set in ``folder``, up to its last checkpoint; a one-line `InputError`
    if it is not one, if a record before the last is damaged (a torn last line, what a kill leaves, is dropped), or
    if no checkpoint was written yet. ``latest``: up to its last step instead (the live stream restoring itself,
    which holds that step's carried state; see `resume`)."""
    folder = Path(folder)
    manifest = read_description(folder, MANIFEST, FORMAT, FORMAT_VERSION, "statekv disk cache")
    try:
        data = (folder / JOURNAL).read_bytes()
    except OSError:
        raise InputError(f"{folder}: the disk cache has no journal") from None
    steps, records, offset = [], [], 0  # records: (end offset, record) of everything but steps
    lines = data.split(b"\n")
    for number, line in enumerate(lines):
        last = number == len(lines) - 1  # no newline after it: torn by a kill, or empty
        record = None if last else _record(line)
        if record is None:
            if last or all(not rest for rest in lines[number + 1:]):
                break
            raise InputError(f"{folder}: the disk cache's journal is damaged at line {number + 1}")
        offset += len(line) + 1
        if "step" in record:
            if record["step"] != len(steps):
                raise InputError(f"{folder}: the disk cache's journal is damaged: step {record['step']} after "
                                 f"{len(steps)} steps")
            steps.append(record)
        records.append((offset, record))
    journal = Journaled(manifest)
    if latest:
        journal.steps = steps
        for record in (record for _, record in records if "evict" in record):
            journal.evicted.extend(int(s) for s in record["evict"] if int(s) < len(steps))
        return journal
    checkpoint = next((i for i in range(len(records) - 1, -1, -1) if "carry" in records[i][1]
                       and isinstance(records[i][1]["carry"], int) and records[i][1]["carry"] < len(steps)), None)
    if checkpoint is None:
        return journal if not steps else _no_checkpoint(folder)
    journal.end, journal.carry = records[checkpoint]
    journal.steps = steps[: journal.carry["carry"] + 1]
    for index, (_, record) in enumerate(records):
        if "evict" in record:
            evicted = [int(s) for s in record["evict"] if int(s) < len(journal.steps)]
            (journal.evicted if index < checkpoint else journal.later_evictions).extend(evicted)
        elif index > checkpoint and "step" not in record and "carry" not in record:
            journal.after.append(record)
    return journal


def _no_checkpoint(folder: Path) -> Journaled:
    raise InputError(f"{folder}: the disk cache holds no checkpoint of its carried state yet; there is nothing to "
                     "resume")


def _record(line: bytes) -> dict[str, Any] | None:
    crc, _, text = line.partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(text):
            return None
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def resume(tier: DiskTier, journal: Journaled, cache: Any, device: torch.device, *, verify: bool = True,
           carried: list[tuple[torch.Tensor | None, ...]] | None = None) -> None:
    """Resume ``cache`` (a `TwoStateCache` whose layers' storages ``tier`` made) at the journal's last checkpoint:
    every step's CRC up to it is checked first (evicted steps excepted; ``verify=False``: not, for a stream
    restoring the files it has just written) and the checkpoint's carried state; a one-line `InputError` names the
    first damage. Nothing is rewritten: the files are adopted as they are (rows after the checkpoint's lengths are
    written over as the stream goes on). The journal is then cut after the checkpoint
    (`DiskTier.truncate_journal`), keeping the evictions recorded since.

    ``carried``: a stream restoring itself after a step its disk could not take (``journal`` read with
    ``latest=True``) passes the carried state its last journaled step left (`DiskTier.remembered`): the journal
    is then kept as it is and no checkpoint is read."""
    where, steps = tier.folder, journal.steps
    last = steps[-1]
    lengths = [int(record["tokens"]) for record in steps]
    sizes = last.get("lengths")
    if not isinstance(sizes, dict) or len(tier.buffers) != len(cache.layers):
        raise InputError(f"{where}: the disk cache's journal is damaged: its last step lacks its files' lengths")
    for layer in range(len(tier.buffers)):
        for name, buffer in tier.buffers[layer].items():
            mapped = getattr(buffer, "mirror", buffer)
            described = Path(f"{mapped.paths[0]}.json")
            if not described.exists() and not int(sizes.get(name, 0) or 0):
                continue  # never written (the segment index before its first segment)
            shape = read_checked(described)
            try:
                mapped.close()  # reopened as the journal says (also in place, after a step it could not write)
                mapped.open(tuple(shape["row"]), getattr(torch, shape["dtype"]), int(sizes[name]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise InputError(f"{where}: the disk cache is damaged: {mapped.paths[0].name} cannot be "
                                 "reopened") from None
    evicted = set(journal.evicted) | set(journal.later_evictions)
    per_segment = cache.layers[0].storage.segment_steps
    start = 0
    for record, length in zip(steps, lengths):
        if verify and record["step"] not in evicted:
            crc = 0
            for layer in range(len(tier.buffers)):
                for name, buffer in tier._mapped(layer):
                    rows = _rows_of(name, record["step"], start, length, per_segment)
                    crc = zlib.crc32((_rows_crc(buffer, *rows) if rows else 0).to_bytes(4, "little"), crc)
            if crc != record["crc"]:
                raise InputError(f"{where}: the disk cache is damaged: step {record['step']}'s data does not match "
                                 "its checksum")
        start += length
    restoring = carried is not None
    if not restoring:
        carried = _carried_slot(where, journal.carry, len(cache.layers), start)
    cache.positions.load(_placements(where, cache.positions, steps), len(steps))
    for index, (layer, (positions, keys, values, placements, segment)) in enumerate(zip(cache.layers, carried)):
        tensors = {"carried_positions": positions, "carried_keys": keys, "carried_values": values}
        if placements is not None:
            tensors["carried_placements"] = placements
        for name, buffer in tier.buffers[index].items():
            mapped = getattr(buffer, "mirror", buffer)
            views = mapped.view(0, mapped.length) if mapped.length or mapped.tensors is not None else None
            if name == "detailed":
                tensors.update(keys=views[0], values=views[1])
            elif name == "segment_index":
                if segment is not None:
                    tensors.update(segment_index=views[0] if views else segment[:, :, :0], segment_partial=segment)
            elif views is not None:
                tensors["block_keys" if name == "step_means" else name] = views[0]
        persistence.restore_layer(layer, tensors, None, lengths, device)
    cache.shared_ring.reset()
    cache.chunk_lengths = list(lengths)
    cache.seen_tokens = sum(lengths)
    cache.evicted_steps = evicted
    cache.seen_device = None
    cache.settle_placement()
    cache.buffers_replaced()
    tier.adopt(cache.layers, len(steps) - 1)
    if restoring:
        return
    tier.checkpointed = len(steps) - 1
    tier.checkpoints = int(journal.carry["slot"]) + 1
    tier.truncate_journal(journal.end)
    if journal.later_evictions:  # their rows are punched: they stay evicted
        tier.append({"evict": sorted(set(journal.later_evictions))})


def _placements(where: Path, positions: Any, steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What `StreamPositions.load` takes, from the steps' records (each ``placed``: ``[first, span, base]``)."""
    if not positions.bounded:
        return None
    placed = [record.get("placed") for record in steps]
    if not all(isinstance(p, list) for p in placed):
        raise InputError(f"{where}: the disk cache's journal lacks the bounded positions of its steps")
    return {"mode": "bounded", "layout": positions.layout.name, "limit": positions.limit, "steps": placed}


def _carried_slot(where: Path, carry: dict[str, Any], layers: int,
                  tokens: int) -> list[tuple[torch.Tensor | None, ...]]:
    """The carried state the checkpoint ``carry`` wrote: per layer, positions ``[B, H_kv, K]``, keys, values,
    placements (or None) and the open segment (or None)."""
    dtype = getattr(torch, str(carry.get("carried_dtype")), None)
    shapes, placed, segment = carry.get("carried"), bool(carry.get("placed")), carry.get("segment")
    if (not isinstance(dtype, torch.dtype) or not isinstance(shapes, list) or len(shapes) != layers
            or not all(isinstance(shape, list) and len(shape) == 4 for shape in shapes)):
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    layout = []
    for shape in shapes:
        parts = [(torch.int64, shape[:3]), (dtype, shape), (dtype, shape)]
        parts.append((torch.int64, [2, *shape[:3]]) if placed else None)
        parts.append((dtype, segment) if isinstance(segment, list) else None)
        layout.append(parts)
    size = sum(math.prod(s) * kind.itemsize for parts in layout for part in parts if part for kind, s in [part])
    try:
        data = (where / f"carry.{carry['slot']}.bin").read_bytes()[:size]
    except (OSError, TypeError):
        data = b""
    if zlib.crc32(data) != carry.get("carry_crc"):
        raise InputError(f"{where}: the disk cache is damaged: the carried state of step {carry['carry']} does not "
                         "match its checksum")
    buffer, offset, carried = bytearray(data), 0, []
    for parts in layout:
        tensors = []
        for part in parts:
            if part is None:
                tensors.append(None)
                continue
            kind, shape = part
            count = math.prod(shape)
            tensors.append(torch.frombuffer(buffer, dtype=kind, count=count, offset=offset).clone().view(*shape))
            offset += count * kind.itemsize
        carried.append(tuple(tensors))
        positions = tensors[0]
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= tokens):
            raise InputError(f"{where}: the disk cache is damaged: carried positions outside its {tokens} tokens")
    if offset != len(data):
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    return carried


__all__ = ["DiskTier", "Journaled", "MappedTokenBuffer", "MirroredTokenBuffer", "hold", "read_checked", "read_file_set",
           "resume"]
