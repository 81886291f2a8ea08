"""The engine's contract around the math: public names, argument errors, restoring the model, atomic steps,
answering without mutation (invariant 6)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import statekv
from conftest import split
from test_streaming import TOTAL, stream, tokens


def test_public_names_of_the_design_exist():
    for name in ("FullAttention", "Recency", "StateKV", "StreamingPrefill", "scored_attention"):
        assert hasattr(statekv, name)
    prefill = inspect.signature(statekv.StreamingPrefill).parameters
    assert {"model", "policy", "settings", "horizon"} <= set(prefill)
    assert {"attention", "offload", "kv_cache_dtype", "cuda_graph", "positions"} <= {
        field.name for field in dataclasses.fields(statekv.EngineSettings)}  # settings, also given as keywords


@pytest.mark.parametrize("make, message", [
    (lambda: statekv.StateKV(budget=0), "budget must be a positive integer, got 0"),
    (lambda: statekv.StateKV(budget=-3), "got -3"),
    (lambda: statekv.StateKV(budget=2.5), "got 2.5"),
    (lambda: statekv.StateKV(budget=True), "got True"),
    (lambda: statekv.Recency(frames=0), "frames must be a positive integer"),
    (lambda: statekv.SinksAndRecency(sinks=0, frames=2), "sinks must be a positive integer"),
])
def test_policy_arguments_are_validated(make, message):
    with pytest.raises(statekv.ConfigurationError, match=message):
        make()


def test_chunk_errors_name_the_problem(tiny_lm):
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8))
    hidden = model.config.hidden_size
    with pytest.raises(statekv.InputError, match="empty chunk"):
        prefill.step(inputs_embeds=torch.zeros(1, 0, hidden))
    with pytest.raises(statekv.InputError, match=f"hidden size {hidden + 1}, but the model's is {hidden}"):
        prefill.step(inputs_embeds=torch.zeros(1, 4, hidden + 1))
    with pytest.raises(statekv.InputError, match="exactly one of"):
        prefill.step()
    with pytest.raises(statekv.InputError, match=r"must be \[B, T, D\]"):
        prefill.step(inputs_embeds=torch.zeros(4, hidden))
    with pytest.raises(statekv.ConfigurationError, match="policy must be a CarryPolicy"):
        statekv.StreamingPrefill(model, "statekv")
    for policy in (statekv.StateKV(budget=8), statekv.FullAttention()):
        with pytest.raises(statekv.ConfigurationError, match="unknown attention backend 'flash'"):
            statekv.StreamingPrefill(model, policy, attention="flash")
    assert prefill.seen_tokens == 0
    assert prefill.detailed_cache.get_seq_length() == 0
    prefill.step(input_ids=torch.arange(3)[None])
    with pytest.raises(statekv.InputError, match="batch size 2, but the stream has 1"):
        prefill.step(input_ids=torch.arange(6).view(2, 3))
    assert prefill.seen_tokens == 3


def test_attention_is_switched_once_and_ordinary_calls_keep_the_original(tiny_lm):
    model = tiny_lm("qwen2")
    chunks = split(tokens(model))
    prompt = tokens(model, 9, seed=5)
    plain = model(prompt).logits
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=10))
    assert model.config._attn_implementation == "statekv+sdpa"  # switched once, when the stream was made
    for chunk in chunks[:4]:
        prefill.step(input_ids=chunk)
        assert model.config._attn_implementation == "statekv+sdpa"
        assert torch.equal(model(prompt).logits, plain)  # an ordinary call between steps: sdpa, its own mask
    before = [layer.detailed.length for layer in prefill.cache.layers], prefill.carried_positions(1).clone()

    class Boom(RuntimeError):
        pass

    def explode(candidates):
        raise Boom("selection failed")

    prefill.cache.policy = statekv.StateKV(budget=10)
    object.__setattr__(prefill.cache.policy, "select", explode)
    with pytest.raises(Boom):
        prefill.step(input_ids=chunks[4])
    assert model.config._attn_implementation == "statekv+sdpa"
    assert torch.equal(model(prompt).logits, plain)
    # The failed step left no trace: same length, same carried state, and streaming goes on as if it never ran.
    assert prefill.seen_tokens == sum(c.shape[1] for c in chunks[:4])
    assert [layer.detailed.length for layer in prefill.cache.layers] == before[0]
    assert torch.equal(prefill.carried_positions(1), before[1])
    prefill.cache.policy = statekv.StateKV(budget=10)
    for chunk in chunks[4:]:
        prefill.step(input_ids=chunk)
    uninterrupted, _ = stream(model, statekv.StateKV(budget=10), chunks)
    for layer, reference in zip(prefill.detailed_cache.layers, uninterrupted.detailed_cache.layers):
        assert torch.equal(layer.keys, reference.keys)


def test_vlm_style_model_switches_only_the_text_config(tiny_lm):
    """A composite config switches through the dict form, so a vision tower would keep its attention."""
    from transformers import AutoModelForImageTextToText, InternVLConfig

    text = tiny_lm("qwen2").config.to_dict()
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  image_size=28, patch_size=14)
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=5)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    seen = {}

    def spy(candidates):
        seen["vision"] = model.config.vision_config._attn_implementation
        seen["text"] = model.config.text_config._attn_implementation
        return slice(0, None)

    policy = statekv.FullAttention()
    object.__setattr__(policy, "select", spy)
    prefill = statekv.StreamingPrefill(model, policy)
    prefill.step(inputs_embeds=torch.randn(1, 5, config.text_config.hidden_size))
    assert seen == {"vision": "sdpa", "text": "statekv+sdpa"}
    assert model.config.text_config._attn_implementation == "statekv+sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"


class HandWrittenAttention(nn.Module):
    """Stands in for a model whose attention bypasses transformers' AttentionInterface."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        b, t, _ = hidden_states.shape
        inner = self.inner
        q = inner.q_proj(hidden_states).view(b, t, -1, inner.head_dim).transpose(1, 2)
        k = inner.k_proj(hidden_states).view(b, t, -1, inner.head_dim).transpose(1, 2)
        v = inner.v_proj(hidden_states).view(b, t, -1, inner.head_dim).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return inner.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None


