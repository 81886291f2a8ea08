"""Answering from retrieved steps (ReKV's question-time retrieval, for every method), ReKV's prefill, and the
memory the engine puts on the model's device."""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.core.answering.retrieval import RETRIEVAL_RULES
from reference import reference_stream
from test_static_step import PREFIX, T, embeddings

POLICIES = [statekv.FullAttention(), statekv.StateKV(budget=20), statekv.Recency(frames=3),
            statekv.ReKV(frames=3, sinks=2)]


def ids(model, length, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def streamed(model, policy, steps, **kwargs):
    prefill = statekv.StreamingPrefill(model, policy, **kwargs)
    for chunk in embeddings(model, lengths=(PREFIX,) + (T,) * steps):
        prefill.step(inputs_embeds=chunk)
    return prefill


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_retrieving_every_step_answers_exactly_as_the_whole_cache(tiny_lm, family, policy):
    model = tiny_lm(family)
    prefill = streamed(model, policy, steps=10)
    prompt = ids(model, 5, seed=1)
    whole = prefill.generate(prompt, max_new_tokens=6)
    for steps, rule in zip((11, 11, 50), RETRIEVAL_RULES.values()):  # 11 steps in all (the prefix, 10 chunks)
        retrieval = statekv.Retrieval(steps, rule=rule)
        assert torch.equal(prefill.generate(prompt, max_new_tokens=6, retrieve=retrieval), whole)


def test_answers_from_few_steps_differ_but_never_change_the_stream(tiny_lm):
    model = tiny_lm("qwen3")
    prefill = streamed(model, statekv.StateKV(budget=20), steps=10)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.detailed_cache.layers]
    prompt = ids(model, 5, seed=2)
    first = prefill.generate(prompt, max_new_tokens=6, retrieve=statekv.Retrieval(2, keep_tokens=PREFIX))
    assert torch.equal(prefill.generate(prompt, max_new_tokens=6, retrieve=statekv.Retrieval(2, keep_tokens=PREFIX)),
                       first)
    for (keys, values), layer in zip(before, prefill.detailed_cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


@pytest.mark.parametrize("policy", [statekv.StateKV(budget=20), statekv.ReKV(frames=3, sinks=2)], ids=repr)
def test_offloaded_memory_on_the_model_device_does_not_grow_with_the_stream(tiny_lm, policy):
    model = tiny_lm("qwen3", max_position_embeddings=4096)
    peaks = []
    for steps in (40, 400):
        prefill = streamed(model, policy, steps, offload=True)
        prefill.generate(ids(model, 5), max_new_tokens=4, retrieve=statekv.Retrieval(8, keep_tokens=PREFIX))
        peaks.append(prefill.peak_device_bytes)
    assert peaks[0] == peaks[1] > 0
    resident = streamed(model, policy, 40)
    assert resident.peak_device_bytes > peaks[0]  # without offload the detailed cache is on the device


def test_rekv_carries_its_sinks_and_the_last_frames(tiny_lm):
    model = tiny_lm("llama")
    lengths = (PREFIX,) + (T,) * 9
    chunks = list(torch.split(ids(model, sum(lengths), seed=3), list(lengths), dim=1))
    policy = statekv.ReKV(frames=3, sinks=2).for_prefix(PREFIX)

    def sinks_and_recent(scores, positions, steps, step, **_):
        keep = (positions[0, 0] < PREFIX + 2) | (steps[0, 0] > step - 3)
        return keep.nonzero().squeeze(-1).expand(*scores.shape[:2], -1)

    prefill = statekv.StreamingPrefill(model, policy)
    forms = set()
    for chunk, (hidden_ref, carried_ref) in zip(chunks, reference_stream(model, chunks, sinks_and_recent)):
        torch.testing.assert_close(prefill.step(input_ids=chunk), hidden_ref, atol=1e-4, rtol=0)
        forms.add(prefill.cache.layers[0].form)
        for layer, (keys_ref, _, positions_ref) in enumerate(carried_ref):
            assert torch.equal(prefill.carried_positions(layer), positions_ref)
            torch.testing.assert_close(prefill.cache.layers[layer].carried()[0], keys_ref, atol=1e-4, rtol=0)
    assert "ring" in forms and prefill.cache.is_steady()


def test_retrieval_after_save_and_restore_answers_the_same(tiny_lm, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_lm("qwen2")
    prefill = streamed(model, statekv.ReKV(frames=3, sinks=2), steps=10)
    retrieval, prompt = statekv.Retrieval(3, keep_tokens=PREFIX + 2), ids(model, 5, seed=4)
    tensors, metadata = prefill.cache.state_dict()
    save_file({name: t.contiguous() for name, t in tensors.items()}, tmp_path / "state.safetensors")
    resumed = statekv.StreamingPrefill(model, statekv.ReKV(frames=3, sinks=2))
    resumed.cache.load_state_dict(load_file(tmp_path / "state.safetensors"), metadata, torch.device("cpu"))
    assert torch.equal(resumed.generate(prompt, max_new_tokens=6, retrieve=retrieval),
                       prefill.generate(prompt, max_new_tokens=6, retrieve=retrieval))


@pytest.mark.parametrize("make, message", [
    (lambda: statekv.Retrieval(0), "steps must be a positive integer, got 0"),
    (lambda: statekv.Retrieval(-2), "got -2"),
    (lambda: statekv.Retrieval(2.5), "got 2.5"),
    (lambda: statekv.Retrieval(4, keep_tokens=-1), "keep_tokens must be a non-negative integer"),
    (lambda: statekv.ReKV(frames=2, sinks=-1), "sinks must be a non-negative integer"),
])
def test_retrieval_settings_are_validated(make, message):
    with pytest.raises(statekv.StateKVError, match=message):
        make()


def test_an_answer_says_which_steps_its_retrieved_context_read(tiny_lm, monkeypatch):
    """`StreamingPrefill.last_read_steps`: the steps some layer read when retrieving (each layer's own choice
    among them), None when the whole cache was read."""
    import statekv.core.answering.retrieval as retrieval_module

    model = tiny_lm("qwen2")
    prefill = streamed(model, statekv.StateKV(budget=20), steps=10)
    prompt = ids(model, 5, seed=1)
    chosen = []
    original = retrieval_module.Retrieval.choose
    monkeypatch.setattr(retrieval_module.Retrieval, "choose",
                        lambda self, seen: chosen.append(original(self, seen)) or chosen[-1])
    prefill.generate(prompt, max_new_tokens=2, retrieve=statekv.Retrieval(2, keep_tokens=PREFIX))
    assert chosen and prefill.last_read_steps == tuple(sorted({0, *(s for each in chosen for s in each)}))
    prefill.generate(prompt, max_new_tokens=2)
    assert prefill.last_read_steps is None
    prefill.generate(prompt, max_new_tokens=2, retrieve=statekv.Retrieval(11))
    assert prefill.last_read_steps == tuple(range(11))
