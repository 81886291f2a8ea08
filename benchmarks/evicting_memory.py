"""Resident memory of a stream under an evicting cap: what it holds should follow the cap, not its history.

The built-in model streams random 16x16 frames (50 distinct ones, cycled; timestamps 0, 1, 2, ...) through
`VideoQA.stream` with the detailed cache off the model's device under ``max_cache_bytes`` and ``cache_limit=
"evict-oldest"``; every ``--every`` frames it records the process's resident memory (anonymous and file-backed, from
/proc/self/status) and the bytes the engine counts (`StreamStats.held_bytes`). Each configuration runs in a child
process of its own, one torch thread. Reported: resident memory at each sample against the first sample's (frame
``--base``), and its growth per 1,000 frames over the run's second half.

    python benchmarks/evicting_memory.py --frames 6000 --out docs/benchmarks.md
    python benchmarks/evicting_memory.py --smoke     # a few hundred frames: seconds

With ``--files``, each sample also saves the stream (`Stream.save`, after its resident memory is read) and records
the file's size and, on the disk tier, the bytes its folder's files take on disk (allocated blocks: holes
excluded); these go to a table of their own.

With ``--asks``, each sample also asks a question of the whole cache five times (`Stream.ask`, two answer tokens)
and records the median CPU time of one (this process's, `time.process_time`, so other work on the machine does
not count): a question should cost what the stream holds, not its history.

With ``--address``, each sample also records the process's address space (``VmSize``) and the memory its page
tables take (``VmPTE``, not part of resident memory), from /proc/self/status: a buffer addressed by every token ever
streamed keeps growing both after its evicted pages went back to the OS. An evicting stream keeps its rows per
token in blocks (`statekv.core.storage.blocks`), which keeps their part flat, its keys' scales too; its step
summaries (17 keys a step) and segment index are packed, the rows of the steps it keeps alone
(`statekv.core.storage.compact`). The built-in model's frames are 4 tokens, so these were two thirds of its growth
here while they were one allocation each; at 256 tokens a frame they are about a thirtieth of what the rows per token
would be.
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

QUESTION = "How many times did the video show red?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer with the letter."
CONFIGS = {
    "memory": {"offload": True},
    "memory int8": {"offload": True, "kv_cache_dtype": "int8"},
    "disk": {"offload": "disk"},
}


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import statekv
    from long_stream import resident, status_bytes  # a sibling script, on the path as this one runs
    from statekv.errors import CacheLimitError

    torch.set_num_threads(1)
    settings = dict(CONFIGS[args.child])
    with tempfile.TemporaryDirectory() as folder:
        if settings["offload"] == "disk":
            settings["offload_dir"] = folder
        qa = statekv.VideoQA.from_pretrained("builtin", budget=64, max_cache_bytes=args.cap,
                                             cache_limit="evict-oldest", **settings)
        frames = [np.random.default_rng(n).integers(0, 256, (16, 16, 3), dtype=np.uint8) for n in range(50)]
        stream = qa.stream()
        try:
            for number in range(1, args.frames + 1):
                stream.push(frames[number % len(frames)], timestamp=float(number - 1))
                if number == args.base or number % args.every == 0:
                    sample = {"frame": number, **resident(), "held_bytes": stream.prefill.stats.held_bytes}
                    if args.files:
                        sample.update(files(stream, folder, settings["offload"] == "disk"))
                    if args.asks:
                        sample["ask_cpu_ms"] = ask_cpu_ms(stream)
                    if args.address:  # the address space and page tables
                        sample.update(status_bytes("VmSize", "VmPTE"))
                    print(json.dumps(sample), flush=True)
        except CacheLimitError as error:  # what the cap counts outgrew it
            print(json.dumps({"frame": number, "refused": str(error)}), flush=True)


def files(stream, folder: str, disk: bool) -> dict:
    """The size of the stream's file saved now, and on the disk tier the bytes its files take on disk."""
    with tempfile.TemporaryDirectory() as saves:
        saved = stream.save(Path(saves) / "stream.safetensors").stat().st_size
    on_disk = sum(path.stat().st_blocks * 512 for path in Path(folder).rglob("*") if path.is_file())
    return {"saved_bytes": saved, **({"disk_bytes": on_disk} if disk else {})}


