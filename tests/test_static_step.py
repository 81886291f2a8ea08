"""Steady streaming steps are static (same ops, shapes and arguments every step), sync-free and cheap, so a GPU
can replay them from one CUDA graph; and the ring and slot forms that make them static give the right answers.

Streams here are a 9-token prefix then chunks of equal length, as a video's frames are.
"""

from __future__ import annotations

import collections
import gc
import threading
import time

import pytest
import torch

import statekv
from statekv.core.step.graphs import StepGraphs, recording, signature
from statekv.core.storage.layer_storage import SEGMENT_STEPS
from statekv.testing.op_trace import OpTrace, device_parts
from reference import last_steps, reference_stream, top_budget

PREFIX, T, STEPS = 9, 6, 16
LENGTHS = (PREFIX,) + (T,) * STEPS
BUDGET, WINDOW = 20, 3  # reached after 2 and 3 chunks: most steps are steady


def embeddings(model, lengths=LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, model.config.hidden_size, generator=generator) for n in lengths]


def traced_steps(prefill, chunks) -> list[OpTrace]:
    traces = []
    with device_parts():
        for chunk in chunks:
            with OpTrace() as trace:
                prefill.step(inputs_embeds=chunk)
            traces.append(trace)
    return traces


def completes_a_segment(step: int) -> bool:
    """Whether step ``step`` (0: the first) completes a segment of the retrieval index: its host part then writes
    the segment's row and starts the next one (a host-known event, once every SEGMENT_STEPS steps)."""
    return (step + 1) % SEGMENT_STEPS == 0


STEADY_CASES = [(statekv.StateKV(budget=BUDGET), "eager"), (statekv.StateKV(budget=BUDGET), "chunked"),
                (statekv.KeyNorm(budget=BUDGET), "chunked"), (statekv.Recency(frames=WINDOW), "chunked"),
                # wrapped rules say their steady budget (the protected prefix plus the rule's, or the layer's own)
                (statekv.WithSinks(statekv.StateKV(budget=BUDGET), sinks=3), "eager"),
                (statekv.PerLayerBudget(statekv.StateKV(budget=BUDGET), (BUDGET, BUDGET + 2, BUDGET + 4)), "eager")]


@pytest.mark.parametrize("policy, backend", STEADY_CASES, ids=lambda x: repr(x) if not isinstance(x, str) else x)
def test_steady_steps_are_static_and_sync_free(tiny_lm, policy, backend):
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, policy, attention=backend, horizon=sum(LENGTHS))
    chunks = embeddings(model)
    traces = traced_steps(prefill, chunks[:6])
    addresses = {(layer.slots.kv.data_ptr(), layer.detailed.keys.data_ptr()) for layer in prefill.cache.layers}
    traces += traced_steps(prefill, chunks[6:])
    assert prefill.cache.is_steady()
    steady = traces[5:]
    assert any(completes_a_segment(step) for step in range(5, len(traces)))
    # what a CUDA graph records: (op, shapes, scalar arguments), step after step
    assert all(trace.device_ops == steady[0].device_ops for trace in steady)
    plain = [trace for step, trace in enumerate(traces) if step >= 5 and not completes_a_segment(step)]
    assert all(trace.ops == plain[0].ops for trace in plain)  # the whole step, but where a segment completes
    assert all(not trace.syncs for trace in traces[1:])
    assert addresses == {(layer.slots.kv.data_ptr(), layer.detailed.keys.data_ptr())
                         for layer in prefill.cache.layers}  # the same buffers, written in place


def test_a_growing_window_is_not_static(tiny_lm):
    """The check above can fail: full attention's window moves every step."""
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention(), horizon=sum(LENGTHS))
    traces = traced_steps(prefill, embeddings(model)[:6])
    assert traces[4].ops != traces[5].ops and not prefill.cache.is_steady()


def test_statekv_adds_at_most_13_compute_ops_per_layer_over_recency(tiny_lm):
    model = tiny_lm("qwen3")
    chunks = embeddings(model)
    counts = {}
    for name, policy in (("statekv", statekv.StateKV(budget=BUDGET)), ("recency", statekv.Recency(frames=WINDOW))):
        prefill = statekv.StreamingPrefill(model, policy, attention="eager", horizon=sum(LENGTHS))
        counts[name] = collections.Counter(traced_steps(prefill, chunks)[-1].compute)
    extra = (sum(counts["statekv"].values()) - sum(counts["recency"].values())) / model.config.num_hidden_layers
    assert 0 < extra <= 13, counts
    layers = model.config.num_hidden_layers
    assert counts["statekv"]["topk.default"] == layers and counts["statekv"]["searchsorted.Tensor"] == layers


