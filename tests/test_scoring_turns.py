"""Past the range a stream's steps are scored where the question reads them, not where they were encoded
(`StreamPositions.scoring_turns`, `LayerQuestion.turns`): every rule, flat and by segments."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from statekv.core.positions.placing import QuestionPlan, StepPlan, StreamPositions
from statekv.core.positions.rotation import rotate
from statekv.core.answering.retrieval import AttentionShare, LayerQuestion, MeanKeyMatch, Retrieval, segment_bounds

DIM = 2
FREQUENCY = torch.tensor([math.pi / 1000])  # one rotary pair: a turn of 1000 positions negates a dot product
STEPS = (2,) + (2,) * 12


def turned_question(turn_of_plant: int, rule_keys: bool = True):
    """A question whose queries match step 5's keys once that step is turned by ``turn_of_plant`` positions: it was
    stored 1000 positions away from where it is read, so compared as stored it scores lowest."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.ones(1, 2, 2, DIM)  # 2 query heads over 1 KV head, 2 prompt tokens
    keys = 0.1 * torch.randn(1, 1, sum(STEPS), DIM, generator=generator)
    keys[:, :, 10:12] = rotate(torch.full((1, 1, 2, DIM), 3.0), torch.full((1, 1, 2), -turn_of_plant), FREQUENCY)
    owner = torch.repeat_interleave(torch.arange(len(STEPS)), torch.tensor(STEPS))
    means = torch.stack([keys[:, :, owner == s].mean(2) for s in range(len(STEPS))], dim=2)
    samples = torch.stack([torch.cat([keys[:, :, owner == s]] * 8, 2) for s in range(len(STEPS))], 2)
    turns = torch.zeros(len(STEPS), dtype=torch.long)
    turns[5] = turn_of_plant
    return LayerQuestion(0, queries, keys if rule_keys else None, means, STEPS, 1 / math.sqrt(DIM), {},
                         samples=samples, turns=turns, frequencies=FREQUENCY)


def test_each_rule_scores_a_step_turned_to_where_it_is_read():
    for rule in (AttentionShare(), MeanKeyMatch()):
        seen = turned_question(1000)
        assert Retrieval(1, keep_tokens=2, rule=rule).choose(seen) == [5]
        as_stored = replace(turned_question(1000), turns=None)
        assert 5 not in Retrieval(3, keep_tokens=2, rule=rule).choose(as_stored)


def test_the_segment_bound_holds_for_keys_turned_by_their_segment():
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(1, 4, 3, 8, generator=generator)
    keys = torch.randn(1, 2, 24, 8, generator=generator)  # 3 segments of 4 two-token steps
    frequencies = 1 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    rows = [torch.cat([part.amin(2), part.amax(2), part.sum(2)], -1) for part in keys.split(8, dim=2)]
    segment_turns = torch.tensor([0, 700, -1300])
    seen = LayerQuestion(0, queries, None, keys[:, :, ::2], (2,) * 12, 1.0, {}, segments=torch.stack(rows, 2),
                         segment_steps=4, segment_turns=segment_turns, frequencies=frequencies)
    grouped = queries[0].reshape(2, -1, 8)
    bounds = []
    for g, part in enumerate(keys.split(8, dim=2)):
        turned = rotate(part, torch.full(part.shape[:3], int(segment_turns[g])), frequencies)[0]
        back = rotate(grouped[None], torch.full(grouped.shape[:2], -int(segment_turns[g]))[None], frequencies)[0]
        bound = back.clamp(min=0) @ rows[g][0, :, 8:16, None] + back.clamp(max=0) @ rows[g][0, :, :8, None]
        assert bool((bound[..., 0] >= (grouped @ turned.transpose(1, 2)).amax(-1) - 1e-4).all())
        bounds.append(bound[..., 0])
    torch.testing.assert_close(segment_bounds(seen), torch.stack(bounds, -1).softmax(-1).amax(1).sum(0))
    assert not torch.allclose(segment_bounds(seen), segment_bounds(replace(seen, segment_turns=None)))


def test_past_the_range_each_step_is_scored_where_its_time_falls_in_the_questions_context():
    positions = StreamPositions("bounded", 64, inv_freq=FREQUENCY)
    positions.append(StepPlan(0, 4, 0))  # the prompt prefix
    for step in range(40):  # 4-token steps; past the range every step is placed at base 20
        positions.append(StepPlan(4 + 4 * step, 4, min(4 + 4 * step, 20)))
    plan = QuestionPlan(False, 4 + 8 * 4, 8, keep_steps=1)  # 8 retrieved steps packed before the prompt at 36
    turns, segment_turns = positions.scoring_turns(plan, 41, segment_steps=4, segments=10)
    where = torch.tensor(positions.bases[:41]) + turns
    assert where[0] == 0  # the prefix stays at its own position
    later = where[1:]
    assert bool((later[1:] >= later[:-1]).all()) and int(later[0]) == 4 and int(later[-1]) <= 36 - 4
    places = torch.tensor(positions.bases[:41:4])[:10] + segment_turns  # a segment turned as its first step, rounded
    assert bool(((places - where[:40:4]).abs() <= (36 - 4 - 4) // 16).all()) and len(set(places.tolist())) > 4
