"""The read path: answering and retrieval read the detailed cache only through its storage (`read_range`,
`read_tokens`, `summaries`); the `attention` rule scores from the sampled keys kept per step."""

from __future__ import annotations

import math

import pytest
import torch

import statekv
from statekv.core.answering.retrieval import AttentionShare, LayerQuestion
from statekv.core.storage.layer_storage import SAMPLES_PER_STEP, sample_index
from test_static_step import embeddings

LENGTHS = (9, 40, 6, 23, 40, 16, 17, 40)  # steps shorter and longer than SAMPLES_PER_STEP


def streamed(model, policy, **kwargs):
    prefill = statekv.StreamingPrefill(model, policy, **kwargs)
    for chunk in embeddings(model, lengths=LENGTHS):
        prefill.step(inputs_embeds=chunk)
    return prefill


def test_sample_index_picks_the_rules_keys_then_pads():
    for length in (1, 5, 16, 17, 40, 256):
        count = min(length, SAMPLES_PER_STEP)
        index = sample_index(length)
        assert index.shape == (SAMPLES_PER_STEP,)
        assert torch.equal(index[:count], torch.arange(count) * length // count)
        assert bool((index[count:] == index[count - 1]).all()) and int(index.max()) < length


@pytest.mark.parametrize("offload", [False, True])
def test_step_summaries_are_the_chunks_mean_and_sampled_keys(tiny_lm, offload):
    model = tiny_lm("qwen3")
    prefill = streamed(model, statekv.StateKV(budget=20), offload=offload)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for layer in prefill.cache.layers:
        keys, _ = layer.storage.read_range(0, layer.storage.length)
        means, samples = layer.storage.summaries
        assert means.dtype == samples.dtype == keys.dtype and means.device == keys.device
        for step, (start, length) in enumerate(zip(starts, LENGTHS)):
            chunk = keys[:, :, start:start + length]
            assert torch.equal(means[:, :, step], chunk.mean(dim=2))
            assert torch.equal(samples[:, :, step], chunk[:, :, sample_index(length)])


@pytest.mark.parametrize("offload", [False, True])
def test_attention_rule_scores_from_summaries_as_from_the_detailed_keys(tiny_lm, offload):
    model = tiny_lm("qwen3")
    prefill = streamed(model, statekv.FullAttention(), offload=offload)
    storage = prefill.cache.layers[1].storage
    keys, _ = storage.read_range(0, storage.length)
    means, samples = storage.summaries
    queries = torch.randn(1, model.config.num_attention_heads, 5, keys.shape[-1],
                          generator=torch.Generator().manual_seed(3))
    rule, scale = AttentionShare(), 1 / math.sqrt(keys.shape[-1])
    direct = rule.scores(LayerQuestion(1, queries, keys, means, LENGTHS, scale, {}))
    summary = rule.scores(LayerQuestion(1, queries, None, means, LENGTHS, scale, {}, samples=samples))
    assert torch.equal(direct, summary)
    other = AttentionShare(keys_per_step=4)  # samples of another size: read the keys through the storage
    reader = LayerQuestion(1, queries, None, means, LENGTHS, scale, {}, samples=samples,
                           read_keys=lambda index: storage.read_tokens(index)[0])
    assert torch.equal(other.scores(reader), other.scores(LayerQuestion(1, queries, keys, means, LENGTHS, scale, {})))


@pytest.mark.parametrize("offload", [False, True])
def test_a_question_reads_only_the_retrieved_tokens(tiny_lm, offload, monkeypatch):
    model = tiny_lm("qwen3")
    prefill = streamed(model, statekv.StateKV(budget=20), offload=offload)
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = prefill.generate(prompt, max_new_tokens=4, retrieve=statekv.Retrieval(2, keep_tokens=9))
    counted = []
    for layer in prefill.cache.layers:
        storage, original = layer.storage, type(layer.storage).read_tokens
        monkeypatch.setattr(storage, "read_range", lambda *a, **k: pytest.fail("the whole cache was read"))
        monkeypatch.setattr(storage, "read_tokens",
                            lambda index, *a, _s=storage, _o=original, **k: counted.append(index.numel()) or _o(
                                _s, index, *a, **k))
    assert torch.equal(prefill.generate(prompt, max_new_tokens=4, retrieve=statekv.Retrieval(2, keep_tokens=9)),
                       expected)
    assert len(counted) == len(prefill.cache.layers)
    assert all(9 < n <= 9 + 2 * max(LENGTHS) for n in counted)
