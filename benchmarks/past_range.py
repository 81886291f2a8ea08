"""Past the built-in model's positional range: why answers get worse, measured cause by cause on held-out sets.

Every video of each set is pushed, every frame, into a `VideoQA.stream()` with no horizon (bounded positions,
the layout chosen per run), exactly as a camera would push it; then each of its questions is asked at the end:

* ``rule@K``: from the K frames per layer the retrieval rule picks (``--ks``, the `attention` rule by default):
  accuracy, and per layer which frames were picked, so the evidence recall@K is counted on the frames actually
  streamed (a question's evidence frames mapped to the steps that hold them);
* ``oracle@K``: from its evidence frames forced in, the rest of the K chosen by the rule (every question sees the
  evidence, nothing else changes: what the layout and the model make of it);
* ``evidence``: from its evidence frames alone;
* ``whole``: from the whole detailed cache, where the stream fits the range (the short set).

``--question-layouts`` also asks the retrieved questions with the context laid out otherwise than the engine does
(``spread:S``: the retrieved frames spread over the last ``S`` positions before the prompt by their time in the
stream, see `past_range_layouts.py`); ``--retrieval-variants`` with other ways of scoring frames.

Each (set, method, layout) run is kept in ``RUNS/<set>-<method>-<layout>.json`` once done (one line per video,
so an interrupted run resumes at its next video). `past_range_report.py` writes the tables.

    python benchmarks/past_range.py --set short=data/pr-short,4610,48,96 --set long=data/pr-2400,4620,24,2400 \\
        --set longest=data/pr-24000,4630,4,24000 --runs runs/past_range
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import past_range_layouts as layouts  # noqa: E402

METHODS = {"full": {"method": "full"}, "statekv": {"method": "statekv", "budget": 64}}
LABELS = {"full": "full attention", "statekv": "StateKV B=64"}


@dataclass(frozen=True)
class DataSet:
    name: str
    folder: Path
    seed: int
    videos: int
    frames: int

    @classmethod
    def parse(cls, text: str) -> "DataSet":
        name, rest = text.split("=", 1)
        folder, seed, videos, frames = rest.split(",")
        return cls(name, Path(folder), int(seed), int(videos), int(frames))

    @property
    def past(self) -> bool:
        """Whether its videos run past the built-in model's 4,096 positions (about 4 tokens a frame)."""
        return self.frames * 4 > 4096

    def make(self) -> None:
        if (self.folder / "questions.jsonl").is_file():
            return
        from statekv.cli import main as statekv_main

        if statekv_main(["synthetic", "make", "--out", str(self.folder), "--videos", str(self.videos), "--seed",
                         str(self.seed), "--frames", str(self.frames)]):
            raise SystemExit("statekv synthetic make failed")


def retrievals():
    """``(Recorded, Forced)``: `Retrieval` subclasses that record the steps chosen per layer; ``Forced`` also puts
    the ``forced`` steps in, filling the rest with the rule's best (or nothing, ``fill=False``)."""
    from statekv.core.answering.retrieval import Retrieval

    @dataclass(frozen=True)
    class Recorded(Retrieval):
        log: list = field(default_factory=list, compare=False)

        def choose(self, seen):
            chosen = super().choose(seen)
            self.log.append(chosen)
            return chosen

    @dataclass(frozen=True)
    class Forced(Retrieval):
        forced: tuple[int, ...] = ()
        fill: bool = True
        log: list = field(default_factory=list, compare=False)

        def choose(self, seen):
            first = int(torch.searchsorted(seen.step_starts[1:], self.keep_tokens, right=True))
            outside = [s for s in range(first, len(seen.steps)) if s not in seen.evicted]
            forced = [s for s in self.forced if s >= first and s not in seen.evicted]
            chosen = list(forced)
            if self.fill:
                scores = self.rule.scores(replace(seen, candidates=None, others=None)).float()
                order = scores[torch.tensor(outside)].argsort(descending=True).tolist()
                taken = set(forced)
                chosen += [outside[i] for i in order if outside[i] not in taken][: self.steps - len(forced)]
            chosen = sorted(chosen)
            self.log.append(chosen)
            return chosen

    return Recorded, Forced


