"""Bounded RoPE positions on the built-in model: the two layouts compared, inside its 4,096 positions and three
times past them, on held-out synthetic sets.

* **Inside the range** (``--inside``: 96-frame videos, about 500 tokens): each method (full attention, StateKV
  B=64) encodes every video with ``positions="stream"`` and with ``positions="bounded"`` under each layout of
  `statekv.core.positions.placing` (``own-then-cache``, ``grouped``, ``cache``; each set with ``bounded_layout``),
  and answers each question
  from the whole cache and from 16 retrieved frames per layer.
* **Past the range** (``--beyond``: videos of ``--beyond-frames`` frames, over three times the model's 4,096
  positions): each video is pushed into a `VideoQA.stream()` with no horizon (bounded positions: it never ends)
  and its questions are asked at the end from 16 retrieved frames (and from as many as fit the range, the
  default when the whole cache does not); the first video is also asked along the way, each time the stream
  passes a multiple of the range. The same question families on the short videos are the reference.

Each (set, method, positions) run is kept in ``RUNS/<name>.json`` once done, so a failure loses only the run it
happened in. Costs: encoding ms per frame, question seconds.

    python benchmarks/bounded_positions.py --inside data/heldout --inside-seed 0 --inside-videos 50 \\
        --beyond data/heldout-long --beyond-seed 808 --beyond-videos 12 --beyond-frames 2400 \\
        --runs runs/bounded --out docs/benchmarks.md --accuracy-out docs/accuracy.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from itertools import groupby
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402
from report import write_section  # noqa: E402

METHODS = {"full": ({"method": "full"}, "full attention"), "statekv": ({"method": "statekv", "budget": 64},
                                                                      "StateKV B=64")}
INSIDE = (("stream", None), ("bounded", "own-then-cache"), ("bounded", "grouped"), ("bounded", "cache"))
BEYOND = (("bounded", "own-then-cache"), ("bounded", "grouped"), ("bounded", "cache"))
# full attention's carried state never fits the range past it: own-then-cache is then grouped (the same run), and
# the cache layout refuses it
SAME_RUN = {("full", "own-then-cache"): "grouped"}
RETRIEVE = 16


def make_set(folder: Path, videos: int, seed: int, frames: int) -> None:
    """Make the set of these flags in ``folder``, or keep it there; another set there is refused (its numbers would
    be reported under these flags)."""
    from statekv.cli import main as statekv_main
    from statekv.synthetic.benchmark import holds_set

    if (folder / "questions.jsonl").is_file():
        if holds_set(folder, videos=videos, seed=seed, num_frames=frames):
            return
        raise SystemExit(f"{folder} holds another set than `statekv synthetic make --frames {frames} --videos "
                         f"{videos} --seed {seed}`: give the flags it was made with, or another folder")

    if statekv_main(["synthetic", "make", "--out", str(folder), "--videos", str(videos), "--seed", str(seed),
                     "--frames", str(frames)]):
        raise SystemExit("statekv synthetic make failed")


def videos_of(folder: Path):
    from statekv.eval.loaders import load_synthetic

    return [(video, list(group)) for video, group in groupby(load_synthetic(folder), key=lambda q: q.video_id)]


def label(method: str, positions: str, layout: str | None) -> str:
    return f"{METHODS[method][1]}, {positions}" + (f" ({layout})" if layout else "")


def judged(question, text: str) -> bool:
    from statekv.eval.parsing import judge
    from statekv.eval.prompts import generation_settings

    return bool(judge("synthetic", generation_settings("synthetic").cut(text), answer=question.answer,
                      letters=question.letters)[1])


def run_inside(qa, folder: Path) -> dict:
    """Every video encoded once; each question from the whole cache and from 16 retrieved frames."""
    from statekv.eval.answering import room_for_prompts
    from statekv.eval.prompts import build_prompt, generation_settings

    settings = generation_settings("synthetic")
    out = {"questions": [], "frame_ms": [], "ask_s": []}
    for _, questions in videos_of(folder):
        prompts = [build_prompt(q) for q in questions]
        encoded = qa.encode(str(questions[0].video_path),
                            reserve_tokens=room_for_prompts(qa, prompts, settings.max_new_tokens))
        out["frame_ms"].append(1e3 * encoded.stats.mean_frame_seconds)
        out["positions"] = encoded.prefill.positions.mode
        for question, prompt in zip(questions, prompts):
            entry = {"qid": question.qid, "family": question.task_type}
            for name, retrieve in (("whole", None), (f"k={RETRIEVE}", RETRIEVE)):
                started = time.perf_counter()
                text = encoded.ask(prompt, max_new_tokens=settings.max_new_tokens, retrieve=retrieve)
                out["ask_s"].append(time.perf_counter() - started)
                entry[name] = judged(question, text)
            out["questions"].append(entry)
        encoded.close()
    return out


def run_beyond(qa, folder: Path, along: bool) -> dict:
    """Every video pushed into a stream with no horizon; its questions asked at the end (16 retrieved frames,
    and as many as fit); the first video asked along the way at each multiple of the range."""
    from statekv.eval.prompts import build_prompt, generation_settings
    from statekv.video import open_video

    settings = generation_settings("synthetic")
    out = {"questions": [], "frame_ms": [], "ask_s": [], "along": []}
    for number, (_, questions) in enumerate(videos_of(folder)):
        prompts = [build_prompt(q) for q in questions]
        stream = qa.stream(vision_batch=16)
        limit = stream.prefill.positions.limit
        next_multiple = limit
        started = time.perf_counter()
        for frame in open_video(str(questions[0].video_path)).sample(max_fps=1.0, max_frames=10**7):
            stream.push(frame)
            if along and number == 0 and stream.tokens >= next_multiple:
                asked = time.perf_counter()
                text = stream.ask(prompts[0], max_new_tokens=settings.max_new_tokens)
                out["along"].append({"tokens": stream.tokens, "frames": stream.frames, "answer": text,
                                     "context": stream.answer_info.context, "seconds": time.perf_counter() - asked,
                                     "retrieved_frames": stream.answer_info.retrieved_frames,
                                     "highest_base": max(stream.prefill.positions.bases)})
                next_multiple += limit
                started += time.perf_counter() - asked
        stream.flush()
        out["frame_ms"].append(1e3 * (time.perf_counter() - started) / stream.frames)
        out["tokens"] = stream.tokens
        out["positions"] = stream.prefill.positions.mode
        for question, prompt in zip(questions, prompts):
            entry = {"qid": question.qid, "family": question.task_type}
            for name, retrieve in ((f"k={RETRIEVE}", RETRIEVE), ("fit", None)):
                asked = time.perf_counter()
                text = stream.ask(prompt, max_new_tokens=settings.max_new_tokens, retrieve=retrieve)
                out["ask_s"].append(time.perf_counter() - asked)
                entry[name] = judged(question, text)
                entry[f"{name} context"] = stream.answer_info.context
                entry[f"{name} frames"] = stream.answer_info.retrieved_frames
            out["questions"].append(entry)
        stream.close()
    return out


def cell(entries: list[dict], key: str) -> str:
    correct, total = sum(e[key] for e in entries), len(entries)
    low, high = wilson(correct, total)
    return f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"


def points(entries: list[dict], key: str) -> float:
    return 100 * sum(e[key] for e in entries) / len(entries)


def changed(entries: list[dict], reference: list[dict], key: str) -> int:
    return sum(a[key] != b[key] for a, b in zip(entries, reference))


def report(results: dict, args, families: list[str]) -> tuple[str, str]:
    """(benchmarks section, accuracy section)."""
    command = "python benchmarks/bounded_positions.py " + shlex.join(sys.argv[1:])
    machine = (f"{platform.machine()}, {args.threads} torch thread(s), {os.cpu_count()} cores shared with other "
               f"work (load average {os.getloadavg()[0]:.1f} at the end)")
    inside = [f"Inside the range: `statekv synthetic make --videos {args.inside_videos} --seed {args.inside_seed}` "
              f"({len(results[('inside', 'full', 'stream', None)]['questions'])} questions, 96 frames, about 500 "
              "tokens per video; the model's range is 4,096). Cells: accuracy % [95% Wilson interval]; "
              "difference from `stream` in points; answers whose correctness changed.", "",
              "| method | positions | whole cache | vs stream | changed | 16 retrieved frames | vs stream | changed "
              "| ms/frame | question s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method in METHODS:
        reference = results[("inside", method, "stream", None)]["questions"]
        for positions, layout in INSIDE:
            run = results[("inside", method, positions, layout)]
            q = run["questions"]
            inside.append(f"| {METHODS[method][1]} | {positions}{f' ({layout})' if layout else ''} | "
                          f"{cell(q, 'whole')} | {points(q, 'whole') - points(reference, 'whole'):+.1f} | "
                          f"{changed(q, reference, 'whole')} | {cell(q, f'k={RETRIEVE}')} | "
                          f"{points(q, f'k={RETRIEVE}') - points(reference, f'k={RETRIEVE}'):+.1f} | "
                          f"{changed(q, reference, f'k={RETRIEVE}')} | {statistics.fmean(run['frame_ms']):.1f} | "
                          f"{statistics.median(run['ask_s']):.3f} |")
    beyond_runs = {key: run for key, run in results.items() if key[0] == "beyond"}
    lines = inside
    if beyond_runs:
        any_run = next(iter(beyond_runs.values()))
        lines += ["", f"Past the range: `statekv synthetic make --videos {args.beyond_videos} --seed {args.beyond_seed} "
                      f"--frames {args.beyond_frames}` ({len(any_run['questions'])} questions, {any_run['tokens']:,} "
                      f"tokens in the last video: {any_run['tokens'] / 4096:.1f} times the model's 4,096 positions), each video "
                      "pushed into "
                      "`qa.stream()` with no horizon; its questions asked at the end from 16 retrieved frames per "
                      "layer, or from as many frames as fit the range (what a question reads by default when the "
                      "whole cache does not fit). Short videos: the inside set's, from 16 retrieved frames "
                      "(`stream` positions).", "",
                      "| method | positions | 16 retrieved frames | as many as fit | short videos, 16 retrieved | "
                      "ms/frame | question s |", "|---|---|---:|---:|---:|---:|---:|"]
        for method in METHODS:
            short = results[("inside", method, "stream", None)]["questions"]
            for positions, layout in BEYOND:
                run = beyond_runs.get(("beyond", method, positions, layout))
                if run is None:
                    continue
                q = run["questions"]
                lines.append(f"| {METHODS[method][1]} | {positions} ({layout}) | {cell(q, f'k={RETRIEVE}')} | "
                             f"{cell(q, 'fit')} | {cell(short, f'k={RETRIEVE}')} | "
                             f"{statistics.fmean(run['frame_ms']):.1f} | {statistics.median(run['ask_s']):.3f} |")
        lines += ["", "Full attention's carried state (every token) never fits the range past it: the own-then-cache "
                      "layout then places it as the grouped one does (the same run, above); the cache layout refuses it.",
                  "", "Per family (16 retrieved frames; short videos beside):", "",
                  "| method | positions | " + " | ".join(families) + " |", "|---|---|" + "---:|" * len(families)]
        for method in METHODS:
            short = results[("inside", method, "stream", None)]["questions"]
            rows = [(f"{positions} ({layout}), past the range", beyond_runs.get(("beyond", method, positions, layout)))
                    for positions, layout in BEYOND] + [("stream, short videos", {"questions": short})]
            for name, run in rows:
                if run is None:
                    continue
                cells = []
                for family in families:
                    chosen = [e for e in run["questions"] if e["family"] == family]
                    cells.append(f"{points(chosen, f'k={RETRIEVE}'):.0f}" if chosen else "")
                lines.append(f"| {METHODS[method][1]} | {name} | " + " | ".join(cells) + " |")
        along = [entry for key in (("beyond", "full", "bounded", "grouped"),
                                   ("beyond", "statekv", "bounded", "own-then-cache"))
                 for entry in beyond_runs.get(key, {}).get("along", [])]
        if along:
            lines += ["", "Asked along the way (the first video, full attention then StateKV, own-then-cache layout): "
                      + "; ".join(f"at {a['tokens']:,} tokens ({a['frames']} frames) read {a['context']} "
                                  f"({a['retrieved_frames']} frames), {a['seconds']:.2f} s, chunks placed at most at "
                                  f"position {a['highest_base']}" for a in along) + "."]
    text = "\n".join([f"Command: `{command}`  ", f"Machine: {machine}.", "", *lines]) + "\n"
    return text, text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inside", type=Path, required=True, help="synthetic set of short videos (made if missing)")
    parser.add_argument("--inside-seed", type=int, default=0)
    parser.add_argument("--inside-videos", type=int, default=50)
    parser.add_argument("--beyond", type=Path, help="synthetic set of long videos (made if missing)")
    parser.add_argument("--beyond-seed", type=int, default=808)
    parser.add_argument("--beyond-videos", type=int, default=12)
    parser.add_argument("--beyond-frames", type=int, default=2400)
    parser.add_argument("--methods", default="full,statekv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=Path, default=Path("runs/bounded"))
    parser.add_argument("--out", type=Path, help="markdown file (docs/benchmarks.md) for the section")
    parser.add_argument("--accuracy-out", type=Path, help="markdown file (docs/accuracy.md) for the section")
    args = parser.parse_args(argv)
    import torch

    import statekv

    torch.set_num_threads(args.threads)
    make_set(args.inside, args.inside_videos, args.inside_seed, 96)
    plan = [("inside", m, p, layout, args.inside) for m in args.methods.split(",") for p, layout in INSIDE]
    if args.beyond:
        make_set(args.beyond, args.beyond_videos, args.beyond_seed, args.beyond_frames)
        plan += [("beyond", m, p, layout, args.beyond) for m in args.methods.split(",") for p, layout in BEYOND
                 if not (m == "full" and layout == "cache") and (m, layout) not in SAME_RUN]
    args.runs.mkdir(parents=True, exist_ok=True)
    results = {}
    for where, method, positions, layout, folder in plan:
        path = args.runs / f"{where}-{method}-{positions}{'-' + layout if layout else ''}.json"
        if path.exists():
            results[(where, method, positions, layout)] = json.loads(path.read_text())
            continue
        qa = statekv.VideoQA.from_pretrained("builtin", device="cpu", positions=positions,
                                             bounded_layout=layout or "own-then-cache", **METHODS[method][0])
        started = time.monotonic()
        along = layout == "own-then-cache" or (method, "own-then-cache") in SAME_RUN and layout == "grouped"
        run = run_inside(qa, folder) if where == "inside" else run_beyond(qa, folder, along=along)
        path.write_text(json.dumps(run))
        results[(where, method, positions, layout)] = run
        print(f"{label(method, positions, layout)} {where}: {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)
    for (method, layout), same in SAME_RUN.items():
        if ("beyond", method, "bounded", same) in results:
            results[("beyond", method, "bounded", layout)] = results[("beyond", method, "bounded", same)]
    families = sorted({e["family"] for run in results.values() for e in run["questions"]})
    text, accuracy_text = report(results, args, families)
    print(text)
    if args.out:
        write_section(args.out, "Bounded positions: the layouts compared, inside and past the range (CPU)", text)
    if args.accuracy_out:
        write_section(args.accuracy_out, "Bounded positions: inside and past the model's range", accuracy_text)


if __name__ == "__main__":
    main()
