"""What a stream that never ends keeps in the Python heap per frame, besides its cache: the bytes still held after
N more frames, measured over two windows so that what stays the same size (the last step's transient objects)
drops out of the slope.

A tiny InternVL (real architecture, 3 layers, 1,048,576 positions: no horizon, bounded positions), StateKV B=64,
frames of 112x112, one frame a step, on the disk tier with int4 under a cap that evicts the oldest steps (evicting
from about the 400th frame on): what a camera streamed for weeks runs. Python's `tracemalloc` counts every
allocation still alive after ``--warm`` frames plus each window (a full `gc.collect` first); the slope between the
two windows is the growth per frame. Two lists that are bounded anyway, the last steps' records
(`statekv.core.stream.prefill.HISTORY_STEPS`) and the last frames' times (`statekv.api.stats.TIMES_KEPT`), are
shortened to 50 and 100 entries, so that windows of a few thousand frames show only what grows for good.

    python benchmarks/step_bookkeeping.py --json runs/step_bookkeeping.json

``--values N`` measures one `StepValues` of N values instead, no model: an irregular one (each step's length drawn
at random, as under a varying frame rate or tokens per frame) and a steady one; the bytes a value it holds
(`tracemalloc`, after building it), and the best of a few timings of `tensor()`, of a slice of all but its first
and last 10 values, and of ``tuple()`` of it. Run it on earlier code from an export of that commit
(``PYTHONPATH=<export>``) to compare.

    python benchmarks/step_bookkeeping.py --values 100000 --json runs/step_values.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch


def held_after(stream, frames, start: int, count: int) -> int:
    """Bytes the Python heap holds more after pushing ``count`` more frames (from frame ``start``)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for index in range(start, start + count):
        stream.push(frames[index % len(frames)], timestamp=float(index))
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


def best_ms(work, repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs of ``work()``, in milliseconds."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return 1000 * min(times)


def values_cost(count: int) -> dict:
    """What a `StepValues` of ``count`` values holds and costs to read, irregular and steady."""
    from statekv.core.storage.step_values import StepValues

    rng = random.Random(0)
    shapes = {"irregular": [rng.randrange(100, 400) for _ in range(count)], "steady": [3] + [260] * (count - 1)}
    result = {}
    for shape, values in shapes.items():
        gc.collect()
        tracemalloc.start()
        kept = StepValues()
        for value in values:
            kept.append(value)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert kept.tensor().tolist() == values and kept[10:-10] == values[10:-10]
        result[shape] = {"bytes_per_value": held / count, "tensor_ms": best_ms(kept.tensor),
                         "slice_ms": best_ms(lambda: kept[10:-10]), "tuple_ms": best_ms(lambda: tuple(kept)),
                         "dense": getattr(kept, "dense", None)}
        print(f"{shape}: {result[shape]}", file=sys.stderr)
    return {"values": count, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=1200, help="frames pushed before measuring")
    parser.add_argument("--cap", default="4MB", help="the stream's max_cache_bytes (it evicts the oldest steps)")
    parser.add_argument("--windows", default="1200,3000", help="two window lengths, in frames")
    parser.add_argument("--values", type=int, help="measure one StepValues of this many values instead (no model)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    if args.values:
        torch.set_num_threads(1)
        write({**values_cost(args.values), "torch": torch.__version__}, args.json)
        return
    short, long = (int(n) for n in args.windows.split(","))
    torch.set_num_threads(1)
    import statekv
    import statekv.api.stats
    import statekv.core.stream.prefill

    statekv.core.stream.prefill.HISTORY_STEPS, statekv.api.stats.TIMES_KEPT = 50, 100
    from statekv.testing.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint("internvl", Path(folder) / "model",
                                          text_config={"max_position_embeddings": 1 << 20},
                                          vision_config={"image_size": 112})
        qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=64, attention="eager",
                                             offload="disk", offload_dir=str(Path(folder) / "disk"),
                                             kv_cache_dtype="int4", max_cache_bytes=args.cap,
                                             cache_limit="evict-oldest")
        frames = np.random.default_rng(1).integers(0, 256, (50, 112, 112, 3), dtype=np.uint8)
        result = {}
        for window in (short, long):
            with qa.stream(vision_batch=1) as stream:
                for index in range(args.warm):
                    stream.push(frames[index % len(frames)], timestamp=float(index))
                tracemalloc.start()
                result[window] = held_after(stream, frames, args.warm, window)
                tracemalloc.stop()
                evicted = stream.stats.evicted_frames
            print(f"{window} frames: {result[window]} bytes more held ({evicted} frames evicted)", file=sys.stderr)
    slope = (result[long] - result[short]) / (long - short)
    summary = {"warm": args.warm, "cap": args.cap, "windows": {str(k): v for k, v in result.items()},
               "bytes_per_frame": slope,
               "torch": torch.__version__}
    write(summary, args.json)


def write(summary: dict, path: Path | None) -> None:
    """Print ``summary`` as one JSON line, and write it to ``path`` when given."""
    print(json.dumps(summary))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
