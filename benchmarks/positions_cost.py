"""What bounded positions cost per frame against stream positions, inside the model's range and past it.

For each method (full attention, StateKV at the model's default budget, recency R=16), a live stream of
``--frames`` frames is pushed one frame at a time with ``positions="stream"`` (a horizon covering it) and with
``positions="bounded"`` under each layout (own-then-cache, grouped, cache: `statekv.core.positions.placing`; and
``handover``, a stream's default: one engine inside the range, each step's inputs kept for its successor, which
replays them at the step that passes the range, `statekv.api.handover`): per frame, the push
(CPU time of the pushing thread on a CPU, where other work on a shared machine does not count; synchronized wall
time on CUDA), mean over the second half of the frames, the median of ``--repeats`` runs taken in turn; and the
compute ops of the last frame's push (`statekv.testing.OpTrace`), the measure no load disturbs. Past the range (``--past-frames``, enough to pass it): StateKV's bounded streams, the median push over
the frames after the first step placed away from its own position against the same stream's frames before it:
what re-placing and rotating the carried keys costs once positions move; and the push that moved them (under
``handover``, its successor's replay of every step before; with ``--offload-dir``, also on the disk tier, where
that push also hands the stream's folder to the successor's file set). At the depths of real models
(``--depths``, tiny random checkpoints): the ops and the CPU time (pushed in turn) of a steady placed push against
a `stream` push. Paired
(``--paired-frames``): the default bounded stream and a `stream`-positions one pushed in turn, inside the range and
past it.

    python benchmarks/positions_cost.py --out docs/benchmarks.md          # the built-in model on the CPU
    python benchmarks/positions_cost.py --device cuda --out docs/benchmarks.md
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import statekv  # noqa: E402
from statekv.core.positions import rope  # noqa: E402
from statekv.testing.op_trace import OpTrace  # noqa: E402

METHODS = (("full", {}, "full attention"), ("statekv", {}, "StateKV"), ("recency", {"frames": 16}, "recency R=16"))
LAYOUTS = ("own-then-cache", "grouped", "cache", "handover")
SECTION = "Runs of benchmarks/positions_cost.py"  # a subsection of "Positions: the cost per frame"


def configurations(method: str) -> list[tuple[str, str | None]]:
    rows = [("stream", None)] + [("bounded", layout) for layout in LAYOUTS]
    return [row for row in rows if not (method == "full" and row[1] == "cache")]  # refused past the range only


def timer(device: str):
    if device.startswith("cuda"):
        def now() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
        return now
    return time.thread_time


def push_all(qa, frames, positions: str, layout: str | None, device: str, traced: bool) -> dict:
    """One stream's frames pushed one at a time: push ms per frame (mean, second half), the compute ops of the
    last push."""
    horizon = len(frames) + 8 if positions == "stream" else None
    stream = qa.with_options(bounded_layout=layout).stream(horizon_frames=horizon, max_fps=None, vision_batch=1)
    assert stream.prefill.positions.mode == positions
    clock, pushes = timer(device), []
    for index, image in enumerate(frames[:-1]):
        started = clock()
        stream.push(image, float(index))
        pushes.append(clock() - started)
    with OpTrace() as trace:
        stream.push(frames[-1], float(len(frames) - 1))
    half = len(pushes) // 2
    result = {"push_ms": 1e3 * statistics.mean(pushes[half:]), "ops": len(trace.compute) if traced else None,
              "tokens": stream.tokens, "placed": stream.prefill.cache.placed}
    stream.close()
    return result


def inside(args, frames) -> list[dict]:
    rows = []
    for method, sizes, label in METHODS:
        qa = statekv.VideoQA.from_options(statekv.ModelOptions(model=args.model, method=method, device=args.device,
                                                               **sizes))
        runs: dict[tuple, list[dict]] = {config: [] for config in configurations(method)}
        traced = min(1, args.repeats - 1)  # ops traced in the second run: the first builds each mask shape once
        for repeat in range(args.repeats):  # in turn, so the machine's load falls on every configuration alike
            for config in runs:
                runs[config].append(push_all(qa, frames, *config, args.device, traced=repeat == traced))
        base = statistics.median(run["push_ms"] for run in runs[("stream", None)])
        base_ops = runs[("stream", None)][traced]["ops"]
        for (positions, layout), measured in runs.items():
            push = statistics.median(run["push_ms"] for run in measured)
            rows.append({"method": label, "positions": positions + (f" ({layout})" if layout else ""),
                         "push_ms": push, "push_ratio": push / base, "ops": measured[traced]["ops"],
                         "ops_ratio": measured[traced]["ops"] / base_ops, "placed": measured[0]["placed"],
                         "tokens": measured[0]["tokens"]})
            print(rows[-1], flush=True)
    return rows


def past(args, frames) -> list[dict]:
    rows = []
    qa = statekv.VideoQA.from_options(statekv.ModelOptions(model=args.model, method="statekv", device=args.device))
    limit = rope.trained_range(qa.adapter.model.config.get_text_config())
    runs = [(layout, {"bounded_layout": layout}) for layout in LAYOUTS]
    if args.offload_dir:  # the default on the disk tier: its backlog and successor in the stream's folder
        runs.append(("handover, disk tier", {"bounded_layout": "handover", "offload": "disk",
                                             "offload_dir": args.offload_dir}))
    for layout, options in runs:
        stream = qa.with_options(**options).stream(max_fps=None, vision_batch=1)
        clock, pushes, moved_at, ops = timer(args.device), [], None, {}
        for index, image in enumerate(frames):
            traced = index in (len(frames) // 2 - 1, len(frames) - 1)  # ops of a frame before moving, and the last
            with OpTrace() if traced else contextlib.nullcontext() as trace:
                started = clock()
                stream.push(image, float(index))
                pushes.append(clock() - started)
            if traced:
                ops["before" if moved_at is None else "after"] = len(trace.compute)
            if moved_at is None and stream.prefill.positions.moved:
                moved_at = index
        steady = pushes[len(frames) // 4: moved_at] if moved_at else []
        beyond = pushes[moved_at + 1:] if moved_at else []
        row = {"layout": layout, "frames": len(frames), "tokens": stream.tokens, "range": limit,
               "moved_at_frame": moved_at, "ops_before": ops.get("before"), "ops_after": ops.get("after"),
               "moved_ms": 1e3 * pushes[moved_at] if moved_at is not None else None}
        if steady and beyond:
            row.update(before_ms=1e3 * statistics.median(steady), after_ms=1e3 * statistics.median(beyond))
            row["past_ratio"] = row["after_ms"] / row["before_ms"]
        rows.append(row)
        print(row, flush=True)
        stream.close()
    return rows


def paired(args, frames) -> list[dict]:
    """StateKV's default bounded stream (the handover layout) and a `stream`-positions stream of the same frames,
    pushed in turn frame by frame (which goes first alternating), so that whatever slows the machine slows both:
    per frame, the push's CPU time of each, inside the range and past it. The `stream` stream runs on a second
    copy of the model whose declared range is raised above the frames' positions (its RoPE is unchanged: the
    default RoPE's rotation does not depend on the range), so it can go where bounded positions have to place."""
    qa = statekv.VideoQA.from_options(statekv.ModelOptions(model=args.model, method="statekv", device=args.device))
    long = statekv.VideoQA.from_options(statekv.ModelOptions(model=args.model, method="statekv",
                                                             device=args.device))
    config = long.adapter.model.config.get_text_config()
    if rope.rope_parameters(config)["rope_type"] != "default":
        raise SystemExit(f"--paired-frames needs a model with the default RoPE, not {args.model}")
    config.max_position_embeddings = 1 << 30
    bounded = qa.stream(max_fps=None, vision_batch=1)
    own = long.stream(horizon_frames=len(frames) + 8, max_fps=None, vision_batch=1)
    assert own.prefill.positions.mode == "stream" and bounded.prefill.positions.mode == "bounded"
    clock, times, moved_at = timer(args.device), {"stream": [], "bounded": []}, None
    for index, image in enumerate(frames):
        order = (("stream", own), ("bounded", bounded)) if index % 2 else (("bounded", bounded), ("stream", own))
        for name, stream in order:
            started = clock()
            stream.push(image, float(index))
            times[name].append(clock() - started)
        if moved_at is None and bounded.handover == "handed over":
            moved_at = index
    rows = []
    if moved_at is None:
        raise SystemExit("--paired-frames: the bounded stream never left the model's range; push more frames")
    for phase, span in (("inside the range", range(len(frames) // 4, moved_at)),
                        ("past the range", range(moved_at + 1, len(frames)))):
        mine, theirs = [times["bounded"][i] for i in span], [times["stream"][i] for i in span]
        rows.append({"phase": phase, "frames": len(span), "stream_ms": 1e3 * statistics.median(theirs),
                     "bounded_ms": 1e3 * statistics.median(mine),
                     "ratio": statistics.median(a / b for a, b in zip(mine, theirs)),
                     "moved_at": moved_at, "handover": bounded.handover})
        print(rows[-1], flush=True)
    bounded.close()
    own.close()
    return rows


def steady_ops(qa, frames, positions: str, layout: str | None, traced: int = 8) -> int:
    """The fewest compute ops of the last ``traced`` pushes (a push that completes a segment of the retrieval index
    does more, at the same step whatever the positions)."""
    horizon = len(frames) + 8 if positions == "stream" else None
    stream = qa.with_options(bounded_layout=layout).stream(horizon_frames=horizon, max_fps=None, vision_batch=1)
    counts = []
    for index, image in enumerate(frames):
        with OpTrace() if index >= len(frames) - traced else contextlib.nullcontext() as trace:
            stream.push(image, float(index))
        if trace is not None:
            counts.append(len(trace.compute))
    assert stream.prefill.positions.moved == (positions == "bounded"), (positions, stream.prefill.positions.mode)
    stream.close()
    return min(counts)


def paired_placed(qa, frames, device: str) -> dict:
    """A `stream`-positions stream and a cache-layout one (every step placed) of the same frames, pushed in turn
    frame by frame (which goes first alternating): push ms per frame over the second half, medians, and the
    median of each frame's placed / stream."""
    streams = {positions: qa.with_options(bounded_layout=layout).stream(
        horizon_frames=len(frames) + 8 if positions == "stream" else None, max_fps=None, vision_batch=1)
        for positions, layout in (("stream", None), ("bounded", "cache"))}
    clock, times = timer(device), {name: [] for name in streams}
    for index, image in enumerate(frames):
        for name in (("stream", "bounded") if index % 2 else ("bounded", "stream")):
            started = clock()
            streams[name].push(image, float(index))
            times[name].append(clock() - started)
    assert streams["bounded"].prefill.positions.moved and not streams["stream"].prefill.positions.moved
    for stream in streams.values():
        stream.close()
    half = slice(len(frames) // 2, None)
    placed, own = times["bounded"][half], times["stream"][half]
    return {"stream_ms": 1e3 * statistics.median(own), "placed_ms": 1e3 * statistics.median(placed),
            "time_ratio": statistics.median(a / b for a, b in zip(placed, own))}


def at_depths(args, frames) -> list[dict]:
    """Compute ops of StateKV's steady push with `stream` positions and with the cache layout (every step placed,
    as every step past the range is), on tiny random InternVL checkpoints with the depth of real models' language
    models (how many ops a placed step adds does not depend on the width, only on the layers), and their CPU time
    pushed in turn (`paired_placed`)."""
    import tempfile

    from statekv.testing import make_tiny_checkpoint

    rows = []
    for depth in args.depths:
        with tempfile.TemporaryDirectory() as folder:
            path = make_tiny_checkpoint("internvl", Path(folder) / "ckpt", vision_config={"image_size": 112},
                                        text_config={"num_hidden_layers": depth, "max_position_embeddings": 65536})
            qa = statekv.VideoQA.from_pretrained(path, method="statekv", budget=64, device=args.device)
            ops = {}
            for positions, layout in (("stream", None), ("bounded", "cache")):
                ops[positions] = steady_ops(qa, frames, positions, layout)
            times = paired_placed(qa, frames, args.device)
        rows.append({"layers": depth, "stream_ops": ops["stream"], "placed_ops": ops["bounded"],
                     "ratio": ops["bounded"] / ops["stream"], **times})
        print(rows[-1], flush=True)
    return rows


def report(args, rows: list[dict], beyond: list[dict], pairs: list[dict], depths: list[dict],
           load: tuple[str, str]) -> str:
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s)"
               if not args.device.startswith("cuda") else torch.cuda.get_device_name(0))
    lines = [f"Command: `python benchmarks/positions_cost.py {shlex.join(sys.argv[1:])}`  ",
             f"Machine: {machine} (load average {load[0]} before, {load[1]} after).", "",
             f"Model {args.model}, {args.frames} frames pushed one at a time into a live stream (stream positions: "
             "a horizon covering them; bounded: each layout), inside the model's range. Push ms: per frame, "
             + ("synchronized wall time" if args.device.startswith("cuda") else "CPU time of the pushing thread")
             + f" (vision tower included), mean over the second half of the frames, the median of {args.repeats} "
             "runs taken in turn; ops: compute ops of the last push (what no load disturbs); placed: the stream "
             "carries slots with placements (its layout placed it away from its own positions).", "",
             "| method | positions | push ms/frame | vs stream | ops per push | vs stream | placed |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['positions']} | {row['push_ms']:.2f} | {row['push_ratio']:.3f} | "
                     f"{row['ops']} | {row['ops_ratio']:.3f} | {'yes' if row['placed'] else 'no'} |")
    if beyond:
        lines += ["", f"Past the range: StateKV, {beyond[0]['frames']} frames ({beyond[0]['tokens']:,} tokens; the "
                  f"model's range is {beyond[0]['range']:,}). Push ms per frame, median, from a quarter of the way in "
                  "to the first step placed away from its own position, and after it; the push of that step (under "
                  "handover, the successor's replay of every step before it).", "",
                  "| layout | moved at frame | push ms/frame before | after | after / before | the push that moved, ms "
                  "| ops per push before | after |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in beyond:
            times = (f"{row['before_ms']:.2f} | {row['after_ms']:.2f} | {row['past_ratio']:.3f}"
                     if "past_ratio" in row else "- | - | -")
            moved = f"{row['moved_ms']:.0f}" if row["moved_ms"] is not None else "-"
            lines.append(f"| {row['layout']} | {row['moved_at_frame']} | {times} | {moved} | "
                         f"{row['ops_before'] or '-'} | {row['ops_after']} |")
    if pairs:
        lines += ["", f"Paired, past the range: StateKV's default bounded stream (handover; handed over at frame "
                  f"{pairs[0]['moved_at']}) and a `stream`-positions stream of the same {args.paired_frames} frames "
                  "(the model's declared range raised, its RoPE unchanged), pushed in turn frame by frame. Push ms "
                  "per frame, medians; the ratio is the median of each frame's bounded / stream.", "",
                  "| frames | pushes | stream ms/frame | bounded ms/frame | bounded / stream |",
                  "|---|---:|---:|---:|---:|"]
        for row in pairs:
            lines.append(f"| {row['phase']} | {row['frames']} | {row['stream_ms']:.2f} | {row['bounded_ms']:.2f} | "
                         f"{row['ratio']:.3f} |")
    if depths:
        lines += ["", f"At the depth of real models (tiny random InternVL checkpoints, StateKV B=64, "
                  f"{args.depth_frames} frames): compute ops of a steady push (the fewest of the last 8) with "
                  "`stream` positions and with the cache layout, every step placed as every step past the range is; "
                  "and the two streams pushed in turn frame by frame, push ms per frame over the second half, "
                  "medians, the ratio the median of each frame's placed / stream.", "",
                  "| decoder layers | ops, stream | ops, placed | ops ratio | ms, stream | ms, placed | time ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in depths:
            lines.append(f"| {row['layers']} | {row['stream_ops']} | {row['placed_ops']} | {row['ratio']:.3f} | "
                         f"{row['stream_ms']:.2f} | {row['placed_ms']:.2f} | {row['time_ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    from report import OneLineParser, count_or_zero, output_file, positive_count

    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=positive_count, default=300)
    parser.add_argument("--repeats", type=positive_count, default=3)
    parser.add_argument("--past-frames", type=count_or_zero, default=1400, help="0: no run past the range")
    parser.add_argument("--threads", type=positive_count, default=1, help="torch threads on the CPU (default: 1)")
    parser.add_argument("--offload-dir", default=None,
                        help="past the range, also the handover layout on the disk tier, its folders made here")
    parser.add_argument("--paired-frames", type=count_or_zero, default=1400,
                        help="frames of the paired run past the range (0: none)")
    parser.add_argument("--depths", default="24,28",
                        help="decoder depths of tiny checkpoints whose ops are counted and pushes timed in turn "
                             "(InternVL3-1B's and -8B's language models have 24 and 28 layers); empty: none")
    parser.add_argument("--depth-frames", type=positive_count, default=200)
    parser.add_argument("--out", type=output_file("--out"), default=None,
                        help=f"markdown file whose '### {SECTION}' subsection is replaced (appended if absent)")
    args = parser.parse_args()
    args.depths = [int(depth) for depth in args.depths.split(",") if depth.strip()]
    torch.set_num_threads(args.threads)
    load = [" ".join(open("/proc/loadavg").read().split()[:3])] if Path("/proc/loadavg").exists() else ["?"]
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (max(args.frames, args.past_frames, args.paired_frames, args.depth_frames), 64, 64, 3),
                          dtype=np.uint8)
    rows = inside(args, frames[:args.frames])
    beyond = past(args, frames[:args.past_frames]) if args.past_frames else []
    pairs = paired(args, frames[:args.paired_frames]) if args.paired_frames else []
    depths = at_depths(args, frames[:args.depth_frames])
    load.append(" ".join(open("/proc/loadavg").read().split()[:3]) if Path("/proc/loadavg").exists() else "?")
    text = report(args, rows, beyond, pairs, depths, tuple(load))
    print(text)
    if args.out:
        from report import write_section

        write_section(Path(args.out), SECTION, text, level=3)


if __name__ == "__main__":
    from report import run_script

    run_script(main)
