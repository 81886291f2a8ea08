"""A set of steps kept as its runs of consecutive steps (`StepRuns`): what a stream has evicted.

A stream evicting under a cap for weeks evicts nearly every step it ever streamed; kept one entry a step, the set
grows with the stream and every question that skips them walks it. Kept as runs, it holds the gaps between the
steps still held (bounded by the cap), and a question reads it in as many operations as there are runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, MutableSet, Sequence

import torch

from ..storage.host_pages import ReleasedRuns


class StepRuns(MutableSet):
    """Step indices (ints, at least 0) as sorted, disjoint, non-adjacent half-open runs ``[start, end)``.

    A set (``in``, ``len``, iteration in ascending order, ``add``, ``discard``, comparison with any set) whose
    membership costs O(log runs) and whose `runs`, `held_runs`, `count_from`, `below`, `total_over` and `mask`
    cost O(runs), however many steps it holds."""

    __hash__ = None  # mutable

    def __init__(self, steps: Iterable[int] = ()):
        self._runs = ReleasedRuns()  # the same merged runs a buffer keeps of the rows it gave back
        for step in sorted(set(steps)):
            self.add(step)

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence[int]]) -> StepRuns:
        """The steps of ``runs`` (``[start, end)`` pairs, in any order, possibly overlapping)."""
        made = cls()
        for start, end in runs:
            if int(start) < int(end):
                made._runs.add(int(start), int(end))
        return made

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        index = bisect.bisect_right(self._runs.starts, step) - 1
        return index >= 0 and step < self._runs.ends[index]

    def __iter__(self) -> Iterator[int]:
        for start, end in zip(self._runs.starts, self._runs.ends):
            yield from range(start, end)

    def __len__(self) -> int:
        return self._runs.rows

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepRuns):
            return self.runs() == other.runs()
        return super().__eq__(other)

    def __repr__(self) -> str:
        return f"StepRuns({self.runs()})"

    def add(self, step: int) -> None:
        self._runs.add(step, step + 1)

    def discard(self, step: int) -> None:
        starts, ends = self._runs.starts, self._runs.ends
        index = bisect.bisect_right(starts, step) - 1
        if index < 0 or step >= ends[index]:
            return
        pieces = [(first, last) for first, last in ((starts[index], step), (step + 1, ends[index])) if first < last]
        starts[index:index + 1] = [first for first, _ in pieces]
        ends[index:index + 1] = [last for _, last in pieces]
        self._runs.rows -= 1

    def copy(self) -> StepRuns:
        return StepRuns.from_runs(self.runs())

    def runs(self) -> list[list[int]]:
        """The runs, ``[start, end)`` pairs in ascending order."""
        return [[start, end] for start, end in zip(self._runs.starts, self._runs.ends)]

    def held_runs(self, total: int) -> list[tuple[int, int]]:
        """The runs of steps ``0 .. total - 1`` not in the set, ascending."""
        return self._runs.kept(total)

    def count_from(self, first: int) -> int:
        """How many steps of the set are ``first`` or later."""
        return sum(end - max(start, first) for start, end in zip(self._runs.starts, self._runs.ends) if end > first)

    def below(self, end: int) -> StepRuns:
        """The steps of the set before ``end``."""
        return StepRuns.from_runs((start, min(stop, end)) for start, stop in zip(self._runs.starts, self._runs.ends)
                                  if start < end)

    def total_over(self, prefix: Sequence[int]) -> int:
        """The sum, over the set's steps, of a per-step value given as its running totals (``prefix[s]``: the sum
        of the values of the steps before ``s``)."""
        return sum(prefix[end] - prefix[start] for start, end in zip(self._runs.starts, self._runs.ends))

    def mask(self, total: int) -> torch.Tensor:
        """``[total]`` bool: which of the steps ``0 .. total - 1`` are in the set."""
        mask = torch.zeros(total, dtype=torch.bool)
        for start, end in zip(self._runs.starts, self._runs.ends):
            mask[start:min(end, total)] = True
        return mask

    def tensor(self) -> torch.Tensor:
        """``[len]`` LongTensor of the steps, ascending."""
        if not self._runs.starts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(start, end) for start, end in zip(self._runs.starts, self._runs.ends)])
