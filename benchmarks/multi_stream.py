"""Many streams on one model: frames pushed to S streams at once, batched (`VideoQA.push_many`: one vision call,
one language-model forward per round of steady steps) against the same streams stepped one after another
(`Stream.push` in turn), measured in one run; then a question to each of the S streams, asked together
(`VideoQA.ask_many`: one forward for all the prompts, one per answer token) against asked one after another
(`Stream.ask` in turn).

Every stream is first brought to its steady state (its carried state full), then each variant pushes the same
frames to its own S streams; the variants alternate ``--repeats`` times and the median is reported. The questions
are asked of the batched variant's streams afterwards, the two ways alternating ``--repeats`` times; their
answers are checked equal.

    python benchmarks/multi_stream.py --out docs/benchmarks.md                      # CPU, the built-in model
    python benchmarks/multi_stream.py --model OpenGVLab/InternVL3-1B-hf --device cuda --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
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
from report import write_section  # noqa: E402

TITLE = "Many streams on one model"
QUESTION = ("What colour was the circle?", ("red", "green", "blue", "yellow"))


def frames(count: int, seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def make_streams(qa: statekv.VideoQA, count: int, horizon: int, warmup: np.ndarray) -> list[statekv.Stream]:
    streams = [qa.stream(horizon_frames=horizon, name=f"stream{index}") for index in range(count)]
    for tick, image in enumerate(warmup):  # to the steady state, batched (what it costs is not measured)
        qa.push_many([(stream, image, float(tick)) for stream in streams])
    return streams


def synchronize(qa: statekv.VideoQA) -> None:
    if qa.adapter.device.type == "cuda":
        torch.cuda.synchronize(qa.adapter.device)


def one_after_another(qa, streams, video: np.ndarray, start: int) -> float:
    synchronize(qa)
    started = time.perf_counter()
    for tick, image in enumerate(video, start=start):
        for stream in streams:
            stream.push(image, float(tick))
    synchronize(qa)
    return time.perf_counter() - started


def batched(qa, streams, video: np.ndarray, start: int) -> float:
    synchronize(qa)
    started = time.perf_counter()
    for tick, image in enumerate(video, start=start):
        qa.push_many([(stream, image, float(tick)) for stream in streams])
    synchronize(qa)
    return time.perf_counter() - started


def ask_both_ways(qa, streams, args) -> dict[str, float]:
    """Median seconds to answer one question of each of ``streams`` asked one after another and together (at most
    ``--answer-tokens`` tokens each), after one untimed round of each, the two ways taking turns at going first;
    their answers must be equal."""
    from statekv.synthetic.prompts import question_prompt

    question, options = question_prompt(*QUESTION), {"max_new_tokens": args.answer_tokens}

    def asked() -> list[str]:
        return [stream.ask(question, **options) for stream in streams]

    def together() -> list[str]:
        return qa.ask_many([(stream, question, options) for stream in streams])

    ways = {"asked": asked, "together": together}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(args.repeats + 1):
        answers = {}
        for name in (("asked", "together") if repeat % 2 else ("together", "asked")):
            synchronize(qa)
            started = time.perf_counter()
            answers[name] = ways[name]()
            synchronize(qa)
            if repeat:  # the first round warms both up
                times[name].append(time.perf_counter() - started)
        if answers["together"] != answers["asked"]:
            raise SystemExit(f"questions asked together answered {answers['together']}, one after another "
                             f"{answers['asked']}")
    return {name: statistics.median(values) for name, values in times.items()}


def measure(qa, count: int, args) -> dict[str, float]:
    warmup = frames(args.warmup, 1, args.size)
    video = frames(args.frames, 2, args.size)
    horizon = args.warmup + args.frames * args.repeats
    serial_streams = make_streams(qa, count, horizon, warmup)
    batch_streams = make_streams(qa, count, horizon, warmup)
    steady = all(stream.prefill.stats.forms[0] != "window" for stream in batch_streams)
    times: dict[str, list[float]] = {"serial": [], "batched": []}
    before = qa.step_scheduler.batched_rows
    for repeat in range(args.repeats):
        start = args.warmup + repeat * args.frames
        times["serial"].append(one_after_another(qa, serial_streams, video, start))
        times["batched"].append(batched(qa, batch_streams, video, start))
    rows = qa.step_scheduler.batched_rows - before
    asked = ask_both_ways(qa, batch_streams, args)
    for stream in serial_streams + batch_streams:
        stream.close()
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update(asked)
    result["batched_share"] = rows / (count * args.frames * args.repeats) if count > 1 else 0.0
    result["steady"] = steady
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--device", default=None)
    parser.add_argument("--method", default="statekv")
    parser.add_argument("--budget", type=int, default=64, help="StateKV budget in tokens (default 64)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--frames", type=int, default=16, help="frames pushed to each stream per repeat")
    parser.add_argument("--warmup", type=int, default=24, help="frames pushed first (to the steady state)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=64, help="frame side in pixels")
    parser.add_argument("--answer-tokens", type=int, default=4, help="most tokens of each answer (default 4)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine more threads than idle cores stall)")
    parser.add_argument("--out", default=None, help=f"markdown file whose '{TITLE}' section is replaced")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from statekv.settings.methods import method

    options = dict(method=args.method)
    if "budget" in method(args.method).uses:  # a size the method does not read is refused
        options["budget"] = args.budget
    if args.device:
        options["device"] = args.device
    qa = statekv.VideoQA.from_pretrained(args.model, **options)
    rows = []
    for count in args.streams:
        result = measure(qa, count, args)
        pushed = count * args.frames
        row = (count, pushed / result["serial"], pushed / result["batched"],
               1e3 * result["serial"] / args.frames, 1e3 * result["batched"] / args.frames,
               result["batched"] / result["serial"], result["batched_share"], result["steady"],
               1e3 * result["asked"] / count, 1e3 * result["together"] / count, result["together"] / result["asked"])
        rows.append(row)
        print(f"{count:2d} streams: serial {row[1]:.1f} frames/s, batched {row[2]:.1f} frames/s, "
              f"batched/serial time {row[5]:.2f}; questions together/one after another {row[10]:.2f}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = qa.adapter.device
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s), "
               f"torch {torch.__version__}; device {device}"
               + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
               + f"; load average {load:.1f} at the end")
    lines = [f"Command: `python benchmarks/multi_stream.py {shlex.join(sys.argv[1:])}`  ",
             f"Machine: {machine}.  ",
             f"Model: {args.model} ({qa.adapter.family}, {qa.adapter.dtype}), method {args.method}"
             + (f" (budget {args.budget} tokens)" if "budget" in options else "") + f", {args.size}x{args.size} "
             "frames; each stream first pushed "
             f"{args.warmup} frames (to its steady state), then {args.frames} frames per variant and repeat; "
             f"median of {args.repeats} alternating repeats.", "",
             "| streams | frames/s one after another | frames/s batched | ms per frame per stream, one after "
             "another | ms per frame per stream, batched | batched / one-after-another time | steps batched |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for count, serial_fps, batch_fps, serial_ms, batch_ms, ratio, share, *_ in rows:
        lines.append(f"| {count} | {serial_fps:.1f} | {batch_fps:.1f} | {serial_ms:.1f} | {batch_ms:.1f} | "
                     f"{ratio:.2f} | {100 * share:.0f}% |")
    lines += ["", "ms per frame per stream: the wall time of one round (one frame to every stream); frames/s: "
              "frames of all streams per second. Steps batched: the share of the batched variant's steps that "
              "ran in a forward with other streams.", "",
              "Then one question to each stream (a four-option question, at most "
              f"{args.answer_tokens} answer tokens, read "
              "from the whole detailed cache), asked one after another (`Stream.ask`) and together "
              "(`VideoQA.ask_many`), the same answers both ways:", "",
              "| streams | ms per question, one after another | ms per question, together | together / one after "
              "another time |", "|---:|---:|---:|---:|"]
    for count, *_, asked_ms, together_ms, asked_ratio in rows:
        lines.append(f"| {count} | {asked_ms:.1f} | {together_ms:.1f} | {asked_ratio:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_section(Path(args.out), TITLE, "\n".join(lines))


if __name__ == "__main__":
    main()
