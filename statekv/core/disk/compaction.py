"""A disk tier's journal kept to what resuming it reads, so that a stream evicting under a cap does not grow its
journal with every step it gives up.

Of an evicted step, a resume reads only its length, its frames and (under bounded positions) where it was placed;
`DiskTier.compact` folds the records of such steps into a ``compacted`` record holding each of these as arithmetic
runs (`runs`: a steady camera's steps, however many, are a run each; later ones are `joined` to them without
unfolding) and drops what no resume reads (records before the last checkpoint other than its steps, the older
checkpoints' records), keeping every other line as it was. Records whose steps interleave (evict-least-attended
gives up old steps after newer ones) are `merged_record` run by run, so compacting costs what the journal holds,
not what the stream ever streamed. `folded_steps` reads a record back as the steps'
records (`statekv.core.disk.files.read_file_set`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import Any

from ..storage.step_values import StepValues, aligned_runs

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
    for run in right:
        _extend(folded, *run)
    return folded


def _extend(folded: list[list[int]], value: int, difference: int, count: int) -> None:
    """Append the run ``[value, difference, count]``'s values to the runs ``folded``, in place, as `runs` would."""
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


def loaded_record(folded: Sequence[Sequence[int]], tokens: Sequence[int], frames: Sequence[int],
                  placed: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The ``compacted`` record `compacted_record` makes of the steps ``folded`` (runs ``[start, end)``, ascending)
    of a state whose every step's ``tokens``, ``frames`` and (or None) placements ``[first, span, base]`` (or a
    tuple of their three columns) are given (a `StepValues` is read as its runs): found a run at a time, so a
    loaded state's evicted steps, however many, are not one record each."""
    columns = placed if isinstance(placed, tuple) else None if placed is None else \
        [[step[part] for step in placed] for part in range(3)]  # a tuple: the three columns, as `StepValues`
    fields = [tokens, frames, *(columns or [])]
    count = len(tokens)
    marks, at = [], 0  # per step: whether it is folded, as runs
    for start, end in folded:
        marks.extend([[0, 0, start - at]] if start > at else [])
        marks.append([1, 0, end - start])
        at = end
    marks.extend([[0, 0, count - at]] if at < count else [])
    made: list[list[list[int]]] = [[] for _ in range(len(fields) + 1)]
    held = [values.runs() if isinstance(values, StepValues) else runs(values) for values in fields]
    for taken, pairs in aligned_runs(marks, [[0, 1, count]] if count else [], *held):
        if pairs[0][0]:
            for runs_, (first, difference) in zip(made, pairs[1:]):
                _extend(runs_, first, difference if taken > 1 else 0, taken)
    record: dict[str, Any] = dict(zip((COMPACTED, "tokens", "frames"), made))
    if placed is not None:
        record[PLACED] = made[3:]
    return record


