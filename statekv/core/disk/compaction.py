"""A disk tier's journal kept to what resuming it reads, so that a stream evicting under a cap does not grow its
journal with every step it gives up.

Of an evicted step, a resume reads only its length, its frames and (under bounded positions) where it was placed;
`DiskTier.compact` folds the records of such steps into a ``compacted`` record holding each of these as arithmetic
runs (`runs`: a steady camera's steps, however many, are a run each; later ones are `joined` to them without
unfolding) and drops what no resume reads (records before the last checkpoint other than its steps, the older
checkpoints' records), keeping every other line as it was. `folded_steps` reads a record back as the steps'
records (`statekv.core.disk.files.read_file_set`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

COMPACTED = "compacted"  # a record's field: the steps it stands for, as runs
BACKLOG = "backlog"  # a step record's field: ``[offset, bytes, crc]`` of its embeddings in the backlog file, which a
# successor replays (`statekv.core.disk.successor`): such a record is kept whole
PLACED = "placed"  # a step record's field under bounded positions: ``[first, span, base]``


def runs(values: Sequence[int]) -> list[list[int]]:
    """``values`` as arithmetic runs ``[first, difference, count]``, in order."""
    folded: list[list[int]] = []
    for value in values:
        if folded:
            first, difference, count = folded[-1]
            if count == 1:
                folded[-1] = [first, value - first, 2]
                continue
            if first + difference * count == value:
                folded[-1][2] += 1
                continue
        folded.append([value, 0, 1])
    return folded


def joined(left: list[list[int]], right: list[list[int]]) -> list[list[int]]:
    """The runs of ``left``'s values then ``right``'s, as `runs` would fold them value by value, without unfolding
    either (a steady camera's runs, however long, join in a few operations)."""
    folded = [list(run) for run in left]
    for value, difference, count in right:
        if folded and count:
            first, step, held = folded[-1]
            if held == 1:  # a run of one takes the next value, whatever the difference
                folded[-1] = [first, value - first, 2]
                value, count = value + difference, count - 1
                first, step, held = folded[-1]
            if count and first + step * held == value:  # the run goes on with the next value
                folded[-1][2] += 1
                value, count = value + difference, count - 1
                if count and difference == step:  # and with every value of this run
                    folded[-1][2] += count
                    count = 0
        if count:
            folded.append([value, difference if count > 1 else 0, count])
    return folded


def last_step(record: dict[str, Any]) -> int:
    """The last step a ``compacted`` record stands for."""
    first, difference, count = record[COMPACTED][-1]
    return first + difference * (count - 1)


def joined_record(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any] | None:
    """One ``compacted`` record standing for ``earlier``'s steps then ``later``'s (all after them); None when
    they do not join (one holds placements, the other not)."""
    if (PLACED in earlier) != (PLACED in later):
        return None
    record = {name: joined(earlier[name], later[name]) for name in (COMPACTED, "tokens", "frames")}
    if PLACED in earlier:
        record[PLACED] = [joined(a, b) for a, b in zip(earlier[PLACED], later[PLACED])]
    if "last_frame" in later or "last_frame" in earlier:
        record["last_frame"] = later.get("last_frame", earlier.get("last_frame"))
    return record


def unfolded(folded: Any) -> list[int]:
    """The values of ``folded`` (`runs`); a `ValueError` unless it is a list of runs of integers."""
    if not isinstance(folded, list):
        raise ValueError("not a list of runs")
    values: list[int] = []
    for run in folded:
        if (not isinstance(run, list) or len(run) != 3 or not all(type(v) is int for v in run) or run[2] < 1
                or len(values) + run[2] > 1 << 40):
            raise ValueError(f"not a run: {run!r}")
        first, difference, count = run
        values.extend(range(first, first + difference * count, difference) if difference else [first] * count)
    return values


def compacted_record(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``compacted`` record standing for the records ``steps`` (evicted, in step order)."""
    record: dict[str, Any] = {COMPACTED: runs([int(step["step"]) for step in steps]),
                              "tokens": runs([int(step["tokens"]) for step in steps]),
                              "frames": runs([int(step.get("frames", 0)) for step in steps])}
    if steps and all(isinstance(step.get(PLACED), list) for step in steps):
        record[PLACED] = [runs([int(step[PLACED][part]) for step in steps]) for part in range(3)]
    framed = [step for step in steps if isinstance(step.get("last_frame"), list)]
    if framed:  # a resume reads the last step's last frame that has one
        record["last_frame"] = [int(framed[-1]["step"]), framed[-1]["last_frame"]]
    return record


def folded_steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The step records (``step``, ``tokens``, ``frames``, ``placed``, ``last_frame``: what a resume reads of an
    evicted step) a ``compacted`` record stands for, in step order; a `ValueError` when it is malformed."""
    steps, tokens, frames = (unfolded(record.get(name)) for name in (COMPACTED, "tokens", "frames"))
    if not len(steps) == len(tokens) == len(frames) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError("its runs disagree")
    if steps and steps[0] < 0:
        raise ValueError("a negative step")
    records = [{"step": s, "tokens": t, "frames": f} for s, t, f in zip(steps, tokens, frames)]
    if PLACED in record:
        parts = record[PLACED]
        if not isinstance(parts, list) or len(parts) != 3:
            raise ValueError("its placements are not three runs")
        placed = [unfolded(part) for part in parts]
        if any(len(part) != len(steps) for part in placed):
            raise ValueError("its placements disagree")
        for index, step in enumerate(records):
            step[PLACED] = [part[index] for part in placed]
    if any(t < 1 for t in tokens) or any(f < 0 for f in frames):
        raise ValueError("a step of no tokens, or of fewer than no frames")
    if "last_frame" in record:
        named = record["last_frame"]
        whole = isinstance(named, list) and len(named) == 2 and type(named[0]) is int
        at = bisect.bisect_left(steps, named[0]) if whole else len(steps)
        if at == len(steps) or steps[at] != named[0]:
            raise ValueError("its last frame names no step of it")
        records[at]["last_frame"] = named[1]
    return records