# A steady step's cost, counted exactly: these fail if a change adds ops to every step (kernel launches on a GPU,
# inside its CUDA graph or, worse, outside it); if one must, update the counts and docs/benchmarks.md.
DEVICE_OPS = {"statekv": 238, "recency": 199}  # the tiny qwen3 decoder (3 layers), eager attention
SEGMENT_OPS_PER_LAYER = {"aminmax.default": 1, "sum.dim_IntList": 1,  # the step's keys reduced
                         "minimum.out": 1, "maximum.out": 1, "add.out": 1}  # folded into the open segment at commit


@pytest.mark.parametrize("name, policy", [("statekv", statekv.StateKV(budget=BUDGET)),
                                          ("recency", statekv.Recency(frames=WINDOW))])
def test_a_steady_step_runs_a_fixed_count_of_ops_and_none_outside_its_device_part(tiny_lm, name, policy):
    model = tiny_lm("qwen3")
    layers = model.config.num_hidden_layers
    lengths = (PREFIX,) + (T,) * (2 * SEGMENT_STEPS + 1)
    prefill = statekv.StreamingPrefill(model, policy, attention="eager", horizon=sum(lengths))
    traces = traced_steps(prefill, embeddings(model, lengths))
    for step, trace in enumerate(traces[5:], start=5):
        counted = collections.Counter(trace.device_compute)
        assert len(trace.device_compute) == DEVICE_OPS[name], (step, counted)
        assert all(counted[op] == count * layers for op, count in SEGMENT_OPS_PER_LAYER.items()
                   if op != "sum.dim_IntList"), counted
        # outside it (the host's part: on a GPU, launches outside the graph): nothing, but once per segment, per
        # layer, its row made (cat) and written into the index (is_pinned, copy_) and the next segment started
        outside = collections.Counter(trace.host_compute)
        if completes_a_segment(step):
            assert outside == {"cat.default": layers, "copy_.default": 2 * layers, "is_pinned.default": layers}, (
                step, outside)
        else:
            assert not outside, (step, outside)


def test_before_its_budget_fills_statekv_runs_exactly_the_ops_of_full_attention(tiny_lm):
    model = tiny_lm("qwen3")
    chunks = embeddings(model, lengths=(PREFIX, T, T))
    budget = sum(len_ for len_ in (PREFIX, T, T))
    traced_steps(statekv.StreamingPrefill(model, statekv.FullAttention()), chunks)  # a process's first steps do more
    full = traced_steps(statekv.StreamingPrefill(model, statekv.FullAttention()), chunks)
    state = traced_steps(statekv.StreamingPrefill(model, statekv.StateKV(budget=budget)), chunks)
    assert [trace.ops for trace in state] == [trace.ops for trace in full]


@pytest.mark.parametrize("policy", [statekv.StateKV(budget=BUDGET), statekv.Recency(frames=WINDOW)], ids=repr)
def test_the_steady_decoder_step_compiles_once(tiny_lm, policy):
    """torch.compile(fullgraph=True) traces the device part of a step (forward, selection, commit) without a
    graph break, and 20 steady steps reuse that one graph: nothing the step reads changes between steps."""
    import torch._dynamo

    model = tiny_lm("qwen3")
    chunks = embeddings(model, lengths=(PREFIX,) + (T,) * 26)
    eager = statekv.StreamingPrefill(model, policy, attention="eager", horizon=sum(c.shape[1] for c in chunks))
    compiled = statekv.StreamingPrefill(model, policy, attention="eager", horizon=eager.horizon)
    for chunk in chunks[:6]:
        eager.step(inputs_embeds=chunk)
        compiled.step(inputs_embeds=chunk)
    torch._dynamo.reset()
    traced, calls = torch.compile(compiled.device_step, fullgraph=True, backend="eager"), []

    def counted(inputs):
        calls.append(inputs)
        return traced(inputs)

    compiled.device_step = counted  # switched on the engine: every later step runs it
    with torch._dynamo.config.patch(error_on_recompile=True):
        for chunk in chunks[6:]:
            assert torch.equal(compiled.step(inputs_embeds=chunk), eager.step(inputs_embeds=chunk))
    assert len(calls) == len(chunks[6:])
    torch._dynamo.reset()


# The ring and slot forms give the reference's answers ------------------------------------------------------
@pytest.mark.parametrize("rule, policy", [(top_budget, statekv.StateKV(budget=BUDGET)),
                                          (last_steps, statekv.Recency(frames=WINDOW))], ids=["statekv", "recency"])
