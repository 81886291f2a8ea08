"""A segment of the retrieval index evicted in part ranks, and stands in the `attention` rule's softmax, for the
keys of its steps still held: its index row was written when it completed, with the keys of steps evicted since,
whose summaries were given back, so a question must not prefer or skip it for keys it can no longer read; nor
(`rekv`) the segment the kept steps end in for the kept keys, which are never chosen."""

from __future__ import annotations

import torch

from statekv.core.answering.retrieval import AttentionShare, LayerQuestion, MeanKeyMatch, Retrieval

from test_hierarchical_retrieval import question

# every third step from 6 on: each segment of 4 steps evicted in part (none whole), as evict-least-attended leaves
EVICTED = set(range(6, 60, 3))


def given_back(seen: LayerQuestion) -> LayerQuestion:
    """``seen`` over a stream that evicted `EVICTED`: their summaries read as zeros."""
    means, samples = seen.step_means.clone(), seen.samples.clone()
    means[:, :, sorted(EVICTED)] = 0
    samples[:, :, sorted(EVICTED)] = 0
    return LayerQuestion(**{**seen.__dict__, "step_means": means, "samples": samples, "evicted": EVICTED,
                            "memory": {}})


def test_a_segment_evicted_in_part_ranks_by_its_held_steps_alone():
    """The evicted steps' keys made to match the question, or left random: the held steps are the same, so the
    steps chosen (and the scores they are chosen by) must be too. Before, the segments holding the matching
    evicted keys ranked first and took the places of the others: 20 of 20 questions read other steps for
    `attention`, 19 of 20 for `rekv`."""
    for rule in (AttentionShare(), MeanKeyMatch()):
        for seed in range(20):
            picks = []
            for plant in (None, sorted(EVICTED)):
                seen = given_back(question(seed, steps=(2,) * 64, plant=plant)[0])
                index, asked = seen.segments.clone(), {}

                class Seen(type(rule)):
                    def scores(self, seen):
                        asked["scores"] = super().scores(seen)
                        return asked["scores"]

                chosen = Retrieval(2, keep_tokens=2, rule=Seen()).choose(seen)
                assert not set(chosen) & EVICTED and torch.equal(seen.segments, index)  # the stream's, never written
                picks.append((chosen, asked["scores"]))
            (first, scores), (second, again) = picks
            assert first == second, (rule.name, seed)
            torch.testing.assert_close(scores, again, rtol=1e-5, atol=1e-6)


def test_the_rekv_rule_ranks_a_segment_kept_in_part_by_its_other_steps():
    """The prompt prefix (and sinks) are kept, never chosen: the segment they end in ranks by the mean key of its
    other steps, so the steps `rekv` chooses must not depend on the kept keys. Before, its mean took them in: with
    the prefix's keys turned towards the question rather than away, 12 of 40 random questions of each layout read
    other steps."""
    for steps, keep_tokens in (((6,) + (2,) * 63, 6), ((2,) * 64, 4)):
        for seed in range(20):
            picks = [Retrieval(2, keep_tokens=keep_tokens, rule=MeanKeyMatch()).choose(question(
                seed, steps=steps, plant=list(range(keep_tokens // steps[0])), strength=strength)[0])
                for strength in (-6, 6)]
            assert picks[0] == picks[1], (steps[0], seed)
