"""DESIGN §4 invariants 1-5 on tiny random Qwen2, Qwen3 and Llama models loaded via from_pretrained."""

from __future__ import annotations

import pytest
import torch

import statekv
from conftest import CHUNK_LENGTHS, split
from reference import last_steps, reference_stream, top_budget

TOTAL = sum(CHUNK_LENGTHS)
FAMILIES = ["qwen2", "qwen3", "llama"]


def tokens(model, length=TOTAL, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, length), generator=generator)


def stream(model, policy, chunks, **kwargs):
    prefill = statekv.StreamingPrefill(model, policy, **kwargs)
    hidden = torch.cat([prefill.step(input_ids=chunk) for chunk in chunks], dim=1)
    return prefill, hidden


@torch.no_grad()
def one_shot(model, ids):
    output = model.get_decoder()(input_ids=ids, use_cache=True)
    return output.last_hidden_state, output.past_key_values


# Invariant 1: full attention streaming equals the model's own one-shot forward --------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_full_attention_equals_one_shot(tiny_lm, family):
    model = tiny_lm(family)
    ids = tokens(model)
    hidden_ref, cache_ref = one_shot(model, ids)
    prefill, hidden = stream(model, statekv.FullAttention(), split(ids))

    assert prefill.seen_tokens == TOTAL
    torch.testing.assert_close(hidden, hidden_ref, atol=1e-4, rtol=0)
    detailed = prefill.detailed_cache
    for layer, ref_layer in zip(detailed.layers, cache_ref.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_answer_is_token_identical_to_one_shot_generate(tiny_lm, family):
    model = tiny_lm(family)
    ids, prompt = tokens(model), tokens(model, length=6, seed=1)
    expected = model.generate(torch.cat([ids, prompt], dim=1), max_new_tokens=8, do_sample=False)[:, TOTAL + 6:]
    for policy in (statekv.FullAttention(), statekv.StateKV(budget=TOTAL)):
        prefill, _ = stream(model, policy, split(ids))
        assert torch.equal(prefill.generate(prompt, max_new_tokens=8), expected)


def test_inputs_embeds_and_explicit_positions_match_input_ids(tiny_lm):
    model = tiny_lm("qwen3")
    ids = tokens(model)
    _, hidden_ids = stream(model, statekv.StateKV(budget=20), split(ids))
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=20))
    embed = model.get_input_embeddings()
    hidden, start = [], 0
    for chunk in split(ids):
        positions = torch.arange(start, start + chunk.shape[1])[None]
        hidden.append(prefill.step(inputs_embeds=embed(chunk), position_ids=positions))
        start += chunk.shape[1]
    torch.testing.assert_close(torch.cat(hidden, dim=1), hidden_ids, atol=1e-6, rtol=0)


# Invariant 2: budgets that keep everything are exactly full attention --------------------------------------
@pytest.mark.parametrize("policy", [statekv.StateKV(budget=TOTAL), statekv.StateKV(budget=10 * TOTAL),
                                    statekv.Recency(frames=len(CHUNK_LENGTHS)), statekv.Recency(frames=100)])
def test_policies_that_keep_everything_equal_full_attention(tiny_lm, policy):
    model = tiny_lm("qwen2")
    chunks = split(tokens(model))
    full, hidden_full = stream(model, statekv.FullAttention(), chunks)
    prefill, hidden = stream(model, policy, chunks)
    assert torch.equal(hidden, hidden_full)
    for layer, full_layer in zip(prefill.detailed_cache.layers, full.detailed_cache.layers):
        assert torch.equal(layer.keys, full_layer.keys) and torch.equal(layer.values, full_layer.values)
    assert torch.equal(prefill.carried_positions(0), torch.arange(TOTAL).expand(1, 1, -1))


# Invariants 3 and 4: the carried state is the brute-force top-B, at logical positions ----------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [1, 7, 24])  # 7 equals a chunk length; 24 spans several chunks
def test_statekv_matches_brute_force_reference(tiny_lm, family, budget):
    model = tiny_lm(family)
    chunks = split(tokens(model))
    prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=budget), attention="eager")
    reference = reference_stream(model, chunks, top_budget, budget=budget)
    for chunk, (hidden_ref, carried_ref) in zip(chunks, reference):
        hidden = prefill.step(input_ids=chunk)
        torch.testing.assert_close(hidden, hidden_ref, atol=1e-4, rtol=0)
        for layer, (keys_ref, values_ref, positions_ref) in enumerate(carried_ref):
            positions = prefill.carried_positions(layer)
            assert positions.shape[-1] == min(budget, prefill.seen_tokens)
            assert torch.equal(positions, positions_ref)
            keys, values = prefill.cache.layers[layer].carried()
            torch.testing.assert_close(keys, keys_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(values, values_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "chunked"])
