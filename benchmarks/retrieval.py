"""Question-time retrieval on the synthetic benchmark: does it find the evidence, and can one answer from it?

The synthetic questions name their evidence (``evidence_frames`` in ``questions.jsonl``). For each method (full
attention, StateKV B=64, ReKV R=16), every video is encoded once and every question asked

* from the whole detailed cache, and
* from ``k`` retrieved frames per layer (k = 8, 16, 32, 64) under each rule of `statekv.core.answering.retrieval`,

every frame of each video streamed (``--max-frames`` to keep fewer: evidence frames left out then count as missed;
evidence is mapped to the steps of the frames actually streamed),

recording per layer which frames each rule chose: evidence recall@k (the share of questions with at least one,
and with all, of their evidence frames among the k) and accuracy (95% Wilson intervals) against k. The time a
rule takes to choose (all layers of one question) is measured against the time of the whole answer.

``--causes`` adds what each candidate cause of a bad ranking changes, measured on the queries and keys of the
whole-cache answers (ReKV's mean key . mean query and the variants that each remove one cause).

    python benchmarks/retrieval.py --data data/heldout-retrieval --seed 424242 --videos 24 \\
        --out docs/retrieval.md --plot docs/figures/retrieval.png --causes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402
from report import (OneLineParser, output_file, positive_count, positive_ints, run_script,  # noqa: E402
                    write_section)

METHODS = {"full": {"method": "full"}, "statekv": {"method": "statekv", "budget": 64},
           "rekv": {"method": "rekv", "frames": 16}}
LABELS = {"full": "full attention", "statekv": "StateKV B=64", "rekv": "ReKV R=16"}
KS = (8, 16, 32, 64)
EVERYTHING = 10 ** 9  # frames: retrieve every step (the whole-cache answer, with the rule's inputs recorded)


def recorded_retrieval():
    """A `Retrieval` that records, per layer, the steps it chose, the seconds choosing took, and (optionally)
    what the rule saw."""
    from statekv.core.answering.retrieval import Retrieval

    @dataclass(frozen=True)
    class Recorded(Retrieval):
        log: list = field(default_factory=list, compare=False)
        keep_inputs: bool = False

        def choose(self, seen):
            started = time.perf_counter()
            chosen = super().choose(seen)
            seconds = time.perf_counter() - started
            if self.keep_inputs and seen.keys is None:  # answering reads the keys lazily: keep them for --causes
                seen = replace(seen, keys=seen.detailed_keys())
            self.log.append({"layer": seen.layer, "steps": chosen, "seconds": seconds,
                             "seen": seen if self.keep_inputs else None})
            return chosen

    return Recorded


def questions_by_video(data: Path):
    from statekv.eval.loaders import load_synthetic

    rows = {}
    with open(data / "questions.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            rows[row["qid"]] = row
    questions = load_synthetic(data)
    return [(video, list(group)) for video, group in groupby(questions, key=lambda q: q.video_id)], rows


def streamed_stills(path: Path, max_frames: int) -> list[int]:
    """The still (second) of each frame `VideoQA.encode` streams from ``path`` at 1 fps with ``max_frames``, in
    order: the frames actually encoded, whose steps follow the prompt prefix."""
    from statekv.video import open_video

    video = open_video(str(path))
    return [int(index / video.fps) for index in video.sample_indices(max_fps=1.0, max_frames=max_frames)]


def evidence_steps(stills: list[int], evidence: list[int], first_frame_step: int, per_step: int) -> list[int]:
    """The steps holding the evidence stills among those streamed (an evidence still never streamed has none:
    no rule can retrieve it, and the question counts as missed)."""
    where = {still: first_frame_step + order // per_step for order, still in enumerate(stills)}
    return sorted({where[f] for f in evidence if f in where})


def run_method(name: str, data: Path, rules: list[str], ks: tuple[int, ...], causes: bool,
               max_frames: int = EVERYTHING) -> dict:
    """Answers, chosen steps and timings of every question under ``name`` (see the module docstring), each video
    streamed with at most ``max_frames`` frames (default: every frame)."""
    import statekv
    from statekv.eval.answering import room_for_prompts
    from statekv.eval.parsing import judge
    from statekv.eval.prompts import build_prompt, generation_settings

    Recorded = recorded_retrieval()
    qa = statekv.VideoQA.from_pretrained("builtin", **METHODS[name])
    settings = generation_settings("synthetic")
    videos, rows = questions_by_video(data)
    out = {"questions": [], "captures": []}
    for _, questions in videos:
        prompts = [build_prompt(q) for q in questions]
        encoded = qa.encode(str(questions[0].video_path), max_frames=max_frames,
                            reserve_tokens=room_for_prompts(qa, prompts, settings.max_new_tokens))
        per_step = encoded.adapter.frames_per_step
        first_frame_step = 1  # step 0 is the prompt prefix
        stills = streamed_stills(questions[0].video_path, max_frames)
        for question, prompt in zip(questions, prompts):
            evidence = evidence_steps(stills, rows[question.qid]["evidence_frames"], first_frame_step, per_step)
            entry = {"qid": question.qid, "family": question.task_type, "evidence_steps": evidence,
                     "evidence_streamed": len(evidence) == len(set(rows[question.qid]["evidence_frames"])),
                     "runs": {}}

            def ask(rule, frames, keep_inputs=False):
                base = encoded.retrieval(frames, rule) if frames is not None else None
                retrieval = None if base is None else Recorded(base.steps, base.keep_tokens, base.rule,
                                                               keep_inputs=keep_inputs)
                original = encoded.retrieval
                encoded.retrieval = lambda *_: retrieval  # the recording Retrieval, for this question only
                started = time.perf_counter()
                try:
                    text = encoded.ask(prompt, max_new_tokens=settings.max_new_tokens)
                finally:
                    encoded.retrieval = original
                seconds = time.perf_counter() - started
                correct = judge("synthetic", settings.cut(text), answer=question.answer,
                                letters=question.letters)[1]
                log = [] if retrieval is None else retrieval.log
                return {"correct": bool(correct), "seconds": seconds,
                        "steps": [record["steps"] for record in log],
                        "choose_seconds": sum(record["seconds"] for record in log)}, log

            entry["runs"]["whole"], _ = ask(None, None)
            if causes:
                _, log = ask("rekv", EVERYTHING, keep_inputs=True)
                out["captures"].append({"evidence_steps": evidence, "family": question.task_type,
                                        "keep": encoded.retrieval(1).keep_tokens,
                                        "layers": [record["seen"] for record in log]})
            for rule in rules:
                for k in ks:
                    entry["runs"][f"{rule}@{k}"], _ = ask(rule, k)
            out["questions"].append(entry)
        encoded.close()
    out["rope"] = rope_of(qa) if causes else None
    return out


def rope_of(qa):
    """The language model's rotary embedding module (for the RoPE cause only)."""
    for module_name, module in qa.adapter.model.named_modules():
        if module_name.endswith("rotary_emb"):
            return module
    return None


