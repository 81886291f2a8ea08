"""Streams that never end, on a CPU: ms per frame, resident memory, disk and question latency against the age of a
stream with no horizon (ten hours and a day and more at 1 fps), and the disk tier against host memory.

A tiny InternVL of the real architecture with a million-position context (`statekv.testing.
make_long_context_checkpoint`, 16 visual tokens per 112x112 frame) streams frames through `VideoQA.stream` (the
whole pipeline: preprocessing, vision tower, language model) under StateKV B=64, with no horizon (so with bounded
positions: past the checkpoint's million positions the stream goes on). Each configuration runs in a child
process of its own and appends its samples to ``RUNS/<configuration>.jsonl`` as it goes (every ``--sample-every``
frames: ms per frame over the window, resident memory split into anonymous and file-backed pages, the disk its
file set takes, the engine's byte counts, the load average); a question (16 retrieved frames per layer, after a
warm-up question) is timed at set ages. A configuration whose file ends with its ``done`` record is not run again
(``--fresh`` reruns it), so a failure loses only the configuration it happened in.

    python benchmarks/long_stream.py --configs ten-hours,tiers --runs runs/long_stream --out docs/benchmarks.md \\
        --plot docs/figures/long_stream.png
    python benchmarks/long_stream.py --configs week --runs runs/week --out docs/benchmarks.md \\
        --plot docs/figures/week_stream.png
    python benchmarks/long_stream.py --smoke      # every configuration at a few hundred frames: seconds

Configurations:

``ten-hours``: ``offload="disk", kv_cache_dtype="int4"``, 36,000 frames (10 h at 1 fps); questions at 1 h and 10 h.
``tiers``: the disk tier (model dtype) and host memory (``offload=True``), two streams pushed in turn in one
    process (the same load for both), 10,000 frames each: the disk tier's ms per frame against host memory's.
``memory``: host memory alone, 10,000 frames (its resident memory and time per frame without another stream).
``week``: disk, int4, 100,800 frames (28 h); questions at 1 h, 10 h, 24 h and at the end.
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
import tempfile
import time
from pathlib import Path

QUESTION = "What happened first?"
RETRIEVE = 16
REPEATS = 3  # timed questions at each age (after a warm-up); the median is reported
HOUR = 3600  # frames of an hour at 1 fps
CONFIGS = {
    "ten-hours": {"streams": {"disk int4": {"offload": "disk", "kv_cache_dtype": "int4"}}, "frames": 36_000,
                  "asks": (HOUR, 36_000)},
    "tiers": {"streams": {"disk": {"offload": "disk"}, "memory": {"offload": True}}, "frames": 10_000,
              "asks": (HOUR, 10_000)},
    "memory": {"streams": {"memory": {"offload": True}}, "frames": 10_000, "asks": (HOUR, 10_000)},
    "week": {"streams": {"disk int4": {"offload": "disk", "kv_cache_dtype": "int4"}}, "frames": 100_800,
             "asks": (HOUR, 36_000, 86_400, 100_800)},
}


def resident() -> dict[str, int]:
    """This process's resident memory in bytes: total, anonymous, file-backed (mapped files)."""
    return status_bytes("VmRSS", "RssAnon", "RssFile")


