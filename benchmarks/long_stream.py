"""Ten hours of live video on a CPU: a 36,000-frame stream (1 fps) with its detailed cache on disk, stored int4.

A tiny InternVL of the real architecture with a million-position context (`statekv.testing.
make_long_context_checkpoint`, 16 visual tokens per 112x112 frame) streams frames through `VideoQA.stream` (the
whole pipeline: preprocessing, vision tower, language model) under StateKV. Each configuration runs in a child
process of its own, which records its resident memory (RSS, split into anonymous and file-backed pages), the disk
its file set takes, ms per frame, and the latency of a question answered from 16 retrieved frames per layer.

    python benchmarks/long_stream.py --out docs/benchmarks.md --plot docs/figures/long_stream.png
    python benchmarks/long_stream.py --frames 600 --compare-frames 300     # minutes -> seconds

Configurations: ``disk int4`` (``offload="disk", kv_cache_dtype="int4"``: the 10-hour run), and, for
``--compare-frames`` frames, ``disk`` (model dtype on disk) against ``memory`` (``offload=True``: the detailed
cache in host memory), the issue's resident-memory comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What happened first?"
SAMPLE_EVERY = 600  # frames between samples (ten minutes of video)


def resident() -> dict[str, int]:
    """This process's resident memory in bytes: total, anonymous, file-backed (mapped files)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def disk_bytes(folder: Path | None) -> int:
    """Bytes the file set takes on disk (allocated blocks: punched and unwritten parts excluded)."""
    if folder is None or not folder.exists():
        return 0
    return sum(path.stat().st_blocks * 512 for path in folder.iterdir() if path.is_file())


def child(args: argparse.Namespace) -> None:
    """One configuration's stream; prints one JSON object per sample."""
    import numpy as np
    import torch

    import statekv

    torch.set_num_threads(args.threads)
    offload = {"disk": "disk", "memory": True}[args.tier]
    settings = dict(method="statekv", budget=args.budget, offload=offload, device="cpu",
                    kv_cache_dtype=args.kv_cache_dtype)
    if offload == "disk":
        settings["offload_dir"] = args.offload_dir
    qa = statekv.VideoQA.from_pretrained(args.checkpoint, **settings)
    pool = np.random.default_rng(0).integers(0, 256, (32, args.image_size, args.image_size, 3), dtype=np.uint8)
    stream = qa.stream(horizon_frames=args.frames, vision_batch=16)
    folder = stream.durability.folder
    geometry = stream.prefill.geometry
    report = {"kind": "setup", "tokens_per_frame": None, "layers": geometry.layers, "kv_heads": geometry.kv_heads,
              "head_dim": geometry.head_dim, "dtype": str(geometry.dtype), **resident()}
    print(json.dumps(report), flush=True)
    asks = {3600, args.frames} if args.frames > 3600 else {args.frames}
    window = time.perf_counter()
    for index in range(args.frames):
        stream.push(pool[index % len(pool)])
        done = index + 1
        if done % SAMPLE_EVERY == 0 or done == args.frames:
            now = time.perf_counter()
            count = done % SAMPLE_EVERY or SAMPLE_EVERY
            stats = stream.prefill.stats
            print(json.dumps({"kind": "sample", "frames": done, "ms_per_frame": 1e3 * (now - window) / count,
                              "tokens": stats.tokens, "detailed_bytes": stats.detailed_bytes,
                              "summary_bytes": stats.summary_bytes,
                              "disk_bytes": disk_bytes(folder), **resident()}), flush=True)
            window = time.perf_counter()
        if done in asks:
            stream.flush()
            stream.ask_tokens(QUESTION, max_new_tokens=8, retrieve=16)  # warm-up (first-call allocations)
            before = resident()
            started = time.perf_counter()
            stream.ask_tokens(QUESTION, max_new_tokens=8, retrieve=16)
            seconds = time.perf_counter() - started
            print(json.dumps({"kind": "ask", "frames": done, "seconds": seconds, "retrieve": 16,
                              "rss_before": before["VmRSS"], "rss_after": resident()["VmRSS"]}), flush=True)
            window = time.perf_counter()
    stream.close()


