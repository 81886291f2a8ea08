"""Per-chunk cost of streaming prefill vs chunk index, for full attention, recency and StateKV.

A small random decoder (Qwen2 architecture) is streamed chunk by chunk; every chunk's wall time is recorded,
and every ``--flops-every``-th chunk is re-run under ``FlopCounterMode`` to count its FLOPs (timed chunks are
never counted, so counting overhead does not pollute the times). A second measurement compares appending
to the detailed cache (in-place writes into a geometrically grown buffer) against ``torch.cat``.

    python benchmarks/prefill_scaling.py --out docs/benchmarks.md --plot docs/figures/prefill_scaling.png

Expected: StateKV and recency flat in the chunk index, full attention linear.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

import statekv
from statekv.core.storage.buffers import TokenBuffer
from statekv.settings.methods import labelled_policies

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

aten = torch.ops.aten


def _cpu_sdpa_flops(query_shape, key_shape, *args, **kwargs) -> int:
    """FLOPs of the CPU flash SDPA kernel (PyTorch counts none): QK^T and PV, 2 FLOPs per multiply-add."""
    b, hq, tq, d = query_shape
    return 4 * b * hq * tq * key_shape[-2] * d


CUSTOM_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def build_model(layers: int, hidden: int, heads: int, kv_heads: int, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1 << 20)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.15 if parameter.dim() > 1 else 0.05)
    model.set_attn_implementation("sdpa")
    return model


def stream_costs(model, policy, chunks: list[torch.Tensor], flops_every: int):
    """Seconds of every chunk, and FLOPs of every ``flops_every``-th chunk (``None`` elsewhere)."""
    horizon = sum(c.shape[1] for c in chunks)
    prefill = statekv.StreamingPrefill(model, policy, attention="chunked", horizon=horizon)
    seconds, flops = [], []
    for index, chunk in enumerate(chunks):
        if index % flops_every == flops_every - 1:
            # Count on a throwaway copy of the stream so the measured chunk itself runs uninstrumented.
            probe = statekv.StreamingPrefill(model, policy, attention="chunked", horizon=horizon)
            probe.load_state_dict(*prefill.state_dict())
            with FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS) as counter:
                probe.step(inputs_embeds=chunk)
            flops.append(counter.get_total_flops())
        else:
            flops.append(None)
        start = time.perf_counter()
        prefill.step(inputs_embeds=chunk)
        seconds.append(time.perf_counter() - start)
    return seconds, flops


def append_costs(chunks: int, chunk_len: int, kv_heads: int, head_dim: int, repeats: int = 3):
    """Seconds to append ``chunks`` chunks to one layer's detailed cache: in-place buffer vs torch.cat."""
    blocks = [torch.randn(1, kv_heads, chunk_len, head_dim) for _ in range(chunks)]

    def buffered():
        buffer = TokenBuffer()
        for block in blocks:
            buffer.write(buffer.length, block, block)
            buffer.length += block.shape[2]
        return buffer.keys[:, :, : buffer.length]

    def concatenated():
        keys = values = blocks[0][:, :, :0]
        for block in blocks:
            keys, values = torch.cat([keys, block], dim=2), torch.cat([values, block], dim=2)
        return keys

    assert torch.equal(buffered(), concatenated())
    timings = {}
    for name, run in (("buffer", buffered), ("torch.cat", concatenated)):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        timings[name] = min(samples)
    return timings


def summarise(name, seconds, flops, window):
    early = statistics.median(seconds[1 : 1 + window])
    late = statistics.median(seconds[-window:])
    counted = [(i, f) for i, f in enumerate(flops) if f is not None]
    return {"method": name, "early_ms": 1e3 * early, "late_ms": 1e3 * late, "late_over_early": late / early,
            "first_gflops": counted[0][1] / 1e9, "last_gflops": counted[-1][1] / 1e9,
            "flops_at": counted}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--chunk-len", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024, help="StateKV budget B (tokens)")
    parser.add_argument("--frames", type=int, default=8, help="recency window R (chunks); R*T = B by default")
    parser.add_argument("--flops-every", type=int, default=16)
    parser.add_argument("--out", type=Path, help="markdown file to write (replaces the section of this benchmark)")
    parser.add_argument("--plot", type=Path, help="PNG of per-chunk time and FLOPs vs chunk index")
    args = parser.parse_args(argv)

    torch.set_grad_enabled(False)
    model = build_model(args.layers, args.hidden, args.heads, args.kv_heads)
    generator = torch.Generator().manual_seed(1)
    chunks = [torch.randn(1, args.chunk_len, args.hidden, generator=generator) for _ in range(args.chunks)]
    policies = labelled_policies(budget=args.budget, frames=args.frames)
    window = max(4, args.chunks // 16)
    results, curves = [], {}
    for name, policy in policies.items():
        print(f"streaming {args.chunks} chunks with {name}...", file=sys.stderr, flush=True)
        seconds, flops = stream_costs(model, policy, chunks, args.flops_every)
        curves[name] = (seconds, flops)
        results.append(summarise(name, seconds, flops, window))
    append = append_costs(args.chunks, args.chunk_len, args.kv_heads, args.hidden // args.heads)

    command = "python benchmarks/prefill_scaling.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = render(args, results, append, command, window)
    print(report)
    if args.out:
        write_section(args.out, "Prefill scaling (CPU)", report)
    if args.plot:
        plot(curves, args.plot)


def render(args, results, append, command, window) -> str:
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    lines = [
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine} (CPU; times are for ratios only, absolute times belong to a GPU run).  ",
        f"Model: random Qwen2 decoder, {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
        f"heads; {args.chunks} chunks of {args.chunk_len} tokens ({args.chunks * args.chunk_len} tokens).  ",
        f"Early/late = median over chunks 1-{window} and over the last {window} chunks; FLOPs of one chunk counted "
        "with `FlopCounterMode` (all matmuls and attention).",
        "",
        "| method | early ms/chunk | late ms/chunk | late / early | GFLOPs, chunk %d | GFLOPs, chunk %d |" % (
            results[0]["flops_at"][0][0], results[0]["flops_at"][-1][0]),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['method']} | {r['early_ms']:.1f} | {r['late_ms']:.1f} | {r['late_over_early']:.2f} | "
                     f"{r['first_gflops']:.2f} | {r['last_gflops']:.2f} |")
    ratio = append["torch.cat"] / append["buffer"]
    lines += ["", f"Appending {args.chunks} chunks to one layer's detailed cache ({args.kv_heads} KV heads x "
                  f"{args.chunk_len} tokens x {args.hidden // args.heads} dims each, keys and values): "
                  f"in-place buffer {1e3 * append['buffer']:.1f} ms, `torch.cat` {1e3 * append['torch.cat']:.1f} ms "
                  f"({ratio:.1f}x)."]
    return "\n".join(lines)


def plot(curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, flops_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (seconds, flops) in curves.items():
        time_axis.plot(range(len(seconds)), [1e3 * s for s in seconds], label=name, linewidth=1)
        counted = [(i, f / 1e9) for i, f in enumerate(flops) if f is not None]
        flops_axis.plot(*zip(*counted), marker="o", markersize=3, label=name)
    time_axis.set(xlabel="chunk index", ylabel="ms per chunk (CPU)", title="wall time per chunk")
    flops_axis.set(xlabel="chunk index", ylabel="GFLOPs per chunk", title="FLOPs per chunk")
    for axis in (time_axis, flops_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
