"""One integer a step, kept as arithmetic runs (`StepValues`): each step's length, its first token, its frames, where
it was placed.

Kept one entry a step, such a list grows with the stream for good: a stream that never ends would hold eight of
them, a few dozen bytes a step. A steady stream's steps are alike (the same length, each placed a fixed distance
after the one before), so as runs ``[first, difference, count]`` each list takes a few runs at any age.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import torch


class StepValues(Sequence):
    """A list of ints (``append`` only) held as arithmetic runs, folded as `statekv.core.disk.compaction.runs`
    folds them: a run of one value takes any next value, a longer run the next value that continues it.

    A sequence (indexing, slices, iteration, ``len``, comparison with any sequence of ints) whose indexing costs
    O(log runs); `tensor` makes the whole list a LongTensor in O(runs) operations."""

    __hash__ = None  # mutable

    def __init__(self, values: Iterable[int] = ()):
        self._firsts, self._differences = array("q"), array("q")
        self._ends = array("q")  # each run's end: the values before it and in it
        for value in values:
            self.append(value)

    def append(self, value: int) -> None:
        value = int(value)
        if self._ends:
            count = self._ends[-1] - (self._ends[-2] if len(self._ends) > 1 else 0)
            if count == 1:
                self._differences[-1] = value - self._firsts[-1]
                self._ends[-1] += 1
                return
            if self._firsts[-1] + self._differences[-1] * count == value:
                self._ends[-1] += 1
                return
        self._firsts.append(value)
        self._differences.append(0)
        self._ends.append(len(self) + 1)

    def then(self, value: int) -> StepValues:
        """A copy with ``value`` appended (O(runs)): the steps so far and the one being run."""
        made = StepValues()
        made._firsts, made._differences = array("q", self._firsts), array("q", self._differences)
        made._ends = array("q", self._ends)
        made.append(value)
        return made

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[at] for at in range(*index.indices(len(self)))]
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError("step index out of range")
        run = len(self._ends) - 1 if index >= length - 1 else bisect.bisect_right(self._ends, index)
        start = self._ends[run - 1] if run else 0
        return self._firsts[run] + self._differences[run] * (index - start)

    def __iter__(self) -> Iterator[int]:
        start = 0
        for first, difference, end in zip(self._firsts, self._differences, self._ends):
            yield from range(first, first + difference * (end - start), difference) if difference else \
                (first for _ in range(end - start))
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepValues):
            return self.runs() == other.runs()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepValues({self.runs()})"

    def runs(self) -> list[list[int]]:
        """The values as runs ``[first, difference, count]``."""
        counts = [end - start for start, end in zip((0, *self._ends), self._ends)]
        return [[first, difference, count]
                for first, difference, count in zip(self._firsts, self._differences, counts)]

    def tensor(self) -> torch.Tensor:
        """The values as a LongTensor ``[len]`` on the host."""
        if not self._ends:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([first + difference * torch.arange(count, dtype=torch.long)
                          for first, difference, count in self.runs()])
