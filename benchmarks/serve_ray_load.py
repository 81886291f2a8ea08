"""`statekv bench serve` against `statekv serve --ray` with one and with two replicas, and against a server alone.

A Ray cluster of this machine alone (127.0.0.1, no dashboard) is started for the run and shut down after it.
For each replica count the service is started on it (`statekv serve --ray ADDRESS --replicas N`) and loaded by
``statekv bench serve --url`` exactly as a server alone is (live cameras at ``--fps``, questions as a Poisson
process, open loop; docs/serving.md, "Measured load"); new streams are placed on the least-loaded replica, so the
cameras are spread evenly. The same load on `statekv serve` alone (started by ``statekv bench serve --model``, as
many torch threads as a replica has CPUs) is the first row, for what Ray Serve's proxy adds.

    python benchmarks/serve_ray_load.py --out docs/serving.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

KEY = "benchmark-key"
REPO = Path(__file__).resolve().parents[1]
CLUSTER = """
import json, sys, ray
context = ray.init(include_dashboard=False, num_cpus=int(sys.argv[2]), _temp_dir=sys.argv[1], log_to_driver=False)
print(json.dumps({"address": context.address_info["gcs_address"]}), flush=True)
sys.stdin.read()
ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(args, env: dict, address: str, replicas: int, state: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "statekv.cli", "serve", "--ray", address, "--replicas", str(replicas),
               "--replica-cpus", str(args.replica_cpus), "--port", str(port), "--state-dir", str(state),
               "--api-key", KEY, "--model", args.model, "--max-streams", "256", "--max-asks", "1024", "--no-page"]
    log = open(state.parent / f"serve-{replicas}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(1200):
        if "ready (pid" in Path(log.name).read_text():
            return process, f"http://127.0.0.1:{port}"
        if process.poll() is not None:
            break
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the service did not start:\n{Path(log.name).read_text()[-2000:]}")


def _bench(args, env: dict, *target: str) -> list[dict]:
    """``statekv bench serve`` with the run's load against ``target`` (its server flags): its rows."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        command = [sys.executable, "-m", "statekv.cli", "bench", "serve", *target, "--streams",
                   ",".join(map(str, args.streams)), "--fps", str(args.fps), "--duration", str(args.duration),
                   "--question-rate", str(args.question_rate), "--json", str(out), "--quiet"]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"statekv bench serve failed: {result.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--question-rate", type=float, default=0.1)
    parser.add_argument("--out", default=None, help="markdown file whose 'Measured load on Ray' section is replaced")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tempfile.mkdtemp(prefix="skv-ray-", dir="/tmp")
    cpus = max(2, int(max(args.replicas) * args.replica_cpus + 0.999))
    threads = str(max(1, int(args.replica_cpus)))
    loads = [" ".join(Path("/proc/loadavg").read_text().split()[:3])]
    rows = [("alone", row) for row in _bench(args, env, "--model", args.model, "--server-threads", threads)]
    print(f"alone: {[round(row['frames_per_s'], 1) for _, row in rows]} frames/s", flush=True)
    head = subprocess.Popen([sys.executable, "-c", CLUSTER, temp, str(cpus)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        address = json.loads(head.stdout.readline())["address"]
        for replicas in args.replicas:
            with tempfile.TemporaryDirectory() as folder:
                process, url = _serve(args, env, address, replicas, Path(folder) / "state")
                try:
                    for row in _bench(args, env, "--url", url, "--api-key", KEY):
                        rows.append((replicas, row))
                        print(f"{replicas} replicas, {row['streams']:2d} streams: {row['frames_per_s']:.1f} frames/s",
                              flush=True)
                finally:
                    process.send_signal(signal.SIGINT)
                    process.wait(timeout=120)
    finally:
        head.stdin.close()
        head.wait(timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    loads.append(" ".join(Path("/proc/loadavg").read_text().split()[:3]))
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    lines = [f"`python benchmarks/serve_ray_load.py {shlex.join(sys.argv[1:])}` on {machine} (load average {loads[0]} "
             f"before, {loads[1]} after), a Ray cluster of this machine alone: `statekv bench serve` (model "
             f"{args.model}, cameras at {args.fps:g} fps for {args.duration:g} s, {args.question_rate:g} questions "
             f"per second per camera) against `statekv serve --ray` with each replica on {args.replica_cpus:g} CPU, "
             f"and (replicas \"alone\") against `statekv serve` without Ray, {threads} torch "
             f"thread{'s' * (threads != '1')}:", "",
             "| replicas | streams | frames/s | lag p95 (s) | TTFT p50 (s) | TTFT p95 (s) | goodput streams | failed | "
             "mean batch |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shown = lambda value: "-" if value is None else f"{value:.3f}"  # noqa: E731
    for replicas, row in rows:
        batch = "-" if row["mean_batch"] is None else f"{row['mean_batch']:.2f}"
        lines.append(f"| {replicas} | {row['streams']} | {row['frames_per_s']:.1f} | {shown(row['lag_p95_s'])} | "
                     f"{shown(row['ttft_p50_s'])} | {shown(row['ttft_p95_s'])} | {row['goodput_streams']} | "
                     f"{row['failures']} | {batch} |")
    print("\n".join(lines))
    if args.out:
        write_section(Path(args.out), "Measured load on Ray", "\n".join(lines))


if __name__ == "__main__":
    main()
