"""The steps a question over an evicting stream sees (`statekv.core.answering.held.held_steps`), checked against a
direct count over random evictions, segment sizes and kept prefixes: every step but those of the complete segments
evicted whole after the kept tokens, numbered from 0, their first tokens and evicted steps renumbered with them."""

from __future__ import annotations

import random
from itertools import accumulate

import torch

from statekv.core.answering.held import held_steps
from statekv.core.cache.step_runs import StepRuns


def _expected(lengths, evicted, per_segment, complete, keep_tokens):
    starts = [0, *accumulate(lengths)]
    first_seen = -(-next((i for i, start in enumerate(starts) if start >= keep_tokens), len(starts)) // per_segment)
    dropped = {segment for segment in range(first_seen, complete)
               if all(step in evicted for step in range(segment * per_segment, (segment + 1) * per_segment))}
    if not complete or not evicted or not dropped:
        return None
    steps = [s for s in range(len(lengths)) if not (s < complete * per_segment and s // per_segment in dropped)]
    return (steps, [g for g in range(complete) if g not in dropped],
            [0, *accumulate(lengths[s] for s in steps)], [at for at, s in enumerate(steps) if s in evicted])


def test_the_held_steps_are_every_step_but_the_segments_evicted_whole_after_the_kept_tokens():
    chance = random.Random(0)
    for _ in range(1500):
        count, per_segment = chance.randrange(1, 50), chance.randrange(1, 7)
        complete = chance.randrange(0, count // per_segment + 1)
        lengths = [chance.randrange(1, 6) for _ in range(count)]
        evicted = set(chance.sample(range(count), chance.randrange(0, count + 1)))
        if chance.random() < 0.4:  # a long run, as evict-oldest leaves
            first = chance.randrange(count)
            evicted |= set(range(first, chance.randrange(first, count + 1)))
        keep_tokens = chance.randrange(0, sum(lengths) + 3)
        starts = torch.tensor([0, *accumulate(lengths)])
        seen = held_steps(starts, StepRuns(sorted(evicted)), count, per_segment, complete, keep_tokens)
        expected = _expected(lengths, evicted, per_segment, complete, keep_tokens)
        if expected is None:
            assert seen is None
            continue
        held, segments, held_starts, held_evicted = seen
        assert held.steps.tolist() == expected[0] and held.firsts.tolist() == starts[held.steps].tolist()
        assert segments.tolist() == expected[1] and held_starts.tolist() == expected[2]
        assert [at for at in range(len(expected[0])) if at in held_evicted] == expected[3]
