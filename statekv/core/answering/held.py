"""The steps a question over a stream that evicts sees: those it holds, numbered from 0 (`LayerQuestion.held`).

A stream under an evicting cache limit (`statekv.core.storage.limits`) gives back the summaries of every step it
evicts and the index rows of every segment it evicts whole, and keeps only the others
(`statekv.core.storage.compact.CompactBuffer`). A question over it is built over the segments it still holds (a
segment evicted in part held whole, its evicted steps marked so, their summaries zeros, as they read) and the open
segment's steps: what a rule scores, and what a question costs, follow what the stream holds, not its age. The
segments before the kept tokens (``keep_tokens``: the prompt prefix and sinks) are always seen, so the kept tokens
are the stream's first tokens there too.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch

from ..cache.step_runs import StepRuns
from ..positions.placing import ScoringTurns
from .retrieval import Held, LayerQuestion

COMPACT = True  # False: every question sees every step streamed (what a question did before), evicted or not


def held_question(layer: int, queries: torch.Tensor, storage: Any, count: int, starts: Sequence[int],
                  evicted: StepRuns, keep_tokens: int, scale: float, memory: dict, dtype: torch.dtype,
                  with_segments: bool = True, turns: ScoringTurns | None = None) -> LayerQuestion:
    """The `LayerQuestion` at ``layer`` for ``queries`` ``[1, Hq, Q, D]`` over the first ``count`` steps (their
    first tokens ``starts``, then the end: a LongTensor ``[S + 1]`` or the cache's `StepValues`, as long or longer;
    ``evicted``, those evicted) of ``storage`` (a `LayerStorage`), the steps it holds alone (`held_steps`);
    ``with_segments``: with the segment index (every complete segment lies among the steps); ``turns``: how the
    steps and complete segments are turned past the range (None: as stored). ``memory``: the question's scratch,
    shared by its layers (the held steps, and their turns, are found once there). What it builds follows the steps
    held, unless every step is (no segment evicted whole)."""
    per_segment = storage.segment_steps
    complete = min(storage.segment_index.length, count // per_segment) if per_segment > 0 else 0
    key = ("held steps", count, keep_tokens, complete)
    if key not in memory:
        memory[key] = held_steps(starts, evicted, count, per_segment, complete, keep_tokens)
    held = memory[key]
    read = lambda index: storage.read_tokens(index, dtype=dtype)[0]  # noqa: E731
    frequencies = None if turns is None else turns.frequencies
    if held is None:  # nothing given back that a question could skip: every step, as stored
        every = memory.get(("every step", count))
        if every is None:
            firsts = starts[:count + 1] if isinstance(starts, torch.Tensor) else \
                torch.tensor(starts[:count + 1], dtype=torch.long)
            every = memory[("every step", count)] = firsts, tuple(torch.diff(firsts).tolist())
        firsts, lengths = every
        step_turns, segment_turns = _turns(turns, memory, torch.arange(count),
                                           torch.arange(storage.segment_index.length) if with_segments else None)
        means, samples = storage.summaries
        index = storage.segments.index if with_segments else None
        return LayerQuestion(layer, queries, None, means[:, :, :count], lengths, scale, memory,
                             samples=samples[:, :, :count], read_keys=read, evicted=evicted,
                             segments=index, segment_steps=per_segment, starts=firsts, turns=step_turns,
                             segment_turns=segment_turns, frequencies=frequencies)
    plan, segments, held_starts, held_evicted = held
    means, samples = storage.step_rows(plan.steps)
    index = storage.segment_rows(segments) if with_segments else None
    step_turns, segment_turns = _turns(turns, memory, plan.steps, segments if with_segments else None)
    return LayerQuestion(layer, queries, None, means, tuple(torch.diff(held_starts).tolist()), scale, memory,
                         samples=samples, read_keys=_global_reads(read, held_starts, plan.firsts),
                         evicted=held_evicted, segments=index, segment_steps=per_segment, starts=held_starts,
                         turns=step_turns, segment_turns=segment_turns, frequencies=frequencies, held=plan)


def _turns(turns: ScoringTurns | None, memory: dict, steps: torch.Tensor, segments: torch.Tensor | None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The turns of ``steps`` ``[S']`` and ``segments`` ``[G']`` (None: none), found once per question."""
    if turns is None:
        return None, None
    key = ("turns", id(turns), steps.shape[0], None if segments is None else segments.shape[0])
    if key not in memory:  # keeps ``turns`` alive with its id
        memory[key] = (turns, turns.of_steps(steps), None if segments is None else turns.of_segments(segments))
    return memory[key][1:]


def held_steps(starts: Sequence[int], evicted: StepRuns, count: int, per_segment: int, complete: int,
               keep_tokens: int) -> tuple[Held, torch.Tensor, torch.Tensor, StepRuns] | None:
    """What a question over the ``count`` steps (first tokens ``starts`` ``[S + 1]``, a LongTensor or the cache's
    `StepValues`; ``evicted``) of a stream
    whose first ``complete`` segments of ``per_segment`` steps are complete sees: ``(Held, its complete segments
    [G'], its steps' first tokens counted over them [S' + 1], its evicted steps)``; None when it would see every
    step (no segment evicted whole after the kept tokens). O(runs of evicted steps + steps held)."""
    if not COMPACT or per_segment < 1 or not complete or not evicted:
        return None
    at_kept = int(torch.searchsorted(starts[:count + 1], keep_tokens)) if isinstance(starts, torch.Tensor) else \
        bisect_left(starts, keep_tokens, 0, count + 1)
    after_kept = -(-at_kept // per_segment)  # first segment seen
    dropped = []  # runs [first, end) of the segments evicted whole after the kept tokens
    for start, end in evicted.runs():
        first, last = max(-(-start // per_segment), after_kept), min(end // per_segment, complete)
        if first < last:
            dropped.append((first, last))
    if not dropped:
        return None
    kept_segments, at = [], 0
    for first, last in dropped:
        kept_segments.append(torch.arange(at, first))
        at = last
    kept_segments.append(torch.arange(at, complete))
    segments = torch.cat(kept_segments)
    steps = torch.cat([(segments[:, None] * per_segment + torch.arange(per_segment)).flatten(),
                       torch.arange(complete * per_segment, count)])
    at = (lambda index: starts[index]) if isinstance(starts, torch.Tensor) else starts.gathered  # noqa: E731
    firsts = at(steps)
    held_starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(at(steps + 1) - firsts, 0)])

    ends = [last for _, last in dropped]
    before = list(accumulate((last - first for first, last in dropped), initial=0))  # segments dropped before each

    def numbered(step: int) -> int:  # a run's bound: never inside a segment dropped (runs are merged)
        return step - per_segment * before[bisect_right(ends, step // per_segment)]

    held_evicted = StepRuns.from_runs((numbered(start), numbered(end)) for start, end in evicted.runs())
    return Held(steps, firsts, complete), segments, held_starts, held_evicted


def _global_reads(read: Callable[[torch.Tensor], torch.Tensor], held_starts: torch.Tensor, firsts: torch.Tensor
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``read`` (of the stream's tokens) of tokens counted over the held steps (first tokens ``held_starts``
    ``[S' + 1]``; the stream's first tokens of them ``firsts`` ``[S']``)."""
    def read_held(index: torch.Tensor) -> torch.Tensor:
        host = index.cpu()
        step = torch.searchsorted(held_starts, host, right=True) - 1
        return read((host - held_starts[step] + firsts[step]).to(index.device))
    return read_held
