"""A host buffer cut into blocks of rows, for a stream that evicts (`statekv.core.storage.limits`).

A `TokenBuffer` is one allocation per part addressed by the token's index in the whole stream, so its size follows
every token ever streamed: the pages of evicted rows go back to the OS, but its address space, the page tables of
the pages it ever touched, and the one allocation the kernel's overcommit check weighs grow with the stream's age.
`BlockBuffer` keeps the same addressing over blocks of `BLOCK_ROWS` rows, each its own allocation made when a row
of it is first written: a block every row of which is released is freed whole (its pages and their page tables go
back), and a block never written takes nothing. What it holds follows the rows it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .host_pages import ReleasedRuns, free_rows, write_kept

BLOCK_ROWS = 1024  # smaller: fewer rows held by a block kept for one row; larger: fewer pieces to a read


class BlockBuffer:
    """`TokenBuffer`'s API (``length``, ``reserve``, ``write``, ``write_at``, ``view``, ``gather``, ``release``,
    ``load``) in host memory, in blocks ``[B, H_kv, rows, X]`` per part.

    A read within one block is a view; across blocks, a copy (released rows read as zeros). Blocks never move, so
    ``on_replace`` is never called. Rows of a block kept in part give their whole pages back as `TokenBuffer`'s do.
    """

    def __init__(self, parts: int = 2, capacity_hint: int | None = None, on_replace: Callable[[], None] | None = None,
                 rows: int | None = None):
        self.parts, self.capacity_hint, self.on_replace = parts, capacity_hint, on_replace
        self.rows = rows or BLOCK_ROWS
        self.device = torch.device("cpu")
        self.blocks: dict[int, list[torch.Tensor]] = {}  # block number -> its parts
        self.length = 0
        self.released = ReleasedRuns()
        self._capacity = 0
        self._like: torch.Tensor | None = None  # [B, H_kv, 0, X]: the rows' shape and dtype

    tensors = keys = values = None  # no tensor of its own: blocks

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes of its rows written and not given back (a block's rows past them were never touched: they take
        no memory)."""
        if self._like is None:
            return 0
        b, h, _, x = self._like.shape
        return (self.length - self.released.rows) * b * h * x * self._like.element_size() * self.parts

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        """Room for ``needed`` rows shaped like ``like`` ``[B, H_kv, *, X]``: blocks are made as they are written,
        so nothing is allocated here; never reallocates (False)."""
        if self._like is None:
            b, h, _, x = like.shape
            self._like = torch.empty(b, h, 0, x, dtype=like.dtype)
        self._capacity = max(self._capacity, needed)
        return False

    def _block(self, number: int) -> list[torch.Tensor]:
        block = self.blocks.get(number)
        if block is None:  # zeros where rows below the length may be released ones (made after a load)
            b, h, _, x = self._like.shape
            make = torch.zeros if number * self.rows < self.length else torch.empty
            block = self.blocks[number] = [make(b, h, self.rows, x, dtype=self._like.dtype)
                                           for _ in range(self.parts)]
        return block

    def _pieces(self, start: int, end: int):
        """``(block number, first row in it, last row + 1 in it, offset from start)`` of rows ``[start, end)``."""
        at = start
        while at < end:
            number, offset = divmod(at, self.rows)
            stop = min(end - at, self.rows - offset)
            yield number, offset, offset + stop, at - start
            at += stop

    def write(self, start: int, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, X]`` tensors (from any device) to rows ``[start, start + T)``."""
        end = start + parts[0].shape[2]
        self.reserve(parts[0], end)
        for number, low, high, at in self._pieces(start, end):
            for tensor, part in zip(self._block(number), parts):
                tensor[:, :, low:high].copy_(part[:, :, at: at + high - low])

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, X]`` tensors to the rows ``index`` (LongTensor ``[T]``, any device)."""
        index = index.to("cpu")
        self.reserve(parts[0], int(index.max()) + 1 if index.numel() else 0)
        numbers = index // self.rows
        for number in numbers.unique().tolist():
            chosen = (numbers == number).nonzero().squeeze(1)
            for tensor, part in zip(self._block(number), parts):
                tensor.index_copy_(2, index[chosen] % self.rows, part.index_select(2, chosen.to(part.device)).cpu())

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Rows ``[start, end)``, ``[B, H_kv, end - start, X]`` each: views within one block, else copies."""
        pieces = list(self._pieces(start, end))
        if len(pieces) == 1 and pieces[0][0] in self.blocks:
            number, low, high, _ = pieces[0]
            return tuple(tensor[:, :, low:high] for tensor in self.blocks[number])
        return tuple(torch.cat([self._rows(number, low, high, part) for number, low, high, _ in pieces], 2)
                     if pieces else self._like for part in range(self.parts))

    def _rows(self, number: int, low: int, high: int, part: int) -> torch.Tensor:
        block = self.blocks.get(number)
        if block is None:  # every row of it given back
            return self._like.new_zeros(*self._like.shape[:2], high - low, self._like.shape[3])
        return block[part][:, :, low:high]

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``index`` (LongTensor ``[N]``, any device), ``[B, H_kv, N, X]`` each (copies)."""
        index = index.to("cpu")
        if not index.numel():
            return tuple(self._like for _ in range(self.parts))
        numbers, counts = torch.unique_consecutive(index // self.rows, return_counts=True)
        pieces, at = [], 0
        for number, count in zip(numbers.tolist(), counts.tolist()):
            local = index[at: at + count] % self.rows
            low, high = int(local[0]), int(local[-1]) + 1
            if high - low == count and bool((local.diff() == 1).all()):  # a run of rows: a view
                pieces.append([self._rows(number, low, high, part) for part in range(self.parts)])
            elif number in self.blocks:
                pieces.append([tensor.index_select(2, local) for tensor in self.blocks[number]])
            else:
                pieces.append([self._rows(number, 0, count, part) for part in range(self.parts)])
            at += count
        return tuple(torch.cat([piece[part] for piece in pieces], 2) for part in range(self.parts))

    def release(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` are never read again: a block every row of which is now released is freed; in the
        others they read as zeros and the whole pages they cover go back to the OS."""
        run_start, run_end = self.released.add(start, end)
        numbers = range(start // self.rows, -(-end // self.rows))
        if len(numbers) > len(self.blocks):  # a long run (a stream's evicted weeks): the blocks held in it alone
            numbers = sorted(number for number in self.blocks if number in numbers)
        for number in numbers:
            block = self.blocks.get(number)
            if block is None:
                continue
            first = number * self.rows
            if run_start <= first and first + self.rows <= run_end:
                del self.blocks[number]
                continue
            run = (max(run_start - first, 0), min(run_end - first, self.rows))
            for tensor in block:
                free_rows(tensor, max(start - first, 0), min(end - first, self.rows), run)

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents as `TokenBuffer.load` does: only the blocks holding a row kept are made."""
        self.blocks, self.length, self.released, self._capacity, self._like = {}, 0, ReleasedRuns(), 0, None
        self.reserve(parts[0], 0)
        length = write_kept(self, parts, released)
        for start, end in released:
            self.release(start, end)
        self.length = length

    def synchronize(self) -> None:
        pass  # written synchronously: host memory that is not pinned