def test_every_chunk_attends_to_at_most_budget_plus_chunk_keys(tiny_lm, backend, monkeypatch):
    model = tiny_lm("qwen3")
    budget, seen_keys = 16, []
    for name in ("scored_attention", "chunk_attention"):  # chunks that fit the budget skip scoring
        original = getattr(statekv.core.cache.two_state, name)

        def spy(q, k, v, _original=original, **kwargs):
            seen_keys.append((q.shape[2], k.shape[2]))
            return _original(q, k, v, **kwargs)

        monkeypatch.setattr(statekv.core.cache.two_state, name, spy)
    stream(model, statekv.StateKV(budget=budget), split(tokens(model)), attention=backend)
    assert len(seen_keys) == len(CHUNK_LENGTHS) * model.config.num_hidden_layers
    assert all(keys <= budget + queries for queries, keys in seen_keys)
    assert max(keys for _, keys in seen_keys) == budget + max(CHUNK_LENGTHS[1:])


@pytest.mark.parametrize("frames", [1, 3])
def test_recency_matches_reference(tiny_lm, frames):
    model = tiny_lm("llama")
    chunks = split(tokens(model))
    prefill = statekv.StreamingPrefill(model, statekv.Recency(frames=frames))
    reference = reference_stream(model, chunks, last_steps, frames=frames)
    for step, (chunk, (hidden_ref, carried_ref)) in enumerate(zip(chunks, reference)):
        hidden = prefill.step(input_ids=chunk)
        torch.testing.assert_close(hidden, hidden_ref, atol=1e-4, rtol=0)
        expected = sum(CHUNK_LENGTHS[max(0, step - frames + 1): step + 1])
        for layer, (_, _, positions_ref) in enumerate(carried_ref):
            assert prefill.carried_positions(layer).shape[-1] == expected
            assert torch.equal(prefill.carried_positions(layer), positions_ref)


def test_sinks_and_recency_keeps_sinks_and_recent_steps(tiny_lm):
    model = tiny_lm("qwen2")
    prefill, _ = stream(model, statekv.SinksAndRecency(sinks=4, frames=2), split(tokens(model)))
    recent = sum(CHUNK_LENGTHS[-2:])
    expected = torch.cat([torch.arange(4), torch.arange(TOTAL - recent, TOTAL)])
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(prefill.carried_positions(layer)[0, 0], expected)


def test_rules_compose_rekv_is_sinks_around_recency(tiny_lm):
    model = tiny_lm("qwen2")
    chunks = split(tokens(model))
    rekv, hidden_rekv = stream(model, statekv.ReKV(frames=2, sinks=3, prefix_tokens=4), chunks)
    composed, hidden = stream(model, statekv.WithSinks(statekv.Recency(frames=2), sinks=3).for_prefix(4), chunks)
    assert torch.equal(hidden, hidden_rekv)
    expected = torch.cat([torch.arange(7), torch.arange(TOTAL - sum(CHUNK_LENGTHS[-2:]), TOTAL)])
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(composed.carried_positions(layer)[0, 0], expected)
        assert torch.equal(rekv.carried_positions(layer), composed.carried_positions(layer))
    sinks_and_top, _ = stream(model, statekv.WithSinks(statekv.StateKV(budget=10), sinks=5), chunks)
    for layer in range(model.config.num_hidden_layers):
        positions = sinks_and_top.carried_positions(layer)
        assert positions.shape[-1] == 15 and bool((positions[..., :5] == torch.arange(5)).all())


def test_a_per_layer_budget_gives_each_layer_its_own(tiny_lm):
    model = tiny_lm("qwen3")
    chunks = split(tokens(model))
    budgets = (6, 20, 11)
    prefill, _ = stream(model, statekv.PerLayerBudget(statekv.StateKV(budget=1), budgets), chunks)
    assert [prefill.carried_positions(layer).shape[-1] for layer in range(3)] == list(budgets)
    alone, _ = stream(model, statekv.StateKV(budget=6), chunks)  # layer 0 sees the same hidden states
    assert torch.equal(prefill.carried_positions(0), alone.carried_positions(0))


