"""Steps of several streams in one forward (`statekv.core.step.batching`): each stream gets what it gets alone, the
batched steady step is static and sync-free, and its compute ops do not grow with the number of streams."""

from __future__ import annotations

import collections

import pytest
import torch

import statekv
from statekv.core.step.batching import StepBatcher, StepRequest
from statekv.testing.op_trace import OpTrace

PREFIX, T, STEPS = 9, 6, 10
BUDGET, WINDOW = 20, 3
POLICIES = {"statekv": lambda: statekv.StateKV(budget=BUDGET), "recency": lambda: statekv.Recency(frames=WINDOW),
            "rekv": lambda: statekv.ReKV(frames=WINDOW, sinks=2).for_prefix(PREFIX),
            "full": lambda: statekv.FullAttention(),
            "withsinks": lambda: statekv.WithSinks(statekv.StateKV(budget=BUDGET), sinks=3),
            "perlayer": lambda: statekv.PerLayerBudget(statekv.StateKV(budget=BUDGET),
                                                       (BUDGET, BUDGET + 2, BUDGET + 4))}


def chunks(model, seed: int, steps: int = STEPS, chunk_len: int = T) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, model.config.hidden_size, generator=generator)
            for n in (PREFIX,) + (chunk_len,) * steps]


def prefill_for(model, method: str) -> statekv.StreamingPrefill:
    return statekv.StreamingPrefill(model, POLICIES[method](), attention="eager", horizon=PREFIX + 40 * T)


def observed(prefill) -> list[torch.Tensor]:
    tensors = [t for layer in prefill.detailed_cache.layers for t in (layer.keys, layer.values)]
    for layer in prefill.cache.layers:
        tensors += [*layer.carried(), layer.positions()]
    return tensors


def run_alone(model, method, stream_chunks):
    prefill = prefill_for(model, method)
    return prefill, [prefill.step(inputs_embeds=chunk) for chunk in stream_chunks]


@pytest.mark.parametrize("method", ["statekv", "recency", "rekv", "full", "withsinks", "perlayer"])
def test_streams_stepped_together_get_what_they_get_alone(tiny_lm, method):
    """Four streams, two joining late and one leaving early: positions and carried tokens identical, hidden
    states within float32 rounding."""
    model = tiny_lm("qwen3")
    data = [chunks(model, seed) for seed in range(4)]
    joins, leaves = [0, 0, 3, 6], [len(data[0]), 7, len(data[0]), len(data[0])]
    prefills = [prefill_for(model, method) for _ in data]
    hidden = [[] for _ in data]
    batcher = StepBatcher()
    for step in range(len(data[0])):
        live = [s for s in range(4) if joins[s] <= step < leaves[s]]
        outcomes = batcher.step([StepRequest(prefills[s], data[s][step - joins[s]]) for s in live])
        for s, outcome in zip(live, outcomes):
            assert isinstance(outcome, torch.Tensor), outcome
            hidden[s].append(outcome)
    if method != "full":
        assert batcher.batched_steps >= 4  # steady steps shared forwards
    else:
        assert batcher.batched_steps == 0  # full attention's window grows differently per stream: alone
    for s in range(4):
        reference, reference_hidden = run_alone(model, method, data[s][:leaves[s] - joins[s]])
        assert len(hidden[s]) == len(reference_hidden)
        for mine, theirs in zip(observed(prefills[s]), observed(reference)):
            if theirs.dtype == torch.long:
                assert torch.equal(mine, theirs)
            else:
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(hidden[s], reference_hidden):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_bad_step_fails_alone_and_the_others_go_on(tiny_lm):
    model = tiny_lm("qwen3")
    data = [chunks(model, seed) for seed in range(3)]
    prefills = [prefill_for(model, "statekv") for _ in data]
    batcher = StepBatcher()
    for step in range(6):
        batcher.step([StepRequest(prefill, stream[step]) for prefill, stream in zip(prefills, data)])
    seen = [prefill.seen_tokens for prefill in prefills]
    bad = torch.randn(1, T, model.config.hidden_size + 1)
    outcomes = batcher.step([StepRequest(prefills[0], data[0][6]), StepRequest(prefills[1], bad),
                             StepRequest(prefills[2], data[2][6])])
    assert isinstance(outcomes[1], statekv.errors.InputError) and "hidden size" in str(outcomes[1])
    assert isinstance(outcomes[0], torch.Tensor) and isinstance(outcomes[2], torch.Tensor)
    assert [prefill.seen_tokens for prefill in prefills] == [seen[0] + T, seen[1], seen[2] + T]


def test_a_forward_that_fails_in_the_batch_is_retried_alone(tiny_lm, monkeypatch):
    """A failure inside the batched forward rolls every stream back; each then steps alone."""
    model = tiny_lm("qwen3")
    data = [chunks(model, seed) for seed in range(2)]
    prefills = [prefill_for(model, "statekv") for _ in data]
    batcher = StepBatcher()
    for step in range(6):
        batcher.step([StepRequest(prefill, stream[step]) for prefill, stream in zip(prefills, data)])
    before = batcher.batched_steps
    import statekv.core.step.batching as batching

    stack = batching.stack_inputs  # stacking several streams' rows fails; a stream alone has nothing to stack
    monkeypatch.setattr(batching, "stack_inputs",
                        lambda inputs: stack(inputs) if len(inputs) == 1 else (_ for _ in ()).throw(RuntimeError("boom")))
    outcomes = batcher.step([StepRequest(prefill, stream[6]) for prefill, stream in zip(prefills, data)])
    assert all(isinstance(outcome, torch.Tensor) for outcome in outcomes) and batcher.batched_steps == before
    reference = prefill_for(model, "statekv")
    for chunk in data[1][:7]:
        reference.step(inputs_embeds=chunk)
    assert all(torch.equal(a, b) for a, b in zip(observed(prefills[1])[-6:], observed(reference)[-6:])
               if a.dtype == torch.long)


def traced_batched_steps(model, method, streams: int, steps: int) -> list[OpTrace]:
    data = [chunks(model, seed, steps) for seed in range(streams)]
    prefills = [prefill_for(model, method) for _ in range(streams)]
    batcher = StepBatcher()
    traces = []
    for step in range(steps + 1):
        with OpTrace() as trace:
            outcomes = batcher.step([StepRequest(prefill, stream[step]) for prefill, stream in zip(prefills, data)])
        assert all(isinstance(outcome, torch.Tensor) for outcome in outcomes)
        traces.append(trace)
    return traces


COMPUTE = ("bmm", "baddbmm", "mm", "addmm", "matmul", "softmax", "_softmax", "topk", "sort",
           "_scaled_dot_product", "linear")


@pytest.mark.parametrize("method", ["statekv", "recency"])
def test_the_batched_steady_step_is_static_and_its_compute_does_not_grow_with_streams(tiny_lm, method):
    model = tiny_lm("qwen3")
    traces = {streams: traced_batched_steps(model, method, streams, 8) for streams in (2, 8)}
    for streams, steps in traces.items():
        steady = steps[6:]  # after the first batched step, which seated the streams in their pool
        assert all(trace.ops == steady[0].ops for trace in steady)  # same ops, shapes and scalars, step after step
        assert all(not trace.syncs for trace in steady)

    def heavy(trace):
        return collections.Counter(name for name in trace.compute if name.split(".")[0] in COMPUTE)

    two, eight = heavy(traces[2][-1]), heavy(traces[8][-1])
    assert two and two == eight, (two, eight)
