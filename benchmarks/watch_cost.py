"""What watches cost a stream (`Stream.watch`): the built-in model streaming held-out synthetic videos with and
without four watches evaluated every four frames, and what one evaluation costs as the stream grows.

1. Per frame: a stream of ``--frames`` frames (held-out synthetic videos back to back) pushed alone, with four
   watches (four question families of the built-in model, evaluated every 4 frames, steering, and not steering),
   and with the same watches answering in one token; CPU seconds of this process per frame (``time.process_time``:
   a shared machine's other jobs do not count), the settings taking turns within each of ``--repeats`` rounds; the
   ratio to the stream alone with a 95% bootstrap interval over rounds.
2. Per evaluation: the four watches' evaluation (one batch) and the same four questions asked (`Stream.ask`, which
   reads the whole detailed cache), after streams of increasing length: an evaluation reads the carried state and
   the frames since the last one, so its cost stays flat; an ask's grows with the stream.

    python benchmarks/watch_cost.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402

HELD_OUT_SEED = 8181  # never used for anything else
EVERY = 4
QUESTIONS = (("How many times did the video show red?", ("1", "2", "3", "4")),
             ("What colour was the circle?", ("red", "green", "blue", "yellow")),
             ("Which came first, red or blue?", ("red", "green", "blue", "yellow")),
             ("What shape was shown in green?", ("circle", "square", "triangle", "star")))
SETTINGS = {"alone": None, "4 watches": {}, "4 watches, not steering": {"steer": False},
            "4 watches, one-token answers": {"max_new_tokens": 1}}
RESAMPLES = 2000


def frames_of(count: int) -> list[np.ndarray]:
    from statekv.synthetic.plans import plan_video
    from statekv.synthetic.scenes import render
    from statekv.synthetic.seeds import video_rng

    frames, video = [], 0
    while len(frames) < count:
        frames += [render(still) for still in plan_video(video_rng(HELD_OUT_SEED, video), 96).stills]
        video += 1
    return frames[:count]


def prompts() -> list[str]:
    from statekv.synthetic.prompts import question_prompt

    return [question_prompt(question, options) for question, options in QUESTIONS]


def per_frame(qa, frames: list[np.ndarray], settings: dict | None) -> float:
    """CPU seconds per frame of a stream pushed ``frames``, with the four watches (``settings``) or alone (None);
    the watches are opened after the first frame, which is not counted."""
    stream = qa.stream(max_fps=1)
    stream.push(frames[0], 0.0)
    if settings is not None:
        for prompt in prompts():
            stream.watch(prompt, every=EVERY, **settings)
    started = time.process_time()
    for index in range(1, len(frames)):
        stream.push(frames[index], float(index))
    spent = time.process_time() - started
    stream.close()
    return spent / (len(frames) - 1)


def per_evaluation(qa, frames: list[np.ndarray], lengths: list[int], repeats: int) -> list[tuple[int, int, float, float]]:
    """``(frames, tokens, evaluation ms, ask ms)`` after streams of each of ``lengths``: the four watches'
    evaluation as one batch, and the four questions asked, CPU milliseconds (median of ``repeats``)."""
    from statekv.api.watch import run_evaluations

    rows = []
    stream = qa.stream(max_fps=1)
    stream.push(frames[0], 0.0)
    watches = [stream.watch(prompt, steer=False) for prompt in prompts()]
    for length in lengths:
        for index in range(stream.frames, length):
            stream.push(frames[index], float(index))
        evaluations, asks = [], []
        for _ in range(repeats):
            started = time.process_time()
            run_evaluations(watches)
            evaluations.append(time.process_time() - started)
            started = time.process_time()
            for prompt in prompts():
                stream.ask(prompt, max_new_tokens=16)
            asks.append(time.process_time() - started)
        rows.append((stream.frames, stream.tokens, 1e3 * float(np.median(evaluations)), 1e3 * float(np.median(asks))))
    stream.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=192, help="frames per stream in the per-frame measure")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the per-frame measure")
    parser.add_argument("--lengths", default="96,384,1536", help="stream lengths of the per-evaluation measure")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="markdown file to write the ## Watches section into")
    args = parser.parse_args(argv)

    import statekv

    torch.set_num_threads(args.threads)
    qa = statekv.VideoQA.from_pretrained("builtin")
    lengths = [int(length) for length in args.lengths.split(",")]
    frames = frames_of(max(args.frames, *lengths))
    per_frame(qa, frames[:24], {})  # warm-up: first calls, allocations
    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_ in range(args.repeats):
        for name, settings in SETTINGS.items():
            seconds[name].append(per_frame(qa, frames[:args.frames], settings))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {1e3 * values[-1]:.2f} ms" for name, values in
                                                   seconds.items()), file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    alone = np.array(seconds["alone"])
    rows = []
    for name, values in seconds.items():
        values = np.array(values)
        ratios = [float(np.mean(values[pick]) / np.mean(alone[pick]))
                  for pick in (rng.integers(len(values), size=len(values)) for _ in range(RESAMPLES))]
        low, high = np.percentile(ratios, [2.5, 97.5])
        rows.append((name, 1e3 * float(np.mean(values)), float(np.mean(values) / np.mean(alone)), low, high))
    growth = per_evaluation(qa, frames, lengths, repeats=5)
    command = "python benchmarks/watch_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"Command: `{command.strip()}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__} (CPU), "
        "sharing 2 cores with other jobs; CPU time of this process, so their load counts little.  ",
        f"Model: the built-in InternVL3, StateKV B=64, a live stream (`qa.stream()`) of {args.frames} frames of "
        f"held-out synthetic videos (seed {HELD_OUT_SEED}; 4 tokens a frame); watches: four questions (a count, a "
        f"colour, an order, a shape), each evaluated every {EVERY} frames (`stream.watch(q, every={EVERY})`); "
        f"{args.repeats} rounds, the settings taking turns within each; ratio to the stream alone with a 95% "
        "bootstrap interval over rounds.",
        "",
        "| stream | CPU ms per frame | ratio to the stream alone |",
        "|---|---:|---:|",
    ]
    for name, milliseconds, ratio, low, high in rows:
        lines.append(f"| {name} | {milliseconds:.2f} | {ratio:.2f} [{low:.2f}, {high:.2f}] |")
    lines += [
        "",
        "One evaluation of the four watches (one batch) against the four questions asked, after streams of "
        "growing length (CPU ms, median of 5):",
        "",
        "| frames | tokens | 4 watches evaluated | 4 questions asked |",
        "|---:|---:|---:|---:|",
    ]
    for count, tokens, evaluation, asked in growth:
        lines.append(f"| {count} | {tokens} | {evaluation:.1f} | {asked:.1f} |")
    body = "\n".join(lines)
    print(body)
    if args.out:
        write_section(args.out, "Watches", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
