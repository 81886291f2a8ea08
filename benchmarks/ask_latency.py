"""Latency of asking a question after each method's encoding, against the context's length.

One stream per method (full attention, recency, StateKV) takes the same frames; at each checkpoint (frames
streamed so far) every method is asked the same question, warmed up first, the methods in rotating order on
every repeat so none is favoured by the machine's state. Two timings per method, median of ``--repeats``:

* time to first token: ``ask_tokens(question, max_new_tokens=1)`` (prompt prefill over the detailed cache
  plus one decoding step, the cache export included);
* per generated token: ``(t(N) - t(1)) / (N - 1)`` with exactly ``N = --new-tokens`` tokens forced
  (``min_new_tokens``), so early stops cannot flatter a method.

Every method answers from the same detailed cache length, so on equal footing they should cost the same; the
ratios to full attention are the issue's target (ask after StateKV <= 1.1x ask after full attention). A
per-token cost that grows with the context shows decoding copying the cache per token.

    python benchmarks/ask_latency.py --out docs/benchmarks.md
    python benchmarks/ask_latency.py --model internvl3-1b --device cuda --dtype bfloat16 --budget 4096 \
        --frames-window 16 --checkpoints 64 256 1024 --out docs/benchmarks.md                     # the GPU target
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import statekv
from statekv.testing import draw_test_frame, make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_overlap import MODEL_NAMES, MODELS  # noqa: E402
from report import (OneLineParser, at_least, output_file, positive_count, run_script,  # noqa: E402
                    write_section)

QUESTION = "What happens in this video, and what colour is the moving square?"
TARGET = 1.1


def _seconds(stream: statekv.Stream, new_tokens: int) -> float:
    started = time.perf_counter()
    stream.ask_tokens(QUESTION, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    if stream.adapter.device.type == "cuda":
        torch.cuda.synchronize(stream.adapter.device)
    return time.perf_counter() - started


def measure_checkpoint(streams: dict[str, statekv.Stream], new_tokens: int, repeats: int) -> dict[str, dict]:
    """Median time to first token and per generated token of every method, at the streams' current length."""
    for stream in streams.values():  # warm-up: first calls at a new length allocate and pick kernels
        _seconds(stream, 2)
    names = list(streams)
    first: dict[str, list[float]] = {name: [] for name in names}
    whole: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            first[name].append(_seconds(streams[name], 1))
            whole[name].append(_seconds(streams[name], new_tokens))
    results = {}
    for name in names:
        ttft, total = statistics.median(first[name]), statistics.median(whole[name])
        results[name] = {"ttft": ttft, "per_token": (total - ttft) / (new_tokens - 1), "total": total,
                         "tokens": streams[name].tokens}
    return results


def render(args, rows: list[tuple[int, dict[str, dict]]], command: str, device: str) -> str:
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
               f"torch {torch.__version__}")
    lines = [
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}; device {device}; load average {os.getloadavg()[0]:.1f} at the end (shared machine).  ",
        f"Model: {MODEL_NAMES[args.model]}, {args.dtype}; one stream per method over the same frames; "
        f"question of {args.question_tokens} tokens, {args.new_tokens} answer tokens forced; median of "
        f"{args.repeats} rotating repeats after a warm-up.",
        "",
        "| frames | context tokens | method | first token ms | ms per token | answer ms | answer / full |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    worst = {}
    for frames, results in rows:
        reference = next(iter(results))  # full attention streams first
        full = results[reference]["total"]
        for name, r in results.items():
            ratio = r["total"] / full
            if name != reference:
                worst[name] = max(worst.get(name, 0.0), ratio)
            lines.append(f"| {frames} | {r['tokens']} | {name} | {1e3 * r['ttft']:.1f} | {1e3 * r['per_token']:.2f} "
                         f"| {1e3 * r['total']:.1f} | {ratio:.2f} |")
    growth = {name: rows[-1][1][name]["per_token"] / rows[0][1][name]["per_token"] for name in rows[0][1]}
    lines += ["",
              "Worst answer / full over the checkpoints: " + ", ".join(f"{name} {value:.2f}" for name, value in
                                                                      worst.items()) + f" (target <= {TARGET}).  ",
              f"Per-token cost, last checkpoint / first ({rows[-1][0]} vs {rows[0][0]} frames): "
              + ", ".join(f"{name} {value:.2f}x" for name, value in growth.items()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny (random weights; CPU) or internvl3-1b (real shapes, random weights; GPU)")
    parser.add_argument("--checkpoints", type=positive_count, nargs="+", default=[16, 64, 256],
                        help="frames streamed when the methods are asked")
    parser.add_argument("--budget", type=positive_count, default=256, help="StateKV budget B")
    parser.add_argument("--frames-window", type=positive_count, default=4, help="recency window R (frames)")
    parser.add_argument("--new-tokens", type=at_least(2), default=16)
    parser.add_argument("--repeats", type=positive_count, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_count, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=output_file("--out"),
                        help="markdown file to write (replaces this benchmark's section)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoints = sorted(args.checkpoints)

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_tiny_checkpoint("internvl", Path(scratch) / "model", dtype=getattr(torch, args.dtype),
                                          **MODELS[args.model])
        qa = statekv.VideoQA.from_pretrained(checkpoint, method="full", dtype=args.dtype, device=args.device,
                                             reserve_tokens=256)
    streams = {}
    for method in ("full", "recency", "statekv"):
        variant = qa.with_options(method=method, budget=args.budget, frames=args.frames_window, reserve_tokens=256)
        name = variant.options.label
        streams[name] = variant.stream(horizon_frames=checkpoints[-1], name=name)
    full = next(iter(streams.values()))
    args.question_tokens = full.adapter.question_ids(QUESTION, full.state).shape[1]

    images = [draw_test_frame(i, (224, 224)) for i in range(checkpoints[-1])]
    rows, pushed = [], 0
    for frames in checkpoints:
        for stream in streams.values():
            for index in range(pushed, frames):
                stream.push(np.ascontiguousarray(images[index]), float(index))
        pushed = frames
        print(f"asking after {frames} frames...", file=sys.stderr, flush=True)
        rows.append((frames, measure_checkpoint(streams, args.new_tokens, args.repeats)))

    command = "python benchmarks/ask_latency.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = render(args, rows, command, args.device)
    print(report)
    if args.out:
        device = "CPU" if args.device == "cpu" else "GPU"
        write_section(args.out, f"Ask latency by method ({device}, {args.model})", report)


if __name__ == "__main__":
    run_script(main)
