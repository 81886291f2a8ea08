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

from ..errors import InputError

# where a saved stream's metadata lists an entry per step
STEP_LISTS = (("cache", "chunk_lengths"), ("cache", "evicted_steps"), ("cache", "positions", "steps"),
              ("successor", "chunk_lengths"), ("successor", "evicted_steps"), ("successor", "positions", "steps"))
MAX_STEPS = 1 << 26  # entries one of a file's lists may hold once expanded: two years of frames at 1 fps


def arithmetic_runs(entries: list) -> dict[str, Any]:
    """``entries`` (integers, or rows of as many integers each) as runs ``[*first, *step, count]``."""
    rows = entries and isinstance(entries[0], list)
    values = [tuple(entry) for entry in entries] if rows else [(entry,) for entry in entries]
    runs, at = [], 0
    while at < len(values):
        first = values[at]
        step = tuple(b - a for a, b in zip(first, values[at + 1])) if at + 1 < len(values) else (0,) * len(first)
        count = 1
        while at + count < len(values) and all(
                value == start + count * delta for value, start, delta in zip(values[at + count], first, step)):
            count += 1
        runs.append([*first, *(step if count > 1 else (0,) * len(first)), count])
        at += count
    return {"columns": len(values[0]), "runs": runs} if rows else {"runs": runs}


def expand_runs(saved: Any, name: str) -> list:
    """The entries ``saved`` (what `arithmetic_runs` wrote) lists; a one-line `InputError` naming ``name`` when it
    is malformed or lists more than `MAX_STEPS` entries."""
    columns = saved.get("columns", 1) if isinstance(saved, dict) else None
    runs = saved.get("runs") if isinstance(saved, dict) else None
    if (type(columns) is not int or columns < 1 or not isinstance(runs, list)
            or set(saved) - {"runs", "columns"}
            or not all(isinstance(run, list) and len(run) == 2 * columns + 1 and all(type(v) is int for v in run)
                       and run[-1] >= 1 for run in runs)):
        raise InputError(f"{name} must be a list or its runs ({{\"runs\": [[*first, *step, count], ...]}})")
    if sum(run[-1] for run in runs) > MAX_STEPS:
        raise InputError(f"{name} lists more than the {MAX_STEPS} steps a saved stream holds")
    entries = []
    for run in runs:
        first, step, count = run[:columns], run[columns: 2 * columns], run[-1]
        if columns == 1:
            entries.extend(range(first[0], first[0] + step[0] * count, step[0]) if step[0] else [first[0]] * count)
        else:
            entries.extend([start + n * delta for start, delta in zip(first, step)] for n in range(count))
    return entries


def compacted(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with its per-step lists (`STEP_LISTS`) as runs (the lists given are left as they are)."""
    metadata = copy.copy(metadata)
    for path in STEP_LISTS:
        holder = _holder(metadata, path, copy_along=True)
        if holder is not None and isinstance(holder.get(path[-1]), list) and holder[path[-1]]:
            holder[path[-1]] = arithmetic_runs(holder[path[-1]])
    return metadata


def expanded(metadata: dict[str, Any], where: str) -> dict[str, Any]:
    """``metadata`` as read from a format 3 file with its per-step lists expanded (in place); a one-line `InputError`
    naming ``where`` and the field when one is malformed."""
    for path in STEP_LISTS:
        holder = _holder(metadata, path)
        if holder is not None and isinstance(holder.get(path[-1]), dict):
            try:
                holder[path[-1]] = expand_runs(holder[path[-1]], "metadata." + ".".join(path))
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