def run(config: dict, args: argparse.Namespace, checkpoint: Path, workdir: Path) -> list[dict]:
    command = [sys.executable, __file__, "--child", "--checkpoint", str(checkpoint), "--tier", config["tier"],
               "--frames", str(config["frames"]), "--budget", str(args.budget), "--threads", str(args.threads),
               "--image-size", str(args.image_size), "--offload-dir", str(workdir / config["label"].replace(" ", "-"))]
    if config.get("kv_cache_dtype"):
        command += ["--kv-cache-dtype", config["kv_cache_dtype"]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    started = time.perf_counter()
    process = subprocess.run(command, env=env, capture_output=True, text=True)
    if process.returncode:
        raise SystemExit(f"{config['label']} failed:\n{process.stderr[-3000:]}")
    records = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    print(f"{config['label']}: {config['frames']} frames in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return records


def mib(count: float) -> str:
    return f"{count / 2**20:.1f}"


def table(results: dict[str, list[dict]]) -> list[str]:
    lines = ["| configuration | frames | RSS at start MiB | RSS at end MiB | RSS growth per frame KiB | disk at end MiB "
             "| ms/frame first 10 min | ms/frame last 10 min | ask, 16 frames retrieved (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, records in results.items():
        samples = [r for r in records if r["kind"] == "sample"]
        setup = next(r for r in records if r["kind"] == "setup")
        first, last = samples[0], samples[-1]
        growth = (last["VmRSS"] - first["VmRSS"]) / max(last["frames"] - first["frames"], 1)
        asks = "; ".join(f"{r['seconds']:.3f} at {r['frames'] / 3600:g} h" for r in records if r["kind"] == "ask")
        lines.append(f"| {label} | {last['frames']} | {mib(setup['VmRSS'])} | {mib(last['VmRSS'])} | "
                     f"{growth / 1024:.2f} | {mib(last['disk_bytes'])} | {first['ms_per_frame']:.1f} | "
                     f"{last['ms_per_frame']:.1f} | {asks} |")
    return lines


def plot(results: dict[str, list[dict]], path: Path) -> None:
    from statekv.plotting import pyplot

    plt = pyplot()
    figure, (memory, disk) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in results.items():
        samples = [r for r in records if r["kind"] == "sample"]
        hours = [r["frames"] / 3600 for r in samples]
        memory.plot(hours, [r["VmRSS"] / 2**20 for r in samples], marker=".", label=f"{label}: RSS")
        if any(r["disk_bytes"] for r in samples):
            disk.plot(hours, [r["disk_bytes"] / 2**20 for r in samples], marker=".", label=f"{label}: disk")
    memory.set(xlabel="hours of video (1 fps)", ylabel="MiB", title="resident memory")
    disk.set(xlabel="hours of video (1 fps)", ylabel="MiB", title="disk taken by the file set")
    memory.legend()
    disk.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=36000, help="frames of the disk int4 run (default: 10 h)")
    parser.add_argument("--compare-frames", type=int, default=10000,
                        help="frames of the disk vs host-memory comparison")
    parser.add_argument("--budget", type=int, default=64, help="StateKV's carried tokens per layer and KV head")
    parser.add_argument("--image-size", type=int, default=112, help="frame side (112: 16 visual tokens, 224: 64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the results into this markdown file")
    parser.add_argument("--plot", type=Path, help="save the memory/disk plot here")
    parser.add_argument("--json", type=Path, help="save every sample here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tier", choices=("disk", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    from statekv.testing import make_long_context_checkpoint

    with tempfile.TemporaryDirectory(prefix="statekv-long-stream-") as work:
        workdir = Path(work)
        checkpoint = make_long_context_checkpoint(workdir / "ckpt", image_size=args.image_size)
        configs = [{"label": "disk int4", "tier": "disk", "kv_cache_dtype": "int4", "frames": args.frames},
                   {"label": "disk", "tier": "disk", "frames": args.compare_frames},
                   {"label": "memory (offload=True)", "tier": "memory", "frames": args.compare_frames}]
        results = {config["label"]: run(config, args, checkpoint, workdir) for config in configs}
    setup = next(r for r in results["disk int4"] if r["kind"] == "setup")
    summary_per_frame = next(r for r in reversed(results["disk int4"]) if r["kind"] == "sample")
    per_frame = summary_per_frame["summary_bytes"] / summary_per_frame["frames"]
    tokens_per_frame = summary_per_frame["tokens"] / summary_per_frame["frames"]
    lines = [f"Tiny InternVL (real architecture; {setup['layers']} layers, {setup['kv_heads']} KV heads of "
             f"{setup['head_dim']}, {setup['dtype'].removeprefix('torch.')}), {args.image_size}x{args.image_size} "
             f"frames, {tokens_per_frame:.1f} tokens per frame with the prompt's, StateKV B={args.budget}, "
             f"`VideoQA.stream` (vision batches of 16), CPU ({platform.processor() or platform.machine()}, "
             f"{args.threads} threads, {os.cpu_count()} cores shared).",
             f"Command: `python benchmarks/long_stream.py {' '.join(argv if argv is not None else sys.argv[1:])}`.",
             "", *table(results), "",
             f"RAM bound of the disk tier: the step summaries, {per_frame / 1024:.2f} KiB per frame here (mean key and "
             "16 sampled keys per layer and KV head, in the model's dtype); everything else of the detailed cache is "
             "on disk."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results))
    if args.plot:
        plot(results, args.plot)
    if args.out:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_section

        write_section(args.out, "Ten hours on disk: resident memory, disk, time per frame (CPU)",
                      text + (f"\n![memory and disk over the stream]({os.path.relpath(args.plot, args.out.parent)})\n"
                              if args.plot else ""))


if __name__ == "__main__":
    main()
