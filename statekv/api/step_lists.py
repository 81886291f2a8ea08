"""A saved stream's lists with an entry per step, kept in its file as arithmetic runs.

A stream's metadata lists every step it ever streamed: each step's token count, the steps it evicted, each step's
placement under bounded positions. Written out one by one they grew a file's header by about 25 bytes a frame, and
the header is bounded (`stream_file.MAX_METADATA_CHARS`): a stream of a few million frames could be saved but no
longer loaded. In the file (stream format 3) each such list is ``{"runs": [[*first, *step, count], ...]}``: runs of
entries that change by the same step each time (a step's token count, constant; its placement, advancing by its
span; the evicted steps, consecutive), so a steady stream's lists take a few runs whatever its age. Entries are
integers, or rows of ``columns`` integers (``{"columns": 3, "runs": ...}``). `compacted` writes them, `expanded`
reads them back into the lists every other part of statekv reads; format 2 files hold the lists themselves.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..core.storage.memory import available_bytes
from ..errors import InputError

# where a saved stream's metadata lists an entry per step, and how many integers an entry is (1: an integer)
STEP_LISTS = {("cache", "chunk_lengths"): 1, ("cache", "evicted_steps"): 1, ("cache", "positions", "steps"): 3,
              ("successor", "chunk_lengths"): 1, ("successor", "evicted_steps"): 1,
              ("successor", "positions", "steps"): 3}
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
    budget = [values_budget()] if budget is None else budget
    values = columns * sum(run[-1] for run in runs)
    if values > budget[0]:
        raise InputError(f"{name} lists more steps than this machine's memory holds once expanded (its per-step "
                         f"lists hold {values:,} values; {budget[0]:,} more fit in the memory available)")
    budget[0] -= values
    if not runs:
        return []
    table = np.asarray(runs, dtype=np.int64)
    counts = table[:, -1]
    run_of = np.repeat(np.arange(len(runs)), counts)
    offset = np.arange(len(run_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    entries = table[run_of, :columns] + offset[:, None] * table[run_of, columns: 2 * columns]
    return entries.tolist() if columns > 1 else entries[:, 0].tolist()


def compacted(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with its per-step lists (`STEP_LISTS`) as runs (the lists given are left as they are)."""
    metadata = copy.copy(metadata)
    for path in STEP_LISTS:
        holder = _holder(metadata, path, copy_along=True)
        if holder is not None and isinstance(holder.get(path[-1]), list) and holder[path[-1]]:
            holder[path[-1]] = arithmetic_runs(holder[path[-1]])
    return metadata


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