def test_detailed_cache_grows_geometrically_and_not_at_all_with_a_horizon(tiny_lm):
    model = tiny_lm("qwen3")
    chunks = split(tokens(model))
    for horizon, max_reallocations in ((None, 5), (TOTAL, 1)):
        prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), horizon=horizon)
        addresses = set()
        for chunk in chunks:
            prefill.step(input_ids=chunk)
            addresses.add(prefill.cache.layers[0].detailed.keys.data_ptr())
        assert len(addresses) <= max_reallocations


# Invariant 5: dynamic RoPE is frozen for the whole run ------------------------------------------------------
def test_dynamic_rope_is_frozen_for_the_horizon(tiny_lm):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_lm("qwen2", max_position_embeddings=64, rope_parameters=rope)  # 100 tokens > 64
    ids = tokens(model)
    horizon = TOTAL + 7  # the streamed tokens, then a question of 4 tokens and its answer of 3
    run = torch.cat([ids, tokens(model, 7, seed=5)], dim=1)
    hidden_ref, cache_ref = one_shot(model, run)  # the model's own NTK rotation for the whole horizon
    hidden_ref = hidden_ref[:, :TOTAL]

    thawed, hidden_thawed = stream(model, statekv.FullAttention(), split(ids), horizon=horizon, freeze_rope=False)
    assert (hidden_thawed - hidden_ref).abs().max() > 1e-3  # per-chunk bases really do break exactness

    frozen, hidden = stream(model, statekv.FullAttention(), split(ids), horizon=horizon)
    torch.testing.assert_close(hidden, hidden_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(frozen.detailed_cache.layers[2].keys, cache_ref.layers[2].keys[:, :, :TOTAL],
                               atol=1e-4, rtol=0)
    rotary = model.get_decoder().rotary_emb
    inv_freq = rotary.inv_freq.clone()
    frozen.generate(tokens(model, 4, seed=3), max_new_tokens=3)
    assert torch.equal(rotary.inv_freq, inv_freq)  # decoding used the prefill's rotation
    frozen.close()
    assert rotary.rope_type == "dynamic"


def test_horizon_beyond_rope_capacity_fails_before_any_work(tiny_lm):
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_lm("qwen2", max_position_embeddings=64, rope_parameters=linear)
    with pytest.raises(statekv.HorizonError, match="beyond the model's RoPE"):
        statekv.StreamingPrefill(model, statekv.FullAttention(), horizon=129)
    statekv.StreamingPrefill(model, statekv.FullAttention(), horizon=128)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_lm("qwen2", max_position_embeddings=64, rope_parameters=dynamic)
    statekv.StreamingPrefill(model, statekv.FullAttention(), horizon=100_000).close()  # NTK rescales to any length
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention())  # no horizon: the trained 64 tokens
    prefill.step(input_ids=tokens(model, 60))
    with pytest.raises(statekv.HorizonError, match="beyond the declared horizon"):
        prefill.step(input_ids=tokens(model, 5))
    assert prefill.seen_tokens == 60


# bf16 ------------------------------------------------------------------------------------------------------
def test_bf16_streaming_stays_within_bf16_tolerance(tiny_lm):
    model = tiny_lm("qwen2", dtype=torch.bfloat16)
    ids = tokens(model)
    hidden_ref, _ = one_shot(model, ids)
    for policy in (statekv.FullAttention(), statekv.StateKV(budget=TOTAL)):
        _, hidden = stream(model, policy, split(ids))
        assert hidden.dtype == torch.bfloat16
        error = (hidden.float() - hidden_ref.float()).norm() / hidden_ref.float().norm()
        assert error < 2e-2


def test_triton_backend_streams_like_eager(tiny_lm):
    """Invariant 7 through the whole engine: the Triton kernel (interpreted on CPU) selects like eager."""
    pytest.importorskip("triton")
    from statekv.kernels import triton_available

    if not triton_available():
        pytest.skip("Triton can neither compile (no CUDA) nor interpret (TRITON_INTERPRET unset) here")
    model = tiny_lm("qwen3")
    chunks = split(tokens(model))[:6]
    eager, hidden_eager = stream(model, statekv.StateKV(budget=12), chunks, attention="eager")
    triton, hidden_triton = stream(model, statekv.StateKV(budget=12), chunks, attention="triton")
    torch.testing.assert_close(hidden_triton, hidden_eager, atol=1e-4, rtol=0)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(triton.carried_positions(layer), eager.carried_positions(layer))
