"""The files of a disk tier's layers: token buffers over memory-mapped files (`MappedTokenBuffer`), the same in
RAM with every write appended to the files too (`MirroredTokenBuffer`: the segment index), which rows of each
buffer a step appends (`rows_of`) and their checksum (`rows_crc`). See `statekv.core.disk.tier` for the file set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import math
import mmap
import os
import platform
import sys
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ...errors import InputError, OutputError
from ..storage.buffers import TokenBuffer
from ..storage.compact import CompactBuffer
from ..storage.host_pages import ReleasedRuns, write_kept
from .files import write_checked

_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
# named from Python 3.14; Linux's value on x86 and Arm (0: reserved, where it is not known)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "i686", "armv7l") else 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

PER_STEP = ("step_means", "step_samples", "key_scales")  # buffers holding a row per step, not per token
PER_SEGMENT = ("segment_index",)  # a row per segment of steps (written by the step that completes it)
MIRRORED = ("segment_index",)  # kept in RAM too (what retrieval ranks segments by)


class MappedTokenBuffer:
    """`TokenBuffer`'s interface over files: ``parts`` files ``{prefix}.{p}.bin`` of rows ``[B, H_kv, X]``.

    ``tensors`` maps the files (copy-on-write, so nothing written through a view reaches them) as
    ``[B, H_kv, capacity, X]`` views; writes append rows with ``pwrite``. ``nbytes`` counts the committed
    rows. The capacity grows geometrically by extending the files (sparse until written). A file holds a row for
    every token streamed, given back or not, so it is mapped without reserving memory for it (``MAP_NORESERVE``):
    a copy-on-write mapping reserves its whole size, which the kernel refuses once it passes the machine's memory
    and swap, while only the pages read are ever resident.
    """

    GROWTH = 2.0
    MIN_CAPACITY = 64

    def __init__(self, parts: int, capacity_hint: int | None, prefix: Path,
                 on_replace: Callable[[], None] | None = None, described: dict | None = None):
        """described: more fields its description (``{prefix}.0.bin.json``) records (the file set it belongs to)."""
        self.parts, self.capacity_hint, self.on_replace = parts, capacity_hint, on_replace
        self.described = dict(described or {})
        self.device = torch.device("cpu")
        self.paths = [Path(f"{prefix}.{part}.bin") for part in range(parts)]
        self.prefix = Path(prefix)
        self.length = 0
        self.row: tuple[int, int, int] | None = None  # (B, H_kv, X)
        self.dtype: torch.dtype | None = None
        self._capacity = 0
        self._fds: list[int] = closed_with(self, [])
        self.crc = 0  # CRC-32 of the bytes written since the owner last reset it
        self.adopted = False  # opened over rows already there (see load)
        self.released = ReleasedRuns()  # rows given back since it was opened or loaded
        self._block = 4096

    # -- TokenBuffer's interface ----------------------------------------------------------------------------
    @property
    def tensors(self) -> list[torch.Tensor] | None:
        if self.row is None or not self._capacity:
            return None
        b, h, x = self.row
        try:
            return [torch.frombuffer(_mapped(path, self._capacity * self.row_bytes), dtype=self.dtype)
                    .view(self._capacity, b, h, x).permute(1, 2, 0, 3) for path in self.paths]
        except (FileNotFoundError, ValueError):  # the file removed, moved or cut short under it
            raise OutputError(f"cannot read the disk cache in {self.paths[0].parent}: {self.paths[0].name} is "
                              "missing or shorter than the stream wrote it (the folder was moved, removed or "
                              "replaced)") from None
        except OSError as error:
            raise OutputError(f"cannot map the disk cache in {self.paths[0].parent}: "
                              f"{error.strerror or error}") from None

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
        """Bytes of its rows written, less those given back (holes in its files)."""
        return (self.length - self.released.rows) * self.row_bytes * self.parts

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        if self.row is None:
            self.open(tuple(like.shape[:2]) + (like.shape[3],), like.dtype)
        if needed <= self._capacity:
            return False
        self._grow(max(needed, expected, math.ceil(self._capacity * self.GROWTH), self.MIN_CAPACITY), needed)
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
            pwrite_all(fd, data, start * self.row_bytes)

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        raise NotImplementedError("a disk-tier buffer is written by appending (write), never on the device")

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, :, start:end] for t in self.tensors)

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``index`` (LongTensor ``[N]``, any device), ``[B, H_kv, N, X]`` each (copies)."""
        return tuple(t.index_select(2, index.to("cpu")) for t in self.tensors)

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents with ``parts`` ``[B, H_kv, length, X]`` (the files are rewritten from empty; with
        ``released`` runs, see `TokenBuffer.load`, only the other rows are written: the released ones are holes),
        except just after `open` adopted that many rows already there (resuming: ``parts`` are their views)."""
        if self.adopted and parts[0].shape[2] == self.length and not released:
            self.adopted = False
            return
        if self.row is not None:
            for fd in self._fds:
                os.ftruncate(fd, 0)
            self._capacity = 0
        self.length = 0
        self.crc = 0
        self.released = ReleasedRuns()
        length = write_kept(self, parts, released)
        for start, end in released:  # never written since the files were emptied: holes already
            self.released.add(start, end)
        self.length = length

    def synchronize(self) -> None:
        """Writes are synchronous (``pwrite``): nothing to wait for."""

    # -- the disk's own ---------------------------------------------------------------------------------------
    def open(self, row: tuple[int, int, int], dtype: torch.dtype, length: int = 0) -> None:
        """Open (creating if needed) the files for rows ``row`` of ``dtype``; ``length`` rows already there are
        committed (resuming). Nothing is written since: `crc` starts again (a step the disk refused part of is
        undone by reopening, and its retry is checked against what it writes then)."""
        row = tuple(int(n) for n in row)
        fds: list[int] = []
        try:
            if not length:  # what a resumed stream reopens the files as
                write_checked(Path(f"{self.paths[0]}.json"), {"row": list(row), **self.described,
                                                            "dtype": str(dtype).removeprefix("torch.")})
            for path in self.paths:
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as error:  # not opened: the next write opens it again
            for fd in fds:
                os.close(fd)
            raise OutputError(f"cannot write the disk cache in {self.paths[0].parent}: "
                              f"{error.strerror or error}") from None
        self.row, self.dtype, self.length, self.adopted = row, dtype, length, length > 0
        self.released, self.crc = ReleasedRuns(), 0
        self._fds.extend(fds)
        sizes = [os.fstat(fd).st_size for fd in self._fds]
        self._block = os.fstat(self._fds[0]).st_blksize or 4096  # the file system's block (what a hole frees)
        self._capacity = min(sizes) // self.row_bytes if self.row_bytes else 0
        if self._capacity < length:
            short, _ = min(zip(self.paths, sizes), key=lambda pair: pair[1])
            raise InputError(f"{short.parent}: the disk cache is damaged: {short.name} holds {self._capacity} rows, "
                             f"fewer than the {length} its journal lists")

    def _grow(self, capacity: int, needed: int) -> None:
        """Extend the files to ``capacity`` rows; where the file system refuses a file that large (``EFBIG``: past
        its largest file, 16 TiB on ext4), to the most rows it takes, ``needed`` at least (found by bisection)."""
        taken, refused, size = self._capacity, None, capacity
        while True:
            try:
                for fd in self._fds:
                    os.ftruncate(fd, size * self.row_bytes)
                taken = size
            except OSError as error:
                if error.errno != errno.EFBIG:
                    raise OutputError(f"cannot grow the disk cache in {self.paths[0].parent}: "
                                      f"{error.strerror or error}") from None
                if size <= needed:
                    raise OutputError(
                        f"cannot grow the disk cache in {self.paths[0].parent}: {self.paths[0].name} would pass the "
                        f"largest file its file system allows ({error.strerror}); a disk-tier file keeps a row for "
                        "every token of the stream, evicted or not (ext4 allows 16 TiB, XFS far more)") from None
                refused = size
            if refused is None or (taken >= needed and refused - taken <= 1):
                break
            size = needed if taken < needed else (taken + refused) // 2
        if refused is not None:  # a part extended before another refused the same size is cut back
            for fd in self._fds:
                os.ftruncate(fd, taken * self.row_bytes)
        self._capacity = taken

    def read_rows(self, start: int, end: int) -> list[bytes]:
        """The raw bytes of rows ``[start, end)`` of each part (for verifying checksums)."""
        return [os.pread(fd, (end - start) * self.row_bytes, start * self.row_bytes) for fd in self._fds]

    def release(self, start: int, end: int) -> None:
        """Give rows ``[start, end)`` back to the file system (they then read as zeros). A row is smaller than a
        block, so the hole punched reaches into the rows released before them (`ReleasedRuns` merges them), to
        cover the whole blocks they now fill."""
        run_start, run_end = self.released.add(start, end)
        row, block = self.row_bytes, self._block
        low = max(run_start * row, start * row // block * block)
        high = min(run_end * row, -(-end * row // block) * block)
        for fd in self._fds:
            if _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, ctypes.c_long(low), ctypes.c_long(high - low)) != 0:
                pwrite_all(fd, memoryview(bytes((end - start) * row)), start * row)  # no hole punching: zeros

    def sync(self) -> None:
        for fd in self._fds:
            os.fsync(fd)

    def close(self) -> None:
        close_all(self._fds)


def _mapped(path: Path, size: int) -> ctypes.Array:
    """The first ``size`` bytes of ``path`` mapped copy-on-write without reserving memory for them, unmapped once
    nothing refers to them. Mapped with libc: Python's `mmap` holds a duplicate of the file's descriptor while a
    mapping lives, and a save reads a buffer through as many views as it has runs of kept rows."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is shorter than {size} bytes")
        address = _libc.mmap(None, ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | _MAP_NORESERVE, fd, ctypes.c_long(0))
    finally:
        os.close(fd)  # the mapping outlives it
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    view = (ctypes.c_char * size).from_address(address)
    weakref.finalize(view, _libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(size)).atexit = False
    return view