def push_video(qa, path: Path, vision_batch: int = 16):
    """A new stream (no horizon) with every frame of ``path`` pushed; returns it with the still (second) each
    step holds (None for the prompt prefix) and the encoding seconds."""
    from statekv.video import open_video

    stream = qa.stream(vision_batch=vision_batch)
    started = time.perf_counter()
    seconds = []
    for frame in open_video(str(path)).sample(max_fps=1.0, max_frames=10 ** 7):
        stream.push(frame)
        seconds.append(int(frame.timestamp))  # a still lasts one second: [s, s + 1)
    stream.flush()
    elapsed = time.perf_counter() - started
    stills, frames = [], iter(seconds)
    for count in stream.step_frames:
        stills.append(next(frames) if count else None)  # one frame per step (InternVL)
    return stream, stills, elapsed


def evidence_steps(stills: list, evidence: list[int]) -> list[int]:
    """The steps holding the evidence stills (all of them, since every frame is streamed)."""
    where = {still: step for step, still in enumerate(stills) if still is not None}
    return sorted(where[f] for f in evidence if f in where)


def ask(stream, question, prompt: str, retrieval, settings) -> bool:
    from statekv.eval.parsing import judge

    original = stream.retrieval
    if retrieval is not None:
        stream.retrieval = lambda *_args, **_kwargs: retrieval
    try:
        text = stream.ask(prompt, max_new_tokens=settings.max_new_tokens, retrieve=None if retrieval is None else 1)
    finally:
        stream.retrieval = original
    return bool(judge("synthetic", settings.cut(text), answer=question.answer, letters=question.letters)[1])


def placed_distances(stream, chosen: list[int], evidence: list[int]) -> list[int]:
    """Distances from the prompt's first position to the first token of each evidence step, as the last question
    laid out its context of the ``chosen`` steps (layer 0's; from its plan)."""
    plan = stream.prefill.last_plan
    positions = stream.prefill.positions
    if plan is None or not positions.bounded or not evidence:
        return []
    keep = list(range(plan.keep_steps)) if plan.packed else []
    steps = sorted(set(keep) | set(chosen))
    where = dict(zip(steps, positions.context_deltas(steps, plan).tolist()))
    return [plan.start - (positions.bases[s] + where[s]) for s in evidence if s in where]


def run_video(stream, stills, questions, evidence_of: dict, args, fits: bool) -> list[dict]:
    """Every question of one streamed video asked every way (module docstring)."""
    from statekv.settings.methods import retrieval_rule
    from statekv.eval.prompts import build_prompt, generation_settings

    Recorded, Forced = retrievals()
    settings = generation_settings("synthetic")
    keep = stream.retrieval(1).keep_tokens
    rule = retrieval_rule(args.rule)
    entries = []
    for question in questions:
        prompt = build_prompt(question)
        evidence = evidence_steps(stills, evidence_of[question.qid])
        entry = {"qid": question.qid, "family": question.task_type, "evidence": evidence, "asks": {}}
        ways = []
        for variant in args.retrieval_variants:
            for k in (args.ks if variant in ("engine", "stored") else args.variant_ks):
                ways.append((f"rule@{k}" + ("" if variant == "engine" else f"/{variant}"), variant, "packed",
                             Recorded(k, keep, rule)))
        for question_layout in args.question_layouts:
            suffix = "" if question_layout == "packed" else f"/{question_layout}"
            ways.append((f"oracle@{args.oracle_k}{suffix}", "engine", question_layout,
                         Forced(args.oracle_k, keep, rule, forced=tuple(evidence))))
            ways.append((f"evidence{suffix}", "engine", question_layout,
                         Forced(args.oracle_k, keep, rule, forced=tuple(evidence), fill=False)))
            if question_layout != "packed":
                ways.append((f"rule@{args.oracle_k}{suffix}", "engine", question_layout,
                             Recorded(args.oracle_k, keep, rule)))
        if fits:
            ways.append(("whole", "engine", "packed", None))
        for name, variant, question_layout, retrieval in ways:
            with layouts.question_layout(question_layout), layouts.retrieval_variant(variant):
                correct = ask(stream, question, prompt, retrieval, settings)
                record = {"correct": correct}
                if retrieval is not None and (name.startswith("oracle") or name.startswith("evidence")):
                    record["distances"] = placed_distances(stream, sorted(set(retrieval.log[0])), evidence)
            if retrieval is not None:
                chosen = retrieval.log
                record["hit_any"] = [any(s in set(c) for s in evidence) for c in chosen]
                record["hit_all"] = [all(s in set(c) for s in evidence) for c in chosen]
            entry["asks"][name] = record
        entries.append(entry)
    return entries


