"""What a server keeps of the streams it no longer holds: streams made and deleted, again and again, as a service
running for weeks sees them come and go.

This starts ``statekv serve``'s application on the built-in model (`statekv.bench.InProcessServer`, in this process)
and runs ``--cycles`` cycles over HTTP, one stream at a time: the stream is made, given a watch (a standing question
evaluated every two frames), pushed ``--frames`` frames, asked a question, its events feed opened and closed, and
deleted. Every ``--every`` cycles it counts what the process holds: open file descriptors, threads, resident memory
(before any collection: a server makes none of its own), the objects a full collection finds unreachable and frees
(a deleted stream held in a reference cycle would be among them) and those it tracks after it, with the server's
streams and the files left in its state folder, which must be none. A server that kept something of every stream
would grow by it in every row; what a bounded cache holds (Python's compiled patterns, the allocator's free lists)
stops growing.

    python benchmarks/serve_churn.py --cycles 1000 --every 200 --out docs/serving.md
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import platform
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from report import write_section  # noqa: E402

TITLE = "Runs of benchmarks/serve_churn.py"
QUESTION = "What colour is the object?"


def census(folder: Path) -> dict[str, int]:
    """What this process holds now (``folder``: the server's state folder, whose files are counted): its resident
    memory as a server that makes no collection of its own holds it, then the objects only a full collection frees
    (a deleted stream's, in a reference cycle, held till then) and those left tracked after it."""
    try:
        descriptors = len(os.listdir("/proc/self/fd"))
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak, not the current, resident memory
        descriptors = -1
        resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = sum(len(names) for _, _, names in os.walk(folder))
    collected = gc.collect()
    return {"descriptors": descriptors, "threads": threading.active_count(), "resident_mib": resident >> 20,
            "collected": collected, "objects": len(gc.get_objects()), "state_files": files}


def frames_png(count: int, size: int) -> list[bytes]:
    from PIL import Image

    rng, encoded = np.random.default_rng(0), []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        encoded.append(buffer.getvalue())
    return encoded


def cycle(client, frames: list[bytes]) -> None:
    """One stream's life: made, watched, pushed, asked, followed, deleted; any reply but the expected one raises."""
    def expect(reply, *statuses):
        if reply.status_code not in statuses:
            raise RuntimeError(f"{reply.request.method} {reply.request.url.path}: {reply.status_code} {reply.text}")
        return reply

    stream = expect(client.post("/v1/streams", json={"horizon_frames": 16, "max_fps": None}), 201).json()["id"]
    expect(client.post(f"/v1/streams/{stream}/watches", json={"question": QUESTION, "every": 2,
                                                                "max_new_tokens": 2}), 201)
    for frame in frames:
        expect(client.post(f"/v1/streams/{stream}/frames", content=frame, headers={"Content-Type": "image/png"}),
               200, 201, 202)
    expect(client.post(f"/v1/streams/{stream}/ask", json={"question": QUESTION, "max_new_tokens": 2}), 200)
    with client.stream("GET", f"/v1/streams/{stream}/events") as feed:
        expect(feed, 200)
    expect(client.delete(f"/v1/streams/{stream}"), 200, 204)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000, help="streams made and deleted, one after another")
    parser.add_argument("--every", type=int, default=200, help="cycles between two counts")
    parser.add_argument("--frames", type=int, default=4, help="frames pushed into each stream")
    parser.add_argument("--frame-size", type=int, default=64, help="frames' side in pixels")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args()
    if args.cycles < 1 or args.every < 1 or args.frames < 1:
        parser.error("--cycles, --every and --frames must be positive")
    import httpx
    import torch

    import statekv
    from statekv.bench.server import InProcessServer

    qa = statekv.VideoQA.from_pretrained("builtin")
    frames = frames_png(args.frames, args.frame_size)
    load, began = os.getloadavg()[0], time.monotonic()
    rows = []
    with InProcessServer(qa, max_streams=8) as server:
        state = Path(server.state_dir)
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"},
                          timeout=120) as client:
            for done in range(1, args.cycles + 1):
                cycle(client, frames)
                # the first stream loads what every later one shares: counted from there
                if done == 1 or done % args.every == 0 or done == args.cycles:
                    held = len(client.get("/v1/streams").json()["data"])
                    rows.append({"cycles": done, "streams_held": held, **census(state)})
                    print(rows[-1], flush=True)
    seconds = time.monotonic() - began
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python "
               f"{platform.python_version()} (load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    lines = [f"Command: `python benchmarks/serve_churn.py --cycles {args.cycles} --every {args.every} --frames "
             f"{args.frames}`. Machine: {machine}. {seconds:.0f} s. Each cycle: a stream made, a watch on it, "
             f"{args.frames} frames pushed, a question, its events feed opened and closed, the stream deleted.", "",
             "| streams made and deleted | streams held | files in the state folder | open descriptors | threads | "
             "resident MiB | freed by a collection | objects tracked |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['cycles']} | {row['streams_held']} | {row['state_files']} | "
                     f"{row['descriptors']} | {row['threads']} | {row['resident_mib']} | {row['collected']:,} | "
                     f"{row['objects']:,} |")
    body = "\n".join(lines)
    print(body)
    if args.out is not None:
        write_section(args.out, TITLE, body, level=3)


if __name__ == "__main__":
    main()
