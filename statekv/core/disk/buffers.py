"""The files of a disk tier's layers: token buffers over memory-mapped files (`MappedTokenBuffer`; the segment
index is also kept in RAM, `statekv.core.disk.mirrored`), which rows of each buffer a step appends (`rows_of`) and
their checksum (`rows_crc`). See `statekv.core.disk.tier` for the file set.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from ...errors import InputError, OutputError, os_reason
from ...flushing import flush_folder
from ..storage.host_pages import ReleasedRuns, write_kept
from .files import write_checked
from .mapping import anonymous, mapped, punch_hole
from .open_files import close_all, closed_with

BLOCK_ALIGN = 1 << 16  # a block file's bytes are a multiple of it: of any page size (4, 16 or 64 KiB) it is mapped at

PER_STEP = ("step_means", "step_samples", "key_scales")  # buffers holding a row per step, not per token
PER_SEGMENT = ("segment_index",)  # a row per segment of steps (written by the step that completes it)
MIRRORED = ("segment_index",)  # kept in RAM too (what retrieval ranks segments by)


class MappedTokenBuffer:
    """`TokenBuffer`'s interface over files: per part, files of rows ``[B, H_kv, X]`` in blocks of `block_rows`
    rows, ``{prefix}.{p}.{k}.bin`` holding rows ``[k * block_rows, (k + 1) * block_rows)``.

    A block's files are made when its first row is written, and removed once every row of it was given back
    (`release`; a run given back within a block punches a hole over the whole file system blocks it covers), so a
    stream that evicts for weeks keeps files of bounded size and number, whatever its age. A file set of format 4
    (its description records no ``block_rows``) has one file a part, ``{prefix}.{p}.bin``, a row for every token
    ever streamed: it is read, and continued, as it is. The description stays ``{prefix}.0.bin.json``.

    ``view`` and ``gather`` map the blocks they read (copy-on-write, so nothing written through a view reaches the
    files; a block given back reads as zeros) without reserving memory for them (``MAP_NORESERVE``: a copy-on-write
    mapping reserves its whole size, which the kernel refuses once it passes the machine's memory and swap, while
    only the pages read are ever resident); writes append rows with ``pwrite``. ``nbytes`` counts the committed
    rows not given back.
    """

    GROWTH = 2.0
    MIN_CAPACITY = 64
    # the bytes of a block file (rounded to `BLOCK_ALIGN`, a whole number of rows); None: one file a part, format 4's
    BLOCK_BYTES: int | None = 64 << 20

    def __init__(self, parts: int, capacity_hint: int | None, prefix: Path,
                 on_replace: Callable[[], None] | None = None, described: dict | None = None):
        """described: more fields its description (``{prefix}.0.bin.json``) records (the file set it belongs to)."""
        self.parts, self.capacity_hint, self.on_replace = parts, capacity_hint, on_replace
        self.described = dict(described or {})
        self.device = torch.device("cpu")
        self.paths = [Path(f"{prefix}.{part}.bin") for part in range(parts)]  # format 4's files; the description's
        self.prefix = Path(prefix)
        self.length = 0
        self.row: tuple[int, int, int] | None = None  # (B, H_kv, X)
        self.dtype: torch.dtype | None = None
        self.block_rows: int | None = None  # rows per block file (None: format 4's one file a part)
        self._capacity = 0
        self._fds: list[int] = closed_with(self, [])  # the files of block `_tail` (format 4: its only files)
        self._tail: int | None = None
        # while `reading`: the block `read_rows` last read, and its files (-1: gone), kept open for the next read
        self._reading: tuple[int, list[int]] | None = None
        self._unsynced: set[int] = set()  # blocks written since the last sync
        self._made_files = False  # a block file made since the last sync (its name not flushed yet)
        self.crc = 0  # CRC-32 of the bytes written since the owner last reset it
        self.adopted = False  # opened over rows already there (see load)
        self.released = ReleasedRuns()  # rows given back since it was opened or loaded
        # runs of rows whose block files it was reopened without (taken as given back: zeros)
        self.missing: list[tuple[int, int]] = []
        self.short: list[tuple[int, int, str]] = []  # runs of rows past the end of a block's file, and its name
        self._block = 4096

    # -- TokenBuffer's interface ----------------------------------------------------------------------------
    @property
    def tensors(self) -> list[torch.Tensor] | None:
        if self.row is None or not self._capacity:
            return None
        return list(self.view(0, self._capacity))

    @property
    def keys(self) -> torch.Tensor | None:
        return (self.tensors or [None, None])[0]

    @property
    def values(self) -> torch.Tensor | None:
        return (self.tensors or [None, None])[1]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row in one part."""
        return 0 if self.row is None else math.prod(self.row) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of its rows written, less those given back (holes in its files, or their files removed)."""
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
        data = []
        for part in parts:
            rows = part.detach().to("cpu").permute(2, 0, 1, 3).contiguous().reshape(-1).view(torch.uint8).numpy()
            data.append(memoryview(rows))
            self.crc = zlib.crc32(data[-1], self.crc)
        row, end = self.row_bytes, start + parts[0].shape[2]
        for block, (first, last) in self._pieces(start, end):
            fds = self._block_fds(block)
            self._unsynced.add(block)
            for fd, rows in zip(fds, data):
                pwrite_all(fd, rows[(first - start) * row: (last - start) * row], (first - self._first(block)) * row)

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        raise NotImplementedError("a disk-tier buffer is written by appending (write), never on the device")

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Rows ``[start, end)``, ``[B, H_kv, end - start, X]`` each (views of the files, mapped afresh)."""
        if self.block_rows is None:
            return tuple(t[:, :, start:end] for t in self._mapped_blocks(0, 1))
        first, last = start // self.block_rows, max(start // self.block_rows + 1, -(-end // self.block_rows))
        at = first * self.block_rows
        return tuple(t[:, :, start - at: end - at] for t in self._mapped_blocks(first, last))

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``index`` (LongTensor ``[N]``, any device), ``[B, H_kv, N, X]`` each (copies)."""
        index = index.to("cpu")
        if self.block_rows is None:
            return tuple(t.index_select(2, index) for t in self._mapped_blocks(0, 1))
        b, h, x = self.row
        out = tuple(torch.empty(b, h, index.numel(), x, dtype=self.dtype) for _ in range(self.parts))
        blocks = index.div(self.block_rows, rounding_mode="floor")
        for block in blocks.unique().tolist():  # each block mapped alone: never the stream's whole history
            where = (blocks == block).nonzero().squeeze(1)
            for rows, block_rows in zip(out, self._mapped_blocks(block, block + 1)):
                rows[:, :, where] = block_rows.index_select(2, index[where] - block * self.block_rows)
        return out

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents with ``parts`` ``[B, H_kv, length, X]`` (the files are removed and written anew, in
        blocks; with ``released`` runs, see `TokenBuffer.load`, only the other rows are written: a block of released
        rows alone is never made), except just after `open` adopted that many rows already there (resuming:
        ``parts`` are their views)."""
        if self.adopted and parts[0].shape[2] == self.length and not released:
            self.adopted = False
            return
        if self.row is not None:
            row, dtype = self.row, self.dtype
            self.close()
            self._capacity = 0
            self.open(row, dtype)  # every file of the buffer removed, its description written anew
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
    def open(self, row: tuple[int, int, int], dtype: torch.dtype, length: int = 0, *,
             block_rows: int | None = None) -> None:
        """Open the files for rows ``row`` of ``dtype``: new (``length`` 0: the buffer's files are removed and its
        description written, in blocks unless `BLOCK_BYTES` is None), or with ``length`` rows already there,
        committed (resuming), in blocks of ``block_rows`` (what its description records; None: format 4's one file
        a part). Nothing is written since: `crc` starts again (a step the disk refused part of is undone by
        reopening, and its retry is checked against what it writes then)."""
        row = tuple(int(n) for n in row)
        self.row, self.dtype = row, dtype
        if not length:
            block_rows = self._rows_per_block()
        self.block_rows = block_rows
        fds: list[int] = []
        try:
            if not length:  # what a resumed stream reopens the files as
                self._remove_files()
                write_checked(Path(f"{self.paths[0]}.json"), {
                    "row": list(row), **self.described, "dtype": str(dtype).removeprefix("torch."),
                    **({} if block_rows is None else {"block_rows": block_rows})})
            if block_rows is None:
                for path in self.paths:
                    fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
            self._block = os.stat(self.prefix.parent).st_blksize or 4096  # the file system's (what a hole frees)
        except OSError as error:  # not opened: the next write opens it again
            for fd in fds:
                os.close(fd)
            self.row = None
            raise OutputError(f"cannot write the disk cache in {self.paths[0].parent}: "
                              f"{os_reason(error)}") from None
        self.length, self.adopted = length, length > 0
        self.released, self.crc = ReleasedRuns(), 0
        self._unsynced, self._made_files = set(), False
        self.missing, self.short = [], []
        if block_rows is None:
            self._fds.extend(fds)
            self._tail = 0
            sizes = [os.fstat(fd).st_size for fd in self._fds]
            self._capacity = min(sizes) // self.row_bytes if self.row_bytes else 0
            if self._capacity < length:
                short, _ = min(zip(self.paths, sizes), key=lambda pair: pair[1])
                raise InputError(f"{short.parent}: the disk cache is damaged: {short.name} holds {self._capacity} "
                                 f"rows, fewer than the {length} its journal lists")
            return
        if type(block_rows) is not int or block_rows < 1 or block_rows * self.row_bytes % BLOCK_ALIGN:
            raise InputError(f"{self.prefix.parent}: the disk cache is damaged: {self.paths[0].name}.json records "
                             f"blocks of {block_rows!r} rows")
        blocks = -(-length // block_rows)
        self._capacity = blocks * block_rows
        # a block whose files are gone, or some of them (a kill while they were removed), was given back whole: a
        # held row lost with it fails its step's checksum (a row no step's checksum covers: see `missing`)
        at = 0
        for block, sizes in sorted(self._present_blocks().items()):
            if block >= blocks:
                break
            if len(sizes) < self.parts:
                continue
            if at < block:
                self.missing.append((at * block_rows, block * block_rows))
                self.released.add(at * block_rows, block * block_rows)
            at, first = block + 1, block * block_rows
            # rows past a file's end are damage only if held (one loaded from a file wrote none it had given back)
            written, listed = first + min(sizes.values()) // self.row_bytes, min(first + block_rows, length)
            if written < listed:
                self.short.append((written, listed, self._path(min(sizes, key=sizes.get), block).name))
            self._unsynced.add(block)
        if at < blocks:
            self.missing.append((at * block_rows, length))
            self.released.add(at * block_rows, length)
        # rows adopted may not be on the device yet (written before a kill, or before a step the disk refused): the
        # next sync forces their blocks, and the folder holding their names
        self._made_files = bool(self._unsynced)

    def _rows_per_block(self) -> int | None:
        """Rows of a new block: `BLOCK_BYTES` rounded to a whole number of rows and of `BLOCK_ALIGN` bytes."""
        if self.BLOCK_BYTES is None:
            return None
        unit = BLOCK_ALIGN // math.gcd(self.row_bytes, BLOCK_ALIGN)  # rows of a multiple of BLOCK_ALIGN bytes
        return unit * max(1, self.BLOCK_BYTES // max(1, unit * self.row_bytes))

    def _path(self, part: int, block: int) -> Path:
        return self.paths[part] if self.block_rows is None else Path(f"{self.prefix}.{part}.{block}.bin")

    def _first(self, block: int) -> int:
        """Block ``block``'s first row."""
        return 0 if self.block_rows is None else block * self.block_rows

    def _pieces(self, start: int, end: int, there: bool = False) -> list[tuple[int, tuple[int, int]]]:
        """Rows ``[start, end)`` cut at the blocks' bounds: ``(block, (first, last))``; ``there``: in the blocks whose
        files there are alone, where the run spans more (a stream's evicted weeks, given back at once)."""
        if self.block_rows is None:
            return [(0, (start, end))] if end > start else []
        size, blocks = self.block_rows, range(start // self.block_rows, -(-end // self.block_rows))
        if there and len(blocks) > 2:
            blocks = sorted(block for block in self._present_blocks() if block in blocks)
        return [(block, (max(start, block * size), min(end, (block + 1) * size))) for block in blocks]

    def _present_blocks(self) -> dict[int, dict[int, int]]:
        """The block files there are of this buffer: by block, by part, their sizes."""
        found: dict[int, dict[int, int]] = {}
        stem = self.prefix.name + "."
        try:
            entries = list(os.scandir(self.prefix.parent))
        except OSError:
            return found
        for entry in entries:
            name = entry.name
            if not (name.startswith(stem) and name.endswith(".bin")):
                continue
            fields = name[len(stem):-4].split(".")
            if len(fields) == 2 and all(f.isascii() and f.isdigit() for f in fields) and int(fields[0]) < self.parts:
                try:
                    found.setdefault(int(fields[1]), {})[int(fields[0])] = entry.stat().st_size
                except OSError:
                    pass
        return found

    def _remove_files(self) -> None:
        """Remove every file of this buffer (a new one starts from none)."""
        self.close()
        for path in self.paths:
            path.unlink(missing_ok=True)
        for block, sizes in self._present_blocks().items():
            for part in sizes:
                Path(f"{self.prefix}.{part}.{block}.bin").unlink(missing_ok=True)

    def _block_fds(self, block: int) -> list[int]:
        """The files of block ``block``, one a part, open for writing (made, empty, if they are not: a block's files
        grow with its rows, `_grow`, so a folder copied by a tool blind to holes copies what it holds)."""
        if self._tail == block and self._fds:
            return self._fds
        self.close()
        fds: list[int] = []
        try:
            for part in range(self.parts):
                fds.append(os.open(self._path(part, block), os.O_RDWR | os.O_CREAT, 0o644))
            # its names flushed at the next sync, even where its files were there: a process killed before its
            # sync may have left them, their names not on the device
            self._made_files = True
        except OSError as error:
            close_all(fds)
            raise OutputError(f"cannot write the disk cache in {self.paths[0].parent}: "
                              f"{os_reason(error)}") from None
        self._fds.extend(fds)
        self._tail = block
        return self._fds

    def _released_whole(self, block: int) -> bool:
        """Whether every row of block ``block`` was written and given back."""
        end = (block + 1) * self.block_rows
        return end <= self.length and self._given_back(block * self.block_rows, end)

    def _given_back(self, start: int, end: int) -> bool:
        """Whether rows ``[start, end)`` were all given back."""
        runs = self.released
        at = bisect.bisect_right(runs.starts, start) - 1
        return at >= 0 and runs.ends[at] >= end

    def _mapped_blocks(self, first: int, last: int) -> list[torch.Tensor]:
        """Blocks ``[first, last)`` mapped as one run of rows, per part ``[B, H_kv, rows, X]``: a block given back,
        or not written yet, reads as zeros (format 4: its one file, `capacity` rows)."""
        b, h, x = self.row
        where = self.paths[0].parent
        try:
            if self.block_rows is None:
                return [torch.frombuffer(mapped(path, self._capacity * self.row_bytes), dtype=self.dtype)
                        .view(self._capacity, b, h, x).permute(1, 2, 0, 3) for path in self.paths]
            size = self.block_rows * self.row_bytes
            tensors = []
            for part in range(self.parts):
                region = anonymous((last - first) * size)
                for block in range(first, last):
                    if self._released_whole(block):
                        continue  # its files are gone: zeros
                    path, start = self._path(part, block), block * self.block_rows
                    held = start < self.length and not self._given_back(start, min(start + self.block_rows,
                                                                                    self.length))
                    try:
                        length = min(size, path.stat().st_size)  # a block's files grow with its rows
                    except FileNotFoundError:
                        if held:
                            raise
                        continue  # gone (given back after a checkpoint resumed) or not written
                    if length:
                        mapped(path, length, region, (block - first) * size)
                tensors.append(torch.frombuffer(region, dtype=self.dtype)
                               .view((last - first) * self.block_rows, b, h, x).permute(1, 2, 0, 3))
            return tensors
        except (FileNotFoundError, ValueError):  # the file removed, moved or cut short under it
            raise OutputError(f"cannot read the disk cache in {where}: {self.paths[0].name} or a block of it is "
                              "missing or shorter than the stream wrote it (the folder was moved, removed or "
                              "replaced)") from None
        except OSError as error:
            raise OutputError(f"cannot map the disk cache in {where}: {os_reason(error)}") from None

    def _grow(self, capacity: int, needed: int) -> None:
        """Room for ``capacity`` rows. In blocks, the files of the block row ``needed - 1`` lies in are made and
        grown to hold it (geometrically, up to a block: sparse, and as long as its rows, so a copy by a tool blind to
        holes is not a block a file), so a disk that refuses them refuses the step as it is staged, before anything
        of it is taken; format 4's files are extended, or where the file system refuses a file that
        large (``EFBIG``: past its largest file, 16 TiB on ext4), to the most rows it takes, ``needed`` at least
        (found by bisection)."""
        if self.block_rows is not None:
            block = (needed - 1) // self.block_rows
            start = block * self.block_rows
            rows = min(self.block_rows, max(needed - start, self.MIN_CAPACITY,
                                            math.ceil(max(self._capacity - start, 0) * self.GROWTH)))
            try:
                for fd in self._block_fds(block):
                    if os.fstat(fd).st_size < rows * self.row_bytes:
                        os.ftruncate(fd, rows * self.row_bytes)
            except OSError as error:
                raise OutputError(f"cannot grow the disk cache in {self.paths[0].parent}: "
                                  f"{os_reason(error)}") from None
            self._capacity = start + rows
            return
        taken, refused, size = self._capacity, None, capacity
        while True:
            try:
                for fd in self._fds:
                    os.ftruncate(fd, size * self.row_bytes)
                taken = size
            except OSError as error:
                if error.errno != errno.EFBIG:
                    raise OutputError(f"cannot grow the disk cache in {self.paths[0].parent}: "
                                      f"{os_reason(error)}") from None
                if size <= needed:
                    raise OutputError(
                        f"cannot grow the disk cache in {self.paths[0].parent}: {self.paths[0].name} would pass the "
                        f"largest file its file system allows ({error.strerror}); a disk-tier file of format 4 keeps "
                        "a row for every token of the stream, evicted or not (ext4 allows 16 TiB, XFS far more)"
                    ) from None
                refused = size
            if refused is None or (taken >= needed and refused - taken <= 1):
                break
            size = needed if taken < needed else (taken + refused) // 2
        if refused is not None:  # a part extended before another refused the same size is cut back
            for fd in self._fds:
                os.ftruncate(fd, taken * self.row_bytes)
        self._capacity = taken

    def read_rows(self, start: int, end: int) -> list[bytes]:
        """The raw bytes of rows ``[start, end)`` of each part (for verifying checksums; a block whose files are
        gone reads as zeros)."""
        row, out = self.row_bytes, [b""] * self.parts
        for block, (first, last) in self._pieces(start, end):
            offset, count = (first - self._first(block)) * row, (last - first) * row
            fds, kept = self._read_fds(block)
            try:
                for part, fd in enumerate(fds):
                    out[part] += bytes(count) if fd < 0 else os.pread(fd, count, offset)
            finally:
                if not kept:
                    close_all([fd for fd in fds if fd >= 0])
        return out

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within it `read_rows` keeps the files of the block it read last open: a pass reading rows in order (every
        step's checksum verified) opens each block's files once, not once a step. A pass within a pass is part of
        it. The files of the block it writes are closed first (its next write opens them): one block's files held."""
        if self._reading is not None:
            yield
            return
        if self.block_rows is not None:
            self.close()
        self._reading = (-1, [])
        try:
            yield
        finally:
            self._forget_read()
            self._reading = None

    def _forget_read(self) -> None:
        """Close the files `reading` keeps: the block's files were removed or made since (a kept file would read
        the rows given back, a kept -1 zeros for rows written), so the next read opens them again."""
        if self._reading is not None:
            close_all([fd for fd in self._reading[1] if fd >= 0])
            self._reading = (-1, [])

    def _read_fds(self, block: int) -> tuple[list[int], bool]:
        """Block ``block``'s files open for reading, one a part (-1: gone, reading as zeros), and whether they are
        kept open (else the caller closes them)."""
        if block == self._tail and self._fds:
            return self._fds, True
        if self._reading is not None and self._reading[0] == block:
            return self._reading[1], True
        fds: list[int] = []
        try:
            for part in range(self.parts):
                try:
                    fds.append(os.open(self._path(part, block), os.O_RDONLY))
                except FileNotFoundError:
                    fds.append(-1)
        except BaseException as error:
            close_all([fd for fd in fds if fd >= 0])
            if isinstance(error, OSError):
                raise OutputError(f"cannot read the disk cache in {self.prefix.parent}: {os_reason(error)}") from None
            raise
        if self._reading is None:
            return fds, False
        self._forget_read()
        self._reading = (block, fds)
        return fds, True

    def release(self, start: int, end: int) -> None:
        """Give rows ``[start, end)`` back to the file system (they then read as zeros): a block every row of which
        is given back has its files removed; else, a row being smaller than a file system block, the hole punched
        reaches into the rows released before them (`ReleasedRuns` merges them), to cover the whole blocks they now
        fill."""
        run_start, run_end = self.released.add(start, end)
        row, block_bytes = self.row_bytes, self._block
        for block, (first, last) in self._pieces(start, end, there=True):
            if self.block_rows is not None and self._released_whole(block):
                self._drop(block)
                continue
            base = self._first(block) * row
            low = max(run_start * row, first * row // block_bytes * block_bytes, base)
            high = min(run_end * row, -(-last * row // block_bytes) * block_bytes)
            if self.block_rows is not None:
                high = min(high, base + self.block_rows * row)
            for part in range(self.parts):
                try:
                    fd = self._fds[part] if block == self._tail and self._fds else \
                        os.open(self._path(part, block), os.O_WRONLY)
                except FileNotFoundError:
                    continue
                except OSError as error:
                    raise OutputError(f"cannot give rows of the disk cache in {self.prefix.parent} back: "
                                      f"{os_reason(error)}") from None
                try:
                    if not punch_hole(fd, low - base, high - low):  # no hole punching: zeros
                        pwrite_all(fd, memoryview(bytes((last - first) * row)), first * row - base)
                finally:
                    if fd not in self._fds:
                        os.close(fd)

    def _drop(self, block: int) -> None:
        """Remove block ``block``'s files (every row of it given back; journaled before, so a kill leaves it
        evicted, whether the files are gone or not)."""
        if block == self._tail:
            close_all(self._fds)
            self._tail = None
        self._forget_read()
        self._unsynced.discard(block)
        for part in range(self.parts):
            try:
                self._path(part, block).unlink(missing_ok=True)
            except OSError:
                pass  # left as it is: its rows are never read again

    def sync(self) -> None:
        """Force the rows written so far to the device, and the names of the block files made."""
        if self.block_rows is None:
            for fd in self._fds:
                os.fsync(fd)
            return
        for block in sorted(self._unsynced):
            if block == self._tail and self._fds:
                for fd in self._fds:
                    os.fsync(fd)
                continue
            for part in range(self.parts):
                try:
                    fd = os.open(self._path(part, block), os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self._unsynced = set()
        if self._made_files:  # the new files' names too
            flush_folder(self.prefix.parent, strict=True)
            self._made_files = False

    def close(self) -> None:
        close_all(self._fds)
        self._tail = None
        self._forget_read()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``; an `OutputError` naming the reason (a full disk...) when it cannot be."""
    try:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
    except OSError as error:
        raise OutputError(f"cannot write the disk cache: {os_reason(error)}") from None


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

