"""What one streaming step asks of the device: ATen ops per step and per layer, host syncs, static steps; on CUDA
also kernel launches per step, ms per frame with and without the CUDA graph, and a long prefill against the
model's own one-shot forward.

The op counts come from :class:`statekv.testing.op_trace.OpTrace` (a ``TorchDispatchMode``): compute ops are ops
that are neither views nor bare allocations, host syncs are ops whose result a GPU host would wait for, and
a stream is *static* when the device parts of its steady steps (what a CUDA graph records) dispatch identical
(op, shapes, scalar arguments) sequences. Ops outside the device part run outside the graph on a GPU (its own
launches): none on most steps, a few per layer on a step that completes a segment of the retrieval index (once
every ``SEGMENT_STEPS`` steps); a replay adds the copies of the step's inputs and output. Steady means: StateKV's
carried state is full, recency's window holds R frames. The batched rows are ``STREAMS`` streams stepped together
(`StepBatcher`, one forward).

    python benchmarks/step_cost.py --out docs/benchmarks.md                 # CPU, tiny model (a few seconds)
    python benchmarks/step_cost.py --device cuda --out docs/benchmarks.md   # + InternVL3-8B LM on a GPU
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import statekv  # noqa: E402
from statekv.core.step.batching import StepBatcher, StepRequest  # noqa: E402
from statekv.core.storage.layer_storage import SEGMENT_STEPS  # noqa: E402
from statekv.testing.op_trace import OpTrace, device_parts  # noqa: E402
from statekv.settings.methods import labelled_policies  # noqa: E402
from walltime import FRAME_TOKENS, internvl3_8b_language_config, random_model  # noqa: E402

PREFIX_TOKENS = 9
STREAMS = 16


def tiny_language_model():
    """A 3-layer Qwen2 decoder (InternVL3's LM family) with 4/2 heads of dim 16, random weights."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=8192)
    torch.manual_seed(0)
    return random_model(config, torch.device("cpu"), torch.float32)


def methods(tokens: int, budget_frames: int) -> dict[str, statekv.CarryPolicy]:
    """StateKV at ``budget_frames`` frames' worth of tokens, and recency at the same number of frames."""
    return labelled_policies(("statekv", "recency"), budget=budget_frames * tokens, frames=budget_frames)


def frames(model, tokens: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` random frames ``[1, tokens, D]`` after a short text prefix, on the model's device and dtype."""
    generator = torch.Generator().manual_seed(seed)
    hidden, device, dtype = model.config.hidden_size, model.device, model.dtype
    lengths = [PREFIX_TOKENS] + [tokens] * count
    return [(torch.randn(1, n, hidden, generator=generator) * 0.02).to(device, dtype) for n in lengths]


@torch.no_grad()
def op_counts(model, policy, backend: str, chunks: list[torch.Tensor], steady_from: int, streams: int = 1) -> dict:
    """Compute ops (all, of the device part, outside it: most and fewest over the steady steps) and syncs of a
    steady step of ``streams`` streams (stepped together when more than one), and whether the device parts of
    all steady steps dispatch the same ops."""
    prefills = [statekv.StreamingPrefill(model, policy, attention=backend, cuda_graph=False,
                                         horizon=sum(c.shape[1] for c in chunks)) for _ in range(streams)]
    batcher = StepBatcher()
    traces = []
    with device_parts():
        for chunk in chunks:
            with OpTrace() as trace:
                if streams == 1:
                    prefills[0].step(inputs_embeds=chunk)
                else:
                    batcher.step([StepRequest(prefill, chunk) for prefill in prefills])
            traces.append(trace)
    steady = traces[steady_from:]
    layers = model.config.num_hidden_layers
    compute = len(steady[-1].compute)
    outside = [len(t.host_compute) for t in steady]
    return {"compute": compute, "per_layer": compute / layers, "device": len(steady[-1].device_compute),
            "outside": (min(outside), max(outside)), "syncs": sum(len(t.syncs) for t in steady),
            "static": all(t.device_ops == steady[0].device_ops for t in steady), "ops": Counter(steady[-1].compute)}


def op_table(model, tokens: int, budget_frames: int, backends: list[str]) -> list[str]:
    count = max(budget_frames + 8, SEGMENT_STEPS + 2)  # the steady steps include one completing a segment
    chunks = frames(model, tokens, count)
    lines = ["| method | backend | streams | compute ops / step | per layer | in the device part | outside it "
             "(fewest-most) | host syncs (steady steps) | static |", "|---|---|---|---|---|---|---|---|---|"]
    results = {}
    for backend in backends:
        for streams in (1, STREAMS):
            for name, policy in methods(tokens, budget_frames).items():
                result = op_counts(model, policy, backend, chunks, budget_frames + 3, streams)
                if streams == 1:
                    results[name, backend] = result
                low, high = result["outside"]
                lines.append(f"| {name} | {backend} | {streams} | {result['compute']} | {result['per_layer']:.1f} | "
                             f"{result['device']} | {low}-{high} | {result['syncs']} | "
                             f"{'yes' if result['static'] else 'NO'} |")
    layers = model.config.num_hidden_layers
    for backend in backends:
        state, recency = (results[name, backend] for name in methods(tokens, budget_frames))
        lines.append(f"\nStateKV over recency ({backend}): "
                     f"{(state['compute'] - recency['compute']) / layers:+.1f} compute ops per layer; "
                     f"StateKV's extra ops: {dict(state['ops'] - recency['ops'])}")
    return lines


# CUDA -------------------------------------------------------------------------------------------------------
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
            "cudaLaunchKernelExC", "cuLaunchKernelEx")


@torch.no_grad()
def gpu_step_figures(model, policy, backend: str, chunks: list[torch.Tensor], steady_from: int,
                     cuda_graph: bool) -> dict:
    """ms per steady frame and host-side launches per steady step of one stream."""
    from torch.profiler import ProfilerActivity, profile

    prefill = statekv.StreamingPrefill(model, policy, attention=backend, cuda_graph=cuda_graph,
                                       horizon=sum(c.shape[1] for c in chunks))
    for chunk in chunks[:steady_from]:
        prefill.step(inputs_embeds=chunk)
    timed = chunks[steady_from:-5]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for chunk in timed:
        prefill.step(inputs_embeds=chunk)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / len(timed)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for chunk in chunks[-5:]:
            prefill.step(inputs_embeds=chunk)
        torch.cuda.synchronize()
    launches = sum(1 for event in trace.events() if event.name in LAUNCHES) / 5
    return {"ms": ms, "launches": launches, "replays": prefill.stats.graph_replays}


@torch.no_grad()
def prefill_seconds(model, policy, backend: str, chunks: list[torch.Tensor]) -> float:
    prefill = statekv.StreamingPrefill(model, policy, attention=backend, horizon=sum(c.shape[1] for c in chunks))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for chunk in chunks:
        prefill.step(inputs_embeds=chunk)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.no_grad()
def one_shot_seconds(model, chunks: list[torch.Tensor]) -> float:
    video = torch.cat(chunks, dim=1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.model(inputs_embeds=video, use_cache=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def gpu_tables(device: torch.device, budget: int, window: int, prefill_frames: int) -> list[str]:
    config = internvl3_8b_language_config(max_positions=(prefill_frames + 2) * FRAME_TOKENS)
    model = random_model(config, device, torch.bfloat16)
    chunks = frames(model, FRAME_TOKENS, 64)
    statekv_policy, recency_policy = labelled_policies(("statekv", "recency"), budget=budget, frames=window).items()
    policies = {f"{statekv_policy[0]} (triton)": (statekv_policy[1], "triton"),
                recency_policy[0]: (recency_policy[1], "auto")}
    steady_from = max(budget // FRAME_TOKENS + 3, window + 3)
    lines = ["| method | graph | ms / frame | host launches / step | graph replays |", "|---|---|---|---|---|"]
    for name, (policy, backend) in policies.items():
        for graphed in (False, True):
            gpu_step_figures(model, policy, backend, chunks[: steady_from + 8], steady_from, graphed)  # warm-up
            figures = gpu_step_figures(model, policy, backend, chunks, steady_from, graphed)
            lines.append(f"| {name} | {'yes' if graphed else 'no'} | {figures['ms']:.1f} | "
                         f"{figures['launches']:.0f} | {figures['replays']} |")
            print(lines[-1], file=sys.stderr, flush=True)
    video = frames(model, FRAME_TOKENS, prefill_frames, seed=1)
    one_shot_seconds(model, video[:8])  # warm-up
    one_shot = one_shot_seconds(model, video)
    statekv_policy, backend = next(iter(policies.values()))
    streamed = prefill_seconds(model, statekv_policy, backend, video)
    del model
    torch.cuda.empty_cache()
    lines += ["", f"{prefill_frames}-frame prefill: one-shot SDPA forward {one_shot:.2f} s; StateKV B={budget} "
              f"streamed {streamed:.2f} s ({streamed / one_shot:.2f}x the one-shot forward)."]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (op counts on a tiny model) or cuda (also GPU timings)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per frame of the tiny CPU model")
    parser.add_argument("--budget-frames", type=int, default=4, help="tiny model: B and R, in frames")
    parser.add_argument("--gpu-budget", type=int, default=4096)
    parser.add_argument("--gpu-window", type=int, default=16)
    parser.add_argument("--prefill-frames", type=int, default=512)
    parser.add_argument("--out", type=Path, help="write the results into this markdown file")
    args = parser.parse_args(argv)

    torch.set_num_threads(min(2, torch.get_num_threads()))
    lines = ["Tiny Qwen2 decoder (3 layers, 4/2 heads of dim 16), "
             f"{args.tokens} tokens per frame after a {PREFIX_TOKENS}-token prefix, CPU, fp32.", ""]
    lines += op_table(tiny_language_model(), args.tokens, args.budget_frames, ["eager", "chunked"])
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/step_cost.py: --device cuda, but no CUDA device is available")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        lines += ["", f"InternVL3-8B language model, random bf16 weights, {FRAME_TOKENS} tokens per frame, "
                  f"{torch.cuda.get_device_name(device)}:", ""]
        lines += gpu_tables(device, args.gpu_budget, args.gpu_window, args.prefill_frames)
    lines += ["", f"Command: `python benchmarks/{Path(__file__).name} {shlex.join(argv or sys.argv[1:])}`; "
              f"torch {torch.__version__}."]
    report = "\n".join(lines)
    print(report)
    if args.out:
        from report import write_section

        write_section(args.out, "Cost of one streaming step", report)


if __name__ == "__main__":
    main()