def run(dataset: DataSet, method: str, layout: str, args, out: Path, videos: int | None = None) -> None:
    """Stream every video of ``dataset`` under ``method`` with the bounded ``layout``; one JSON line per video."""
    import statekv
    from statekv.eval.loaders import load_synthetic
    from itertools import groupby

    done = set()
    if out.exists():
        done = {json.loads(line)["video"] for line in out.read_text().splitlines() if line.strip()}
    evidence_of = {row["qid"]: row["evidence_frames"] for row in map(json.loads, (
        dataset.folder / "questions.jsonl").read_text().splitlines())}
    # a folder `statekv train-builtin` wrote loads with the built-in model's layout (`is_builtin_kind`)
    qa = statekv.VideoQA.from_pretrained(args.checkpoint, device="cpu", positions="bounded", bounded_layout=layout,
                                         **METHODS[method])
    if args.range is not None:  # the range the model declares (what bounded positions keep inside)
        qa.adapter.model.config.get_text_config().max_position_embeddings = args.range
    limit = None
    for video, group in groupby(load_synthetic(dataset.folder), key=lambda q: q.video_id):
        questions = list(group)
        if video in done:
            continue
        if videos is not None and int(video.lstrip("v")) >= videos:
            break
        stream, stills, seconds = push_video(qa, questions[0].video_path)
        positions = stream.prefill.positions
        limit = positions.limit
        fits = positions.next_first + 64 <= limit
        entries = run_video(stream, stills, questions, evidence_of, args, fits)
        line = {"video": video, "frames": stream.frames, "tokens": stream.tokens, "encode_s": seconds,
                "ms_per_frame": 1e3 * seconds / stream.frames, "highest_base": max(positions.bases),
                "widest": positions.widest, "limit": limit, "fits": fits, "questions": entries}
        stream.close()
        with out.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        print(f"{out.stem} {video}: {stream.frames} frames, {line['ms_per_frame']:.1f} ms/frame", file=sys.stderr,
              flush=True)