# -- recall -----------------------------------------------------------------------------------------------------
def recall(entries: list[dict], run: str) -> list[tuple[float, float]]:
    """Per layer: (% of questions with at least one evidence step chosen, % with all of them)."""
    layers = len(entries[0]["runs"][run]["steps"])
    result = []
    for layer in range(layers):
        any_hits = all_hits = 0
        for entry in entries:
            chosen = set(entry["runs"][run]["steps"][layer])
            evidence = entry["evidence_steps"]
            streamed = entry.get("evidence_streamed", True)  # evidence never streamed: never all retrieved
            any_hits += any(s in chosen for s in evidence)
            all_hits += streamed and all(s in chosen for s in evidence)
        result.append((100 * any_hits / len(entries), 100 * all_hits / len(entries)))
    return result


def accuracy(entries: list[dict], run: str) -> tuple[int, int]:
    return sum(e["runs"][run]["correct"] for e in entries), len(entries)


def cell(correct: int, total: int) -> str:
    low, high = wilson(correct, total)
    return f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"


# -- causes -------------------------------------------------------------------------------------------------------
def unrotate(x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """``x [H, N, D]`` rotated at ``positions`` turned back to no rotation (the RoPE cause only)."""
    cos, sin = rope(x[None].float(), positions[None])
    cos, sin = cos[0].float(), sin[0].float()
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * (-sin)


def cause_scores(seen, rope) -> dict[str, torch.Tensor]:
    """``{variant: [S] scores}``: ReKV's score and variants that each remove one candidate cause."""
    keys, queries = seen.keys[0].float(), seen.queries[0].float()  # [H_kv, T, D], [Hq, Q, D]
    hkv, tokens, dim = keys.shape
    group = queries.shape[0] // hkv
    steps = torch.tensor(seen.steps)
    owner = torch.repeat_interleave(torch.arange(len(steps)), steps)
    mean = lambda k: torch.zeros(hkv, len(steps), dim).index_add_(1, owner, k) / steps[None, :, None]  # noqa: E731
    grouped_mean_query = queries.reshape(hkv, -1, dim).mean(1)  # [H_kv, D]
    out = {"ReKV: mean key . mean query, summed over heads": torch.einsum("hsd,hd->s", mean(keys),
                                                                           grouped_mean_query)}
    if rope is not None:
        plain_keys = unrotate(keys, torch.arange(tokens), rope)
        plain_queries = unrotate(queries, torch.arange(tokens, tokens + queries.shape[1]), rope)
        out["RoPE removed from keys and queries"] = torch.einsum(
            "hsd,hd->s", mean(plain_keys), plain_queries.reshape(hkv, -1, dim).mean(1))
    starts = torch.cumsum(steps, 0) - steps
    slot_scores = []
    for slot in range(int(steps[1:].min())):  # one token per step (the same offset in each) as its mean key
        index = (starts + slot).clamp(max=tokens - 1)
        slot_scores.append(torch.einsum("hsd,hd->s", keys[:, index], grouped_mean_query))
    out["one token per frame (best offset) as the frame's key"] = slot_scores
    per_token = torch.einsum("hsd,hqd->hqs", mean(keys), queries.reshape(hkv, -1, dim))  # every prompt token
    out["each prompt token's query, best token (no mean query)"] = per_token.amax(1).sum(0)
    out["mean key . mean query, best head (not summed)"] = torch.einsum(
        "hsd,hd->hs", mean(keys), grouped_mean_query).amax(0)
    weights = (queries.reshape(hkv, -1, dim) @ keys.transpose(1, 2) * seen.scale).softmax(-1)  # [H_kv, gQ, T]
    shares = torch.zeros(hkv, weights.shape[1], len(steps)).index_add_(2, owner, weights)
    per_layer = shares.reshape(hkv, group, -1, len(steps)).amax(2).sum((0, 1))
    out["attention share, this layer only"] = per_layer
    return out


def causes_table(captures: list[dict], rope, k: int) -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    layers = len(captures[0]["layers"])
    hits: dict[str, list[list[int]]] = {}
    for capture in captures:
        evidence = capture["evidence_steps"]
        running = None
        for layer, seen in enumerate(capture["layers"]):
            variants = cause_scores(seen, rope)
            share = variants["attention share, this layer only"]
            share = share / share.sum()
            running = share if running is None else running + share
            variants["attention share, accumulated over layers (the `attention` rule)"] = running
            for name, scores in variants.items():
                candidates = scores if isinstance(scores, list) else [scores]
                best = None
                for scores_one in candidates:
                    chosen = set(top_steps(scores_one, seen.steps, capture["keep"], k))
                    result = (any(s in chosen for s in evidence), all(s in chosen for s in evidence))
                    best = result if best is None or result > best else best
                counts = hits.setdefault(name, [[0, 0] for _ in range(layers)])
                counts[layer][0] += best[0]
                counts[layer][1] += best[1]
    table = {name: [(100 * a / len(captures), 100 * b / len(captures)) for a, b in counts]
             for name, counts in hits.items()}
    return list(table), table


def top_steps(scores: torch.Tensor, steps, keep: int, k: int) -> list[int]:
    ends = torch.cumsum(torch.tensor(steps), 0)
    outside = [s for s, end in enumerate(ends.tolist()) if end > keep]
    best = scores[torch.tensor(outside)].topk(min(k, len(outside))).indices.tolist()
    return [outside[i] for i in best]


# -- report -------------------------------------------------------------------------------------------------------
def markdown(results: dict[str, dict], rules: list[str], ks: tuple[int, ...], command: str, data_note: str,
             causes: tuple | None) -> str:
    any_method = next(iter(results.values()))["questions"]
    lines = [f"Command: `{command}`  ",
             f"Machine: {platform.machine()} ({platform.processor() or 'cpu'}), {torch.get_num_threads()} threads, "
             f"torch {torch.__version__} (CPU).  ",
             f"{data_note} ({len(any_method)} questions).  ",
             "Recall cells: % of questions with at least one / with all of their evidence frames among the k "
             "frames retrieved at that layer. Accuracy cells: % [95% Wilson interval]; chance is 25% (a guess "
             "among four options; 50% on order, which names two of them).",
             "", "### Evidence recall@k per layer", ""]
    layers = len(any_method[0]["runs"][f"{rules[0]}@{ks[0]}"]["steps"])
    lines += ["| method | rule | k | " + " | ".join(f"layer {i}" for i in range(layers)) + " |",
              "|---|---|---:|" + "---:|" * layers]
    for name, result in results.items():
        for rule in rules:
            for k in ks:
                cells = [f"{a:.0f} / {b:.0f}" for a, b in recall(result["questions"], f"{rule}@{k}")]
                lines.append(f"| {LABELS[name]} | {rule} | {k} | " + " | ".join(cells) + " |")
    lines += ["", "### Accuracy against k", "",
              "| method | whole cache | " + " | ".join(f"{rule} k={k}" for rule in rules for k in ks) + " |",
              "|---|---:|" + "---:|" * (len(rules) * len(ks))]
    for name, result in results.items():
        cells = [cell(*accuracy(result["questions"], "whole"))]
        cells += [cell(*accuracy(result["questions"], f"{rule}@{k}")) for rule in rules for k in ks]
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    lines += ["", "### Cost of choosing", "",
              "Seconds per question, all layers: choosing the frames (the rule's scores and the top-k) against "
              "the whole answer from k = 16 frames (prompt and 8 new tokens; the choosing included).", "",
              "| method | rule | choosing (ms) | answer (ms) | share |", "|---|---|---:|---:|---:|"]
    for name, result in results.items():
        for rule in rules:
            runs = [e["runs"][f"{rule}@16"] for e in result["questions"] if f"{rule}@16" in e["runs"]]
            if not runs:
                continue
            choose = sum(r["choose_seconds"] for r in runs) / len(runs)
            answer = sum(r["seconds"] for r in runs) / len(runs)
            lines.append(f"| {LABELS[name]} | {rule} | {1000 * choose:.2f} | {1000 * answer:.1f} | "
                         f"{100 * choose / answer:.1f}% |")
    if causes is not None:
        names, table, k, method = causes
        lines += ["", f"### Causes (recall@{k} per layer, {LABELS[method]}, queries of the whole-cache answer)", "",
                  "| score | " + " | ".join(f"layer {i}" for i in range(layers)) + " |", "|---|" + "---:|" * layers]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(f"{a:.0f} / {b:.0f}" for a, b in table[name]) + " |")
    return "\n".join(lines)