def test_model_that_bypasses_the_attention_interface_is_refused(tmp_path):
    from conftest import build_tiny_lm

    model = build_tiny_lm("llama", tmp_path)
    for layer in model.model.layers:
        layer.self_attn = HandWrittenAttention(layer.self_attn)
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention())
    with pytest.raises(statekv.UnsupportedModelError, match=r"layers \[0, 1, 2\] did not run their attention"):
        prefill.step(input_ids=torch.arange(5)[None])
    assert prefill.seen_tokens == 0
    with pytest.raises(statekv.UnsupportedModelError, match="is not a transformers model"):
        statekv.StreamingPrefill(nn.Linear(2, 2), statekv.FullAttention())


def test_answering_never_mutates_the_stream(tiny_lm):
    model = tiny_lm("qwen3")
    chunks = split(tokens(model))
    prompt = tokens(model, 5, seed=7)
    asked = statekv.StreamingPrefill(model, statekv.StateKV(budget=12))
    for chunk in chunks[:6]:
        asked.step(input_ids=chunk)
    first = asked.generate(prompt, max_new_tokens=6)
    second = asked.generate(prompt, max_new_tokens=6)
    assert torch.equal(first, second)
    for chunk in chunks[6:]:
        asked.step(input_ids=chunk)
    never_asked, _ = stream(model, statekv.StateKV(budget=12), chunks)
    for layer, reference in zip(asked.detailed_cache.layers, never_asked.detailed_cache.layers):
        assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(asked.carried_positions(layer), never_asked.carried_positions(layer))
    assert asked.seen_tokens == TOTAL


def test_generate_needs_a_streamed_context_and_a_prompt(tiny_lm):
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention())
    with pytest.raises(statekv.InputError, match="nothing has been streamed"):
        prefill.generate(tokens(model, 3))
    prefill.step(input_ids=tokens(model, 4))
    with pytest.raises(statekv.InputError, match="non-empty"):
        prefill.generate(torch.zeros(1, 0, dtype=torch.long))


def test_the_cache_reports_lengths_as_transformers_sliding_window_layers_do(tiny_lm):
    """get_seq_length: logical tokens seen (what positions count); get_mask_sizes: (carried + T, offset) with
    the chunk causal at the end, whatever the carried state holds."""
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=12))
    for chunk in split(tokens(model))[:6]:
        prefill.step(input_ids=chunk)
    seen = prefill.seen_tokens
    assert prefill.cache.get_seq_length() == seen and prefill.cache.get_query_offset() == seen
    assert prefill.cache.get_mask_sizes(5, 0) == (12 + 5, seen - 12)


@pytest.mark.parametrize("mask", [torch.tensor([[1, 1, 0]]), torch.ones(1, 1, 3, 3)])
def test_an_attention_mask_that_is_not_plain_causal_is_refused(tiny_lm, mask):
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=12))
    with pytest.raises(statekv.InputError, match="cannot apply an attention mask"):
        prefill.step(input_ids=tokens(model, 3), attention_mask=mask)
    assert prefill.seen_tokens == 0
    hidden = prefill.step(input_ids=tokens(model, 3), attention_mask=torch.ones(1, 3, dtype=torch.long))
    assert torch.equal(hidden, stream(model, statekv.StateKV(budget=12), [tokens(model, 3)])[1])


def test_chunks_of_the_wrong_dtype_device_or_vocabulary_are_refused(tiny_lm):
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=12))
    hidden = model.config.hidden_size
    with pytest.raises(statekv.InputError, match="inputs_embeds are float64, but the model runs in float32"):
        prefill.step(inputs_embeds=torch.zeros(1, 3, hidden, dtype=torch.float64))
    with pytest.raises(statekv.InputError, match=r"outside the vocabulary \[0, 96\)"):
        prefill.step(input_ids=torch.tensor([[1, 96]]))
    with pytest.raises(statekv.InputError, match="on meta, but the model is on cpu"):
        prefill.step(inputs_embeds=torch.zeros(1, 3, hidden, device="meta"))
    assert prefill.seen_tokens == 0
