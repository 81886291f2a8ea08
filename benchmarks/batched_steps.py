"""What a batched steady step asks of the device as the number of streams grows: ATen ops per step of S = 1, 2,
4, 8, 16 and 32 streams stepped together (`StepBatcher`, one forward), on a tiny decoder on the CPU.

Counted with :class:`statekv.testing.op_trace.OpTrace` as in ``benchmarks/step_cost.py``: compute ops are ops that
are neither views nor bare allocations (on a GPU, each is at least one kernel launch, inside a CUDA graph a launch
slot), split into the device part of the step (what a CUDA graph records and replays) and the rest (the host's
own launches: stacking the chunks, and on a step completing a segment of the retrieval index, that segment's
row). A steady step is one past the streams' fill (StateKV's carried state full, recency's window in its ring)
and past their first batched step. ``static``: the device parts of the steady steps dispatch identical ops.

    python benchmarks/batched_steps.py --json runs/batched_after.json --before runs/batched_before.json \\
        --out docs/benchmarks.md
    PYTHONPATH=<an older checkout> python benchmarks/batched_steps.py --json runs/batched_before.json   # before
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import statekv  # noqa: E402
from statekv.core.step.batching import StepBatcher, StepRequest  # noqa: E402
from statekv.testing.op_trace import OpTrace, device_parts  # noqa: E402
from step_cost import PREFIX_TOKENS, frames, methods, tiny_language_model  # noqa: E402

TITLE = "Batched steps: ATen ops per step against the streams stepped together (CPU)"
STREAMS = (1, 2, 4, 8, 16, 32)
SEGMENT_STEPS = 16  # steps per segment of the retrieval index (`statekv.core.storage.layer_storage`)


@torch.no_grad()
def measure(model, policy, tokens: int, streams: int, steady_from: int, steps: int) -> dict:
    """Ops of the steady steps of ``streams`` streams stepped together (one stream: its own step)."""
    chunks = [frames(model, tokens, steps, seed) for seed in range(streams)]
    horizon = sum(chunk.shape[1] for chunk in chunks[0])
    prefills = [statekv.StreamingPrefill(model, policy, attention="chunked", cuda_graph=False, horizon=horizon)
                for _ in range(streams)]
    batcher = StepBatcher()
    traces, seconds = [], []
    with device_parts():
        for step in range(steps + 1):
            with OpTrace() as trace:
                started = time.perf_counter()
                outcomes = batcher.step([StepRequest(prefill, chunk[step]) for prefill, chunk in zip(prefills, chunks)])
                seconds.append(time.perf_counter() - started)
            if any(isinstance(outcome, Exception) for outcome in outcomes):
                raise next(outcome for outcome in outcomes if isinstance(outcome, Exception))
            traces.append(trace)
    for prefill in prefills:
        prefill.close()
    steady = list(range(steady_from, steps + 1))
    completing = [step for step in steady if step % SEGMENT_STEPS == SEGMENT_STEPS - 1]
    plain = [step for step in steady if step not in completing]
    compute = [len(traces[step].compute) for step in plain]
    return {"streams": streams, "compute": statistics.median(compute),
            "device": statistics.median(len(traces[step].device_compute) for step in plain),
            "outside": statistics.median(len(traces[step].host_compute) for step in plain),
            "completing": max((len(traces[step].compute) for step in completing), default=None),
            "syncs": sum(len(traces[step].syncs) for step in steady),
            "static": all(traces[step].device_ops == traces[plain[0]].device_ops for step in plain),
            "batched": batcher.batched_steps, "ms": 1e3 * statistics.median(seconds[step] for step in plain)}


def run(tokens: int, budget_frames: int, steps: int) -> dict:
    torch.set_num_threads(1)
    model = tiny_language_model()
    results = {}
    for name, policy in methods(tokens, budget_frames).items():
        results[name] = [measure(model, policy, tokens, streams, budget_frames + 4, steps) for streams in STREAMS]
        for row in results[name]:
            print(f"{name} {row}", file=sys.stderr, flush=True)
    return results


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(statekv.__file__).parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(results: dict, before: dict | None) -> list[str]:
    head = ("| method | streams | compute ops / step | per stream | / one stream's | in the device part | outside it | "
            "on a step completing a segment | host syncs | static | ms / step |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, rows in results.items():
        one = rows[0]["compute"]
        for index, row in enumerate(rows):
            old = "" if before is None else f" (before: {before[name][index]['compute']:.0f})"
            lines.append(f"| {name} | {row['streams']} | {row['compute']:.0f}{old} | "
                         f"{row['compute'] / row['streams']:.1f} | {row['compute'] / one:.2f} | {row['device']:.0f} | "
                         f"{row['outside']:.0f} | {row['completing'] if row['completing'] is not None else '-'} | "
                         f"{row['syncs']} | {'yes' if row['static'] else 'NO'} | {row['ms']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per frame")
    parser.add_argument("--budget-frames", type=int, default=4, help="StateKV's budget and recency's R, in frames")
    parser.add_argument("--steps", type=int, default=20, help="steps per stream after the prefix")
    parser.add_argument("--json", type=Path, help="write the results (with the commit measured) here")
    parser.add_argument("--before", type=Path, help="results of an earlier checkout (its --json) to set beside")
    parser.add_argument("--out", type=Path, help="markdown file whose section is replaced")
    args = parser.parse_args(argv)
    if min(args.tokens, args.budget_frames) < 1 or args.steps < args.budget_frames + 5:
        # steady from step B + 4 (`run`), and of two steady steps one completes no segment
        parser.error(f"--tokens and --budget-frames must be at least 1 and --steps at least --budget-frames + 5 "
                     f"({args.budget_frames + 5}): the steps measured begin once the streams are steady")
    results = run(args.tokens, args.budget_frames, args.steps)
    record = {"commit": commit(), "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    before = json.loads(args.before.read_text()) if args.before else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"Command: `python benchmarks/batched_steps.py {shlex.join(argv if argv is not None else sys.argv[1:])}`"
             + (f" (before: the same script over commit {before['commit']})" if before else "") + "  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, 1 torch thread, torch {torch.__version__}; "
             f"load average {load:.1f} at the end; commit {record['commit']}.  ",
             f"Model: a 3-layer Qwen2 decoder (4/2 heads of dim 16), fp32, {args.tokens} tokens per frame after a "
             f"{PREFIX_TOKENS}-token prefix; StateKV at {args.budget_frames} frames of tokens and recency at "
             f"{args.budget_frames} frames, chunked attention. Medians over the steady steps that complete no segment "
             "of the retrieval index (the last column is the largest such step's count).", ""]
    lines += table(record["results"], before and before["results"])
    for name, rows in record["results"].items():
        sixteen = next(row for row in rows if row["streams"] == 16)
        old = "" if before is None else next(row for row in before["results"][name] if row["streams"] == 16)
        lines += ["", f"{name}: a batched steady step of 16 streams dispatches {sixteen['compute']:.0f} compute ops, "
                  f"{sixteen['compute'] / rows[0]['compute']:.2f}x one stream's steady step"
                  + ("" if not old else f" (before: {old['compute']:.0f}, {old['compute'] / rows[0]['compute']:.2f}x)")
                  + "; issue 48's CPU acceptance is at most 1.5x."]
    lines += ["", "ms / step is the CPU's wall time of the whole batched step (a shared machine: a rough figure); on a "
              "GPU the device part is one CUDA graph replay per bucket and every op in it a launch slot."]
    report = "\n".join(lines)
    print(report)
    if args.out:
        from report import write_section

        write_section(args.out, TITLE, report)


if __name__ == "__main__":
    main()