def accuracy_section(results: dict[str, dict], rules: list[str], ks: tuple[int, ...], command: str,
                     data_note: str) -> str:
    """Rows for docs/accuracy.md: each rule at each k per method, with intervals, beside the whole cache."""
    total = len(next(iter(results.values()))["questions"])
    lines = [f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__} (CPU).  ",
             f"{data_note} ({total} questions; not the set of the table above).  ",
             "Cells: accuracy in % [95% Wilson interval], answering from k frames per layer chosen by each rule "
             "(`--retrieve k --retrieval RULE`); `whole` answers from the whole detailed cache.", "",
             "| method | rule | whole | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|---|---:|" + "---:|" * len(ks)]
    for name, result in results.items():
        whole = cell(*accuracy(result["questions"], "whole"))
        for rule in rules:
            cells = [cell(*accuracy(result["questions"], f"{rule}@{k}")) for k in ks]
            lines.append(f"| {LABELS[name]} | {rule} | {whole} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against(results: dict[str, dict], flat: dict, rules: list[str], ks: tuple[int, ...], command: str, note: str,
            segment_steps: int | None) -> str:
    """Hierarchical retrieval (this run) against the flat rule (``flat``, an earlier run's --json): evidence
    recall@k, worst layer, and accuracy with intervals, side by side."""
    lines = [f"Command: `{command}` (against `{flat['command']}`)  ",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__} (CPU).  ",
             f"{note}; segments of {segment_steps} steps, so a 96-frame video holds {97 // (segment_steps or 16)} and a "
             "question with k frames scores the steps of k segments (and of the segments earlier layers chose).  ",
             "Recall: % of questions with at least one evidence frame among the k, at the worst layer. Accuracy: % "
             "[95% Wilson interval].", "",
             "| method | rule | k | recall, flat | recall, hierarchical | accuracy, flat | accuracy, hierarchical | "
             "points |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        reference = flat["results"].get(name)
        if reference is None:
            continue
        for rule in rules:
            for k in ks:
                run = f"{rule}@{k}"
                if run not in reference[0]["runs"]:
                    continue
                worst = min(a for a, _ in recall(result["questions"], run))
                worst_flat = min(a for a, _ in recall(reference, run))
                mine, theirs = accuracy(result["questions"], run), accuracy(reference, run)
                lines.append(f"| {LABELS[name]} | {rule} | {k} | {worst_flat:.0f} | {worst:.0f} | {cell(*theirs)} | "
                             f"{cell(*mine)} | {100 * (mine[0] - theirs[0]) / mine[1]:+.1f} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], rules: list[str], ks: tuple[int, ...], path: Path) -> Path:
    from statekv.plotting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    colours = dict(zip(results, ("tab:blue", "tab:orange", "tab:green")))
    styles = dict(zip(rules, ("-o", "--s", ":^")))
    for name, result in results.items():
        questions = result["questions"]
        whole = accuracy(questions, "whole")
        axes[0].axhline(100 * whole[0] / whole[1], color=colours[name], alpha=0.4)
        for rule in rules:
            ys = [100 * accuracy(questions, f"{rule}@{k}")[0] / len(questions) for k in ks]
            axes[0].plot(ks, ys, styles[rule], color=colours[name], label=f"{LABELS[name]}, {rule}")
            worst = [min(a for a, _ in recall(questions, f"{rule}@{k}")) for k in ks]
            axes[1].plot(ks, worst, styles[rule], color=colours[name], label=f"{LABELS[name]}, {rule}")
    axes[0].set(xscale="log", xticks=ks, xticklabels=[str(k) for k in ks], xlabel="frames retrieved per layer (k)",
                ylabel="accuracy (%)", title="accuracy (lines: whole cache)")
    axes[1].set(xscale="log", xticks=ks, xticklabels=[str(k) for k in ks], xlabel="frames retrieved per layer (k)",
                ylabel="recall, worst layer (%)", title="evidence recall@k (at least one frame)")
    for ax in axes:
        ax.minorticks_off()
    axes[1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def methods_list(text: str) -> list[str]:
    """--methods: names of `METHODS`, comma-separated."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method {unknown[0]!r}; known: {', '.join(METHODS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="synthetic set folder (made if missing)")
    parser.add_argument("--seed", type=int, required=True, help="its seed (a held-out one for reported numbers)")
    parser.add_argument("--videos", type=positive_count, default=24)
    parser.add_argument("--methods", type=methods_list, default="full,statekv,rekv")
    parser.add_argument("--rules", default="attention,rekv,recent")
    parser.add_argument("--ks", type=positive_ints, default=",".join(map(str, KS)))
    parser.add_argument("--causes", action="store_true", help="also measure the candidate causes")
    parser.add_argument("--max-frames", type=positive_count, default=EVERYTHING,
                        help="frames streamed per video (default: every frame; evidence frames left out count as "
                             "missed)")
    parser.add_argument("--frames", type=positive_count, default=96, help="frames per video of a set made here")
    parser.add_argument("--threads", type=positive_count, default=2)
    parser.add_argument("--out", type=output_file("--out"), default=None,
                        help="markdown file to write a ## Measured section to")
    parser.add_argument("--plot", type=output_file("--plot"), default=None)
    parser.add_argument("--json", type=output_file("--json"), default=None, help="write the per-question results here")
    parser.add_argument("--accuracy-out", type=output_file("--accuracy-out"), default=None,
                        help="markdown file (docs/accuracy.md) to write the accuracy rows to")
    parser.add_argument("--accuracy-ks", type=positive_ints, default="8,16,32", help="the k of those rows")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no runs: write --accuracy-out and --plot from the results an earlier --json saved")
    parser.add_argument("--segment-steps", type=positive_count, default=None,
                        help="steps per segment of the retrieval index (default: the engine's); small enough that a "
                             "96-frame video holds more segments than k, questions retrieve hierarchically")
    parser.add_argument("--against", type=Path, default=None,
                        help="an earlier --json (the flat rule): write recall@k and accuracy against it")
    parser.add_argument("--title", default="Measured", help="the section --out is written to")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.segment_steps is not None:
        from statekv.core.storage import layer_storage as segmented

        segmented.SEGMENT_STEPS = args.segment_steps
    if args.from_json:
        saved = json.loads(args.from_json.read_text(encoding="utf-8"))
        torch.set_num_threads(saved.get("threads", args.threads))  # the Machine line names the run's threads
        results = {name: {"questions": questions} for name, questions in saved["results"].items()}
        if args.accuracy_out:
            write_section(args.accuracy_out, "Answering from retrieved frames",
                          accuracy_section(results, saved["rules"], args.accuracy_ks,
                                           saved["command"], saved["note"]))
        if args.plot:
            plot(results, saved["rules"], tuple(saved["ks"]), args.plot)
        return
    if not (args.data / "questions.jsonl").is_file():
        from statekv.cli import main as statekv_main

        if statekv_main(["synthetic", "make", "--out", str(args.data), "--videos", str(args.videos),
                         "--seed", str(args.seed), "--frames", str(args.frames)]):
            raise SystemExit("statekv synthetic make failed")
    rules, ks = args.rules.split(","), args.ks
    results, causes = {}, None
    for number, name in enumerate(args.methods):
        started = time.monotonic()
        results[name] = run_method(name, args.data, rules, ks, args.causes and number == 0, args.max_frames)
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        if args.causes and number == 0:
            causes = (*causes_table(results[name]["captures"], results[name]["rope"], 16), 16, name)
    command = "python benchmarks/retrieval.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    note = (f"Held-out set: `statekv synthetic make --videos {args.videos} --seed {args.seed}"
            + ("" if args.frames == 96 else f" --frames {args.frames}") + "`"
            + ("" if args.max_frames == EVERYTHING else f", {args.max_frames} frames streamed per video"))
    text = markdown(results, rules, ks, command, note, causes)
    if args.against:
        flat = json.loads(args.against.read_text(encoding="utf-8"))
        text = against(results, flat, rules, ks, command, note, args.segment_steps)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "note": note, "rules": rules, "ks": ks,
                                         "threads": args.threads,
                                         "results": {name: r["questions"] for name, r in results.items()}}),
                             encoding="utf-8")
    if args.plot:
        plot(results, rules, ks, args.plot)
    if args.accuracy_out:
        accuracy_ks = args.accuracy_ks
        write_section(args.accuracy_out, "Answering from retrieved frames",
                      accuracy_section(results, rules, accuracy_ks, command, note))
    if args.out:
        figure = ""
        if args.plot:
            relative = Path(os.path.relpath(args.plot.resolve(), args.out.resolve().parent)).as_posix()
            figure = f"\n\n![accuracy and evidence recall against k]({relative})"
        write_section(args.out, args.title, text + figure)


if __name__ == "__main__":
    run_script(main)
