"""The question-time retrieval rules (`statekv.core.answering.retrieval`), each against a direct computation, and how a rule
is chosen: `Retrieval`, `ModelOptions`, the command line and the evaluation's run identity."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

import statekv
from statekv.core.answering.retrieval import (RETRIEVAL_RULES, AttentionShare, LayerQuestion, MeanKeyMatch, MostRecent,
                                              Retrieval, RetrievalRule)
from statekv.settings.methods import retrieval_rule

STEPS = (3, 2, 2, 2, 2, 2)  # a 3-token prefix, then five 2-token steps


def seen(seed=0, layer=0, memory=None, steps=STEPS, heads=(4, 2), prompt=3, dim=4):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads[1], sum(steps), dim, generator=generator)
    queries = torch.randn(1, heads[0], prompt, dim, generator=generator)
    owner = torch.repeat_interleave(torch.arange(len(steps)), torch.tensor(steps))
    means = torch.stack([keys[:, :, owner == s].mean(2) for s in range(len(steps))], dim=2)
    return LayerQuestion(layer, queries, keys, means, steps, 1 / math.sqrt(dim), {} if memory is None else memory)


def test_rekv_rule_is_mean_key_dot_mean_query_summed_over_heads():
    question = seen()
    group = question.queries.shape[1] // question.keys.shape[1]
    mean_query = question.queries.reshape(1, 2, group * 3, 4).mean(2)  # per KV head, over its query heads
    expected = (question.step_means * mean_query[:, :, None]).sum(-1).sum(1)[0]
    torch.testing.assert_close(MeanKeyMatch().scores(question), expected)


def attention_shares(question: LayerQuestion) -> torch.Tensor:
    """float64, one query head and prompt token at a time: sum over heads of the largest step share."""
    keys, queries = question.keys[0].double(), question.queries[0].double()
    group = queries.shape[0] // keys.shape[0]
    ends = torch.tensor(question.steps).cumsum(0).tolist()
    total = torch.zeros(len(ends), dtype=torch.float64)
    for head in range(queries.shape[0]):
        best = torch.zeros(len(ends), dtype=torch.float64)
        for token in range(queries.shape[1]):
            weights = torch.softmax(keys[head // group] @ queries[head, token] * question.scale, 0)
            shares = torch.stack([weights[end - length:end].sum() for end, length in zip(ends, question.steps)])
            best = torch.maximum(best, shares)
        total += best
    return total / total.sum()


def test_attention_share_is_each_steps_largest_share_summed_over_heads_and_accumulated_over_layers():
    memory = {}
    first, second = seen(0, 0, memory), seen(1, 1, memory)
    got_first = AttentionShare().scores(first)
    torch.testing.assert_close(got_first.double(), attention_shares(first))
    got_second = AttentionShare().scores(second)
    torch.testing.assert_close(got_second.double(), attention_shares(first) + attention_shares(second))
    alone = AttentionShare().scores(seen(1, 1))  # a fresh question: nothing carried over
    torch.testing.assert_close(alone.double(), attention_shares(second))


def test_attention_share_scores_long_streams_in_blocks(monkeypatch):
    question = seen(steps=(3,) + (2,) * 40, prompt=5)
    whole = AttentionShare().scores(question)
    monkeypatch.setattr("statekv.core.answering.retrieval.SCORE_BLOCK", 50)  # a few query rows per block
    torch.testing.assert_close(AttentionShare().scores(seen(steps=(3,) + (2,) * 40, prompt=5)), whole)


def test_attention_share_finds_the_step_a_question_looks_up():
    question = seen()
    keys = question.keys.clone()
    keys[:, :, 7] = 5 * question.queries.reshape(1, 2, -1, 4).mean(2)  # token 7 is in step 3 (tokens 7-8)
    planted = LayerQuestion(0, question.queries, keys, question.step_means, STEPS, question.scale, {})
    assert Retrieval(1, keep_tokens=3, rule=AttentionShare()).choose(planted) == [3]


def test_recent_keeps_the_last_steps():
    assert MostRecent().scores(seen()).tolist() == [0, 1, 2, 3, 4, 5]
    assert Retrieval(2, keep_tokens=3, rule=MostRecent()).tokens(seen()).tolist() == [0, 1, 2, 9, 10, 11, 12]


class Fixed(RetrievalRule):
    name = "fixed"

    def __init__(self, scores, calls):
        object.__setattr__(self, "_scores", scores)
        object.__setattr__(self, "calls", calls)

    def scores(self, question):
        self.calls.append(question.layer)
        return torch.tensor(self._scores)


def test_retrieval_takes_the_top_k_of_the_steps_outside_the_kept_tokens_in_time_order():
    calls = []
    rule = Fixed([100.0, 5.0, 1.0, 4.0, 3.0, 2.0], calls)  # step 0 scores highest but is kept anyway
    assert Retrieval(2, keep_tokens=3, rule=rule).choose(seen()) == [1, 3]
    assert Retrieval(2, keep_tokens=3, rule=rule).tokens(seen()).tolist() == [0, 1, 2, 3, 4, 7, 8]
    partial = Retrieval(1, keep_tokens=4, rule=rule)  # step 1 is partly kept: it still competes
    assert partial.tokens(seen()).tolist() == [0, 1, 2, 3, 4]
    calls.clear()
    assert Retrieval(5, keep_tokens=3, rule=rule).choose(seen()) == [1, 2, 3, 4, 5]
    assert calls == []  # every step fits: the rule is not even asked


def test_rules_by_name_and_bad_names():
    assert set(RETRIEVAL_RULES) == {"attention", "rekv", "recent"}
    assert retrieval_rule("recent") == MostRecent()
    assert Retrieval(4).rule == AttentionShare()  # the default rule
    with pytest.raises(statekv.ConfigurationError, match="unknown retrieval rule 'nearest'; choose one of"):
        retrieval_rule("nearest")
    with pytest.raises(statekv.ConfigurationError, match="rule must be a RetrievalRule"):
        Retrieval(4, rule="recent")


def test_model_options_choose_a_rule_and_rekv_keeps_its_own():
    assert statekv.ModelOptions(method="statekv").retrieval_rule == "attention"
    assert statekv.ModelOptions(method="rekv").retrieval_rule == "rekv"
    assert statekv.ModelOptions(method="rekv", retrieval="attention").retrieval_rule == "attention"
    assert statekv.ModelOptions(method="full", retrieve=16, retrieval="recent").label == "Full SA k=16 (recent)"
    assert statekv.ModelOptions(method="rekv").label == "ReKV R=16"
    assert statekv.ModelOptions.from_strings({"retrieval": "rekv"}).retrieval == "rekv"
    assert statekv.ModelOptions.from_strings({"retrieval": ""}).retrieval is None
    with pytest.raises(statekv.ConfigurationError, match="unknown retrieval rule"):
        statekv.ModelOptions(retrieval="nearest")
    with pytest.raises(statekv.ConfigurationError, match="retrieval"):
        statekv.ModelOptions.from_strings({"retrieval": "nearest"})


def test_command_line_retrieval_flag():
    parser = argparse.ArgumentParser()
    statekv.ModelOptions.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--retrieve", "16", "--retrieval", "recent"])
    options = statekv.ModelOptions.from_args(args)
    assert (options.retrieve, options.retrieval) == (16, "recent")
    assert statekv.ModelOptions.from_args(parser.parse_args(["--model", "m"])).retrieval is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--retrieval", "nearest"])


def test_the_rule_is_part_of_an_evaluation_runs_identity(tmp_path):
    from statekv.eval.runner import EvalConfig

    def identity(**options):
        return EvalConfig.for_model("synthetic", "builtin", tmp_path, tmp_path / "run", **options).identity()

    assert identity(method="full")["retrieval"] is None  # no retrieval: no rule
    assert identity(method="full", retrieve=16)["retrieval"] == "attention"
    assert identity(method="full", retrieve=16, retrieval="recent")["retrieval"] == "recent"
    assert identity(method="rekv")["retrieval"] == "rekv"


def test_attention_share_represents_long_steps_by_evenly_spaced_keys():
    long = seen(steps=(3, 8, 8, 8), prompt=4)
    rule = AttentionShare(keys_per_step=4)
    keys, steps = rule.sampled_keys(long)
    assert steps == (3, 4, 4, 4)
    index = [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25]
    assert torch.equal(keys, long.keys[0, :, index])
    sampled = LayerQuestion(0, long.queries, long.keys[:, :, index], long.step_means, steps, long.scale, {})
    torch.testing.assert_close(rule.scores(long).double(), attention_shares(sampled))
    torch.testing.assert_close(AttentionShare(keys_per_step=8).scores(seen(steps=(3, 8, 8, 8), prompt=4)).double(),
                               attention_shares(long))  # short enough: every key
    with pytest.raises(statekv.ConfigurationError, match="keys_per_step"):
        AttentionShare(keys_per_step=0)
