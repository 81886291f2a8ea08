"""Giving rows of host memory back to the OS: a buffer's rows ``[B, H_kv, capacity, X]`` that will never be read
again (evicted steps, `statekv.core.storage.limits`) read as zeros, and the whole pages they cover are returned,
so a stream that evicts holds the memory of what it keeps, not of everything it streamed.

A row is far smaller than a page (a step of a few tokens), so pages are returned as runs of released rows come to
cover them (`ReleasedRuns` merges the runs), and a buffer that grows leaves the released runs out of its copy.
Pinned memory (offloaded from a GPU) cannot be returned this way: its released rows are zeroed only.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence

import torch

RELEASED = ".released"  # a saved tensor's runs of rows given back (left out of it), `saved_rows`
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class ReleasedRuns:
    """Disjoint ``[start, end)`` runs of released rows, ascending, merged as they are added (touching ones too)."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.rows = 0  # released, all runs together

    def add(self, start: int, end: int) -> tuple[int, int]:
        """Add rows ``[start, end)``; returns the merged run now holding them."""
        first = bisect.bisect_left(self.ends, start)
        last = bisect.bisect_right(self.starts, end)
        if first < last:
            start, end = min(start, self.starts[first]), max(end, self.ends[last - 1])
        self.rows += end - start - sum(b - a for a, b in zip(self.starts[first:last], self.ends[first:last]))
        self.starts[first:last], self.ends[first:last] = [start], [end]
        return start, end

    def within(self, end: int) -> list[tuple[int, int]]:
        """The runs below row ``end``, cut at it."""
        return [(a, min(b, end)) for a, b in zip(self.starts, self.ends) if a < end]

    def kept(self, end: int) -> list[tuple[int, int]]:
        """The runs of rows below ``end`` not released."""
        kept, at = [], 0
        for a, b in self.within(end):
            if a > at:
                kept.append((at, a))
            at = b
        return kept + [(at, end)] if at < end else kept


def kept_in(released: Sequence[tuple[int, int]], length: int) -> list[tuple[tuple[int, int], int]]:
    """The runs of rows below ``length`` outside ``released`` (ascending disjoint runs), each with where it starts
    among the kept rows alone (what a saved state holds of a buffer with released rows)."""
    runs = ReleasedRuns()
    for start, end in released:
        runs.add(start, end)
    kept, at = [], 0
    for start, end in runs.kept(length):
        kept.append(((start, end), at))
        at += end - start
    return kept


def whole_length(parts: Sequence[torch.Tensor], released: Sequence[tuple[int, int]]) -> int:
    """The rows of a buffer saved as ``parts`` ``[B, H_kv, kept, X]`` without its ``released`` runs."""
    return parts[0].shape[2] + sum(end - start for start, end in released)


def write_kept(buffer, parts: Sequence[torch.Tensor], released: Sequence[tuple[int, int]]) -> int:
    """Write ``parts`` (a buffer's rows outside ``released``, see `kept_in`) into the empty ``buffer`` (a
    `TokenBuffer`'s ``reserve``/``write``) at their places; returns the whole length (the caller releases the runs
    and sets it)."""
    length = whole_length(parts, released)
    if length:
        buffer.reserve(parts[0], length)
        for (start, end), at in kept_in(released, length):
            buffer.write(start, *(part[:, :, at: at + end - start] for part in parts))
    return length


def saved(names: Sequence[str], buffer, end: int) -> dict[str, torch.Tensor]:
    """``buffer``'s rows below ``end`` as a saved state holds them: part ``i`` named ``names[i]``, each with
    ``{name}.released`` (LongTensor ``[R, 2]``) when it was saved without released rows (`saved_rows`)."""
    parts, released = saved_rows(buffer, end)
    tensors = dict(zip(names, parts))
    if released:
        tensors.update({name + RELEASED: torch.tensor(released, dtype=torch.long) for name in names})
    return tensors


def saved_rows(buffer, end: int) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, int]]]:
    """What a saved state holds of ``buffer``'s rows below ``end`` (any buffer with TokenBuffer's ``view`` and
    ``gather``): its parts ``[B, H_kv, kept, X]`` without the rows it released, and the released runs ``[start,
    end)`` left out (none: the views of every row). Only kept rows are read (`gather`), so a buffer that gave back
    most of its history saves without reading it."""
    runs = getattr(buffer, "released", None)
    released = runs.within(end) if runs is not None else []
    if not released:
        return buffer.view(0, end), []
    kept = [torch.arange(start, stop) for (start, stop), _ in kept_in(released, end)]
    return buffer.gather(torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)), released


def with_released(parts: Sequence[torch.Tensor], released: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Tensors ``[B, H_kv, kept, X]`` holding the rows outside ``released`` (see `kept_in`) as whole tensors
    ``[B, H_kv, length, X]``, the released rows zeros."""
    if not released:
        return tuple(parts)
    length = whole_length(parts, released)
    whole = []
    for part in parts:
        rows = part.new_zeros(*part.shape[:2], length, part.shape[3])
        for (start, end), at in kept_in(released, length):
            rows[:, :, start:end] = part[:, :, at: at + end - start]
        whole.append(rows)
    return tuple(whole)


def returnable(tensor: torch.Tensor) -> bool:
    """Whether pages of ``tensor`` can be returned to the OS (CPU memory, not pinned)."""
    return tensor.device.type == "cpu" and not tensor.is_pinned()


def free_rows(tensor: torch.Tensor, start: int, end: int, run: tuple[int, int] | None = None, *,
              zero: bool = True) -> None:
    """Rows ``[start, end)`` of ``tensor`` ``[B, H_kv, capacity, X]`` read as zeros from now on (``zero`` False:
    scratch rows, whatever they read), and the whole pages of the released ``run`` (default: the rows themselves)
    that they touch go back to the OS."""
    run_start, run_end = run or (start, end)
    if not returnable(tensor):
        if zero:
            tensor[:, :, start:end].zero_()
        return
    page, row_bytes = mmap.PAGESIZE, tensor.shape[-1] * tensor.element_size()
    for b in range(tensor.shape[0]):
        for h in range(tensor.shape[1]):
            rows = tensor[b, h]
            base = rows.data_ptr()
            low = max(base + run_start * row_bytes, (base + start * row_bytes) // page * page)
            high = min(base + run_end * row_bytes, -(-(base + end * row_bytes) // page) * page)
            first, last = -(-low // page) * page, high // page * page
            if last <= first:
                if zero:
                    rows[start:end].zero_()
                continue
            if zero:  # rows outside the whole pages are zeroed; those in them read as zeros once they are returned
                rows[start: max(start, min(end, -(-(first - base) // row_bytes)))].zero_()
                rows[min(end, max(start, (last - base) // row_bytes)): end].zero_()
            if _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
                rows[start:end].zero_()  # not given back (locked memory...): read as zeros all the same
