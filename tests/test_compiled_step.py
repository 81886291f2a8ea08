"""``compile_step``: steady steps through the decoder compiled by ``torch.compile`` (Inductor, here on the CPU).

A compiled step must carry exactly what the eager step carries (the engine's attention is not traced, so the
selection runs eagerly on the same scores up to rounding), give the eager hidden states up to rounding, compile
only steady steps, and compile once per step shape for every stream of that shape.
"""

from __future__ import annotations

import pytest
import torch

import statekv
from statekv.core.step.batching import StepBatcher, StepRequest

PREFIX, T, STEPS = 9, 6, 12
BUDGET, WINDOW = 20, 3
POLICIES = [lambda: statekv.StateKV(budget=BUDGET), lambda: statekv.Recency(frames=WINDOW)]


def chunks(model, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, model.config.hidden_size, generator=generator) for n in (PREFIX,) + (T,) * STEPS]


class Counting:
    """Set as a stream's compiled decoder, wrapping ``decoder``: how many steps called it (its steady steps)."""

    def __init__(self, prefill, decoder):
        self.decoder, self.calls = decoder, 0
        prefill.compiled_decoder = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.decoder(*args, **kwargs)


def carried(prefill) -> list[torch.Tensor]:
    return [layer.positions().clone() for layer in prefill.cache.layers]


@pytest.fixture(scope="module")
def fresh_dynamo():
    """Dynamo's counters, from a reset at the module's start (its tests share what they compiled, as the
    streams of one process do)."""
    torch._dynamo.reset()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def no_recompile():
    """Compiling again raises (and Dynamo's suppressed errors do not hide it)."""
    return torch.compiler.set_stance("fail_on_recompile")


@pytest.mark.parametrize("policy", POLICIES, ids=["statekv", "recency"])
def test_compiled_steady_steps_carry_what_eager_steps_carry(tiny_lm, policy, fresh_dynamo):
    model = tiny_lm("qwen3")
    data = chunks(model, 0)
    horizon = sum(chunk.shape[1] for chunk in data) + 7  # the question and its answer fit too
    eager = statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon)
    compiled = statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon, compile_step=True)
    counting = Counting(compiled, compiled.compiled_decoder)
    steady = Counting(eager, eager.decoder)  # the eager decoder, called by the same steady steps
    for step, chunk in enumerate(data):
        expected = eager.step(inputs_embeds=chunk)
        got = compiled.step(inputs_embeds=chunk)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(carried(compiled), carried(eager))), f"step {step}"
    assert 0 < counting.calls == steady.calls < len(data)  # steady steps only, each compiled
    assert fresh_dynamo["stats"]["unique_graphs"] > 0
    assert fresh_dynamo["graph_break"], "the engine's attention is a call Dynamo does not trace"
    answer_eager = eager.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert torch.equal(compiled.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4), answer_eager)


def test_streams_of_the_same_shape_reuse_the_compiled_code_whatever_their_horizon(tiny_lm, fresh_dynamo):
    """The cache's state (its buffers' sizes, a horizon or none, the carried length) is not traced, so it is
    no guard: a stream with another horizon, or none (its buffers grow), compiles nothing more."""
    model = tiny_lm("qwen3")
    data = chunks(model, 1)
    horizon = sum(chunk.shape[1] for chunk in data)

    def stream(horizon) -> list[torch.Tensor]:
        prefill = statekv.StreamingPrefill(model, statekv.StateKV(budget=BUDGET), attention="eager",
                                           horizon=horizon, compile_step=True, positions="stream")
        return [prefill.step(inputs_embeds=chunk) for chunk in data]

    first = stream(horizon)
    graphs = fresh_dynamo["stats"]["unique_graphs"]
    with no_recompile():
        again, longer = stream(horizon), stream(4 * horizon)
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs > 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, again, longer))


def test_every_layer_of_a_deep_decoder_compiles(tiny_lm, fresh_dynamo, caplog):
    """Dynamo keeps one entry per layer (it guards the layer's index): more layers than its default limit of 8
    entries must all compile, not fall back to eager past the eighth."""
    model = tiny_lm("qwen3", num_hidden_layers=12)
    data = chunks(model, 3)
    horizon = sum(chunk.shape[1] for chunk in data)
    eager = statekv.StreamingPrefill(model, statekv.Recency(frames=WINDOW), attention="eager", horizon=horizon)
    compiled = statekv.StreamingPrefill(model, statekv.Recency(frames=WINDOW), attention="eager", horizon=horizon,
                                        compile_step=True)
    with caplog.at_level("WARNING", logger="torch._dynamo"):
        for chunk in data:
            torch.testing.assert_close(compiled.step(inputs_embeds=chunk), eager.step(inputs_embeds=chunk),
                                       rtol=1e-4, atol=1e-5)
    assert not [record for record in caplog.records if "recompile_limit" in record.getMessage()]


@pytest.mark.parametrize("policy", POLICIES, ids=["statekv", "recency"])
def test_batched_compiled_steps_get_what_each_stream_gets_alone(tiny_lm, policy, fresh_dynamo):
    model = tiny_lm("qwen3")
    data = [chunks(model, seed) for seed in range(3)]
    horizon = sum(chunk.shape[1] for chunk in data[0])
    alone = [statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon) for _ in data]
    together = [statekv.StreamingPrefill(model, policy(), attention="eager", horizon=horizon, compile_step=True)
                for _ in data]
    batcher = StepBatcher()
    for step in range(len(data[0])):
        outcomes = batcher.step([StepRequest(prefill, stream[step]) for prefill, stream in zip(together, data)])
        for prefill, stream, outcome in zip(alone, data, outcomes):
            assert isinstance(outcome, torch.Tensor), outcome
            torch.testing.assert_close(outcome, prefill.step(inputs_embeds=stream[step]), rtol=1e-4, atol=1e-5)
    assert batcher.batched_steps >= STEPS - 4
    for one, other in zip(alone, together):
        assert all(torch.equal(a, b) for a, b in zip(carried(one), carried(other)))


def test_compile_step_is_a_setting_of_every_front():
    import argparse

    from statekv.settings.options import ModelOptions

    parser = argparse.ArgumentParser()
    ModelOptions.add_arguments(parser)
    assert ModelOptions.from_args(parser.parse_args(["--model", "m", "--compile-step"])).engine.compile_step
    assert not ModelOptions.from_args(parser.parse_args(["--model", "m"])).engine.compile_step
    assert ModelOptions.from_strings({"model": "m", "compile_step": "yes"}).engine.compile_step


def test_a_decoder_that_cannot_compile_steps_eagerly(tiny_lm, fresh_dynamo, monkeypatch):
    """A backend that fails (no C compiler, say) costs the fusion, never the stream."""
    import statekv.core.step.compiled as compiled_module

    def failing(graph, example_inputs):
        raise RuntimeError("no compiler here")

    original = torch.compile
    monkeypatch.setattr(compiled_module.torch, "compile", lambda model, **_: original(model, backend=failing))
    model = tiny_lm("qwen3")
    data = chunks(model, 2)
    horizon = sum(chunk.shape[1] for chunk in data)
    eager = statekv.StreamingPrefill(model, statekv.StateKV(budget=BUDGET), attention="eager", horizon=horizon)
    compiled = statekv.StreamingPrefill(model, statekv.StateKV(budget=BUDGET), attention="eager", horizon=horizon,
                                        compile_step=True)
    for chunk in data:
        assert torch.equal(compiled.step(inputs_embeds=chunk), eager.step(inputs_embeds=chunk))
