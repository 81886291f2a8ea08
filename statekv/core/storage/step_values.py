"""One integer a step, kept as arithmetic runs (`StepValues`): each step's length, its first token, its frames, where
it was placed.

Kept one entry a step, such a list grows with the stream for good: a stream that never ends would hold eight of
them, a few dozen bytes a step. A steady stream's steps are alike (the same length, each placed a fixed distance
after the one before), so as runs ``[first, difference, count]`` each list takes a few runs at any age.

A list whose values vary step to step folds into about one run per two values, where runs cost more than the
values themselves; such a list turns dense (an ``array('q')``, one entry a step) once it holds more than one run per
four values, and stays so.
"""

from __future__ import annotations

import bisect
import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import overload

import torch

FEWEST_RUNS_DENSE = 64  # a short list stays as runs whatever its shape: a stream's first steps often differ


class StepValues(Sequence):
    """A list of ints (``append`` only) held as arithmetic runs, folded as `statekv.core.disk.compaction.runs`
    folds them: a run of one value takes any next value, a longer run the next value that continues it; or, once
    the runs outnumber a quarter of the values (and `FEWEST_RUNS_DENSE`), held dense, one value a step (`dense`).

    A sequence (indexing, slices, iteration, ``len``, comparison with any sequence of ints) whose indexing costs
    O(log runs); slices and iteration go a run at a time; `tensor` (and `totals`, its running sums) makes the whole
    list a LongTensor in a few tensor operations. ``StepValues(other)`` copies another as it is held."""

    __hash__ = None  # mutable

    def __init__(self, values: Iterable[int] = ()):
        self._runs: _Runs | None = _Runs()
        self._dense: array | None = None  # the values, once the list turned dense (then ``_runs`` is None)
        if isinstance(values, StepValues):
            self._runs = None if values._runs is None else values._runs.copy()
            self._dense = None if values._dense is None else array("q", values._dense)
            return
        for value in values:
            self.append(value)

    @property
    def dense(self) -> bool:
        """Whether the values are held one a step (a list too irregular for runs) rather than as runs."""
        return self._dense is not None

    @property
    def nbytes(self) -> int:
        """Host bytes the values take as held (their runs' arrays, or the dense array)."""
        if self._dense is not None:
            return len(self._dense) * self._dense.itemsize
        runs = self._runs
        return sum(len(held) * held.itemsize for held in (runs.firsts, runs.differences, runs.ends))

    def append(self, value: int) -> None:
        value = int(value)
        if self._dense is not None:
            self._dense.append(value)
            return
        runs = self._runs
        runs.append(value)
        if len(runs.ends) > FEWEST_RUNS_DENSE and 4 * len(runs.ends) > runs.ends[-1]:
            self._dense, self._runs = array("q", self), None

    def extend_run(self, first: int, difference: int, count: int) -> None:
        """Append the ``count`` values ``first, first + difference, ...`` as many appends would fold them, in
        O(1) once the run they make goes on (O(count) once dense): a compacted journal's runs read back whole."""
        value = int(first)
        while count > 0:
            runs = self._runs
            if runs is not None and len(runs.ends) and runs.differences[-1] == difference and \
                    runs.ends[-1] - (runs.ends[-2] if len(runs.ends) > 1 else 0) > 1 and \
                    runs.firsts[-1] + difference * (runs.ends[-1] - (runs.ends[-2] if len(runs.ends) > 1 else 0)) \
                    == value:
                runs.ends[-1] += count  # every value goes on the last run: no run is added, none turns it dense
                return
            if self._dense is not None:
                self._dense.extend(range(value, value + difference * count, difference) if difference else
                                   repeat(value, count))
                return
            self.append(value)
            value, count = value + difference, count - 1

    def total(self, start: int = 0, stop: int | None = None) -> int:
        """The sum of the values ``start .. stop - 1`` (default: all), in O(runs) (O(stop - start) once dense)."""
        stop = len(self) if stop is None else min(stop, len(self))
        if stop <= start:
            return 0
        if self._dense is not None:
            return sum(self._dense[start:stop])
        runs, summed = self._runs, 0
        run = bisect.bisect_right(runs.ends, start)
        begin = runs.ends[run - 1] if run else 0
        while begin < stop:
            end, first, difference = runs.ends[run], runs.firsts[run], runs.differences[run]
            count, low = min(stop, end) - max(start, begin), first + difference * (max(start, begin) - begin)
            summed += count * low + difference * count * (count - 1) // 2
            begin, run = end, run + 1
        return summed

    def within(self, low: int, high: int, start: int = 0) -> bool:
        """Whether every value from ``start`` on is ``low`` to ``high``: each run checked by its ends (O(runs))."""
        for first, difference, count in self.runs():
            skipped, start = min(start, count), start - min(start, count)
            first, count = first + difference * skipped, count - skipped
            if count and not low <= first <= high or count and not low <= first + difference * (count - 1) <= high:
                return False
        return True

    def totals_at(self, steps: Iterable[int]) -> dict[int, int]:
        """The running total before each of ``steps`` within the list (what ``totals()[step]`` gives), summed run by
        run up to the last of them, without a tensor of every value."""
        totals, at, total = {}, 0, 0
        for step in sorted({step for step in steps if 0 <= step < len(self)}):
            at, total = step, total + self.total(at, step)
            totals[step] = total
        return totals

    def gathered(self, index: torch.Tensor) -> torch.Tensor:
        """``self.tensor()[index]`` for a LongTensor ``index`` on the host (each within the list), without a tensor
        of every value: each found by its run (O(len(index) log runs)), or read from a dense list in place."""
        if self._dense is not None:
            return torch.frombuffer(self._dense, dtype=torch.long)[index] if len(index) else \
                torch.zeros(index.shape, dtype=torch.long)  # in place: released before anything appends
        if not len(self._runs.ends):
            return torch.zeros(index.shape, dtype=torch.long)
        ends = _long(self._runs.ends)
        run = torch.searchsorted(ends, index, right=True)
        begins = ends - torch.diff(ends, prepend=torch.zeros(1, dtype=torch.long))
        return _long(self._runs.firsts)[run] + _long(self._runs.differences)[run] * (index - begins[run])

    def searched(self, values: torch.Tensor) -> torch.Tensor:
        """``torch.searchsorted(self.tensor(), values, right=True)`` for a non-decreasing list and LongTensor
        ``values`` on the host, without a tensor of every value: searched run by run (O(len(values) log runs)), or
        a dense list in place."""
        if not len(self):
            return torch.zeros_like(values)
        if self._dense is not None:
            held = torch.frombuffer(self._dense, dtype=torch.long)  # in place: released before anything appends
            return torch.searchsorted(held, values, right=True)
        runs = self._runs
        firsts, differences, ends = _long(runs.firsts), _long(runs.differences), _long(runs.ends)
        counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.long))
        run = (torch.searchsorted(firsts, values, right=True) - 1).clamp(min=0)
        first, difference, count = firsts[run], differences[run], counts[run]
        steps = torch.div(values - first, difference.clamp(min=1), rounding_mode="floor") + 1
        within = torch.where(difference > 0, steps, count).clamp(max=count)
        return torch.where(values < firsts[0], 0, ends[run] - count + within)

    def then(self, value: int) -> StepValues:
        """A copy with ``value`` appended (O(runs), or O(len) once dense): the steps so far and the one being
        run."""
        made = StepValues(self)
        made.append(value)
        return made

    def __len__(self) -> int:
        if self._dense is not None:
            return len(self._dense)
        return self._runs.ends[-1] if self._runs.ends else 0

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        length = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(length)
            if step != 1:
                return [self[at] for at in range(start, stop, step)]
            if stop <= start:
                return []
            if self._dense is not None:
                return self._dense[start:stop].tolist()
            return list(chain.from_iterable(self._runs.pieces(start, stop)))
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError("step index out of range")
        if self._dense is not None:
            return self._dense[index]
        return self._runs.at(index)

    def __iter__(self) -> Iterator[int]:
        if self._dense is not None:
            return iter(self._dense)
        return chain.from_iterable(self._runs.pieces(0, len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepValues):
            if len(other) != len(self):
                return False
            if self._runs is not None and other._runs is not None:  # one list folds into one set of runs
                return self._runs == other._runs
            return self._values() == other._values()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(map(operator.eq, self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepValues({self.runs()})"

    def runs(self) -> list[list[int]]:
        """The values as runs ``[first, difference, count]`` (folded afresh from the values once dense)."""
        runs = self._runs
        if runs is None:
            runs = _Runs()
            for value in self._dense:
                runs.append(value)
        counts = [end - start for start, end in zip((0, *runs.ends), runs.ends)]
        return [[first, difference, count]
                for first, difference, count in zip(runs.firsts, runs.differences, counts)]

    def tensor(self) -> torch.Tensor:
        """The values as a LongTensor ``[len]`` on the host."""
        if self._dense is not None:
            return _long(self._dense)
        if len(self._runs.ends) <= FEWEST_RUNS_DENSE:  # a few long runs: an arange each beats the gathers below
            return torch.cat([torch.zeros(0, dtype=torch.long)] +
                             [first + difference * torch.arange(count, dtype=torch.long)
                              for first, difference, count in self.runs()])
        ends = _long(self._runs.ends)
        counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.long))
        run = torch.repeat_interleave(torch.arange(len(ends)), counts)
        offsets = torch.arange(len(self)) - (ends - counts)[run]
        return _long(self._runs.firsts)[run] + _long(self._runs.differences)[run] * offsets

    def running_totals(self, initial: int = 0) -> StepValues:
        """The running totals from ``initial`` (``len + 1`` values: entry ``s`` is ``initial`` plus the values
        before step ``s``), made a run at a time: a run of equal values is one run of totals, so a steady stream's
        steps cost a few operations at any age (O(len) once dense, or where runs of two alternate)."""
        made, total = StepValues([initial]), int(initial)
        if self._dense is not None:
            for value in self._dense:
                total += value
                made.append(total)
            return made
        for first, difference, count in self.runs():
            if difference:  # totals of a rising run rise faster each step: not arithmetic
                for value in range(first, first + difference * count, difference):
                    total += value
                    made.append(total)
            else:
                made.extend_run(total + first, first, count)
                total += first * count
        return made

    def totals(self) -> torch.Tensor:
        """The running totals as a LongTensor ``[len + 1]`` on the host: entry ``s`` is the sum of the values
        before step ``s``."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.tensor().cumsum(0)])

    def _values(self) -> array:
        return self._dense if self._dense is not None else array("q", self)


class _Runs:
    """Arithmetic runs: each run's first value, its difference (0 for a run of one) and its end (the values
    before it and in it)."""

    def __init__(self):
        self.firsts, self.differences, self.ends = array("q"), array("q"), array("q")

    def copy(self) -> _Runs:
        made = _Runs()
        made.firsts, made.differences, made.ends = array("q", self.firsts), array("q", self.differences), \
            array("q", self.ends)
        return made

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Runs) and self.ends == other.ends and self.firsts == other.firsts \
            and self.differences == other.differences

    def append(self, value: int) -> None:
        if self.ends:
            count = self.ends[-1] - (self.ends[-2] if len(self.ends) > 1 else 0)
            if count == 1:
                self.differences[-1] = value - self.firsts[-1]
                self.ends[-1] += 1
                return
            if self.firsts[-1] + self.differences[-1] * count == value:
                self.ends[-1] += 1
                return
        self.firsts.append(value)
        self.differences.append(0)
        self.ends.append((self.ends[-1] if self.ends else 0) + 1)

    def at(self, index: int) -> int:
        """The value at ``index`` (within the runs' length)."""
        last = len(self.ends) - 1
        run = last if index >= self.ends[-1] - 1 else bisect.bisect_right(self.ends, index)
        start = self.ends[run - 1] if run else 0
        return self.firsts[run] + self.differences[run] * (index - start)

    def pieces(self, start: int, stop: int) -> Iterator[Iterable[int]]:
        """The values ``start .. stop - 1`` (within the runs' length, ``start < stop``), one iterable a run: the
        first and last runs cut, those between whole."""
        run = bisect.bisect_right(self.ends, start)
        begin = self.ends[run - 1] if run else 0
        while begin < stop:
            end, first, difference = self.ends[run], self.firsts[run], self.differences[run]
            low, high = max(start, begin), min(stop, end)
            low_value = first + difference * (low - begin)
            yield range(low_value, low_value + difference * (high - low), difference) if difference else \
                repeat(first, high - low)
            begin, run = end, run + 1


def _long(values: array) -> torch.Tensor:
    """``values`` as a LongTensor of their own (copied while the GIL is held: no export of the array outlives the
    call, so a concurrent ``append`` never meets one)."""
    if not values:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(values), dtype=torch.long)


def aligned_runs(*runs: Sequence[Sequence[int]]) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """The values of lists given as ``runs`` (each ``[first, difference, count]``, as `StepValues.runs`; the lists
    as long as each other) a piece at a time, cut where a run of any ends: ``(count, [(first, difference), ...])``,
    each list arithmetic over the piece; as many pieces as their runs together."""
    at, taken = [0] * len(runs), [0] * len(runs)
    while runs and at[0] < len(runs[0]):
        count = min(held[index][2] - took for held, index, took in zip(runs, at, taken))
        yield count, [(held[index][0] + held[index][1] * took, held[index][1])
                      for held, index, took in zip(runs, at, taken)]
        for k, held in enumerate(runs):
            taken[k] += count
            if taken[k] == held[at[k]][2]:
                at[k], taken[k] = at[k] + 1, 0
