"""What the handover's replay costs live cameras, with and without quiet moments replaying it.

A bounded stream keeps each step's embeddings until it passes the model's range; its successor engine then
replays them all (`statekv.api.handover`). In a server that replay either happens whole in the push that passes
the range, a pause for every camera stepped with it (``statekv serve --no-quiet-catch-up``), or a step at a time
whenever no push or question waits, once a stream has taken half the range (the default, `statekv.serve.worker`).
This starts ``statekv serve``'s application on the built-in model (`statekv.bench.InProcessServer`) once each way
and loads it with ``statekv bench serve --url`` in its own process: ``--streams`` cameras at ``--fps`` for
``--duration`` seconds, long enough for every camera to pass the range (the built-in model's: about 770 frames),
and reports the lag behind real time (p50, p95, p99, max), TTFT and goodput (the cameras held at real time with
their TTFT under its target, `statekv bench serve`'s) per run, the two runs taken in turn ``--repeats`` times.

    python benchmarks/quiet_catch_up.py --out docs/serving.md
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from report import write_section  # noqa: E402

TITLE = "Runs of benchmarks/quiet_catch_up.py"
QUIET = "statekv_quiet_catch_up_steps"
FIELDS = ("frames_per_s", "lag_p50_s", "lag_p95_s", "lag_p99_s", "lag_max_s", "ttft_p50_s", "ttft_p99_s", "failures",
          "mean_batch", "goodput_streams")


def run_once(qa, quiet: bool, streams: int, args, folder: Path) -> dict:
    """One load run of ``streams`` cameras against a server replaying backlogs in quiet moments (``quiet``) or
    not."""
    from statekv.bench.server import InProcessServer, metric_totals

    out = folder / f"{'quiet' if quiet else 'at-range'}-{time.monotonic_ns()}.json"
    with InProcessServer(qa, quiet_catch_up=quiet) as server:
        command = [sys.executable, "-m", "statekv.cli", "bench", "serve", "--url", server.url, "--api-key",
                   server.key, "--streams", str(streams), "--fps", str(args.fps), "--duration",
                   str(args.duration), "--json", str(out), "--quiet"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        replayed = (metric_totals(server.url, QUIET, (f"{QUIET}_total",)) or {}).get(f"{QUIET}_total")
    if result.returncode != 0:
        raise RuntimeError(f"statekv bench serve exited {result.returncode}: {result.stderr.strip()[-300:]}")
    row = json.loads(out.read_text())["results"][0]
    return {**{name: row[name] for name in FIELDS}, "quiet_catch_up_steps": replayed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[2], help="camera counts, one pair of runs each")
    parser.add_argument("--fps", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=100.0, help="seconds of each run (past the range: > 80)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args()
    import statekv

    qa = statekv.VideoQA.from_pretrained("builtin")
    load = os.getloadavg()[0]
    runs: dict[tuple[int, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="statekv-quiet-") as folder:
        for streams in args.streams:
            for repeat in range(args.repeats):
                for quiet in (False, True):  # in turn: the machine's load falls on both alike
                    runs.setdefault((streams, quiet), []).append(run_once(qa, quiet, streams, args, Path(folder)))
                    print(f"{streams} cameras, repeat {repeat}, quiet={quiet}: {runs[streams, quiet][-1]}", flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
               f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    counts = " ".join(str(streams) for streams in args.streams)
    lines = [f"Command: `python benchmarks/quiet_catch_up.py --streams {counts} --fps {args.fps:g} --duration "
             f"{args.duration:g} --repeats {args.repeats}`. Machine: {machine}. Each run: `statekv bench serve --url "
             f"... --streams N --fps {args.fps:g} --duration {args.duration:g}` against the built-in model's server, "
             "every camera passing the range.", "",
             "| cameras | server | run | frames/s | lag p50 (s) | lag p95 (s) | lag p99 (s) | lag max (s) | TTFT p50 (s) | "
             "TTFT p99 (s) | goodput (cameras held) | failed | steps replayed in quiet moments |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    for (streams, quiet), rows in runs.items():
        name = "quiet moments replay (default)" if quiet else "`--no-quiet-catch-up`"
        for index, row in enumerate(rows):
            lines.append(f"| {streams} | {name} | {index + 1} | {row['frames_per_s']:.1f} | " + " | ".join(
                cell(row[field]) for field in ("lag_p50_s", "lag_p95_s", "lag_p99_s", "lag_max_s", "ttft_p50_s",
                                               "ttft_p99_s")) + f" | {row['goodput_streams']} | {row['failures']} | "
                         f"{'-' if row['quiet_catch_up_steps'] is None else int(row['quiet_catch_up_steps'])} |")
    body = "\n".join(lines)
    print(body)
    if args.out is not None:
        write_section(args.out, TITLE, body, level=3)


if __name__ == "__main__":
    main()