def status_bytes(*names: str) -> dict[str, int]:
    """Fields ``names`` of /proc/self/status (each in kB there), in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            fields[key] = int(value.split()[0]) * 1024
    return fields


def disk_bytes(folder: Path | None) -> int:
    """Bytes the file set takes on disk (allocated blocks: punched and unwritten parts excluded)."""
    if folder is None or not folder.exists():
        return 0
    return sum(path.stat().st_blocks * 512 for path in folder.iterdir() if path.is_file())


def child(args: argparse.Namespace) -> None:
    """One configuration's streams, pushed in turn; one JSON line per sample, ask and stream, then ``done``."""
    import numpy as np
    import torch

    import statekv

    torch.set_num_threads(args.threads)
    config = CONFIGS[args.config]
    frames = args.frames or config["frames"]
    asks = sorted({min(age, frames) for age in config["asks"]} if not args.smoke else {frames // 3, frames})
    out = open(args.record, "a", buffering=1)

    def record(**fields) -> None:
        out.write(json.dumps({**fields, "load": os.getloadavg()[0]}) + "\n")

    streams = {}
    for label, settings in config["streams"].items():
        extra = {"offload_dir": str(args.offload_dir / label.replace(" ", "-"))} if settings["offload"] == "disk" else {}
        qa = statekv.VideoQA.from_pretrained(args.checkpoint, method="statekv", budget=args.budget, device="cpu",
                                             **settings, **extra)
        streams[label] = qa.stream(vision_batch=16)  # no horizon: it never ends (bounded positions)
        stream = streams[label]
        geometry = stream.prefill.geometry
        record(kind="stream", stream=label, cores=os.cpu_count(), threads=args.threads, command=args.command,
               processor=platform.processor() or platform.machine(), positions=stream.prefill.positions.mode, layers=geometry.layers,
               kv_heads=geometry.kv_heads, head_dim=geometry.head_dim, dtype=str(geometry.dtype),
               limit=stream.prefill.positions.limit, **resident())
    pool = np.random.default_rng(0).integers(0, 256, (32, args.image_size, args.image_size, 3), dtype=np.uint8)
    spent = {label: 0.0 for label in streams}
    cpu = {label: 0.0 for label in streams}
    for index in range(frames):
        for label, stream in streams.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            stream.push(pool[index % len(pool)])
            spent[label] += time.perf_counter() - started
            cpu[label] += time.process_time() - started_cpu
        done = index + 1
        if done % args.sample_every == 0 or done == frames:
            count = done % args.sample_every or args.sample_every
            for label, stream in streams.items():
                stats = stream.prefill.stats
                folder = stream.durability.folder
                record(kind="sample", stream=label, frames=done, ms_per_frame=1e3 * spent[label] / count,
                       cpu_ms_per_frame=1e3 * cpu[label] / count,
                       tokens=stats.tokens, detailed_bytes=sum(e.stats.detailed_bytes for e in stream.engines),
                       summary_bytes=stats.summary_bytes,
                       journal_bytes=stats.journal_bytes, disk_bytes=disk_bytes(folder), **resident())
                spent[label] = cpu[label] = 0.0
        if done in asks:
            for label, stream in streams.items():
                stream.flush()
                stream.ask_tokens(QUESTION, max_new_tokens=8, retrieve=RETRIEVE)  # warm-up (first-call allocations)
                before = resident()
                walls, cpus = [], []
                for _ in range(REPEATS):
                    started, started_cpu = time.perf_counter(), time.process_time()
                    stream.ask_tokens(QUESTION, max_new_tokens=8, retrieve=RETRIEVE)
                    walls.append(time.perf_counter() - started)
                    cpus.append(time.process_time() - started_cpu)
                record(kind="ask", stream=label, frames=done, seconds=statistics.median(walls),
                       cpu_seconds=statistics.median(cpus), retrieve=RETRIEVE, context=stream.answer_info.context,
                       rss_before=before["VmRSS"], rss_after=resident()["VmRSS"])
    for stream in streams.values():
        stream.close()
    record(kind="done", frames=frames)


def run(name: str, args: argparse.Namespace, checkpoint: Path, workdir: Path) -> list[dict]:
    """The records of configuration ``name``: read from its file when complete, else run (appending)."""
    path = args.runs / f"{name}.jsonl"
    if path.exists() and not args.fresh:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if records and records[-1]["kind"] == "done":
            print(f"{name}: complete in {path}, not run again (--fresh reruns it)", file=sys.stderr)
            return records
    if args.render_only:
        raise SystemExit(f"--render-only: {path} holds no complete run of {name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    command = [sys.executable, __file__, "--child", name, "--checkpoint", str(checkpoint), "--record", str(path),
               "--budget", str(args.budget), "--threads", str(args.threads), "--image-size", str(args.image_size),
               "--sample-every", str(args.sample_every), "--offload-dir", str(workdir / name),
               "--command", args.command]
    if args.frames:
        command += ["--frames", str(args.frames)]
    if args.smoke:
        command.append("--smoke")
    paths = [str(Path(__file__).resolve().parents[1]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    started = time.perf_counter()
    process = subprocess.run(command, env=env, capture_output=True, text=True)
    if process.returncode:
        raise SystemExit(f"{name} failed (its samples so far are in {path}):\n{process.stderr[-3000:]}")
    print(f"{name}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tenths(samples: list[dict], key: str = "ms_per_frame", pick=statistics.fmean) -> tuple[float, float]:
    """ms per frame (``key``: wall or process CPU time) over the first tenth of the stream (its first window, the
    warm-up, left out) and over the last tenth, from the samples (each a window of frames): ``pick`` of the windows'
    (the mean; ``min``: the least disturbed window of each, what a machine shared with other work measures best)."""
    frames = samples[-1]["frames"]
    first = [s[key] for s in samples[1:] if s["frames"] <= frames / 10] or [samples[1][key]]
    last = [s[key] for s in samples if s["frames"] > frames * 0.9]
    return pick(first), pick(last)


def mib(count: float) -> str:
    return f"{count / 2**20:.1f}"


def hours(frames: int) -> str:
    return f"{frames / HOUR:g} h"


def table(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| configuration | stream | frames | CPU ms/frame, first tenth | last tenth | last / first | best windows, "
             "last / first | wall ms/frame, first tenth | last tenth | last / first | RSS at start MiB | RSS at end MiB "
             "| RSS growth per frame B | disk at end MiB | question, 16 frames retrieved: CPU s (wall s) | "
             "last / first question, CPU |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, records in results.items():
        for label in [r["stream"] for r in records if r["kind"] == "stream"]:
            samples = [r for r in records if r["kind"] == "sample" and r["stream"] == label]
            asks = [r for r in records if r["kind"] == "ask" and r["stream"] == label]
            first_cpu, last_cpu = tenths(samples, "cpu_ms_per_frame")
            best_first, best_last = tenths(samples, "cpu_ms_per_frame", min)
            first_ms, last_ms = tenths(samples)
            after = [s for s in samples if asks and s["frames"] > asks[0]["frames"]] or samples
            growth = (after[-1]["VmRSS"] - after[0]["VmRSS"]) / max(after[-1]["frames"] - after[0]["frames"], 1)
            questions = "; ".join(f"{r['cpu_seconds']:.3f} ({r['seconds']:.3f}) at {hours(r['frames'])}"
                                  for r in asks)
            ratio = f"{asks[-1]['cpu_seconds'] / asks[0]['cpu_seconds']:.2f}" if len(asks) > 1 else ""
            lines.append(f"| {name} | {label} | {samples[-1]['frames']} | {first_cpu:.2f} | {last_cpu:.2f} | "
                         f"{last_cpu / first_cpu:.3f} | {best_last / best_first:.3f} | {first_ms:.1f} | {last_ms:.1f} | "
                         f"{last_ms / first_ms:.3f} | "
                         f"{mib(samples[0]['VmRSS'])} | {mib(samples[-1]['VmRSS'])} | {growth:.0f} | "
                         f"{mib(samples[-1]['disk_bytes'])} | {questions} | {ratio} |")
    return lines


def tier_ratio(records: list[dict], key: str = "ms_per_frame") -> str:
    """The disk tier's ms per frame (``key``: wall or CPU) over host memory's, window by window in the one run
    (median)."""
    by_frames: dict[int, dict[str, float]] = {}
    for r in records:
        if r["kind"] == "sample":
            by_frames.setdefault(r["frames"], {})[r["stream"]] = r[key]
    ratios = [v["disk"] / v["memory"] for v in by_frames.values() if "disk" in v and "memory" in v]
    return f"{statistics.median(ratios):.2f}" if ratios else "n/a"


def plot(results: dict[str, list[dict]], path: Path) -> None:
    from statekv.plotting import pyplot

    plt = pyplot()
    figure, panels = plt.subplots(1, 4, figsize=(18, 4))
    time_panel, memory, disk, asks = panels
    for name, records in results.items():
        for label in [r["stream"] for r in records if r["kind"] == "stream"]:
            samples = [r for r in records if r["kind"] == "sample" and r["stream"] == label]
            ages = [r["frames"] / HOUR for r in samples]
            tag = f"{name}: {label}"
            time_panel.plot(ages, [r["cpu_ms_per_frame"] for r in samples], label=f"{tag} (CPU)")
            time_panel.plot(ages, [r["ms_per_frame"] for r in samples], alpha=0.4, label=f"{tag} (wall)")
            memory.plot(ages, [r["VmRSS"] / 2**20 for r in samples], label=tag)
            if any(r["disk_bytes"] for r in samples):
                disk.plot(ages, [r["disk_bytes"] / 2**20 for r in samples], label=tag)
            questions = [r for r in records if r["kind"] == "ask" and r["stream"] == label]
            asks.plot([r["frames"] / HOUR for r in questions], [r["cpu_seconds"] for r in questions], marker="o",
                      label=f"{tag} (CPU)")
    time_panel.set(xlabel="age of the stream (hours at 1 fps)", ylabel="ms per frame", title="time per frame")
    memory.set(xlabel="age of the stream (hours at 1 fps)", ylabel="MiB", title="resident memory")
    disk.set(xlabel="age of the stream (hours at 1 fps)", ylabel="MiB", title="disk taken by the file set")
    asks.set(xlabel="age of the stream (hours at 1 fps)", ylabel="seconds", title="a question, 16 frames retrieved")
    asks.set_ylim(bottom=0)
    for panel in panels:
        panel.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="ten-hours,tiers", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--frames", type=int, help="frames of every configuration (default: each its own)")
    parser.add_argument("--budget", type=int, default=64, help="StateKV's carried tokens per layer and KV head")
    parser.add_argument("--image-size", type=int, default=112, help="frame side (112: 16 visual tokens, 224: 64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sample-every", type=int, default=600, help="frames per sample window")
    parser.add_argument("--runs", type=Path, default=Path("runs/long_stream"), help="the samples, one file per "
                        "configuration (a complete one is not run again)")
    parser.add_argument("--fresh", action="store_true", help="rerun configurations already complete")
    parser.add_argument("--smoke", action="store_true", help="every configuration at a few hundred frames")
    parser.add_argument("--out", type=Path, help="write the results into this markdown file")
    parser.add_argument("--title", default="Streams without an end: time, memory and questions against age (CPU)")
    parser.add_argument("--plot", type=Path, help="save the plot here")
    parser.add_argument("--child", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--render-only", action="store_true", help="run nothing: write --out and --plot from the "
                        "complete runs under --runs (e.g. made on another machine)")
    parser.add_argument("--offload-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command is None:
        args.command = shlex.join(argv if argv is not None else sys.argv[1:])
    if args.child:
        args.config = args.child
        return child(args)
    if args.smoke:
        args.frames, args.sample_every = args.frames or 240, min(args.sample_every, 40)
        args.configs = ",".join(CONFIGS) if args.configs == parser.get_default("configs") else args.configs
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}; choose among {', '.join(CONFIGS)}")
    from statekv.testing import make_long_context_checkpoint

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="statekv-long-stream-") as work:
        workdir = Path(work)
        checkpoint = make_long_context_checkpoint(workdir / "ckpt", image_size=args.image_size)
        results = {name: run(name, args, checkpoint, workdir) for name in names}
    first = next(r for records in results.values() for r in records if r["kind"] == "stream")
    loads = [r["load"] for records in results.values() for r in records if r["kind"] == "sample"]
    lines = [f"Tiny InternVL (real architecture; {first['layers']} layers, {first['kv_heads']} KV heads of "
             f"{first['head_dim']}, {first['dtype'].removeprefix('torch.')}, {first['limit']:,} positions), "
             f"{args.image_size}x{args.image_size} frames, StateKV B={args.budget}, `VideoQA.stream()` with no horizon "
             f"(positions: {first['positions']}), vision batches of 16; CPU ({first.get('processor') or platform.machine()},"
             f" {first.get('threads', args.threads)} torch thread, {first.get('cores', os.cpu_count())} cores: load "
             f"average {min(loads):.1f} to {max(loads):.1f} over the runs"
             + ("" if args.render_only else f", {load_before:.1f} before") + ").",
             f"Command: `python benchmarks/long_stream.py {first.get('command') or args.command}`"
             + (" (rendered later with `--render-only`)." if args.render_only else "."), "",
             *table(results)]
    if "tiers" in results:
        lines += ["", f"The disk tier against host memory, window by window in the one run (median of disk / memory "
                      f"ms per frame): {tier_ratio(results['tiers'], 'cpu_ms_per_frame')} in CPU time, "
                      f"{tier_ratio(results['tiers'])} in wall time."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.plot:
        plot(results, args.plot)
    if args.out:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_section

        write_section(args.out, args.title, text + (
            f"\n![time, memory, disk and questions against age]({os.path.relpath(args.plot, args.out.parent)})\n"
            if args.plot else ""))
    return text


if __name__ == "__main__":
    main()