def layouts_for(method: str, dataset: DataSet, chosen: list[str], layout_frames: int) -> list[str]:
    """The layouts ``method`` streams ``dataset`` with: past the range, full attention's carried state never fits,
    so own-then-cache places it as grouped does (one run: grouped) and cache refuses it; layouts after the first
    only on sets of at most ``layout_frames`` frames."""
    if method == "full" and dataset.past:  # (of the 4,096 positions the built-in model declares)
        return ["grouped"] if dataset.frames <= layout_frames or chosen[0] != "grouped" else chosen[:1]
    return [layout for number, layout in enumerate(chosen) if not number or dataset.frames <= layout_frames]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", type=DataSet.parse, required=True, dest="sets",
                        metavar="NAME=DIR,SEED,VIDEOS,FRAMES", help="a held-out set (made if missing)")
    parser.add_argument("--methods", default="full,statekv")
    parser.add_argument("--layouts", default="own-then-cache,grouped,cache",
                        help="bounded layouts to stream with (full attention: grouped only past the range)")
    parser.add_argument("--full-frames", type=int, default=2400,
                        help="full attention only on sets of at most this many frames (its cost per frame grows)")
    parser.add_argument("--layout-frames", type=int, default=2400,
                        help="layouts other than the first only on sets of at most this many frames")
    parser.add_argument("--limit-videos", type=int, default=None, help="every run on the first N videos only")
    parser.add_argument("--full-videos", type=int, default=None,
                        help="full attention on the first N videos only of sets past the range")
    parser.add_argument("--layout-videos", type=int, default=None,
                        help="layouts after the first on the first N videos only")
    parser.add_argument("--ks", default="16,64")
    parser.add_argument("--variant-ks", default="16", help="the ks of retrieval variants other than engine and "
                        "stored")
    parser.add_argument("--oracle-k", type=int, default=16)
    parser.add_argument("--rule", default="attention")
    parser.add_argument("--question-layouts", default="packed", help="packed (the engine's), spread:S")
    parser.add_argument("--retrieval-variants", default="engine", help="engine, or the variants of "
                        "past_range_layouts.RETRIEVAL_VARIANTS")
    parser.add_argument("--anchors", default="true", choices=("true", "wrap"),
                        help="wrap: frames named Frame1 to Frame96 over and over (the anchors the built-in model was "
                             "trained on) instead of their index")
    parser.add_argument("--range", type=int, default=None,
                        help="declare this positional range instead of the checkpoint's max_position_embeddings "
                             "(the built-in model was trained on videos of about 420 positions)")
    parser.add_argument("--checkpoint", default="builtin", help="a checkpoint folder (default: the built-in model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=Path, default=Path("runs/past_range"))
    parser.add_argument("--out", type=Path, help="markdown file (docs/accuracy.md) for the tables of every run in RUNS")
    parser.add_argument("--retrieval-out", type=Path, help="markdown file (docs/retrieval.md) for the recall tables")
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="model_range.py JSON lines to add to the accuracy tables")
    args = parser.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    args.variant_ks = [int(k) for k in args.variant_ks.split(",")]
    args.question_layouts = args.question_layouts.split(",")
    args.retrieval_variants = args.retrieval_variants.split(",")
    torch.set_num_threads(args.threads)
    layouts.install()
    if args.anchors == "wrap":
        layouts.wrap_anchors()
    args.runs.mkdir(parents=True, exist_ok=True)
    chosen_layouts = args.layouts.split(",")
    for dataset in args.sets:
        dataset.make()
        for method in args.methods.split(","):
            if method == "full" and dataset.frames > args.full_frames:
                continue
            for layout in layouts_for(method, dataset, chosen_layouts, args.layout_frames):
                anchors = ("" if args.anchors == "true" else f"+{args.anchors}") + (
                    "" if args.range is None else f"+range{args.range}")
                out = args.runs / f"{dataset.name}-{method}-{layout}{anchors}.json"
                started = time.monotonic()
                limited = [limit for limit, applies in ((args.limit_videos, True),
                                                        (args.full_videos, method == "full" and dataset.past),
                                                        (args.layout_videos, layout != chosen_layouts[0]))
                           if applies and limit is not None]
                run(dataset, method, layout, args, out, min(limited) if limited else None)
                print(f"{out.name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if args.out or args.retrieval_out:
        write_report(args, argv)


def write_report(args, argv: list[str] | None) -> None:
    """The tables of every run under ``args.runs`` (`past_range_report.py`) into the docs."""
    import os
    import platform

    import past_range_report as report
    from report import write_section

    runs = report.load(args.runs)
    sets = [dataset.name for dataset in args.sets]
    every = sorted({ask for videos in runs.values() for q in report.questions(videos) for ask in q["asks"]})
    command = "python benchmarks/past_range.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    note = (f"Command: `{command}`  \nMachine: {platform.machine()}, {args.threads} torch thread, {os.cpu_count()} "
            f"cores shared with other work (load average {os.getloadavg()[0]:.1f} at the end).")
    accuracy, retrieval = report.sections(runs, sets, every, [a for a in every if a.startswith("rule@")
                                                              and "/spread" not in a], args.model, note)
    if args.out:
        write_section(args.out, "Past the range: measured", accuracy)
    if args.retrieval_out:
        write_section(args.retrieval_out, "Past the range: measured", retrieval)


if __name__ == "__main__":
    main()
