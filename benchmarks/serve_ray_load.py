"""Aggregate frames per second and ask latency of `statekv serve --ray` with one and with two replicas.

A Ray cluster of this machine alone (127.0.0.1, no dashboard) is started for the run and shut down after it.
For each replica count the service is started on it (`statekv serve --ray ADDRESS --replicas N`), warmed up,
then loaded exactly as `benchmarks/serve_load.py` loads one server: each of S clients creates its own stream and
pushes ``--frames`` PNG frames, asking a question after every ``--ask-every`` frames, all clients at once, each as
fast as the service answers. New streams are placed on the least-loaded replica, so S streams are spread evenly.
Reported per replica count and S: aggregate frames/s (every frame of every client over the wall time of the
run, questions included) and p50 / p99 of a question's time to its whole answer, as the client sees it. The same
load on `statekv serve` alone (one process, no Ray, as many threads as a replica has CPUs) is the first row, for
what Ray Serve's proxy adds.

    python benchmarks/serve_ray_load.py --out docs/serving.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402
from serve_load import KEY, percentile, run_client, start_server  # noqa: E402

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
               "--api-key", KEY, "--model", args.model, "--max-streams", "64", "--max-asks", "64", "--no-page"]
    if args.device:
        command += ["--device", args.device]
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


def _load(url: str, args, count: int) -> tuple[float, float, float, int]:
    """(aggregate frames/s, ask p50 ms, ask p99 ms, asks) of ``count`` clients at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda seed: run_client(url, seed, args.frames, args.ask_every, args.new_tokens),
                                range(1, count + 1)))
    wall = time.perf_counter() - started
    latencies = [value for result in results for value in result]
    return (count * args.frames / wall, 1e3 * statistics.median(latencies), 1e3 * percentile(latencies, 0.99),
            len(latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--device", default=None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--frames", type=int, default=16, help="frames each client pushes (default: 16)")
    parser.add_argument("--ask-every", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--out", default=None, help="markdown file whose 'Measured load on Ray' section is replaced")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tempfile.mkdtemp(prefix="skv-ray-", dir="/tmp")
    cpus = max(2, int(max(args.replicas) * args.replica_cpus + 0.999))
    head = subprocess.Popen([sys.executable, "-c", CLUSTER, temp, str(cpus)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    rows = []
    try:
        threads = str(max(1, int(args.replica_cpus)))
        alone = dict(os.environ, OMP_NUM_THREADS=threads, PYTHONPATH=str(REPO))
        with tempfile.TemporaryDirectory() as folder:
            process, url = start_server(args, Path(folder), alone)
            try:
                run_client(url, 0, args.ask_every, args.ask_every, args.new_tokens)  # warm-up
                for count in args.streams:
                    rows.append(("alone", count, *_load(url, args, count)))
                    print(f"alone, {count:2d} streams: {rows[-1][2]:.1f} frames/s", flush=True)
            finally:
                process.terminate()
                process.wait(timeout=60)
        address = json.loads(head.stdout.readline())["address"]
        for replicas in args.replicas:
            with tempfile.TemporaryDirectory() as folder:
                process, url = _serve(args, env, address, replicas, Path(folder) / "state")
                try:
                    with ThreadPoolExecutor(replicas) as pool:  # warm-up: a stream on every replica
                        list(pool.map(lambda seed: run_client(url, seed, args.ask_every, args.ask_every,
                                                           args.new_tokens), range(replicas)))
                    for count in args.streams:
                        rows.append((replicas, count, *_load(url, args, count)))
                        print(f"{replicas} replicas, {count:2d} streams: {rows[-1][2]:.1f} frames/s, ask p50 "
                              f"{rows[-1][3]:.0f} ms, p99 {rows[-1][4]:.0f} ms", flush=True)
                finally:
                    process.send_signal(signal.SIGINT)
                    process.wait(timeout=120)
    finally:
        head.stdin.close()
        head.wait(timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    lines = [f"`python benchmarks/serve_ray_load.py {' '.join(sys.argv[1:])}` on {machine}, a Ray cluster of this "
             f"machine alone (model {args.model}, each replica {args.replica_cpus:g} CPU, {args.frames} frames of "
             f"224x224 per stream, a question of {args.new_tokens} new tokens every {args.ask_every} frames; "
             f"replicas \"alone\": `statekv serve` without Ray, {threads} thread{'s' * (threads != '1')}):", "",
             "| replicas | streams | aggregate frames/s | ask p50 (ms) | ask p99 (ms) | asks |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r} | {c} | {fps:.1f} | {p50:.0f} | {p99:.0f} | {n} |" for r, c, fps, p50, p99, n in rows]
    print("\n".join(lines))
    if args.out:
        write_section(Path(args.out), "Measured load on Ray", "\n".join(lines))


if __name__ == "__main__":
    main()
