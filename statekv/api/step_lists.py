"""A saved stream's lists with an entry per step, kept in its file as arithmetic runs.

A stream's metadata lists every step it ever streamed: each step's token count, the steps it evicted, each step's
placement under bounded positions. Written out one by one they grew a file's header by about 25 bytes a frame, and
the header is bounded (`stream_file.MAX_METADATA_CHARS`): a stream of a few million frames could be saved but no
longer loaded. In the file (stream format 3) each such list is ``{"runs": [[*first, *step, count], ...]}``: runs of
entries that change by the same step each time (a step's token count, constant; its placement, advancing by its
span; the evicted steps, consecutive), so a steady stream's lists take a few runs whatever its age. Entries are
integers, or rows of ``columns`` integers (``{"columns": 3, "runs": ...}``). `compacted` writes them (from lists, or
from the runs the engine holds them as: a save makes no list a step); `held` reads them back as the engine holds them
(`StepValues`, three of them for rows of three, `StepRuns` for the evicted steps), a run at a time, so a stream
that evicted for weeks loads in memory and time that follow its runs; `expanded` reads them back into lists. Format 2
files hold the lists themselves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..core.cache.step_runs import StepRuns
from ..core.storage.memory import available_bytes
from ..core.storage.step_values import StepValues, aligned_runs
from ..errors import InputError

# where a saved stream's metadata lists an entry per step, and how many integers an entry is (1: an integer)
STEP_LISTS = {("cache", "chunk_lengths"): 1, ("cache", "evicted_steps"): 1, ("cache", "positions", "steps"): 3,
              ("successor", "chunk_lengths"): 1, ("successor", "evicted_steps"): 1,
              ("successor", "positions", "steps"): 3}
SETS = {("cache", "evicted_steps"), ("successor", "evicted_steps")}  # sets of steps, held as `StepRuns`
# Expanded, a file's lists take memory its runs do not (about this much a value: a row counts each of its values),
# so what they may expand to in all is what the memory available holds, at least `MIN_VALUES` (a steady stream
# lists 5 values a step: its length, placement and eviction): a forged file of a few runs cannot exhaust it
BYTES_PER_VALUE = 64
MIN_VALUES = 1 << 24
INT64 = (-(1 << 63), (1 << 63) - 1)


def values_budget() -> int:
    """How many values a file's per-step lists may expand to in all (see `BYTES_PER_VALUE`)."""
    available = available_bytes(torch.device("cpu"))
    return MIN_VALUES if available is None else max(MIN_VALUES, available // BYTES_PER_VALUE)


def arithmetic_runs(entries: list) -> dict[str, Any]:
    """``entries`` (integers, or rows of as many integers each) as runs ``[*first, *step, count]``: from each run's
    first entry, as far as the entries keep changing by the step between its first two."""
    rows = isinstance(entries[0], list)
    values = np.asarray(entries, dtype=np.int64).reshape(len(entries), -1)
    steps = np.diff(values, axis=0)
    turns = np.flatnonzero((steps[1:] != steps[:-1]).any(1)) + 1  # where the step between entries changes
    runs, at, still = [], 0, [0] * values.shape[1]
    while at < len(values):
        turn = np.searchsorted(turns, at, side="right")
        last = int(turns[turn]) if turn < len(turns) else len(values) - 1
        count = last - at + 1
        runs.append([*values[at].tolist(), *(steps[at].tolist() if count > 1 else still), count])
        at += count
    return {"columns": values.shape[1], "runs": runs} if rows else {"runs": runs}


def expand_runs(saved: Any, name: str, columns: int = 1, budget: list[int] | None = None) -> list:
    """The entries ``saved`` (what `arithmetic_runs` wrote, entries of ``columns`` integers) lists; a one-line
    `InputError` naming ``name`` when it is malformed or lists more values than ``budget[0]`` (default:
    `values_budget`), which it takes them from."""
    runs = _checked_runs(saved, name, columns)
    _take(budget, columns * sum(run[-1] for run in runs), name)
    if not runs:
        return []
    table = np.asarray(runs, dtype=np.int64)
    counts = table[:, -1]
    run_of = np.repeat(np.arange(len(runs)), counts)
    offset = np.arange(len(run_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    entries = table[run_of, :columns] + offset[:, None] * table[run_of, columns: 2 * columns]
    return entries.tolist() if columns > 1 else entries[:, 0].tolist()


def held_runs(saved: Any, name: str, columns: int = 1, budget: list[int] | None = None,
              as_set: bool = False) -> StepValues | tuple[StepValues, ...] | StepRuns:
    """What ``saved`` (as `expand_runs` reads it) lists, as the engine holds it, built a run at a time: a
    `StepValues`, a tuple of ``columns`` of them (a column each), or, ``as_set``, a `StepRuns` of the steps. Only
    values a list holds one by one (once it turns dense, `StepValues.dense`; a set's steps not consecutive) are
    taken from ``budget[0]``; a one-line `InputError` as `expand_runs`'s."""
    runs = _checked_runs(saved, name, columns)
    if as_set:
        ranges = []
        for first, step, count in runs:
            if count > 1 and step not in (0, 1):  # not a run of consecutive steps: each a run of its own
                _take(budget, count, name)
                ranges.extend((value, value + 1) for value in range(first, first + step * count, step))
            else:  # consecutive steps, or one listed ``count`` times (a set holds it once, as a list's)
                ranges.append((first, first + (count if step else 1)))
        return StepRuns.from_runs(ranges)
    made = tuple(StepValues() for _ in range(columns))
    for run in runs:
        count = run[-1]
        for values, first, step in zip(made, run[:columns], run[columns:2 * columns]):
            head = min(count, 3)  # after three values the list's last run is this one's: the rest costs O(1)
            values.extend_run(first, step, head)
            if count > head:
                if values.dense:
                    _take(budget, count - head, name)
                values.extend_run(first + step * head, step, count - head)
    return made[0] if columns == 1 else made


def _checked_runs(saved: Any, name: str, columns: int) -> list[list[int]]:
    runs = saved.get("runs") if isinstance(saved, dict) else None
    if (not isinstance(runs, list) or set(saved) - {"runs", "columns"}
            or saved.get("columns", 1) != columns or (columns > 1) != ("columns" in saved)
            or not all(isinstance(run, list) and len(run) == 2 * columns + 1 and all(type(v) is int for v in run)
                       and run[-1] >= 1 for run in runs)):
        raise InputError(f"{name} must be a list or its runs ({{\"runs\": [[*first, *step, count], ...]}}"
                         + (f", rows of {columns}" if columns > 1 else "") + ")")
    low, high = INT64
    if not all(low <= v <= high for run in runs for v in run) or not all(
            low <= v + (run[-1] - 1) * run[columns + i] <= high for run in runs for i, v in enumerate(run[:columns])):
        raise InputError(f"{name} lists an entry past the 64-bit integers")
    return runs


def _take(budget: list[int] | None, values: int, name: str) -> None:
    """Take ``values`` from ``budget[0]`` (None: a budget of its own, `values_budget`), refusing more."""
    budget = [values_budget()] if budget is None else budget
    if values > budget[0]:
        raise InputError(f"{name} lists more steps than this machine's memory holds once expanded (its per-step "
                         f"lists hold {values:,} values; {budget[0]:,} more fit in the memory available)")
    budget[0] -= values


def compacted(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with its per-step lists (`STEP_LISTS`) as runs (the lists given are left as they are): lists,
    or the engine's own runs (`StepValues`, a tuple of them for rows, `StepRuns`), read a run at a time."""
    metadata = copy.copy(metadata)
    for path in STEP_LISTS:
        holder = _holder(metadata, path, copy_along=True)
        value = holder.get(path[-1]) if holder is not None else None
        if isinstance(value, list) and value:
            holder[path[-1]] = arithmetic_runs(value)
        elif isinstance(value, (StepValues, StepRuns, tuple)):
            holder[path[-1]] = written_runs(value)
    return metadata


def written_runs(values: StepValues | tuple[StepValues, ...] | StepRuns) -> Any:
    """What `arithmetic_runs` writes of the list the engine holds as ``values`` (an empty list: ``[]``), found from
    its runs (the rows of several `StepValues` read in pieces cut where a run of any ends, folded as
    `arithmetic_runs` folds rows: a few steps a piece)."""
    if isinstance(values, StepRuns):
        pieces = (((start,), (1,), end - start) for start, end in values.runs())
    else:
        columns = values if isinstance(values, tuple) else (values,)
        pieces = ((tuple(first for first, _ in parts), tuple(step for _, step in parts), count)
                  for count, parts in aligned_runs(*(column.runs() for column in columns)))
    runs = _folded(pieces)
    if not runs:
        return []
    return {"columns": len(values), "runs": runs} if isinstance(values, tuple) else {"runs": runs}


def _folded(pieces: Any) -> list[list[int]]:
    """`arithmetic_runs`' runs of the entries given as ``pieces`` (``(first, step, count)``, ``first`` and ``step``
    tuples of a value a column: ``count`` entries ``first + i * step``): from each run's first entry, as far as the
    entries keep changing by the step between its first two."""
    runs: list[list[int]] = []
    first = step = None  # the run being made: its first entry and its step (None while it holds one entry)
    count = 0
    for start, change, left in pieces:
        at = 0
        while at < left:
            entry = tuple(value + at * by for value, by in zip(start, change))
            if first is not None and step is None:
                step, count = tuple(b - a for a, b in zip(first, entry)), 2
            elif first is not None and all(a + s * count == b for a, s, b in zip(first, step, entry)):
                count += 1
            else:
                if first is not None:
                    runs.append([*first, *(step or (0,) * len(first)), count])
                first, step, count = entry, None, 1
            at += 1
            if step == change and at < left:  # the rest of the piece goes on this run
                count, at = count + left - at, left
    if first is not None:
        runs.append([*first, *(step or (0,) * len(first)), count])
    return runs


def expanded(metadata: dict[str, Any], where: str, budget: int | None = None) -> dict[str, Any]:
    """``metadata`` as read from a format 3 file with its per-step lists expanded (in place, at most ``budget``
    values in all: default `values_budget`); a one-line `InputError` naming ``where`` and the field when one is
    malformed."""
    budget = [values_budget() if budget is None else budget]
    for path, columns in STEP_LISTS.items():
        holder = _holder(metadata, path)
        if holder is not None and isinstance(holder.get(path[-1]), dict):
            try:
                holder[path[-1]] = expand_runs(holder[path[-1]], "metadata." + ".".join(path), columns, budget)
            except InputError as error:
                raise InputError(f"{where}: malformed stream metadata: {error}") from None
    return metadata


def held(metadata: dict[str, Any], where: str, budget: int | None = None) -> dict[str, Any]:
    """``metadata`` as read from a format 3 file with its per-step lists as the engine holds them (`held_runs`: in
    place, at most ``budget`` values held one by one in all: default `values_budget`); a one-line `InputError`
    naming ``where`` and the field when one is malformed."""
    budget = [values_budget() if budget is None else budget]
    for path, columns in STEP_LISTS.items():
        holder = _holder(metadata, path)
        if holder is not None and isinstance(holder.get(path[-1]), dict):
            try:
                holder[path[-1]] = held_runs(holder[path[-1]], "metadata." + ".".join(path), columns, budget,
                                             as_set=path in SETS)
            except InputError as error:
                raise InputError(f"{where}: malformed stream metadata: {error}") from None
    return metadata


def held_check(listed: Callable[[Any, str], Any], minimum: int) -> Callable[[Any, str], Any]:
    """A stream file schema's check of a per-step list: ``listed`` (a format 2 file's list), or of the runs `held`
    reads a format 3 file's as (a `StepValues` or `StepRuns`), every value at least ``minimum`` (by their ends)."""
    def check(value: Any, name: str) -> Any:
        if isinstance(value, StepValues) and not value.within(minimum, INT64[1]) or \
                isinstance(value, StepRuns) and value and value.runs()[0][0] < minimum:
            raise InputError(f"{name} must list integers >= {minimum}")
        return value if isinstance(value, (StepValues, StepRuns)) else listed(value, name)
    return check


def steps_of(*lists: Sequence[int]) -> StepValues:
    """The per-step ``lists`` given (lists, or `StepValues` as `held` reads them) one after another, as runs: two
    compared list no step one by one (a forged file's run of billions of steps included)."""
    made = StepValues()
    for values in lists:
        for first, step, count in values.runs() if isinstance(values, StepValues) else ([value, 0, 1]
                                                                                       for value in values):
            made.extend_run(first, step, count)
    return made


def step_set(steps: Sequence[int] | StepRuns | None) -> StepRuns | None:
    """A set of steps (a list, or a `StepRuns` as `held` reads one) as a `StepRuns` (None: None), to compare."""
    return None if steps is None else steps if isinstance(steps, StepRuns) else StepRuns(steps)


def shown(value: Any) -> Any:
    """``value`` as an error names it: a per-step list held as runs listed, unless it is long (then as its runs)."""
    if isinstance(value, (StepValues, StepRuns)):
        return list(value) if len(value) <= 100 else value
    return value

def _holder(metadata: dict, path: tuple[str, ...], copy_along: bool = False) -> dict | None:
    """The object holding ``path``'s last field (copied on the way when ``copy_along``), if every part is one."""
    holder = metadata
    for key in path[:-1]:
        inner = holder.get(key)
        if not isinstance(inner, dict):
            return None
        if copy_along:
            inner = holder[key] = copy.copy(inner)
        holder = inner
    return holder
