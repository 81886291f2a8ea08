"""The quantized detailed cache (kv_cache_dtype int8/int4): KIVI-style quantization against a direct float64
computation, bytes, answers through retrieval and the whole cache, save/resume, and the option's plumbing."""

from __future__ import annotations

import math

import pytest
import torch

import statekv
from statekv import Stream
from statekv.core.storage.quantized import (KV_CACHE_BITS, QuantizedStorage, check_kv_cache_dtype, dequantize,
                                            pack_int4, quantize, scale_dtype, unpack_int4)
from statekv.models import load_adapter
from statekv.settings.options import ModelOptions

from conftest import random_frames
from test_static_step import embeddings

LENGTHS = (9, 40, 6, 23, 40, 16, 17, 40)
QUESTION = "Why?"


def reference(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric quantization computed directly in float64: (dequantized x, the step size per slice)."""
    x = x.double()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (high - low) / (2 ** bits - 1)
    codes = torch.where(step > 0, (x - low) / torch.where(step > 0, step, 1), 0).round()
    return codes * step + low, step


@pytest.mark.parametrize("kv_cache_dtype", list(KV_CACHE_BITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [2, 3], ids=["keys per channel", "values per token"])
def test_quantization_error_is_half_a_step_of_its_own_range(kv_cache_dtype, dtype, dim):
    bits = KV_CACHE_BITS[kv_cache_dtype]
    generator = torch.Generator().manual_seed(bits + dim)
    x = (torch.randn(2, 3, 37, 16, generator=generator) * torch.linspace(0.1, 20, 16)).to(dtype)
    x[0, 0, :, 3] = 1.5  # a constant channel, and a constant token
    x[0, 1, 4, :] = -2.0
    codes, scale, zero = quantize(x, dim, bits, scale_dtype(dtype))
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 16 * bits // 8
    assert scale.dtype == zero.dtype == scale_dtype(dtype)
    assert scale.shape == zero.shape == tuple(1 if d == dim else n for d, n in enumerate(x.shape))
    restored = dequantize(codes, scale, zero, bits, torch.float64)
    direct, step = reference(x, dim, bits)
    exact = x.double()
    rounding = torch.finfo(scale_dtype(dtype)).eps  # scale and zero kept in the model's dtype (or float32)
    span = exact.abs().amax(dim, keepdim=True)
    # the zero point is exact (the smallest of x, in a dtype as fine as x's), the scale never rounded down (it
    # would clamp the largest codes: most of a step at 8 bits in bfloat16), the sum rounded in float32
    assert bool(((restored - exact).abs() <= step / 2 * (1 + 2 * rounding) + span * 2 ** -22 + 1e-12).all())
    assert bool(((direct - exact).abs() <= step / 2 + 1e-12).all())  # the reference's own bound
    assert bool(((restored - direct).abs() <= step * (1 + 4 * rounding) + 4 * rounding * span + 1e-12).all())
    assert torch.equal(restored[0, 0, :, 3], exact[0, 0, :, 3]) if dim == 2 else True  # a constant is exact
    if dim == 3:
        assert torch.equal(restored[0, 1, 4], exact[0, 1, 4])


def test_int4_packs_two_codes_per_byte():
    codes = torch.randint(0, 16, (2, 3, 5, 8), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (2, 3, 5, 4) and torch.equal(packed, codes[..., 0::2] + 16 * codes[..., 1::2])
    assert torch.equal(unpack_int4(packed), codes)


def streamed(model, policy, **kwargs):
    prefill = statekv.StreamingPrefill(model, policy, **kwargs)
    for chunk in embeddings(model, lengths=LENGTHS):
        prefill.step(inputs_embeds=chunk)
    return prefill


def prompt(model):
    return torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kv_cache_dtype", list(KV_CACHE_BITS))
@pytest.mark.parametrize("offload", [False, True])
def test_quantized_storage_holds_each_chunk_quantized_and_reads_it_back(tiny_lm, kv_cache_dtype, offload):
    model = tiny_lm("qwen3")
    plain = streamed(model, statekv.StateKV(budget=20), offload=offload)
    quantized = streamed(model, statekv.StateKV(budget=20), offload=offload, kv_cache_dtype=kv_cache_dtype)
    bits = KV_CACHE_BITS[kv_cache_dtype]
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for exact_layer, layer in zip(plain.cache.layers, quantized.cache.layers):
        storage = layer.storage
        assert isinstance(storage, QuantizedStorage) and not storage.holds_window
        assert storage.key_codes.keys.device.type == "cpu" and storage.key_codes.keys.dtype == torch.uint8
        keys, values = exact_layer.storage.read_range(0, storage.length)
        read_keys, read_values = storage.read_range(0, storage.length)
        assert read_keys.dtype == keys.dtype and read_keys.shape == keys.shape
        for start, length in zip(starts, LENGTHS):  # keys: one range per channel over the step's tokens
            chunk = slice(start, start + length)
            direct, _ = reference(keys[:, :, chunk], 2, bits)
            step = (keys[:, :, chunk].amax(2) - keys[:, :, chunk].amin(2)).double() / (2 ** bits - 1)
            assert bool(((read_keys[:, :, chunk].double() - direct).abs() <= step[:, :, None] + 1e-5).all())
        direct, step = reference(values, 3, bits)
        assert bool(((read_values.double() - direct).abs() <= step + 1e-5).all())
        index = torch.tensor([0, 3, 50, 51, storage.length - 1])
        picked = storage.read_tokens(index)
        assert torch.equal(picked[0], read_keys[:, :, index]) and torch.equal(picked[1], read_values[:, :, index])
        # the summaries and the carried state are the model's own, not quantized
        assert all(torch.equal(a, b) for a, b in zip(storage.summaries, exact_layer.storage.summaries))
        assert torch.equal(layer.carried()[0], exact_layer.carried()[0])


@pytest.mark.parametrize("kv_cache_dtype", list(KV_CACHE_BITS))
def test_quantized_streams_answer_through_retrieval_and_the_whole_cache(tiny_lm, kv_cache_dtype):
    model = tiny_lm("qwen3")
    for policy in (statekv.FullAttention(), statekv.StateKV(budget=20), statekv.Recency(frames=2)):
        prefill = streamed(model, policy, kv_cache_dtype=kv_cache_dtype)
        whole = prefill.generate(prompt(model), max_new_tokens=5)
        assert whole.shape == (1, 5)
        every = statekv.Retrieval(len(LENGTHS))  # every step retrieved: the whole cache, in order
        assert torch.equal(prefill.generate(prompt(model), max_new_tokens=5, retrieve=every), whole)
        few = prefill.generate(prompt(model), max_new_tokens=5, retrieve=statekv.Retrieval(2, keep_tokens=9))
        assert few.shape == (1, 5)
        dense = prefill.detailed_cache  # dequantized, as a DynamicCache
        assert dense.layers[0].keys.shape[2] == sum(LENGTHS)


def test_unquantized_answers_do_not_change_with_auto(tiny_lm):
    model = tiny_lm("qwen3")
    base = streamed(model, statekv.StateKV(budget=20))
    auto = streamed(model, statekv.StateKV(budget=20), kv_cache_dtype="auto")
    assert auto.cache.tier.kv_cache_dtype is None and type(auto.cache.layers[0].storage) is type(base.cache.layers[0].storage)
    for retrieve in (None, statekv.Retrieval(2, keep_tokens=9)):
        assert torch.equal(auto.generate(prompt(model), max_new_tokens=5, retrieve=retrieve),
                           base.generate(prompt(model), max_new_tokens=5, retrieve=retrieve))


def test_detailed_bytes_shrink_to_a_half_and_a_quarter_of_bf16(tmp_path):
    from conftest import build_tiny_lm
    model = build_tiny_lm("qwen3", tmp_path / "wide", dtype=torch.bfloat16, heads=2, kv_heads=1,
                          hidden_size=256, head_dim=128)
    lengths = (64,) * 6
    saved, stats = {}, {}
    for kv_cache_dtype in (None, "int8", "int4"):
        prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=64), kv_cache_dtype=kv_cache_dtype,
                                           horizon=sum(lengths))
        for chunk in embeddings(model, lengths=lengths):
            prefill.step(inputs_embeds=chunk.to(torch.bfloat16))
        tensors, _ = prefill.state_dict()
        saved[kv_cache_dtype] = sum(t.numel() * t.element_size() for name, t in tensors.items()
                                    if not name.endswith(("block_keys", "step_samples", "segment_index", "segment_partial"))
                                    and "carried" not in name)
        stats[kv_cache_dtype] = prefill.stats.detailed_bytes  # as allocated (sized for the horizon)
    ratio8, ratio4 = saved["int8"] / saved[None], saved["int4"] / saved[None]
    # codes + per-token value scale/zero + per-step key scale/zero over 64 tokens, bfloat16
    assert math.isclose(ratio8, (256 + 4 + 8) / 512) and math.isclose(ratio4, (128 + 4 + 8) / 512)
    assert ratio8 < 0.55 and ratio4 < 0.28
    assert stats[None] == saved[None] and all(math.isclose(stats[q] / stats[None], saved[q] / saved[None], rel_tol=0.02)
                                              for q in ("int8", "int4"))



@pytest.mark.parametrize("kv_cache_dtype", list(KV_CACHE_BITS))
def test_bfloat16_keys_past_float16s_range_read_back_within_half_a_step(tmp_path, kv_cache_dtype):
    from conftest import build_tiny_lm
    model = build_tiny_lm("qwen3", tmp_path / "loud", dtype=torch.bfloat16)
    with torch.no_grad():  # keys and values in the 10^5s: bfloat16 holds them, float16 (65,504) does not
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.mul_(3e4)
            layer.self_attn.v_proj.weight.mul_(3e4)
    chunks = [chunk.to(torch.bfloat16) for chunk in embeddings(model, lengths=LENGTHS[:3])]
    plain = statekv.StreamingPrefill(model, statekv.StateKV(budget=20))
    quantized = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), kv_cache_dtype=kv_cache_dtype)
    for chunk in chunks:
        plain.step(inputs_embeds=chunk)
        quantized.step(inputs_embeds=chunk)
    bits = KV_CACHE_BITS[kv_cache_dtype]
    for exact_layer, layer in zip(plain.cache.layers, quantized.cache.layers):
        keys, values = (part.double() for part in exact_layer.storage.read_range(0, layer.storage.length))
        assert keys.abs().max() > 65504 and values.abs().max() > 65504
        read_keys, read_values = (part.double() for part in layer.storage.read_range(0, layer.storage.length))
        for exact, read, dim in ((values, read_values, 3), (keys[:, :, :LENGTHS[0]], read_keys[:, :, :LENGTHS[0]], 2)):
            _, step = reference(exact, dim, bits)  # half a step, and bfloat16's rounding (scale, zero, what is read)
            bound = step / 2 + exact.abs().amax(dim, keepdim=True) * 2 ** -6
            assert bool(((read - exact).abs() <= bound).all())
    assert quantized.generate(prompt(model), max_new_tokens=5).shape == (1, 5)
    tensors, metadata = quantized.state_dict()
    tensors = {name: t.half() if name.endswith("_scales") else t for name, t in tensors.items()}
    resumed = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), kv_cache_dtype=kv_cache_dtype)
    resumed.load_state_dict(tensors, metadata)  # saved when bfloat16's scales were float16: it goes on in them
    resumed.step(inputs_embeds=chunks[0])
    assert resumed.state_dict()[0]["layers.0.value_scales"].dtype == torch.float16

def test_bad_kv_cache_dtype_is_one_line(tiny_lm):
    for bad in ("int2", "fp8", 8, torch.int8):
        with pytest.raises(statekv.ConfigurationError, match="kv_cache_dtype must be auto, int8 or int4") as info:
            check_kv_cache_dtype(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(statekv.ConfigurationError, match="kv_cache_dtype"):
        statekv.StreamingPrefill(tiny_lm("qwen3"), statekv.StateKV(budget=20), kv_cache_dtype="int3")
    with pytest.raises(statekv.ConfigurationError, match="kv_cache_dtype"):
        ModelOptions(model="x", kv_cache_dtype="float8")
    assert ModelOptions.from_strings({"model": "x", "kv_cache_dtype": "int4"}).kv_cache_dtype == "int4"
    assert ModelOptions.from_strings({"model": "x", "kv_cache_dtype": "none"}).kv_cache_dtype is None
    with pytest.raises(statekv.ConfigurationError, match="kv_cache_dtype"):
        ModelOptions.from_strings({"model": "x", "kv_cache_dtype": "int16"})


def test_state_dict_resumes_a_quantized_cache_and_refuses_another_dtype(tiny_lm):
    model = tiny_lm("qwen3")
    whole = streamed(model, statekv.StateKV(budget=20), kv_cache_dtype="int4")
    first = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), kv_cache_dtype="int4")
    chunks = embeddings(model, lengths=LENGTHS)
    for chunk in chunks[:4]:
        first.step(inputs_embeds=chunk)
    tensors, metadata = first.state_dict()
    assert metadata["kv_cache_dtype"] == "int4" and tensors["layers.0.key_codes"].dtype == torch.uint8
    assert "layers.0.keys" not in tensors
    for other in (None, "int8"):
        wrong = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), kv_cache_dtype=other)
        with pytest.raises(statekv.InputError, match="kv_cache_dtype=int4") as info:
            wrong.load_state_dict(tensors, metadata)
        assert "\n" not in str(info.value)
    resumed = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), kv_cache_dtype="int4")
    resumed.load_state_dict({k: v.clone() for k, v in tensors.items()}, metadata)
    for chunk in chunks[4:]:
        resumed.step(inputs_embeds=chunk)
    for retrieve in (None, statekv.Retrieval(2, keep_tokens=9)):
        assert torch.equal(resumed.generate(prompt(model), max_new_tokens=5, retrieve=retrieve),
                           whole.generate(prompt(model), max_new_tokens=5, retrieve=retrieve))
    plain_tensors, plain_metadata = streamed(model, statekv.StateKV(budget=20)).state_dict()
    with pytest.raises(statekv.InputError, match="kv_cache_dtype=auto"):
        resumed.load_state_dict(plain_tensors, plain_metadata)


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint)


@pytest.mark.parametrize("kv_cache_dtype", list(KV_CACHE_BITS))
def test_saved_quantized_streams_resume_identically_and_refuse_another_dtype(adapter, tmp_path, kv_cache_dtype):
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40,
                         kv_cache_dtype=kv_cache_dtype)
    frames = random_frames(7)
    whole = qa.stream(horizon_frames=7, max_fps=1)
    whole.push_many((image, float(t)) for t, image in enumerate(frames))
    first = qa.stream(horizon_frames=7, max_fps=1)
    first.push_many((image, float(t)) for t, image in enumerate(frames[:3]))
    path = first.save(tmp_path / "stream.safetensors")
    first.close()
    plain = statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40)
    with pytest.raises(statekv.InputError, match=f"saved with kv_cache_dtype={kv_cache_dtype}") as info:
        Stream.load(path, plain)
    assert "\n" not in str(info.value)
    resumed = Stream.load(path, plain, kv_cache_dtype=kv_cache_dtype)  # or say how it was stored
    resumed.close()
    resumed = Stream.load(path, qa)
    resumed.push_many((image, float(t)) for t, image in enumerate(frames[3:], start=3))
    for retrieve in (None, 2):
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve),
                           whole.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve))
    unquantized = plain.stream(horizon_frames=7, max_fps=1)
    unquantized.push_many((image, float(t)) for t, image in enumerate(frames[:3]))
    with pytest.raises(statekv.InputError, match="saved with kv_cache_dtype=auto") as refused:
        Stream.load(unquantized.save(tmp_path / "plain.safetensors"), qa)
    assert "(--kv-cache-dtype auto on the command line)" in str(refused.value)  # the flag a command takes too


def test_per_stream_kv_cache_dtype_and_the_cli_flag(adapter):
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40)
    assert qa.stream(horizon_frames=2, kv_cache_dtype="int8").prefill.settings.kv_cache_dtype == "int8"
    assert qa.stream(horizon_frames=2).prefill.settings.kv_cache_dtype is None
    import argparse
    parser = argparse.ArgumentParser()
    ModelOptions.add_arguments(parser)
    assert ModelOptions.from_args(parser.parse_args(["--model", "x", "--kv-cache-dtype", "int4"])).kv_cache_dtype == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--kv-cache-dtype", "int3"])


def test_flops_cache_bytes_per_frame_and_hour():
    from statekv.flops.memory import cache_bytes, cache_table, format_cache_table
    from statekv.flops.presets import PRESETS
    plain = cache_bytes("internvl3-8b")  # 28 layers x 2 x 4 KV heads x 128 x 2 bytes x (256 + 3) tokens
    assert plain.detailed_per_frame == 28 * 2 * 4 * 128 * 2 * 259
    assert plain.summaries_per_frame == 28 * 4 * 17 * 128 * 2
    int8, int4 = cache_bytes("internvl3-8b", "int8"), cache_bytes("internvl3-8b", "int4")
    # codes, a float16 scale and zero point per token (values) and per channel over the 259-token step (keys)
    assert int8.detailed_per_frame == pytest.approx(28 * 4 * (259 * (256 + 4) + 2 * 128 * 2))
    assert int4.detailed_per_frame == pytest.approx(28 * 4 * (259 * (128 + 4) + 2 * 128 * 2))
    assert 0.5 < int8.detailed_per_frame / plain.detailed_per_frame < 0.52
    assert 0.25 < int4.detailed_per_frame / plain.detailed_per_frame < 0.27
    assert plain.per_hour == 3600 * (plain.detailed_per_frame + plain.summaries_per_frame)
    qwen = cache_bytes("qwen3-vl-8b")  # two frames per step
    spec = PRESETS["qwen3-vl-8b"]
    assert qwen.detailed_per_frame == 36 * 2 * 8 * 128 * 2 * spec.tokens_per_step / 2
    text = format_cache_table(cache_table(list(PRESETS)))
    assert len(text.splitlines()) == 4 + 3 * len(PRESETS) and "internvl3-8b    int4" in text