def merged_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``compacted`` record standing for the steps of ``records`` (each steps in order, their steps apart):
    the record `compacted_record` makes of their steps, found run by run, without unfolding a step (the cost goes
    with their runs and how often their steps interleave, not with how many steps they stand for); a `ValueError`
    when one is malformed or two stand for the same step."""
    placed = bool(records) and all(PLACED in record for record in records)
    cursors = []  # per record: its pieces, each ``[count, first step, step difference, first, difference, ...]``
    for record in records:
        fields = [_checked_runs(record.get(name)) for name in (COMPACTED, "tokens", "frames")]
        if PLACED in record:
            parts = record[PLACED]
            if not isinstance(parts, list) or len(parts) != 3:
                raise ValueError("its placements are not three runs")
            fields.extend(_checked_runs(part) for part in parts)
        if len({sum(run[2] for run in runs_) for runs_ in fields}) != 1:
            raise ValueError("its runs disagree")
        if fields[0] and fields[0][0][0] < 0:
            raise ValueError("a negative step")
        if any(_least(run) < 1 for run in fields[1]) or any(_least(run) < 0 for run in fields[2]):
            raise ValueError("a step of no tokens, or of fewer than no frames")
        pieces = _pieces(fields if placed else fields[:3])
        for before, after in zip(pieces, pieces[1:]):
            if after[1] <= before[1] + before[2] * (before[0] - 1):
                raise ValueError("its runs disagree")
        if any(piece[0] > 1 and piece[2] < 1 for piece in pieces):
            raise ValueError("its runs disagree")
        cursors.append([pieces, 0, 0])  # its pieces, the one reached, the values of it taken
    merged: list[list[list[int]]] = [[] for _ in range(6 if placed else 3)]
    heap = [(pieces[0][1], index) for index, (pieces, _, _) in enumerate(cursors) if pieces]
    heapq.heapify(heap)
    while heap:
        step, index = heapq.heappop(heap)
        cursor = cursors[index]
        pieces, at, taken = cursor
        count, first, difference = pieces[at][:3]
        left = count - taken
        if heap:  # the values before the next record's next step
            if heap[0][0] == step:
                raise ValueError("two records stand for the same step")
            left = min(left, -(-(heap[0][0] - step) // difference) if difference > 0 else 1)
        values = pieces[at][1:]
        for runs_, value, change in zip(merged, values[::2], values[1::2]):
            _extend(runs_, value + change * taken, change if left > 1 else 0, left)
        taken += left
        if taken == count:
            at, taken = at + 1, 0
        cursor[1:] = [at, taken]
        if at < len(pieces):
            heapq.heappush(heap, (pieces[at][1] + pieces[at][2] * taken, index))
    record: dict[str, Any] = dict(zip((COMPACTED, "tokens", "frames"), merged))
    if placed:
        record[PLACED] = merged[3:]
    framed = []
    for one, (pieces, _, _) in zip(records, cursors):
        if "last_frame" in one:
            named = one["last_frame"]
            if not (isinstance(named, list) and len(named) == 2 and type(named[0]) is int
                    and any(_holds(piece, named[0]) for piece in pieces)):
                raise ValueError("its last frame names no step of it")
            if isinstance(named[1], list):
                framed.append(named)
    if framed:  # a resume reads the last step's last frame that has one
        record["last_frame"] = [*max(framed, key=lambda named: named[0])]
    return record


def _checked_runs(folded: Any) -> list[list[int]]:
    """``folded`` if it is a list of runs of integers (`runs`); a `ValueError` if not."""
    if not isinstance(folded, list):
        raise ValueError("not a list of runs")
    for run in folded:
        if not isinstance(run, list) or len(run) != 3 or not all(type(v) is int for v in run) or run[2] < 1:
            raise ValueError(f"not a run: {run!r}")
    if sum(run[2] for run in folded) > 1 << 40:
        raise ValueError("too many")
    return folded


def _holds(piece: list[int], step: int) -> bool:
    """Whether the piece (`_pieces`) stands for step ``step``."""
    count, first, difference = piece[:3]
    return first <= step <= first + difference * (count - 1) and (step - first) % (difference or 1) == 0


def _least(run: list[int]) -> int:
    first, difference, count = run
    return min(first, first + difference * (count - 1))


def _pieces(fields: list[list[list[int]]]) -> list[list[int]]:
    """The runs ``fields`` (as many values each) cut where any of them is: ``[count, first, difference, ...]``
    each, every field arithmetic over the piece."""
    return [[count, *(value for pair in pairs for value in pair)] for count, pairs in aligned_runs(*fields)]


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


class JournalSteps(Sequence):
    """A journal's steps in order, as `statekv.core.disk.files.read_file_set` reads them: the records of the steps
    written whole (`held`), and what a resume reads of every step (`tokens`, `frames`, `placements`) as runs, so
    that the steps ``compacted`` records stand for, however many, are never one entry each.

    A sequence of step records (``len``, indexing, iteration): a compacted step's is the one `folded_steps` makes
    of it, made when asked for."""

    def __init__(self):
        self.tokens, self.frames = StepValues(), StepValues()
        self.placed: list[StepValues] | None = [StepValues(), StepValues(), StepValues()]  # None: a step has none
        self._held: dict[int, dict[str, Any]] = {}  # the records written whole, by step
        self._named: dict[int, Any] = {}  # the last frames compacted records name, by step

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[at] for at in range(*index.indices(len(self)))]
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError("step index out of range")
        if index in self._held:
            return self._held[index]
        record: dict[str, Any] = {"step": index, "tokens": self.tokens[index], "frames": self.frames[index]}
        if self.placed is not None:
            record[PLACED] = [part[index] for part in self.placed]
        if index in self._named:
            record["last_frame"] = self._named[index]
        return record

    @property
    def dense(self) -> bool:
        """Whether one of its lists is held one value a step (too irregular for runs; `StepValues.dense`)."""
        return any(values.dense for values in (self.tokens, self.frames, *(self.placed or ())))

    def held(self) -> list[dict[str, Any]]:
        """The records of the steps written whole (not compacted), in step order."""
        return list(self._held.values())

    def through_first_folded(self) -> list[dict[str, Any]]:
        """The step records up to the first compacted step's (all of them when none is compacted)."""
        records = []
        for record in self._held.values():
            if record["step"] != len(records):
                break
            records.append(record)
        return records if len(records) == len(self) else [*records, self[len(records)]]

    def last_frame(self) -> list | None:
        """``[index, timestamp]`` of the last frame the last step that names one names (None if none does)."""
        named = [(step, frame) for step, frame in self._named.items() if isinstance(frame, list)]
        held = next(((step, record["last_frame"]) for step, record in reversed(self._held.items())
                     if isinstance(record.get("last_frame"), list)), None)
        return max([*named, *([held] if held else [])], key=lambda pair: pair[0], default=(0, None))[1]

    def add(self, record: dict[str, Any]) -> None:
        """Append the step ``record`` (the next step), written whole; a `ValueError` if its numbers do not read."""
        tokens, frames, placed = int(record["tokens"]), int(record.get("frames", 0)), record.get(PLACED)
        self._held[len(self)] = record
        self.tokens.append(tokens)
        self.frames.append(frames)
        self._place(*([part, 0, 1] for part in placed) if _three(placed) else ())

    def name_frames(self, named: dict[int, Any]) -> None:
        """The last frames compacted records name, by step (each among this sequence's compacted steps)."""
        self._named = named

    def fold(self, piece: list[int], count: int, named: Any = None) -> None:
        """Append ``count`` steps of the piece ``[count, step, difference, tokens, difference, frames, difference,
        (first, difference, span, difference, base, difference)]`` (`_pieces` of a checked ``compacted`` record),
        the next steps."""
        self.tokens.extend_run(piece[3], piece[4], count)
        self.frames.extend_run(piece[5], piece[6], count)
        self._place(*([piece[at], piece[at + 1], count] for at in (7, 9, 11)) if len(piece) == 13 else ())

    def _place(self, *parts: list[int]) -> None:
        if self.placed is not None and not parts:
            self.placed = None
        elif self.placed is not None:
            for values, (first, difference, count) in zip(self.placed, parts):
                values.extend_run(first, difference, count)


def _three(placed: Any) -> bool:
    return isinstance(placed, list) and len(placed) == 3 and all(type(value) is int for value in placed)


def record_pieces(record: dict[str, Any]) -> tuple[list[list[int]], dict[int, Any]]:
    """The pieces (`_pieces`: ``[count, step, difference, ...]``, ascending) of the steps, tokens, frames and (if
    it holds them) placements of a ``compacted`` record checked by `merged_record`, and the last frame it names
    by step."""
    fields = [record[name] for name in (COMPACTED, "tokens", "frames")] + list(record.get(PLACED, []))
    named = record.get("last_frame")
    return _pieces(fields), {} if named is None else {named[0]: named[1]}
