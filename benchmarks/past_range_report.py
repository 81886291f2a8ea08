"""Tables of `past_range.py`'s runs: accuracy per family with 95% Wilson intervals, evidence recall@k on the frames
streamed, and the distances a question reads at.

    python benchmarks/past_range_report.py --runs runs/past_range --out docs/accuracy.md --title "..."
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402
from report import write_section  # noqa: E402

FAMILIES = ("needle", "attribute", "order", "first_last", "count", "position")
TARGET = ("needle", "attribute", "order", "first_last")  # the families the target names
LABELS = {"full": "full attention", "statekv": "StateKV B=64"}


def load(runs: Path) -> dict[tuple[str, str, str], list[dict]]:
    """``{(set, method, layout): [video lines]}`` of every run file under ``runs``."""
    out = {}
    for path in sorted(runs.glob("*.json")):
        dataset, method, layout = path.stem.split("-", 2)
        out[(dataset, method, layout)] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def questions(videos: list[dict]) -> list[dict]:
    return [q for video in videos for q in video["questions"]]


def cell(values: list[bool], interval: bool = True) -> str:
    if not values:
        return ""
    correct, total = sum(values), len(values)
    if not interval:
        return f"{100 * correct / total:.0f}"
    low, high = wilson(correct, total)
    return f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"


def correct(entries: list[dict], ask: str, families=None) -> list[bool]:
    return [e["asks"][ask]["correct"] for e in entries if ask in e["asks"]
            and (families is None or e["family"] in families)]


def recalled(entries: list[dict], ask: str, families=None, key: str = "hit_all") -> list[bool]:
    """Per question, whether its evidence was retrieved (``hit_all``: all of it, ``hit_any``: some) at every layer."""
    return [all(e["asks"][ask][key]) for e in entries if ask in e["asks"] and e["evidence"]
            and (families is None or e["family"] in families)]


def accuracy_table(runs: dict, asks: list[str], sets: list[str]) -> list[str]:
    """Rows: (set, method, layout, ask); columns: the target group, every family, overall."""
    lines = ["| set | method | layout | answered from | needle+attribute+order+first_last | "
             + " | ".join(FAMILIES) + " | all |", "|---|---|---|---|---:|" + "---:|" * (len(FAMILIES) + 1)]
    for (dataset, method, layout), videos in sorted(runs.items(), key=lambda item: (sets.index(item[0][0])
                                                                                   if item[0][0] in sets else 99,
                                                                                   item[0][1:])):
        if dataset not in sets:
            continue
        entries = questions(videos)
        for ask in asks:
            if not correct(entries, ask):
                continue
            cells = [cell(correct(entries, ask, TARGET))]
            cells += [cell(correct(entries, ask, (family,)), interval=False) for family in FAMILIES]
            cells.append(cell(correct(entries, ask)))
            lines.append(f"| {dataset} | {LABELS[method]} | {layout} | {ask} | " + " | ".join(cells) + " |")
    return lines


def recall_table(runs: dict, asks: list[str], sets: list[str]) -> list[str]:
    """Rows: (set, method, layout, ask); cells: % of questions with all their evidence frames retrieved at every
    layer (pooled, with an interval, and per family), and with at least one."""
    lines = ["| set | method | layout | retrieval | all evidence, every layer | " + " | ".join(FAMILIES)
             + " | some evidence, every layer |", "|---|---|---|---|---:|" + "---:|" * (len(FAMILIES) + 1)]
    for (dataset, method, layout), videos in sorted(runs.items()):
        if dataset not in sets:
            continue
        entries = questions(videos)
        for ask in asks:
            if not recalled(entries, ask):
                continue
            cells = [cell(recalled(entries, ask))]
            cells += [cell(recalled(entries, ask, (family,)), interval=False) for family in FAMILIES]
            cells.append(cell(recalled(entries, ask, key="hit_any")))
            lines.append(f"| {dataset} | {LABELS[method]} | {layout} | {ask} | " + " | ".join(cells) + " |")
    return lines


def runs_note(runs: dict, sets: list[str]) -> list[str]:
    """One line per run: videos, questions, tokens, encoding ms per frame, where chunks were placed."""
    lines = ["| set | method | layout | videos | questions | tokens (last video) | ms/frame (median) | highest base |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for (dataset, method, layout), videos in sorted(runs.items()):
        if dataset not in sets:
            continue
        lines.append(f"| {dataset} | {LABELS[method]} | {layout} | {len(videos)} | {len(questions(videos))} | "
                     f"{videos[-1]['tokens']:,} | {statistics.median(v['ms_per_frame'] for v in videos):.1f} | "
                     f"{max(v['highest_base'] for v in videos)} |")
    return lines


def model_table(paths: list[Path]) -> list[str]:
    """Rows of `model_range.py`'s JSON lines: the built-in model's own forward against video length, anchors,
    RoPE offset and spacing."""
    lines = ["| checkpoint | frames | anchors | offset | gap | needle+attribute+order+first_last | "
             + " | ".join(FAMILIES) + " | all |", "|---|---:|---|---:|---:|---:|" + "---:|" * (len(FAMILIES) + 1)]
    for path in paths:
        for row in map(json.loads, path.read_text().splitlines()):
            families = row["families"]
            target = [families[f] for f in TARGET if f in families]
            correct, total = sum(f[0] for f in target), sum(f[1] for f in target)
            low, high = wilson(correct, total)
            overall = row["overall"]
            cells = [f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"]
            cells += [f"{families[f][2]:.0f}" if f in families else "" for f in FAMILIES]
            cells.append(f"{overall[2]:.1f} [{overall[3]:.0f}, {overall[4]:.0f}]")
            name = "built-in" if row.get("checkpoint", "builtin") == "builtin" else row["checkpoint"]
            lines.append(f"| {name} | {row['frames']} | {row['anchors']} | {row['offset']} | {row.get('gap', 0)} | "
                         + " | ".join(cells) + " |")
    return lines


def distance_table(runs: dict, sets: list[str]) -> list[str]:
    """The distances (positions) from a question's first token back to its evidence frames, as the question
    reads them: median and largest per (set, method, layout, ask)."""
    lines = ["| set | method | layout | answered from | median | largest |", "|---|---|---|---|---:|---:|"]
    for (dataset, method, layout), videos in sorted(runs.items()):
        if dataset not in sets:
            continue
        asks = sorted({a for q in questions(videos) for a, r in q["asks"].items() if r.get("distances")})
        for ask in asks:
            found = [d for q in questions(videos) for d in q["asks"].get(ask, {}).get("distances", [])]
            if found:
                lines.append(f"| {dataset} | {LABELS[method]} | {layout} | {ask} | {statistics.median(found):.0f} | "
                             f"{max(found)} |")
    return lines


def sections(runs: dict, sets: list[str], asks: list[str], recall_asks: list[str], model: list[Path],
             note: str) -> tuple[str, str]:
    """(the accuracy section, the retrieval section) of the runs."""
    table_note = runs_note(runs, sets)
    accuracy = "\n".join([note, "", *table_note, "", "Accuracy, % [95% Wilson interval] (families: %, 12 to 48 "
                          "questions each; the interval is the pooled column's):", "",
                          *accuracy_table(runs, asks, sets), "",
                          "Distances from the prompt's first token back to the evidence frames, in positions:", "",
                          *distance_table(runs, sets)]
                         + (["", "The model's own forward (`benchmarks/model_range.py`), % [95% Wilson interval]:",
                             "", *model_table(model)] if model else [])).strip() + "\n"
    retrieval = "\n".join([note, "", "Evidence recall on the frames streamed: % of questions whose evidence frames "
                           "were all (or some) among the k retrieved at every layer [95% Wilson interval]:", "",
                           *recall_table(runs, recall_asks, sets)]).strip() + "\n"
    return accuracy, retrieval


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--sets", default=None, help="comma-separated set names, in table order (default: all)")
    parser.add_argument("--asks", default=None, help="comma-separated asks for the accuracy table (default: all)")
    parser.add_argument("--recall-asks", default=None, help="comma-separated retrieval asks for the recall table")
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="model_range.py JSON lines to add as the model's table")
    parser.add_argument("--out", type=Path, default=None, help="markdown file for the accuracy section")
    parser.add_argument("--title", default="Past the range: measured")
    parser.add_argument("--retrieval-out", type=Path, default=None, help="markdown file for the recall section")
    parser.add_argument("--retrieval-title", default="Past the range: measured")
    parser.add_argument("--note", default="", help="text before the tables (the command, the machine)")
    args = parser.parse_args(argv)
    runs = load(args.runs)
    sets = args.sets.split(",") if args.sets else sorted({key[0] for key in runs})
    every = sorted({ask for videos in runs.values() for q in questions(videos) for ask in q["asks"]})
    asks = args.asks.split(",") if args.asks else every
    recall_asks = (args.recall_asks.split(",") if args.recall_asks
                   else [a for a in every if a.startswith("rule@") and "/spread" not in a])
    accuracy, retrieval = sections(runs, sets, asks, recall_asks, args.model, args.note)
    print(accuracy)
    print(retrieval)
    if args.out:
        write_section(args.out, args.title, accuracy)
    if args.retrieval_out:
        write_section(args.retrieval_out, args.retrieval_title, retrieval)


if __name__ == "__main__":
    main()
