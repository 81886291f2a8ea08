"""Ops of a steady streaming step inside and outside its device part (what a CUDA graph records), for one stream
and for 16 streams stepped together, on any checkout: it marks ``statekv.core.step.batching.device_step`` itself, so it
also counts trees older than `statekv.testing.op_trace.device_parts` (compare commits with it).

    cd <checkout> && PYTHONPATH=$PWD python /path/to/benchmarks/step_split.py

Tiny Qwen2 decoder of `benchmarks/step_cost.py` (3 layers), eager attention, 44 frames of 16 tokens, CPU.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))  # the checkout's own step_cost

import torch  # noqa: E402

import statekv  # noqa: E402
import statekv.core.step.batching as batching  # noqa: E402
import statekv.core.stream.prefill as prefill_module  # noqa: E402
from statekv.testing.op_trace import OpTrace  # noqa: E402
from step_cost import frames, methods, tiny_language_model  # noqa: E402

STREAMS, TOKENS, BUDGET_FRAMES, FRAMES = 16, 16, 4, 44


class SplitTrace(OpTrace):
    """An `OpTrace` that also splits the compute ops into the device part's and the others."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.device, self.outside = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.compute)
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.compute) > before:
            (self.device if self.inside else self.outside).append(self.compute[-1])
        return result


ACTIVE: list[SplitTrace] = []
_device_step = batching.device_step


def marked_device_step(*args, **kwargs):
    trace = ACTIVE[-1] if ACTIVE else None
    if trace is not None:
        trace.inside = True
    try:
        return _device_step(*args, **kwargs)
    finally:
        if trace is not None:
            trace.inside = False


batching.device_step = prefill_module.device_step = marked_device_step


def traced(step) -> SplitTrace:
    trace = SplitTrace()
    ACTIVE.append(trace)
    with trace:
        step()
    ACTIVE.pop()
    return trace


def report(label: str, traces: list[SplitTrace], layers: int) -> None:
    steady = traces[BUDGET_FRAMES + 3:]
    device, outside = len(steady[-1].device), [len(t.outside) for t in steady]
    static = all(t.ops == steady[0].ops for t in steady)
    print(f"{label}: device part {device} ops ({device / layers:.1f} per layer); outside it {min(outside)}-"
          f"{max(outside)} ops; host syncs {sum(len(t.syncs) for t in steady)}; whole steps identical: {static}")
    print(f"    outside, at most: {dict(Counter(steady[outside.index(max(outside))].outside))}")


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    model = tiny_language_model()
    layers = model.config.num_hidden_layers
    chunks = frames(model, TOKENS, FRAMES)
    horizon = sum(c.shape[1] for c in chunks)
    for name, policy in methods(TOKENS, BUDGET_FRAMES).items():
        prefill = statekv.StreamingPrefill(model, policy, attention="eager", cuda_graph=False, horizon=horizon)
        report(f"{name}, one stream", [traced(lambda c=c: prefill.step(inputs_embeds=c)) for c in chunks], layers)
        prefills = [statekv.StreamingPrefill(model, policy, attention="eager", cuda_graph=False, horizon=horizon)
                    for _ in range(STREAMS)]
        batcher = batching.StepBatcher()
        traces = [traced(lambda c=c: batcher.step([batching.StepRequest(p, inputs_embeds=c) for p in prefills]))
                  for c in chunks]
        report(f"{name}, {STREAMS} streams batched ({batcher.batched_steps} batched steps)", traces, layers)


if __name__ == "__main__":
    main()