def test_steady_forms_match_the_reference_through_a_shorter_chunk(tiny_lm, rule, policy):
    """Equal chunks (ring / in-place slots), then a shorter one (the forms are left and rebuilt), then equal."""
    model = tiny_lm("llama")
    lengths = (PREFIX,) + (T,) * 6 + (T - 2,) + (T,) * 6
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    chunks = list(torch.split(ids, list(lengths), dim=1))
    prefill = statekv.StreamingPrefill(model, policy, attention="eager")
    reference = reference_stream(model, chunks, rule, budget=BUDGET, frames=WINDOW)
    forms = set()
    for chunk, (hidden_ref, carried_ref) in zip(chunks, reference):
        hidden = prefill.step(input_ids=chunk)
        forms.add(prefill.cache.layers[0].form)
        torch.testing.assert_close(hidden, hidden_ref, atol=1e-4, rtol=0)
        for layer, (keys_ref, values_ref, positions_ref) in enumerate(carried_ref):
            assert torch.equal(prefill.carried_positions(layer), positions_ref)
            keys, values = prefill.cache.layers[layer].carried()
            torch.testing.assert_close(keys, keys_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(values, values_ref, atol=1e-4, rtol=0)
    assert forms == ({"window", "ring"} if isinstance(policy, statekv.Recency) else {"window", "slots"})


def test_key_norm_carries_the_smallest_keys(tiny_lm):
    model = tiny_lm("qwen2")
    chunks = list(torch.split(torch.arange(PREFIX + 5 * T)[None] % model.config.vocab_size,
                              [PREFIX] + [T] * 5, dim=1))

    def smallest_keys(scores, positions, keys, budget, **_):
        return None if keys.shape[2] <= budget else (-keys.norm(dim=-1)).topk(budget).indices.sort().values

    prefill = statekv.StreamingPrefill(model, statekv.KeyNorm(budget=BUDGET))
    for chunk, (hidden_ref, carried_ref) in zip(chunks, reference_stream(model, chunks, smallest_keys,
                                                                         budget=BUDGET)):
        torch.testing.assert_close(prefill.step(input_ids=chunk), hidden_ref, atol=1e-4, rtol=0)
        for layer, (_, _, positions_ref) in enumerate(carried_ref):
            assert torch.equal(prefill.carried_positions(layer), positions_ref)


# CUDA graphs: the plumbing on CPU, the real thing where a GPU is present -----------------------------------
def test_graph_signatures_tell_shapes_and_values_apart():
    x = torch.zeros(1, 4, 8)
    base = signature({"inputs_embeds": x, "position_ids": None, "flag": True})
    assert base == signature({"inputs_embeds": torch.ones(1, 4, 8), "position_ids": None, "flag": True})
    assert base != signature({"inputs_embeds": torch.zeros(1, 5, 8), "position_ids": None, "flag": True})
    assert base != signature({"inputs_embeds": x, "position_ids": None, "flag": False})
    assert base != signature({"inputs_embeds": x.transpose(1, 2).contiguous().transpose(1, 2), "position_ids": None,
                              "flag": True})
    assert signature({"inputs_embeds": x, "extra": bytearray(b"unhashable")}) is None


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: counts replays (the plumbing, not the recording)."""

    replays = 0

    def replay(self):
        FakeGraph.replays += 1


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    FakeGraph.replays = 0
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, capture_error_mode="global":
                        __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_graphs_are_recorded_on_second_sight_and_dropped_when_buffers_move(fake_cuda_graphs):
    graphs = StepGraphs(lambda inputs: inputs["x"] * 2, host_dependent=lambda: False)
    assert graphs.run({"x": torch.ones(2)}, layout=0) is None  # first sight: the eager warm-up
    assert torch.equal(graphs.run({"x": torch.ones(2)}, layout=0), torch.full((2,), 2.0))  # recorded, replayed
    graphs.run({"x": torch.full((2,), 5.0)}, layout=0)
    assert FakeGraph.replays == 2 and torch.equal(graphs.captured[signature({"x": torch.ones(2)})].inputs[0],
                                                  torch.full((2,), 5.0))  # inputs copied into the graph's own
    assert graphs.run({"x": torch.ones(3)}, layout=0) is None  # another shape: its own warm-up
    assert graphs.run({"x": torch.ones(2)}, layout=1) is None and not graphs.captured  # buffers moved


def test_a_step_that_reads_host_values_is_refused_with_one_warning(fake_cuda_graphs):
    graphs = StepGraphs(lambda inputs: inputs["x"] + 1, host_dependent=lambda: True)
    inputs = {"x": torch.zeros(2)}
    assert graphs.run(inputs, 0) is None  # first sight: the eager warm-up
    with pytest.warns(RuntimeWarning, match="per-step host values"):
        assert graphs.run(inputs, 0) is None
    assert graphs.run(inputs, 0) is None and not graphs.captured and FakeGraph.replays == 0  # refused for good


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("policy", [statekv.StateKV(budget=BUDGET), statekv.Recency(frames=WINDOW)], ids=repr)
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_graph_replays_equal_eager_steps_bit_for_bit(tiny_lm, policy, offload):
    model = tiny_lm("qwen3").to("cuda")
    chunks = [c.to("cuda") for c in embeddings(model, lengths=(PREFIX,) + (T,) * 24)]
    prompt_tokens, answer_tokens = 4, 4
    horizon = sum(c.shape[1] for c in chunks) + prompt_tokens + answer_tokens
    runs = {}
    for graphed in (False, True):
        prefill = statekv.StreamingPrefill(model, policy, attention="eager", horizon=horizon, offload=offload,
                                           cuda_graph=graphed)
        runs[graphed] = prefill, [prefill.step(inputs_embeds=chunk) for chunk in chunks]
    assert runs[True][0].graphs.replays >= 15
    for got, expected in zip(runs[True][1], runs[False][1]):
        assert torch.equal(got, expected)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(runs[True][0].carried_positions(layer), runs[False][0].carried_positions(layer))
    prompt = torch.arange(prompt_tokens, device="cuda")[None]
    assert torch.equal(runs[True][0].generate(prompt, max_new_tokens=answer_tokens),
                       runs[False][0].generate(prompt, max_new_tokens=answer_tokens))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("layout", ["cache", "own-then-cache", "grouped"])
def test_cuda_graph_replays_of_placed_steps_equal_eager_steps_bit_for_bit(tiny_lm, layout):
    """Past the model's range (bounded positions), a steady step placed away from its own position replays from a
    graph as it runs eagerly: its places settled on the host (cache order) or found on the device (grouped)."""
    model = tiny_lm("qwen3", max_position_embeddings=64).to("cuda")
    chunks = [c.to("cuda") for c in embeddings(model, lengths=(PREFIX,) + (T,) * 30)]
    runs = {}
    for graphed in (False, True):
        prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=BUDGET), attention="eager",
                                           positions="bounded", bounded_layout=layout, cuda_graph=graphed)
        runs[graphed] = prefill, [prefill.step(inputs_embeds=chunk) for chunk in chunks]
    assert runs[True][0].positions.moved and runs[True][0].graphs.replays >= 10
    for got, expected in zip(runs[True][1], runs[False][1]):
        assert torch.equal(got, expected)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(runs[True][0].carried_positions(layer), runs[False][0].carried_positions(layer))
    prompt = torch.arange(4, device="cuda")[None]
    assert torch.equal(runs[True][0].generate(prompt, max_new_tokens=4),
                       runs[False][0].generate(prompt, max_new_tokens=4))


def test_one_recording_at_a_time_with_no_garbage_collection_during_it():
    """`recording`: a recording on a second thread waits for the first to end (torch records every graph on one
    capture stream), dropping recorded graphs (`StepGraphs.clear`) waits too, a recording nested on the same thread
    does not, the collector is off throughout and on again after; a collector already off stays off."""
    assert gc.isenabled()
    inside, leave, order = threading.Event(), threading.Event(), []

    def first():
        with recording():
            inside.set()
            leave.wait(10)
            order.append(("first ends", gc.isenabled()))

    def second():
        inside.wait(10)
        with recording():
            order.append(("second starts", gc.isenabled()))

    graphs = StepGraphs(lambda inputs: inputs["x"], lambda: False)

    def clearing():
        inside.wait(10)
        graphs.clear()
        order.append(("cleared", None))

    threads = [threading.Thread(target=target, daemon=True) for target in (first, second, clearing)]
    try:
        for thread in threads:
            thread.start()
        inside.wait(10)
        time.sleep(0.2)  # the other two are waiting now, if they wait at all
        order.append(("released", None))
        leave.set()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads)
        assert order[:2] == [("released", None), ("first ends", False)], order
        assert sorted(order[2:]) == [("cleared", None), ("second starts", False)] and gc.isenabled()
        with recording():
            with recording():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with recording():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
