"""A host buffer of per-step rows that holds only the rows it keeps, for a stream that evicts
(`statekv.core.storage.limits`).

The step summaries (a row per step) and the segment index (a row per segment of steps) of an evicting stream are
read whole by retrieval, not row by row as its rows per token are (`statekv.core.storage.blocks`): `CompactBuffer`
keeps its rows packed, one allocation per part, beside the ascending global rows they are (``held``). Released rows
leave it: once they are more than the rows it keeps, the rows kept are copied to an allocation of twice their number
(it grows by doubling, as a `TokenBuffer` does), so it takes at most about four times the rows it keeps. Its address
space, page tables and copies follow the rows it keeps, not every row the stream ever wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .host_pages import ReleasedRuns, kept_in, whole_length


class CompactBuffer:
    """`TokenBuffer`'s API (``length``, ``reserve``, ``write``, ``write_at``, ``view``, ``gather``, ``release``,
    ``load``), rows addressed by their global index, in host memory: parts ``[B, H_kv, capacity, X]`` whose first
    ``count`` rows are the global rows ``held[:count]`` (ascending; those released since the last compaction read
    as zeros until it drops them). Released rows, and rows never written, read as zeros. Written on the host when a
    step commits and read by no recorded step, so moving it never calls ``on_replace``."""

    def __init__(self, parts: int = 1, on_replace: Callable[[], None] | None = None):
        self.parts, self.on_replace = parts, on_replace
        self.capacity_hint = None
        self.device = torch.device("cpu")
        self.tensors: list[torch.Tensor] | None = None
        self.held = torch.zeros(0, dtype=torch.long)  # [capacity]: the global row of each local one (first count)
        self.count = 0  # local rows written
        self.dead = 0  # of them, released (dropped at the next compaction)
        self.length = 0
        self.released = ReleasedRuns()
        self._like: torch.Tensor | None = None  # [B, H_kv, 0, X]: the rows' shape and dtype

    keys = values = None

    @property
    def capacity(self) -> int:
        """Rows allocated (local: what it holds, and room to add to it)."""
        return 0 if self.tensors is None else self.tensors[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of its rows held and not released."""
        if self._like is None:
            return 0
        b, h, _, x = self._like.shape
        return (self.count - self.dead) * b * h * x * self._like.element_size() * self.parts

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        """Room for rows up to global row ``needed`` (exclusive) written after those held, shaped like ``like``
        ``[B, H_kv, *, X]`` (``expected``, every row until the horizon, is not reserved: most will be released);
        True if it reallocated (the rows it holds packed into the new allocation)."""
        if self._like is None:
            b, h, _, x = like.shape
            self._like = torch.empty(b, h, 0, x, dtype=like.dtype)
        return self._room(max(needed - max(self.length, self._known()), 0))

    def _known(self) -> int:
        """The global row after the last it holds (0: none)."""
        return int(self.held[self.count - 1]) + 1 if self.count else 0

    def _room(self, rows: int) -> bool:
        """Room for ``rows`` more local rows; True if it reallocated."""
        if self.count + rows <= self.capacity:
            return False
        live = self.count - self.dead
        self._pack(max(live + rows, 2 * live, 1))
        return True

    def _pack(self, capacity: int) -> None:
        """The rows held, released ones left out, copied to a new allocation of ``capacity`` rows."""
        b, h, _, x = self._like.shape
        live = self._live()
        grown = [torch.empty(b, h, capacity, x, dtype=self._like.dtype) for _ in range(self.parts)]
        for new, old in zip(grown, self.tensors or ()):
            new[:, :, :live.shape[0]] = old.index_select(2, live)
        held = torch.zeros(capacity, dtype=torch.long)
        held[:live.shape[0]] = self.held[live]
        self.tensors, self.held, self.count, self.dead = grown, held, int(live.shape[0]), 0

    def _live(self) -> torch.Tensor:
        """``[L]`` local rows not released (ascending)."""
        if not self.dead:
            return torch.arange(self.count)
        return (~self._released_mask(self.held[:self.count])).nonzero().squeeze(1)

    def _released_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: which of the global ``rows`` (ascending) were released."""
        starts = torch.tensor(self.released.starts, dtype=torch.long)
        ends = torch.tensor(self.released.ends, dtype=torch.long)
        at = torch.searchsorted(starts, rows, right=True) - 1
        return (at >= 0) & (rows < ends[at.clamp(min=0)]) if starts.numel() else torch.zeros_like(rows, dtype=bool)

    def write(self, start: int, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, X]`` tensors (from any device) to global rows ``[start, start + T)``: rows past those
        it holds (rewritten in place where it holds them already)."""
        end = start + parts[0].shape[2]
        known = self._known()
        if start < known:  # rows it holds already (or released): written where they are held
            index = torch.arange(start, min(end, known))
            local = torch.searchsorted(self.held[:self.count], index)
            found = local < self.count
            found[found.clone()] = self.held[local[found]] == index[found]
            for tensor, part in zip(self.tensors, parts):
                tensor[:, :, local[found]] = part[:, :, found.nonzero().squeeze(1).to(part.device)].to(tensor.dtype)
            if end <= known:
                return
            parts, start = tuple(part[:, :, known - start:] for part in parts), known
        rows = end - start
        self.reserve(parts[0], 0)
        self._room(rows)
        for tensor, part in zip(self.tensors, parts):
            tensor[:, :, self.count:self.count + rows].copy_(part)
        self.held[self.count:self.count + rows] = torch.arange(start, end)
        self.count += rows

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, X]`` tensors to the global rows ``index`` (LongTensor ``[T]``, ascending, any
        device)."""
        index = index.to("cpu")
        for at, row in enumerate(index.tolist()):
            self.write(row, *(part[:, :, at:at + 1] for part in parts))

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Global rows ``[start, end)``, ``[B, H_kv, end - start, X]`` each (copies)."""
        return self.gather(torch.arange(start, end))

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Global rows ``index`` (LongTensor ``[N]``, any device), ``[B, H_kv, N, X]`` each (copies; rows not held
        or released read as zeros)."""
        index = index.to("cpu")
        b, h, _, x = self._like.shape
        out = [self._like.new_zeros(b, h, index.shape[0], x) for _ in range(self.parts)]
        if not self.count or not index.numel():
            return tuple(out)
        held = self.held[:self.count]
        local = torch.searchsorted(held, index).clamp(max=self.count - 1)
        found = held[local] == index
        if self.dead:
            found &= ~self._released_mask(index)
        at, rows = found.nonzero().squeeze(1), local[found]
        for new, tensor in zip(out, self.tensors):
            new[:, :, at] = tensor.index_select(2, rows)
        return tuple(out)

    def release(self, start: int, end: int) -> None:
        """Global rows ``[start, end)`` are never read again: they read as zeros, and once the released rows it
        holds outnumber the others, those others are packed into an allocation of twice their number."""
        self.released.add(start, end)
        if not self.count:
            return
        self.dead = int(self._released_mask(self.held[:self.count]).sum())
        if 2 * self.dead > self.count:
            live = self.count - self.dead
            self._pack(max(2 * live, 1))

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents as `TokenBuffer.load` does: only the rows kept are written, into an allocation of
        their number."""
        self.tensors, self.held, self.count, self.dead = None, torch.zeros(0, dtype=torch.long), 0, 0
        self.length, self.released, self._like = 0, ReleasedRuns(), None
        self.reserve(parts[0], 0)
        length = whole_length(parts, released)
        self._room(length - sum(end - start for start, end in released))
        for (start, end), at in kept_in(released, length):
            self.write(start, *(part[:, :, at: at + end - start] for part in parts))
        for start, end in released:
            self.released.add(start, end)
        self.length = length

    def synchronize(self) -> None:
        pass  # written synchronously: host memory that is not pinned
