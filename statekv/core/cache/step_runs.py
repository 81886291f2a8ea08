"""A set of steps kept as its runs of consecutive steps (`StepRuns`): what a stream has evicted.

A stream evicting under a cap for weeks evicts nearly every step it ever streamed; kept one entry a step, the set
grows with the stream and every question that skips them walks it. Kept as runs, it holds the gaps between the
steps still held (bounded by the cap), and a question reads it in as many operations as there are runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, MutableSet, Sequence

import torch


class StepRuns(MutableSet):
    """Step indices (ints, at least 0) as sorted, disjoint, non-adjacent half-open runs ``[start, end)``.

    A set (``in``, ``len``, iteration in ascending order, ``add``, ``discard``, comparison with any set) whose
    membership costs O(log runs) and whose `runs`, `held_runs`, `count_from`, `below`, `total_over` and `mask`
    cost O(runs), however many steps it holds."""

    __hash__ = None  # mutable

    def __init__(self, steps: Iterable[int] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._count = 0
        for step in sorted(set(steps)):
            self.add(step)

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence[int]]) -> StepRuns:
        """The steps of ``runs`` (``[start, end)`` pairs, in any order, possibly overlapping)."""
        made = cls()
        for start, end in sorted((int(start), int(end)) for start, end in runs):
            if start >= end:
                continue
            if made._ends and start <= made._ends[-1]:
                made._count += max(0, end - made._ends[-1])
                made._ends[-1] = max(made._ends[-1], end)
            else:
                made._starts.append(start)
                made._ends.append(end)
                made._count += end - start
        return made

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        index = bisect.bisect_right(self._starts, step) - 1
        return index >= 0 and step < self._ends[index]

    def __iter__(self) -> Iterator[int]:
        for start, end in zip(self._starts, self._ends):
            yield from range(start, end)

    def __len__(self) -> int:
        return self._count

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepRuns):
            return self._starts == other._starts and self._ends == other._ends
        return super().__eq__(other)

    def __repr__(self) -> str:
        return f"StepRuns({self.runs()})"

    def add(self, step: int) -> None:
        index = bisect.bisect_right(self._starts, step) - 1
        if index >= 0 and step < self._ends[index]:
            return
        joins_left = index >= 0 and self._ends[index] == step
        joins_right = index + 1 < len(self._starts) and self._starts[index + 1] == step + 1
        if joins_left and joins_right:
            self._ends[index] = self._ends[index + 1]
            del self._starts[index + 1], self._ends[index + 1]
        elif joins_left:
            self._ends[index] = step + 1
        elif joins_right:
            self._starts[index + 1] = step
        else:
            self._starts.insert(index + 1, step)
            self._ends.insert(index + 1, step + 1)
        self._count += 1

    def discard(self, step: int) -> None:
        index = bisect.bisect_right(self._starts, step) - 1
        if index < 0 or step >= self._ends[index]:
            return
        start, end = self._starts[index], self._ends[index]
        pieces = [(first, last) for first, last in ((start, step), (step + 1, end)) if first < last]
        self._starts[index:index + 1] = [first for first, _ in pieces]
        self._ends[index:index + 1] = [last for _, last in pieces]
        self._count -= 1

    def copy(self) -> StepRuns:
        made = StepRuns()
        made._starts, made._ends, made._count = list(self._starts), list(self._ends), self._count
        return made

    def runs(self) -> list[list[int]]:
        """The runs, ``[start, end)`` pairs in ascending order."""
        return [[start, end] for start, end in zip(self._starts, self._ends)]

    def held_runs(self, total: int) -> list[tuple[int, int]]:
        """The runs of steps ``0 .. total - 1`` not in the set, ascending."""
        held, at = [], 0
        for start, end in zip(self._starts, self._ends):
            if start >= total:
                break
            if start > at:
                held.append((at, start))
            at = end
        if at < total:
            held.append((at, total))
        return held

    def count_from(self, first: int) -> int:
        """How many steps of the set are ``first`` or later."""
        return sum(end - max(start, first) for start, end in zip(self._starts, self._ends) if end > first)

    def below(self, end: int) -> StepRuns:
        """The steps of the set before ``end``."""
        return StepRuns.from_runs((start, min(stop, end)) for start, stop in zip(self._starts, self._ends)
                                  if start < end)

    def total_over(self, prefix: Sequence[int]) -> int:
        """The sum, over the set's steps, of a per-step value given as its running totals (``prefix[s]``: the sum
        of the values of the steps before ``s``)."""
        return sum(prefix[end] - prefix[start] for start, end in zip(self._starts, self._ends))

    def mask(self, total: int) -> torch.Tensor:
        """``[total]`` bool: which of the steps ``0 .. total - 1`` are in the set."""
        mask = torch.zeros(total, dtype=torch.bool)
        for start, end in zip(self._starts, self._ends):
            mask[start:min(end, total)] = True
        return mask

    def tensor(self) -> torch.Tensor:
        """``[len]`` LongTensor of the steps, ascending."""
        if not self._starts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(start, end) for start, end in zip(self._starts, self._ends)])
