"""Ask latency and aggregate frames per second of `statekv serve` with 1, 4 and 16 concurrent streams.

The server runs as its own process on a loopback port (the built-in model by default). Each of N clients
creates its own stream and pushes ``--frames`` PNG frames, asking a question after every ``--ask-every``
frames; clients run at once, each as fast as the server answers. Reported per N: aggregate frames/s (every
frame pushed by every client over the wall time of the whole run, questions included), and p50 / p99 of the
time from sending a question to its whole answer, as the client sees it.

    python benchmarks/serve_load.py --out docs/serving.md
    python benchmarks/serve_load.py --model builtin --device cuda --out docs/serving.md      # a GPU machine
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

KEY = "benchmark-key"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."


def png_frame(seed: int) -> bytes:
    image = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def start_server(args, state: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "statekv.cli", "serve", "--port", str(port), "--state-dir", str(state),
               "--api-key", KEY, "--model", args.model, "--max-streams", "64", "--max-asks", "64", "--no-page"]
    if args.device:
        command += ["--device", args.device]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**(env or os.environ), "PYTHONPATH": str(Path(__file__).parents[1])})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start")


def run_client(url: str, seed: int, frames: int, ask_every: int, new_tokens: int) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:
        stream = client.post("/v1/streams", json={"horizon_frames": frames, "max_fps": None}).json()["id"]
        for index in range(frames):
            client.post(f"/v1/streams/{stream}/frames?t={index}", content=png_frame(seed * 1000 + index),
                        headers={"Content-Type": "image/png"}).raise_for_status()
            if (index + 1) % ask_every == 0:
                started = time.perf_counter()
                client.post(f"/v1/streams/{stream}/ask", json={"question": QUESTION, "max_new_tokens": new_tokens}
                            ).raise_for_status()
                latencies.append(time.perf_counter() - started)
        client.delete(f"/v1/streams/{stream}").raise_for_status()
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--device", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--frames", type=int, default=16, help="frames each client pushes (default: 16)")
    parser.add_argument("--ask-every", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--out", default=None, help="markdown file whose 'Measured load' section is replaced")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        process, url = start_server(args, Path(state))
        try:
            run_client(url, 0, args.ask_every, args.ask_every, args.new_tokens)  # warm-up
            rows = []
            for count in args.streams:
                started = time.perf_counter()
                with ThreadPoolExecutor(count) as pool:
                    results = list(pool.map(lambda seed: run_client(url, seed, args.frames, args.ask_every,
                                                                  args.new_tokens), range(1, count + 1)))
                wall = time.perf_counter() - started
                latencies = [value for result in results for value in result]
                rows.append((count, count * args.frames / wall, 1e3 * statistics.median(latencies),
                             1e3 * percentile(latencies, 0.99), len(latencies)))
                print(f"{count:2d} streams: {rows[-1][1]:.1f} frames/s, ask p50 {rows[-1][2]:.0f} ms, "
                      f"p99 {rows[-1][3]:.0f} ms ({len(latencies)} asks)", flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores" + (f", {args.device}" if args.device else "")
    lines = [f"`python benchmarks/serve_load.py {' '.join(sys.argv[1:])}` on {machine} (model {args.model}, "
             f"{args.frames} frames of 224x224 per stream, a question of {args.new_tokens} new tokens every "
             f"{args.ask_every} frames):", "",
             "| streams | aggregate frames/s | ask p50 (ms) | ask p99 (ms) | asks |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {c} | {fps:.1f} | {p50:.0f} | {p99:.0f} | {n} |" for c, fps, p50, p99, n in rows]
    print("\n".join(lines))
    if args.out:
        write_section(Path(args.out), "Measured load", "\n".join(lines))


if __name__ == "__main__":
    main()