def close_all(fds: list[int]) -> None:
    """Close the descriptors in ``fds``, emptying it."""
    while fds:
        os.close(fds.pop())


def closed_with(owner: object, fds: list[int]) -> list[int]:
    """``fds`` (a list its owner adds the descriptors it opens to, and empties with `close_all` when it closes them),
    closed when ``owner`` is collected still holding some: a stream dropped without `close` leaves none open."""
    weakref.finalize(owner, close_all, fds)
    return fds


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``; an `OutputError` naming the reason (a full disk...) when it cannot be."""
    try:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
    except OSError as error:
        raise OutputError(f"cannot write the disk cache: {error.strerror or error}") from None


class MirroredTokenBuffer:
    """A buffer in RAM (what is read) whose writes are also appended to a `MappedTokenBuffer` (what a resumed
    stream reads back): the segment index. For a stream that ``evicts`` the RAM half is a `CompactBuffer` (only
    the rows it keeps, so its address space follows them, not the stream's age; its views are copies), else a
    `TokenBuffer` (views). Everything but writing, releasing and loading is the RAM half's."""

    def __init__(self, parts: int, prefix: Path, on_replace: Callable[[], None] | None = None,
                 described: dict | None = None, evicts: bool = False):
        self.mirror = MappedTokenBuffer(parts, None, prefix, described=described)
        self._ram_only = False  # while loading: the file has the rows already
        # never pinned: its rows are copied to the file synchronously anyway, and pinned rows a stream evicts could
        # not go back to the OS (nor would the slots ahead of its length go uncounted, `nbytes`)
        self.ram = (CompactBuffer(parts, on_replace) if evicts
                    else TokenBuffer(parts, None, "cpu", on_replace=on_replace, pin=False))

    def __getattr__(self, name: str):
        if name == "ram":  # not set yet
            raise AttributeError(name)
        return getattr(self.ram, name)

    @property
    def length(self) -> int:
        return self.ram.length

    @length.setter
    def length(self, value: int) -> None:
        self.ram.length = value
        if not self._ram_only:
            self.mirror.length = value

    def write(self, start: int, *parts: torch.Tensor) -> None:
        self.ram.write(start, *parts)
        if not self._ram_only:
            self.mirror.write(start, *parts)

    def release(self, start: int, end: int) -> None:
        self.ram.release(start, end)
        self.mirror.release(start, end)

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        self.mirror.load(*parts, released=released)
        self._ram_only = True
        try:
            self.ram.load(*(part.clone() for part in parts), released=released)
        finally:
            self._ram_only = False

    @property
    def crc(self) -> int:
        return self.mirror.crc

    @crc.setter
    def crc(self, value: int) -> None:
        self.mirror.crc = value


def rows_of(name: str, step: int, start: int, length: int, per_segment: int) -> tuple[int, int] | None:
    """The rows of buffer ``name`` that step ``step`` (tokens ``[start, start + length)``) appended (None: none)."""
    if name in PER_STEP:
        return step, step + 1
    if name in PER_SEGMENT:
        return (step // per_segment, step // per_segment + 1) if (step + 1) % per_segment == 0 else None
    return start, start + length


def rows_crc(buffer: MappedTokenBuffer, start: int, end: int) -> int:
    crc = 0
    for part in buffer.read_rows(start, end):
        crc = zlib.crc32(part, crc)
    return crc

