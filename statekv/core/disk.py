"""The disk tier of the detailed cache: one stream's keys and values in an append-only, memory-mapped file set.

A stream streamed with ``offload="disk"`` owns a folder (`DiskTier`) holding, per layer, its keys and values
(``layer{i}.detailed.0.bin``, ``layer{i}.detailed.1.bin``; quantized: its codes and scales) and its step
summaries (``layer{i}.step_means.0.bin``, ``layer{i}.step_samples.0.bin``), each a `MappedTokenBuffer`: rows of
``[B, H_kv, X]`` in token (or step) order, so the files only grow and nothing written is rewritten. The layer's
storage is the usual offloaded (or quantized) one over these buffers (the storages' ``make_buffer`` factory): a
step stages its chunk on the model's device and its data is appended when it commits. Only the step summaries
(what retrieval scores steps by) are also kept in RAM (`MirroredTokenBuffer`). Reads map the files afresh each
time, so what a question reads is resident only while the question holds it.

Durability: after each step a line is appended to ``journal`` (its CRC-32, then JSON: the step's length, the
CRC-32 of every byte it appended, where its carried positions were written and what the layers above record,
e.g. the stream's layout state). The carried state of every layer (positions, keys and values in the model's
dtype) goes to ``carry.{step % 2}.bin`` (two slots
written in turn, so the last journaled step's slot is intact whatever a kill interrupts). Data is written
before the line that vouches for it: a process killed at any point leaves a file set whose last complete line
names a state that can be resumed (`read_file_set`, `resume`), and anything after it counts as lost. Written data
reaches the kernel at once (a kill loses none of it); `DiskTier.sync` forces it to the device.

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
from ..locks import ExclusiveLock
from . import persistence
from .buffers import TokenBuffer
from .storage import OffloadedStorage

FORMAT = "statekv-disk-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "journal"
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
SUMMARIES = ("step_means", "step_samples")  # kept in RAM too (what retrieval scores from)


@dataclass
class Journaled:
    """What a file set's journal says: the committed ``steps`` (one record each, in order), the ``evicted``
    steps, and the records written after the last step (e.g. frames pushed but not streamed)."""

    manifest: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)
    end: int = 0  # byte offset of the journal just after the last step's record


class DiskTier:
    """One stream's file set in ``folder`` (see the module docstring): the layers' buffers, the journal, the
    carried-state slots.

    Create a new one with `create`; `open` adopts an existing one (resuming, after `read_file_set`).
    """

    def __init__(self, folder: Path, manifest: dict[str, Any], lock: ExclusiveLock | None = None, *,
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
        over this tier's buffers (the summaries mirrored in RAM, everything else only in the files)."""
        from .quantized import QuantizedStorage

        buffers: dict[str, MappedTokenBuffer | MirroredTokenBuffer] = {}
        self.buffers.append(buffers)

        def make_buffer(name: str, parts: int, hint: int | None):
            prefix = self.folder / f"layer{index}.{name}"
            buffers[name] = (MirroredTokenBuffer(parts, prefix, on_replace) if name in SUMMARIES
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
        """Journal step ``step`` (``tokens`` long), once its data is appended: its CRC, then the carried state of
        every layer (``layers``: the cache's; positions ``[B, H_kv, K]``, keys and values ``[B, H_kv, K, D]``)
        in slot ``step % 2``, then the record vouching for both."""
        crc = self._take_crc()
        carried = [(layer.positions(), *layer.carried()) for layer in layers]
        data = b"".join(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                        for parts in carried for t in parts)
        slot = step % 2
        if not self._slots:  # kept open and overwritten in place (a record names the bytes it vouches for)
            try:
                self._slots = [os.open(self.folder / f"carry.{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644) for i in (0, 1)]
            except OSError as error:
                raise OutputError(f"cannot write the disk cache in {self.folder}: {error.strerror or error}") from None
        _pwrite_all(self._slots[slot], memoryview(data), 0)
        lengths = {name: buffer.length for name, buffer in self._mapped(0)}
        self.append({"step": step, "tokens": tokens, "crc": crc, "slot": slot, "lengths": lengths,
                     "carried": [list(parts[1].shape) for parts in carried], "carry_crc": zlib.crc32(data),
                     "carried_dtype": str(carried[0][1].dtype).removeprefix("torch."), **extra})

    def journal_loaded(self, cache: Any, step_frames: list[int], extra: dict[str, Any]) -> None:
        """Journal every step of a state just loaded into this tier (a saved stream resumed on disk), so the
        file set can itself be resumed: ``step_frames`` the frames of each step, ``extra`` what the last step's
        record adds (see `commit_step`)."""
        os.ftruncate(self._journal, 0)
        if cache.evicted_steps:
            self.append({"evict": sorted(cache.evicted_steps)})
        start = 0
        for step, length in enumerate(cache.chunk_lengths):
            for layer in range(len(self.buffers)):
                for name, buffer in self._mapped(layer):
                    buffer.crc = _rows_crc(buffer, *((step, step + 1) if name in PER_STEP else
                                                     (start, start + length)))
            if step == len(cache.chunk_lengths) - 1:
                self.commit_step(step, length, cache.layers, {**extra, "frames": step_frames[step]})
            else:
                self.append({"step": step, "tokens": length, "crc": self._take_crc(), "frames": step_frames[step]})
            start += length

    def _take_crc(self) -> int:
        """CRC-32 of what every file was appended since the last call (layer by layer, files by name)."""
        crc = 0
        for layer in range(len(self.buffers)):
            for _, buffer in self._mapped(layer):
                crc = zlib.crc32(buffer.crc.to_bytes(4, "little"), crc)
                buffer.crc = 0
        return crc

    def sync(self) -> None:
        """Force everything written so far to the storage device (an `OutputError` when the device fails it)."""
        try:
            for layer in range(len(self.buffers)):
                for _, buffer in self._mapped(layer):
                    buffer.sync()
            for fd in (*self._slots, self._journal):
                os.fsync(fd)
        except OSError as error:
            raise OutputError(f"cannot write the disk cache in {self.folder}: {error.strerror or error}") from None

    def truncate_journal(self, end: int) -> None:
        """Drop what the journal holds after byte ``end`` (resuming after the last durable step)."""
        os.ftruncate(self._journal, end)

    def close(self) -> None:
        if self._journal >= 0:
            os.close(self._journal)
            self._journal = -1
        for fd in self._slots:
            os.close(fd)
        self._slots = []
        for layer in range(len(self.buffers)):
            for _, buffer in self._mapped(layer):
                buffer.close()
        self.lock.release()  # the files stay, for the next owner


def _rows_crc(buffer: MappedTokenBuffer, start: int, end: int) -> int:
    crc = 0
    for part in buffer.read_rows(start, end):
        crc = zlib.crc32(part, crc)
    return crc


# -- one owner, and descriptions that vouch for themselves -----------------------------------------------------
def hold(folder: Path, holder: str) -> ExclusiveLock:
    """The exclusive lock of the file set in ``folder`` for ``holder``; a one-line `InputError` naming whoever
    holds it already."""
    return ExclusiveLock.acquire(Path(folder) / LOCK, what=f"the disk cache {folder}", holder=holder,
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


def read_file_set(folder: str | os.PathLike) -> Journaled:
    """The manifest and journal of the file set in ``folder``; a one-line `InputError` if it is not one, or if a
    record before the last is damaged (a torn last line, what a kill leaves, is dropped)."""
    folder = Path(folder)
    manifest = read_description(folder, MANIFEST, FORMAT, FORMAT_VERSION, "statekv disk cache")
    try:
        data = (folder / JOURNAL).read_bytes()
    except OSError:
        raise InputError(f"{folder}: the disk cache has no journal") from None
    journal, offset = Journaled(manifest), 0
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
            if record["step"] != len(journal.steps):
                raise InputError(f"{folder}: the disk cache's journal is damaged: step {record['step']} after "
                                 f"{len(journal.steps)} steps")
            journal.steps.append(record)
            journal.after, journal.end = [], offset
        elif "evict" in record:
            journal.evicted.extend(int(s) for s in record["evict"])
        else:
            journal.after.append(record)
    return journal


def _record(line: bytes) -> dict[str, Any] | None:
    crc, _, text = line.partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(text):
            return None
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def resume(tier: DiskTier, journal: Journaled, cache: Any, device: torch.device, *, verify: bool = True) -> None:
    """Resume ``cache`` (a `TwoStateCache` whose layers' storages ``tier`` made) from the journal's last step:
    every step's CRC is checked first (evicted steps excepted; ``verify=False``: not, for a stream restoring the
    files it has just written) and the last step's carried state; a one-line `InputError` names the first damage.
    Nothing is rewritten: the files are adopted as they are."""
    where, steps = tier.folder, journal.steps
    last = steps[-1]
    lengths = [int(record["tokens"]) for record in steps]
    sizes = last.get("lengths")
    if not isinstance(sizes, dict) or len(tier.buffers) != len(cache.layers):
        raise InputError(f"{where}: the disk cache's journal is damaged: its last step lacks its files' lengths")
    for layer in range(len(tier.buffers)):
        for name, buffer in tier.buffers[layer].items():
            mapped = getattr(buffer, "mirror", buffer)
            shape = read_checked(Path(f"{mapped.paths[0]}.json"))
            try:
                mapped.close()  # reopened as the journal says (also in place, after a step it could not write)
                mapped.open(tuple(shape["row"]), getattr(torch, shape["dtype"]), int(sizes[name]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise InputError(f"{where}: the disk cache is damaged: {mapped.paths[0].name} cannot be "
                                 "reopened") from None
    evicted, start = set(journal.evicted), 0
    for record, length in zip(steps, lengths):
        if verify and record["step"] not in evicted:
            crc = 0
            for layer in range(len(tier.buffers)):
                for name, buffer in tier._mapped(layer):
                    rows = (record["step"], record["step"] + 1) if name in PER_STEP else (start, start + length)
                    crc = zlib.crc32(_rows_crc(buffer, *rows).to_bytes(4, "little"), crc)
            if crc != record["crc"]:
                raise InputError(f"{where}: the disk cache is damaged: step {record['step']}'s data does not match "
                                 "its checksum")
        start += length
    carried = _carried_slot(where, last, len(cache.layers), start)
    for index, (layer, (positions, keys, values)) in enumerate(zip(cache.layers, carried)):
        tensors = {"carried_positions": positions, "carried_keys": keys, "carried_values": values}
        for name, buffer in tier.buffers[index].items():
            mapped = getattr(buffer, "mirror", buffer)
            views = mapped.view(0, mapped.length)
            if name == "detailed":
                tensors.update(keys=views[0], values=views[1])
            else:
                tensors["block_keys" if name == "step_means" else name] = views[0]
        persistence.restore_layer(layer, tensors, None, lengths, device)
    cache.shared_ring.reset()
    cache.chunk_lengths = list(lengths)
    cache.seen_tokens = sum(lengths)
    cache.evicted_steps = set(journal.evicted)
    cache.seen_device = None
    cache.buffers_replaced()


def _carried_slot(where: Path, last: dict[str, Any], layers: int, tokens: int) -> list[tuple[torch.Tensor, ...]]:
    """The carried state the last step wrote: per layer, positions ``[B, H_kv, K]``, keys and values."""
    dtype = getattr(torch, str(last.get("carried_dtype")), None)
    shapes = last.get("carried")
    if not isinstance(dtype, torch.dtype) or not isinstance(shapes, list) or len(shapes) != layers:
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    size = sum(math.prod(shape[:3]) * 8 + 2 * math.prod(shape) * dtype.itemsize for shape in shapes)
    try:
        data = (where / f"carry.{last['slot']}.bin").read_bytes()[:size]
    except (OSError, TypeError):
        data = b""
    if zlib.crc32(data) != last.get("carry_crc"):
        raise InputError(f"{where}: the disk cache is damaged: the carried state of step {last['step']} does not "
                         "match its checksum")
    buffer, offset, carried = bytearray(data), 0, []
    for shape in shapes:
        parts = []
        for kind, size in ((torch.int64, math.prod(shape[:3])), (dtype, math.prod(shape)), (dtype, math.prod(shape))):
            nbytes = size * kind.itemsize
            parts.append(torch.frombuffer(buffer, dtype=kind, count=size, offset=offset).clone())
            offset += nbytes
        carried.append((parts[0].view(*shape[:3]), parts[1].view(*shape), parts[2].view(*shape)))
        positions = carried[-1][0]
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= tokens):
            raise InputError(f"{where}: the disk cache is damaged: carried positions outside its {tokens} tokens")
    if offset != len(data):
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    return carried


__all__ = ["DiskTier", "Journaled", "MappedTokenBuffer", "MirroredTokenBuffer", "hold", "read_checked", "read_file_set",
           "resume"]
