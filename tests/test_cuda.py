"""What only a CUDA device can check: batched steps replayed as CUDA graphs (pooled: one graph per bucket), the
Triton kernels at the real models' shapes, and the quantized and disk-tier caches of streams whose model runs on the
GPU.

Marked ``cuda``: ``benchmarks/gpu_suite.py`` runs every test so marked (with the static step's graph tests and the
kernel's float64 checks); without a CUDA device they skip.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import statekv
from statekv.core.step.batching import StepBatcher, StepRequest


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PREFIX, T, STEPS = 9, 6, 14
QUESTION = 10  # room past the streamed tokens for each test's prompt and answer


def chunks(model, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, model.config.hidden_size, generator=generator).to("cuda")
            for n in (PREFIX,) + (T,) * STEPS]


@pytest.fixture
def replays(monkeypatch):
    """Counts CUDA-graph replays made while the test runs."""
    counted = {"replays": 0}
    original = torch.cuda.CUDAGraph.replay

    def counting(graph):
        counted["replays"] += 1
        return original(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return counted


def test_steps_are_recorded_again_after_every_recording_was_dropped(recwarn):
    """`StepGraphs.clear` (a layout change, a pool that grew) drops every recording, which releases their memory
    pool: the next recording takes a pool of its own and replays, instead of failing the caching allocator's
    assertion and stepping eagerly from then on."""
    from statekv.core.step.graphs import StepGraphs

    buffer = torch.zeros(4, device="cuda")

    def device_step(inputs):
        buffer.add_(inputs["x"])
        return buffer * 2

    graphs = StepGraphs(device_step, lambda: False)
    for round_ in range(3):
        graphs.clear()
        x = torch.full((4,), float(round_ + 1), device="cuda")
        assert graphs.run({"x": x}, "layout") is None  # the warm-up, run eagerly by the caller
        device_step({"x": x})
        for _ in range(2):
            before = buffer.clone()
            out = graphs.run({"x": x}, "layout")
            assert out is not None and torch.equal(buffer, before + x) and torch.equal(out, 2 * buffer)
    assert not [w for w in recwarn if "cannot be replayed" in str(w.message)]


def test_a_collection_during_a_recording_cannot_fail_it(recwarn):
    """A dead graph in a reference cycle is freed by the garbage collector, and freeing a graph inside another's
    capture fails that capture (the step's signature would then run eagerly for good): `StepGraphs` holds the
    collector off while it records (`statekv.core.step.graphs.recording`). Here the step itself leaves such a cycle
    behind while it is recorded, with the collector's thresholds at their lowest; the dead graph is freed after."""
    import gc
    import weakref

    from statekv.core.step.graphs import StepGraphs

    assert gc.isenabled()
    dead, side = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    side.add_(1)  # warmed up outside a capture
    with torch.cuda.graph(dead):
        side.add_(1)
    freed = []  # whether a capture was under way when the dead graph was freed
    weakref.finalize(dead, lambda: freed.append(torch.cuda.is_current_stream_capturing()))
    kept, calls = [dead], []
    del dead
    buffer = torch.zeros(4, device="cuda")

    def device_step(inputs):
        calls.append(1)
        if len(calls) == 2:  # the recording (the first call is the eager warm-up)
            cycle = {"graph": kept.pop()}
            cycle["itself"] = cycle
            del cycle
            for _ in range(100):  # allocations that would start a collection
                [object() for _ in range(10)]
        buffer.add_(inputs["x"])
        return buffer * 2

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graphs = StepGraphs(device_step, lambda: False)
        x = torch.ones(4, device="cuda")
        assert graphs.run({"x": x}, "layout") is None
        device_step({"x": x})
        assert graphs.run({"x": x}, "layout") is not None and len(calls) == 2
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    assert freed == [False] and not [w for w in recwarn if "cannot be replayed" in str(w.message)]


@pytest.mark.parametrize("policy", [lambda: statekv.StateKV(budget=20), lambda: statekv.Recency(frames=3)],
                         ids=["statekv", "recency"])
def test_batched_steps_replayed_as_graphs_get_what_each_stream_gets_alone(tiny_lm, policy, replays):
    model = tiny_lm("qwen3").to("cuda")
    data = [chunks(model, seed) for seed in range(3)]
    horizon = PREFIX + STEPS * T + QUESTION
    together = [statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon) for _ in data]
    batcher = StepBatcher()
    hidden = [[] for _ in data]
    for step in range(len(data[0])):
        outcomes = batcher.step([StepRequest(prefill, stream[step]) for prefill, stream in zip(together, data)])
        for collected, outcome in zip(hidden, outcomes):
            assert isinstance(outcome, torch.Tensor), outcome
            collected.append(outcome)
    assert batcher.batched_steps >= STEPS - 4 and replays["replays"] >= STEPS - 6
    for prefill, stream, collected in zip(together, data, hidden):
        alone = statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon, cuda_graph=False)
        expected = [alone.step(inputs_embeds=chunk) for chunk in stream]
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(prefill.carried_positions(layer), alone.carried_positions(layer))
        for got, want in zip(collected, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        prompt = torch.arange(4, device="cuda")[None]
        assert torch.equal(prefill.generate(prompt, max_new_tokens=4), alone.generate(prompt, max_new_tokens=4))


@pytest.mark.parametrize("policy", [lambda: statekv.StateKV(budget=20), lambda: statekv.Recency(frames=3)],
                         ids=["statekv", "recency"])
def test_a_pooled_bucket_is_one_graph_replayed_whoever_fills_it(tiny_lm, policy, replays, monkeypatch):
    """Streams joining and leaving pooled batches (`statekv.core.step.pooled`): each bucket is recorded once and
    replayed for every set of streams that fills it; a replay equals the same pooled step run eagerly bit for bit,
    and each stream carries what it carries alone."""
    from statekv.core.step.pooled import PooledGraphs

    recordings = {"count": 0}  # of pooled steps: steps before the carried state fills are batched, not pooled
    run = PooledGraphs.run

    def counting(graphs, inputs, layout):
        before = list(graphs.captured.values())  # held: a recording made now cannot take a dropped one's id
        hidden = run(graphs, inputs, layout)
        recordings["count"] += sum(all(captured is not old for old in before)
                                   for captured in graphs.captured.values())
        return hidden

    monkeypatch.setattr(PooledGraphs, "run", counting)
    model = tiny_lm("qwen3").to("cuda")
    data = [chunks(model, 10 + seed) for seed in range(5)]
    horizon = PREFIX + STEPS * T + QUESTION
    joins, leaves = [0, 0, 0, 4, 6], [len(data[0]), len(data[0]), 9, len(data[0]) - 3, len(data[0]) - 5]
    runs = {graphed: [statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon,
                                               cuda_graph=graphed) for _ in data] for graphed in (True, False)}
    hidden = {graphed: [[] for _ in data] for graphed in runs}
    for graphed, prefills in runs.items():
        batcher = StepBatcher()
        for step in range(len(data[0]) + max(joins)):
            live = [s for s in range(len(data)) if joins[s] <= step < joins[s] + leaves[s]]
            outcomes = batcher.step([StepRequest(prefills[s], data[s][step - joins[s]]) for s in live])
            for s, outcome in zip(live, outcomes):
                assert isinstance(outcome, torch.Tensor), outcome
                hidden[graphed][s].append(outcome)
        if graphed:
            # memberships {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 3, 4} fill bucket 4: one recording (two if a join grew the
            # pool's tensors), where a graph per set of streams would take three
            assert replays["replays"] >= 6 and 1 <= recordings["count"] <= 2
    for s, stream in enumerate(data):
        assert all(torch.equal(a, b) for a, b in zip(hidden[True][s], hidden[False][s]))
        alone = statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon, cuda_graph=False)
        expected = [alone.step(inputs_embeds=chunk) for chunk in stream[:leaves[s]]]
        for prefill in (runs[True][s], runs[False][s]):
            for layer in range(model.config.num_hidden_layers):
                assert torch.equal(prefill.carried_positions(layer), alone.carried_positions(layer))
        for got, want in zip(hidden[True][s], expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        prompt = torch.arange(4, device="cuda")[None]
        assert torch.equal(runs[True][s].generate(prompt, max_new_tokens=4), alone.generate(prompt, max_new_tokens=4))


@pytest.mark.parametrize("attention", ["eager", "triton"])
@pytest.mark.parametrize("policy", [lambda: statekv.StateKV(budget=20), lambda: statekv.Recency(frames=3)],
                         ids=["statekv", "recency"])
def test_a_compiled_step_replays_as_a_graph_what_it_runs_eagerly(tiny_lm, policy, attention, replays):
    """``compile_step`` under a CUDA graph: the replays run the compiled step's kernels (equal to it bit for bit),
    which carry what the plain step carries and give its hidden states up to rounding."""
    torch._dynamo.reset()
    model = tiny_lm("qwen3").to("cuda")
    data = chunks(model, 5)
    horizon = PREFIX + STEPS * T + QUESTION
    graphed, compiled, plain = (
        statekv.StreamingPrefill(model, policy(), attention=attention, horizon=horizon, **settings)
        for settings in (dict(compile_step=True), dict(compile_step=True, cuda_graph=False), dict(cuda_graph=False)))
    for chunk in data:
        replayed, expected = graphed.step(inputs_embeds=chunk), compiled.step(inputs_embeds=chunk)
        assert torch.equal(replayed, expected)
        torch.testing.assert_close(replayed, plain.step(inputs_embeds=chunk), atol=1e-4, rtol=1e-4)
    assert replays["replays"] >= STEPS - 6
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(graphed.carried_positions(layer), plain.carried_positions(layer))
    torch._dynamo.reset()


def reference_scored_attention(q, k, v, scale):
    """Float64 attention of a chunk over ``[carried; chunk]``: out ``[B, Tq, Hq, D]``, key mass ``[B, Hkv, Tk]``."""
    batch, heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = (q.double() @ keys.transpose(-1, -2)) * scale
    carried = k_len - q_len
    visible = torch.arange(k_len, device=q.device)[None, :] <= carried + torch.arange(q_len, device=q.device)[:, None]
    probs = logits.masked_fill(~visible, -math.inf).softmax(-1)
    return (probs @ values).transpose(1, 2), probs.view(batch, kv_heads, group, q_len, k_len).sum((2, 3))


@pytest.mark.parametrize("heads, kv_heads, carried, head_dim", [(28, 4, 4096, 128), (14, 2, 1024, 64)],
                         ids=["internvl3-8b", "internvl3-1b"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 3e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_triton_kernel_at_the_real_shapes_matches_float64(heads, kv_heads, carried, head_dim, dtype, tolerance):
    generator = torch.Generator(device="cuda").manual_seed(3)
    q = (1.5 * torch.randn(1, heads, 259, head_dim, device="cuda", generator=generator)).to(dtype)
    k = (1.5 * torch.randn(1, kv_heads, carried + 259, head_dim, device="cuda", generator=generator)).to(dtype)
    v = torch.randn(1, kv_heads, carried + 259, head_dim, device="cuda", generator=generator).to(dtype)
    out, mass = statekv.scored_attention(q, k, v, scale=head_dim ** -0.5, backend="triton")
    expected_out, expected_mass = reference_scored_attention(q, k, v, head_dim ** -0.5)
    assert float((out.double() - expected_out).abs().max() / expected_out.abs().max()) < tolerance
    assert float((mass.double() - expected_mass).abs().max() / expected_mass.abs().max()) < tolerance


@pytest.mark.parametrize("kv_cache_dtype, bits", [("int8", 8), ("int4", 4)])
def test_a_quantized_cache_on_cuda_stays_within_a_step_of_its_range_and_answers(tiny_lm, kv_cache_dtype, bits):
    model = tiny_lm("qwen3").to("cuda")
    data = chunks(model, 7)
    horizon = PREFIX + STEPS * T + QUESTION
    plain = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), horizon=horizon)
    quantized = statekv.StreamingPrefill(model, statekv.StateKV(budget=20), horizon=horizon,
                                         kv_cache_dtype=kv_cache_dtype)
    for chunk in data:
        plain.step(inputs_embeds=chunk)
        quantized.step(inputs_embeds=chunk)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(plain.carried_positions(layer), quantized.carried_positions(layer))
    for exact, read in zip(plain.detailed_cache.layers, quantized.detailed_cache.layers):
        assert read.keys.device.type == "cuda"
        for want, got in ((exact.keys, read.keys), (exact.values, read.values)):
            step = float(want.max() - want.min()) / (2 ** bits - 1)
            assert float((got - want).abs().max()) <= step + 1e-5
    prompt = torch.arange(5, device="cuda")[None]
    whole = quantized.generate(prompt, max_new_tokens=5)
    every = statekv.Retrieval(len(data))  # every step retrieved: the whole cache, in order
    assert torch.equal(quantized.generate(prompt, max_new_tokens=5, retrieve=every), whole)


@pytest.mark.parametrize("kv_cache_dtype", [None, "int4"])
def test_a_disk_tier_stream_on_cuda_answers_as_host_memory_and_resumes(checkpoint, tmp_path, kv_cache_dtype):
    options = dict(method="statekv", budget=12, attention="eager", device="cuda", reserve_tokens=40,
                   kv_cache_dtype=kv_cache_dtype)
    memory = statekv.VideoQA.from_pretrained(checkpoint, offload=True, **options)
    disk = statekv.VideoQA.from_pretrained(checkpoint, offload="disk", offload_dir=tmp_path / "tier", **options)
    frames = np.random.default_rng(0).integers(0, 256, (8, 24, 32, 3), dtype=np.uint8)
    streams = [qa.stream(horizon_frames=12) for qa in (memory, disk)]
    for frame in frames:
        for stream in streams:
            stream.push(frame)
    for retrieve in (None, 2):
        answers = [stream.ask_tokens("Why?", max_new_tokens=6, retrieve=retrieve) for stream in streams]
        assert torch.equal(answers[0], answers[1])
    saved = streams[1].save(tmp_path / "disk.stream")
    streams[1].close()
    resumed = statekv.Stream.load(saved, disk)
    assert torch.equal(resumed.ask_tokens("Why?", max_new_tokens=6), streams[0].ask_tokens("Why?", max_new_tokens=6))


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_an_evicting_stream_offloaded_from_the_gpu_gives_its_evicted_rows_back(checkpoint, kv_cache_dtype):
    """Pinned host memory cannot give pages back: an evicting stream's host buffers are not pinned, so what it
    evicts leaves its process's memory (pinned, it grew with every frame streamed); a stream that keeps everything
    stays pinned (asynchronous copies)."""
    from statekv.core.storage.buffers import TokenBuffer
    from statekv.core.storage.host_pages import returnable

    options = dict(method="statekv", budget=12, attention="eager", device="cuda", reserve_tokens=40, offload=True,
                   kv_cache_dtype=kv_cache_dtype)
    evicting = statekv.VideoQA.from_pretrained(checkpoint, max_cache_bytes=60_000, cache_limit="evict-oldest",
                                               **options).stream()
    keeping = statekv.VideoQA.from_pretrained(checkpoint, **options).stream()
    for frame in np.random.default_rng(0).integers(0, 256, (40, 24, 32, 3), dtype=np.uint8):
        evicting.push(frame)
        keeping.push(frame)
    assert evicting.prefill.cache.evicted_steps
    buffers = [buffer for layer in evicting.prefill.cache.layers for buffer in (
        [layer.storage.detailed] if kv_cache_dtype is None else layer.storage.buffers)]
    held = [t for buffer in buffers for t in (
        buffer.tensors or () if isinstance(buffer, TokenBuffer) else [t for block in buffer.blocks.values()
                                                                       for t in block])]
    assert held and all(returnable(t) for t in held)
    kept = [t for layer in keeping.prefill.cache.layers for buffer in (
        [layer.storage.detailed] if kv_cache_dtype is None else layer.storage.buffers) for t in buffer.tensors or ()]
    assert kept and all(t.is_pinned() for t in kept)
    assert evicting.prefill.stats.detailed_bytes <= 60_000
