"""Invariant 7: every score backend agrees with a float64 reference; scores are attention mass per KV head."""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.core.attention import scored as attention


def reference(q, k, v, scale):
    """float64 brute force with explicit GQA repetition."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    kr, vr = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    logits = q.double() @ kr.transpose(-1, -2) * scale
    visible = torch.arange(tk) <= (tk - tq + torch.arange(tq))[:, None]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = (probs @ vr).transpose(1, 2)
    scores = probs.sum(dim=2).reshape(b, hkv, group, tk).sum(dim=2)
    return out, scores


def contrasted_inputs(b, hq, hkv, tq, carried, d, dtype, seed=0):
    """Inputs whose attention is far from uniform: a few sink keys plus strong random logits."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g) * 2.0
    k = torch.randn(b, hkv, carried + tq, d, generator=g) * 2.0
    sinks = torch.randint(0, carried + tq, (3,), generator=g)
    k[:, :, sinks] += 2.0 * q.mean(dim=(1, 2), keepdim=True).squeeze(1)[:, None]
    v = torch.randn(b, hkv, carried + tq, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


CASES = [  # (batch, query heads, KV heads, queries, carried keys, head dim)
    (1, 14, 2, 37, 100, 64),
    (1, 16, 8, 1, 100, 32),
    (2, 4, 4, 23, 0, 16),
    (1, 28, 4, 259, 41, 16),
]


@pytest.mark.parametrize("backend", ["eager", "chunked"])
@pytest.mark.parametrize("case", CASES)
def test_backends_match_float64_reference_fp32(backend, case):
    b, hq, hkv, tq, carried, d = case
    q, k, v = contrasted_inputs(b, hq, hkv, tq, carried, d, torch.float32)
    scale = d ** -0.5
    out, scores = statekv.scored_attention(q, k, v, scale=scale, backend=backend)
    out_ref, scores_ref = reference(q, k, v, scale)
    assert out.shape == (b, tq, hq, d) and out.dtype == torch.float32
    assert scores.shape == (b, hkv, carried + tq) and scores.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.double(), scores_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.sum(-1), torch.full((b, hkv), float(tq * hq // hkv)), rtol=1e-5, atol=0)
    assert scores_ref.max() > 3 * scores_ref.mean()  # the inputs really are contrasted (not near-uniform)


@pytest.mark.parametrize("max_keys", [32, 1000])  # key blocks in two passes, or every key at once
def test_chunked_tiles_across_query_and_key_blocks(max_keys):
    q, k, v = contrasted_inputs(1, 6, 2, 45, 70, 16, torch.float32, seed=3)
    out_ref, scores_ref = reference(q, k, v, 0.25)
    out, scores = attention.chunked_scored_attention(q, k, v, scale=0.25, block_rows=16, max_keys=max_keys,
                                                     block_keys=32)  # 9 ragged row tiles (x 4 key blocks)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.double(), scores_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["eager", "chunked"])
def test_backends_in_half_precision(backend, dtype):
    q, k, v = contrasted_inputs(1, 14, 2, 37, 100, 64, dtype, seed=1)
    out, scores = statekv.scored_attention(q, k, v, scale=0.125, backend=backend)
    out_ref, scores_ref = reference(q, k, v, 0.125)
    assert out.dtype == dtype and scores.dtype == torch.float32
    assert (out.double() - out_ref).norm() / out_ref.norm() < 2e-2
    assert (scores.double() - scores_ref).norm() / scores_ref.norm() < 2e-2


def test_sdpa_output_matches_reference():
    q, k, v = contrasted_inputs(1, 14, 2, 37, 100, 64, torch.float32, seed=2)
    out_ref, _ = reference(q, k, v, 0.125)
    torch.testing.assert_close(attention.chunk_attention(q, k, v, scale=0.125).double(), out_ref,
                               rtol=1e-5, atol=1e-5)


def test_auto_picks_chunked_on_cpu_and_rejects_unknown_backends():
    assert attention.resolve_backend("auto", torch.device("cpu")) == "chunked"
    with pytest.raises(statekv.ConfigurationError, match="unknown attention backend 'flash'"):
        attention.resolve_backend("flash", torch.device("cpu"))


@pytest.mark.parametrize("shapes, message", [
    (((1, 4, 5, 8), (1, 3, 9, 8)), "cannot be grouped"),
    (((1, 4, 9, 8), (1, 2, 5, 8)), "only 5 keys"),
    (((1, 4, 5, 8), (1, 2, 9, 16)), "disagree"),
])
def test_shape_errors(shapes, message):
    q, k = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    with pytest.raises(statekv.InputError, match=message):
        statekv.scored_attention(q, k, k, scale=1.0, backend="eager")


@pytest.mark.parametrize("tq", [1, 5, 7])
def test_largest_query_index_of_a_row_block(tq):
    for r0 in range(0, 3 * tq):
        for r1 in range(r0 + 1, 4 * tq):
            assert attention.largest_query_index(r0, r1, tq) == max(i % tq for i in range(r0, r1))


def test_chunked_runs_on_meta_tensors():
    q, k = torch.empty(1, 4, 9, 8, device="meta"), torch.empty(1, 2, 30, 8, device="meta")
    out, scores = attention.chunked_scored_attention(q, k, k, scale=0.3, block_rows=5, max_keys=8, block_keys=8)
    assert out.shape == (1, 9, 4, 8) and scores.shape == (1, 2, 30)


def test_a_question_builds_its_causal_mask_once_for_every_layer(tiny_lm):
    """A prompt's queries read their layer's context through one causal mask, built at the first layer and read by
    the others: on a deeper model a question dispatches no more mask ops (each was a kernel launch on a GPU)."""
    from statekv.core import StateKV, StreamingPrefill
    from statekv.testing.op_trace import OpTrace

    masks = {}
    for layers in (2, 6):
        prefill = StreamingPrefill(tiny_lm("qwen2", num_hidden_layers=layers), StateKV(16))
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            prefill.step(input_ids=torch.randint(0, 96, (1, 8), generator=generator))
        with OpTrace() as trace:
            prefill.generate(torch.randint(0, 96, (1, 5), generator=generator), max_new_tokens=1)
        masks[layers] = [name for name in trace.compute if name.startswith("masked_fill_")]
    assert masks[2] == masks[6] == ["masked_fill_.Scalar"]



def test_a_question_counts_the_cache_it_holds_once_however_deep_the_model(tiny_lm):
    """Before: each layer that opened its context summed every layer's device bytes for the peak, so a question's
    host work grew with the square of the depth (on a 24-layer decoder on the CPU, 2,880 dispatched buffer queries
    against 919 compute ops). It is counted once every layer is open, when it holds the most, and the peak is
    what it was."""
    from statekv.core import Retrieval, StateKV, StreamingPrefill
    from statekv.testing.op_trace import OpTrace

    queries, peaks = {}, {}
    for layers in (2, 6):
        prefill = StreamingPrefill(tiny_lm("qwen2", num_hidden_layers=layers), StateKV(16))
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            prefill.step(input_ids=torch.randint(0, 96, (1, 8), generator=generator))
        question = torch.randint(0, 96, (1, 5), generator=generator)
        prefill.generate(question, max_new_tokens=1)  # the first ask may grow the stream's buffers
        with OpTrace() as trace:
            prefill.generate(question, max_new_tokens=1, retrieve=Retrieval(2))  # copies the steps it retrieves
        queries[layers] = trace.compute.count("is_pinned.default")
        held = prefill.cache.device_bytes()
        peaks[layers] = (prefill.cache.peak_device_bytes, held)
    assert queries[6] <= 3 * queries[2]  # as deep, not as deep squared
    for peak, held in peaks.values():
        assert peak > held  # the contexts it retrieved counted on top of the stream's cache


def test_a_questions_layers_share_a_mask_only_where_their_contexts_are_as_long(tiny_lm, monkeypatch):
    """Layers that retrieved steps of other lengths read contexts of other lengths: each reads a mask of its own
    length, and layers whose contexts are as long read the same one."""
    from statekv.core import Retrieval, StateKV, StreamingPrefill
    from statekv.core.answering import answer_cache

    read = []

    def recorded(q, k, v, *, scale, mask=None):
        read.append((k.shape[2], mask))
        return attention.chunk_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(answer_cache, "chunk_attention", recorded)
    layers = 6
    prefill = StreamingPrefill(tiny_lm("qwen2", num_hidden_layers=layers), StateKV(16))
    generator = torch.Generator().manual_seed(5)
    for length in (3, 19, 4, 15, 2, 11, 6, 2, 9, 3):
        prefill.step(input_ids=torch.randint(0, 96, (1, length), generator=generator))
    prefill.generate(torch.randint(0, 96, (1, 5), generator=generator), max_new_tokens=1, retrieve=Retrieval(1))
    prompt = read[:layers]  # the prompt's forward, one call a layer
    assert len({length for length, _ in prompt}) > 1
    assert all(mask.tk == length and mask.tq == 5 for length, mask in prompt)
    for length, mask in prompt:
        assert all(other is mask for other_length, other in prompt if other_length == length)


def test_the_masks_of_shapes_no_longer_used_are_let_go():
    """Before: every chunk shape's mask was kept for good, and a full-attention stream makes a new shape at every
    step (its keys grow), so a long one held memory quadratic in its length after it closed. A shape in use stays
    one mask."""
    from statekv.core.attention.scored import MASKS_KEPT, ChunkMask

    cpu = torch.device("cpu")
    first, steady = ChunkMask.of(1, 3, 1, cpu), ChunkMask.of(2, 6, 1, cpu)
    for tk in range(4, 4 + 2 * MASKS_KEPT):  # a growing stream's steps
        ChunkMask.of(1, tk, 1, cpu)
        if tk % 64 == 0:
            assert ChunkMask.of(2, 6, 1, cpu) is steady  # used all along: kept
    assert ChunkMask.of(2, 6, 1, cpu) is steady and ChunkMask.of(1, 3, 1, cpu) is not first
