"""Saving and restoring a stream's cache, and keeping the detailed cache off the model's device (offload)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import statekv
from conftest import CHUNK_LENGTHS, split

TOTAL = sum(CHUNK_LENGTHS)
POLICIES = [statekv.FullAttention(), statekv.Recency(frames=2), statekv.StateKV(budget=20)]
CUT = 5  # chunks streamed before the save


def _ids(model, length=TOTAL, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def _observe(prefill) -> list[torch.Tensor]:
    """Everything the stream's future depends on: detailed K/V, carried K/V and positions of every layer."""
    tensors = []
    for layer, detailed in zip(prefill.cache.layers, prefill.detailed_cache.layers):
        tensors += [detailed.keys, detailed.values, *layer.carried(), layer.positions()]
    return [t.to("cpu") for t in tensors]


def _assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.equal(x, y)


UNIFORM = (9,) + (7,) * 13  # equal frames: recency runs in its ring, StateKV in place


@pytest.mark.parametrize("lengths", [CHUNK_LENGTHS, UNIFORM], ids=["unequal", "equal"])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_save_then_restore_continues_bit_identically(tiny_lm, tmp_path, policy, lengths):
    model = tiny_lm("qwen2")
    ids, prompt = _ids(model), _ids(model, 5, seed=1)
    chunks = split(ids, lengths)

    uninterrupted = statekv.StreamingPrefill(model, policy)
    hidden = [uninterrupted.step(input_ids=chunk) for chunk in chunks]
    assert lengths != UNIFORM or isinstance(policy, statekv.FullAttention) or uninterrupted.cache.is_steady()
    answer = uninterrupted.generate(prompt, max_new_tokens=6)

    first = statekv.StreamingPrefill(model, policy)
    for chunk in chunks[:CUT]:
        first.step(input_ids=chunk)
    tensors, metadata = first.cache.state_dict()
    save_file({name: t.contiguous() for name, t in tensors.items()}, tmp_path / "state.safetensors")

    resumed = statekv.StreamingPrefill(model, policy)
    resumed.cache.load_state_dict(load_file(tmp_path / "state.safetensors"), metadata, torch.device("cpu"))
    assert resumed.seen_tokens == sum(lengths[:CUT])
    resumed_hidden = [resumed.step(input_ids=chunk) for chunk in chunks[CUT:]]
    for got, expected in zip(resumed_hidden, hidden[CUT:]):
        assert torch.equal(got, expected)
    _assert_identical(_observe(resumed), _observe(uninterrupted))
    assert torch.equal(resumed.generate(prompt, max_new_tokens=6), answer)


@pytest.mark.parametrize("lengths", [CHUNK_LENGTHS, UNIFORM], ids=["unequal", "equal"])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_offloaded_stream_equals_the_resident_one(tiny_lm, policy, lengths):
    model = tiny_lm("qwen3")
    ids, prompt = _ids(model), _ids(model, 5, seed=1)
    resident = statekv.StreamingPrefill(model, policy)
    offloaded = statekv.StreamingPrefill(model, policy, offload=True)
    for chunk in split(ids, lengths):
        torch.testing.assert_close(offloaded.step(input_ids=chunk), resident.step(input_ids=chunk),
                                   rtol=0, atol=1e-6)
    for layer in offloaded.cache.layers:
        assert layer.detailed.keys.device.type == "cpu" and layer.window_start is None
        assert layer.positions().shape[-1] <= TOTAL
    for got, expected in zip(_observe(offloaded), _observe(resident)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(offloaded.generate(prompt, max_new_tokens=6), resident.generate(prompt, max_new_tokens=6))


def test_state_moves_between_resident_and_offloaded_streams(tiny_lm):
    model = tiny_lm("qwen2")
    chunks = split(_ids(model))
    policy = statekv.Recency(frames=3)  # window form when resident, explicit when offloaded
    reference = statekv.StreamingPrefill(model, policy)
    for chunk in chunks:
        reference.step(input_ids=chunk)

    resident = statekv.StreamingPrefill(model, policy)
    for chunk in chunks[:CUT]:
        resident.step(input_ids=chunk)
    offloaded = statekv.StreamingPrefill(model, policy, offload=True)
    offloaded.cache.load_state_dict(*resident.cache.state_dict(), torch.device("cpu"))
    for chunk in chunks[CUT:]:
        offloaded.step(input_ids=chunk)
    for got, expected in zip(_observe(offloaded), _observe(reference)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_restoring_into_a_different_model_depth_is_refused(tiny_lm):
    model = tiny_lm("qwen2")
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention())
    prefill.step(input_ids=_ids(model, 4))
    tensors, metadata = prefill.cache.state_dict()
    metadata["window_starts"] = metadata["window_starts"][:-1]
    with pytest.raises(statekv.InputError, match="layers"):
        statekv.StreamingPrefill(model, statekv.FullAttention()).cache.load_state_dict(tensors, metadata,
                                                                                       torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to offload from")
def test_offload_keeps_the_detailed_cache_off_the_gpu(tiny_lm):
    model = tiny_lm("qwen2").to("cuda")
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=16), offload=True)
    ids = _ids(model).to("cuda")
    for chunk in split(ids):
        prefill.step(input_ids=chunk)
    for layer in prefill.cache.layers:
        assert layer.detailed.keys.device.type == "cpu" and layer.carried()[0].device.type == "cuda"
    assert prefill.generate(_ids(model, 4, seed=1).to("cuda"), max_new_tokens=3).device.type == "cuda"
