"""Model dtypes: the ones a model runs in are taken by name, others refused in one line before anything loads;
a float16 model's segment index, whose key sums may overflow, still ranks segments as exact sums would."""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.core.answering.retrieval import AttentionShare, LayerQuestion, MeanKeyMatch, Retrieval
from statekv.settings.options import ModelOptions

from test_hierarchical_retrieval import PER_SEGMENT, question, segment_index


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float8_dtype_is_refused_in_one_line_before_the_model_loads(dtype):
    with pytest.raises(statekv.ConfigurationError, match=f"dtype '{dtype}' is not one a model runs in") as info:
        ModelOptions(model="builtin", dtype=dtype)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rule", [AttentionShare(), MeanKeyMatch()], ids=["attention", "rekv"])
def test_segment_sums_that_overflow_float16_leave_hierarchical_retrieval_as_it_was(rule):
    """A key channel as large at every token as a key bias makes it sums to more than float16 holds over a
    segment (inf in the index of a float16 model): the steps retrieved are those of the index with exact sums."""
    for plant in (5, 30, 60):
        seen, keys = question(plant=plant)
        keys[..., 0] = 9000.0  # 8 or 9 tokens a segment: a sum of 72,000 or more
        exact = segment_index(keys, seen.steps, PER_SEGMENT).half().float()
        dim = keys.shape[-1]
        exact[..., 2 * dim:] = segment_index(keys, seen.steps, PER_SEGMENT)[..., 2 * dim:]
        held = segment_index(keys, seen.steps, PER_SEGMENT).half()  # what a float16 model's storage holds
        assert held[..., 2 * dim].isinf().all()
        means = torch.stack([keys[:, :, sum(seen.steps[:s]):sum(seen.steps[:s + 1])].mean(2)
                             for s in range(len(seen.steps))], 2)
        asked = {**seen.__dict__, "step_means": means, "memory": {}}
        expected = Retrieval(2, keep_tokens=3, rule=rule).choose(LayerQuestion(**{**asked, "segments": exact}))
        chosen = Retrieval(2, keep_tokens=3, rule=rule).choose(LayerQuestion(**{**asked, "segments": held}))
        assert chosen == expected and plant in expected, plant