def ask_cpu_ms(stream) -> float:
    """The median CPU time of five questions of the whole cache, in milliseconds."""
    spent = []
    for _ in range(5):
        started = time.process_time()
        stream.ask(QUESTION, max_new_tokens=2)
        spent.append(time.process_time() - started)
    return 1000 * statistics.median(spent)


def run(name: str, args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, __file__, "--child", name, "--frames", str(args.frames), "--cap", str(args.cap),
               "--every", str(args.every), "--base", str(args.base), *(["--files"] if args.files else []),
               *(["--asks"] if args.asks else []), *(["--address"] if args.address else [])]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    frames = sorted({sample["frame"] for samples in results.values() for sample in samples if "VmRSS" in sample})
    lines = ["| configuration | " + " | ".join(f"frame {f:,}" for f in frames) + " | per 1,000 frames, second half |",
             "|---|" + "---:|" * (len(frames) + 1)]
    for name, samples in results.items():
        measured = [s for s in samples if "VmRSS" in s]
        base = measured[0]["VmRSS"]
        cells = {s["frame"]: f"{(s['VmRSS'] - base) / 2**20:+.1f} MB" for s in measured}
        refused = [s["frame"] for s in samples if "refused" in s]
        half = [s for s in measured if s["frame"] >= args.frames // 2]
        slope = "–"
        if len(half) >= 2:
            growth = (half[-1]["VmRSS"] - half[0]["VmRSS"]) / 2**20 / max(half[-1]["frame"] - half[0]["frame"], 1)
            slope = f"{growth * 1000:+.2f} MB"
        row = [cells.get(f, f"refused at frame {refused[0]:,}" if refused and f >= refused[0] else "–") for f in frames]
        lines.append(f"| {name} | " + " | ".join(row) + f" | {slope} |")
    held = max(s["held_bytes"] for samples in results.values() for s in samples if "held_bytes" in s)
    before = ("\n\nRows marked before: the same command on the code before evicted rows were given back as runs of them"
              " cover whole pages (`--before`)." if any(name.endswith(", before") for name in results) else "")
    return ("\n".join(lines) + f"\n\nMost bytes the engine counted at a sample, any configuration: {held:,} (cap "
            f"{args.cap:,}).{before} What still grows is not the cache: each frame's timings (kept for the last 10,000 "
            "to 20,000 frames) and each step's records (the last steps), and per step a few dozen bytes of "
            "bookkeeping (which steps were evicted, each step's length).")


def sample_table(results: dict[str, list[dict]], field: str, cell) -> list[str]:
    """A markdown table, a row per configuration and a column per sample holding ``field``: ``cell(sample, first)``
    (``first``: the row's first such sample)."""
    frames = sorted({s["frame"] for samples in results.values() for s in samples if field in s})
    lines = ["| configuration | " + " | ".join(f"frame {f:,}" for f in frames) + " |", "|---|" + "---:|" * len(frames)]
    for name, samples in results.items():
        measured = [s for s in samples if field in s]
        if measured:
            cells = {s["frame"]: cell(s, measured[0]) for s in measured}
            lines.append(f"| {name} | " + " | ".join(cells.get(f, "–") for f in frames) + " |")
    return lines


def before_note(results: dict[str, list[dict]], what: str) -> str:
    """What rows marked before are (``what``: the code before), when there are any."""
    return (f" Rows marked before: the same command on the code before {what} (`--before`)."
            if any(name.endswith(", before") for name in results) else "")


def files_table(results: dict[str, list[dict]]) -> str:
    """The saved file's size and the disk tier's bytes on disk at each sample (runs with ``--files``)."""
    lines = sample_table(results, "saved_bytes", lambda s, _: f"{s['saved_bytes'] / 1e6:.2f} MB" + (
        f" / {s['disk_bytes'] / 1e6:.2f} MB" if "disk_bytes" in s else ""))
    before = before_note(results, "a saved stream kept its per-step lists as runs, in stream format 2")
    return ("\n".join(lines) + "\n\nEach cell: the saved file's size (`Stream.save`), and for the disk tier / the "
            f"bytes its folder's files take on disk (allocated blocks).{before} What grows until frame 10,000 to "
            "20,000 is each frame's timings, kept for the last 10,000 to 20,000 frames; a file's per-step lists are "
            "runs (stream format 3), a few whatever the stream's age.")


def asks_table(results: dict[str, list[dict]]) -> str:
    """A question's CPU time at each sample (runs with ``--asks``), against its first sample's."""
    lines = sample_table(results, "ask_cpu_ms", lambda s, first: f"{s['ask_cpu_ms'] / first['ask_cpu_ms']:.2f}x")
    before = before_note(results, "a stream kept its evicted steps as runs, when a question walked every step ever "
                                  "evicted")
    return "\n".join(lines) + ("\n\nEach cell: the median CPU time of one question of the whole cache, against the "
                               f"row's first sample (a ratio measured in one run).{before}")


def address_table(results: dict[str, list[dict]]) -> str:
    """The address space and page tables at each sample (runs with ``--address``), against the first sample's."""
    lines = sample_table(results, "VmSize", lambda s, first: (
        f"{(s['VmSize'] - first['VmSize']) / 2**20:+,.0f} MB / {(s['VmPTE'] - first['VmPTE']) / 2**10:+,.0f} kB"))
    before = before_note(results, "an evicting stream kept its rows per step (step summaries, segment index, key "
                                  "scales) for the steps it holds alone: one allocation each, addressed by every "
                                  "step streamed (its rows per token were in blocks already)")
    return "\n".join(lines) + ("\n\nEach cell: the growth of the address space (VmSize) / of the page tables (VmPTE) "
                               f"since the row's first sample.{before}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=6000)
    parser.add_argument("--cap", type=int, default=3_000_000, help="max_cache_bytes")
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--base", type=int, default=200, help="the first sample's frame")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, help="write the table into this markdown file's section")
    parser.add_argument("--json", type=Path, help="write every sample here")
    parser.add_argument("--from-json", type=Path, help="render the samples a run wrote with --json (no streaming)")
    parser.add_argument("--before", type=Path, help="samples (--json) of the same run on earlier code, shown beside")
    parser.add_argument("--smoke", action="store_true", help="400 frames, a sample every 100")
    parser.add_argument("--files", action="store_true",
                        help="also save the stream at each sample: the file's size, and the disk tier's bytes on disk")
    parser.add_argument("--asks", action="store_true",
                        help="also ask a question of the whole cache at each sample: its CPU time")
    parser.add_argument("--address", action="store_true",
                        help="also record the address space and page tables at each sample")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.frames, args.every, args.base = 400, 100, 50
    if args.child:
        return child(args)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        results = {}
        for name in args.configs.split(","):
            results[name] = run(name, args)
            print(f"{name}: done", file=sys.stderr, flush=True)
    if args.before:
        results = {**{f"{name}, before": samples for name, samples in json.loads(args.before.read_text()).items()},
                   **results}
    body = table(results, args)
    print(body)
    saved = files_table(results) if any("saved_bytes" in s for samples in results.values() for s in samples) else ""
    if saved:
        print("\n" + saved)
    asked = asks_table(results) if any("ask_cpu_ms" in s for samples in results.values() for s in samples) else ""
    if asked:
        print("\n" + asked)
    mapped = address_table(results) if any("VmSize" in s for samples in results.values() for s in samples) else ""
    if mapped:
        print("\n" + mapped)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.out:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_section

        flags = (f"--frames {args.frames} --cap {args.cap} --every {args.every} --base {args.base}"
                 + (" --files" if args.files else "") + (" --asks" if args.asks else "")
                 + (" --address" if args.address else "")
                 + (f" --configs {shlex.quote(args.configs)}" if args.configs != ",".join(CONFIGS) else ""))
        command = f"python benchmarks/evicting_memory.py {flags} --out {args.out}"
        if args.before:  # "before": the same command on earlier code, its samples written with --json
            command = (f"python benchmarks/evicting_memory.py {flags} --json NEW`, "
                       f"the same at the code before (--json BEFORE), then `python benchmarks/evicting_memory.py "
                       f"--from-json NEW --before BEFORE {flags} --out {args.out}")
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, one torch thread a configuration, each in a process"
        title, part, shown = (("Evicting streams: address space", 5, mapped) if mapped else
                              ("Evicting streams: questions", 4, asked) if asked else
                              ("Evicting streams: saved files and disk use", 3, saved) if saved else
                              ("Evicting streams: resident memory", 1, body))
        about = (__doc__ or "").split(chr(10) + chr(10))[part].strip()
        write_section(args.out, title, f"{about}\n\nCommand: `{command}`  \nMachine: {machine}.\n\n{shown}")


if __name__ == "__main__":
    main()
