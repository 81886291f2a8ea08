"""Accuracy of the built-in model on a held-out synthetic set, under full attention, StateKV and recency.

Makes the held-out set if it is missing (``statekv synthetic make``: 50 videos of 96 frames, seed 0, one
question of each of the six families per video: 300 questions), evaluates it with the ordinary runner
(``statekv eval synthetic``; every run directory resumes) under

* full attention (exact),
* StateKV at budgets B = 16, 32, 64 tokens (4, 8, 16 frames' worth: the model streams 4 tokens per frame),
* recency at the compute-matched windows R = B / 4 = 4, 8, 16 frames (R = 16 is the paper's ReKV setting),

and writes accuracy with 95% Wilson intervals, overall and per family, to a ``## Measured`` section of
``--out`` and a plot of accuracy against the carried budget to ``--plot``.

    python benchmarks/accuracy.py --data data/heldout --runs runs/accuracy \\
        --out docs/accuracy.md --plot docs/figures/accuracy_vs_budget.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402

BUDGETS = (16, 32, 64)
HELD_OUT_SEED = 0
HELD_OUT_VIDEOS = 50
Z95 = 1.959964
CHANCE = "chance is 25% (a guess among four options; 50% on order, which names two of them)"


@dataclass(frozen=True)
class Setting:
    method: str
    budget: int | None = None  # StateKV: tokens; recency: frames

    @property
    def label(self) -> str:
        return {"full": "full attention", "statekv": f"StateKV B={self.budget}",
                "recency": f"recency R={self.budget}"}[self.method]

    @property
    def run_name(self) -> str:
        return self.method if self.budget is None else f"{self.method}-{self.budget}"


def settings(tokens_per_frame: int) -> list[Setting]:
    return ([Setting("full")] + [Setting("statekv", b) for b in BUDGETS]
            + [Setting("recency", b // tokens_per_frame) for b in BUDGETS])


def wilson(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion, in percent."""
    if total == 0:
        return float("nan"), float("nan")
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return 100 * (centre - half), 100 * (centre + half)


def evaluate(setting: Setting, data: Path, runs: Path, threads: int) -> list:
    from statekv.eval.records import run_records
    from statekv.eval.runner import EvalConfig, run_evaluation

    torch.set_num_threads(threads)
    size = {"statekv": {"budget": setting.budget}, "recency": {"frames": setting.budget}}.get(setting.method, {})
    config = EvalConfig.for_model("synthetic", "builtin", data, runs / setting.run_name, method=setting.method,
                                  progress=False, **size)  # only the size the method reads (others are refused)
    started = time.monotonic()
    run_evaluation(config)
    print(f"{setting.label}: done in {time.monotonic() - started:.0f} s (0 when the run was already complete)",
          file=sys.stderr)
    return run_records(config.out)


def tally(records) -> dict[str, tuple[int, int]]:
    """``{family: (correct, questions)}`` plus ``"overall"``."""
    result: dict[str, list[int]] = {}
    for record in records:
        for key in (record.task_type, "overall"):
            entry = result.setdefault(key, [0, 0])
            entry[0] += int(record.correct)
            entry[1] += 1
    return {key: (c, n) for key, (c, n) in result.items()}


def cell(correct: int, total: int) -> str:
    low, high = wilson(correct, total)
    return f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"


def markdown(results: dict[Setting, dict[str, tuple[int, int]]], families: list[str], command: str,
             tokens_per_frame: int, made: dict) -> str:
    """The section's text; ``made`` is the set's manifest (`statekv.synthetic.benchmark.MANIFEST_FILE`)."""
    total = next(iter(results.values()))["overall"][1]
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__} (CPU).  ",
        f"Held-out set: `statekv synthetic make --frames {made['num_frames']} --videos {made['videos']} --seed "
        f"{made['seed']}` ({total} questions, {made['num_frames']} frames per video, {tokens_per_frame} tokens per "
        "frame).  ",
        "Cells: accuracy in % [95% Wilson interval]; " + CHANCE + ". Budgets are carried tokens per layer and "
        f"KV head; recency R frames carry {tokens_per_frame} R tokens.",
        "",
        "| method | overall | " + " | ".join(families) + " |",
        "|---|" + "---:|" * (len(families) + 1),
    ]
    for setting, counts in results.items():
        row = [cell(*counts["overall"])] + [cell(*counts[f]) if f in counts else "–" for f in families]
        lines.append(f"| {setting.label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict[Setting, dict[str, tuple[int, int]]], families: list[str], tokens_per_frame: int,
         path: Path) -> Path:
    from statekv.plotting import pyplot

    plt = pyplot()
    panels = ["overall", *families]
    columns = 4
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.8 * rows), sharex=True, sharey=True)
    for ax, panel in zip(axes.flat, panels, strict=False):
        full = next(counts[panel] for s, counts in results.items() if s.method == "full")
        low, high = wilson(*full)
        ax.axhspan(low, high, color="black", alpha=0.08)
        ax.axhline(100 * full[0] / full[1], color="black", linestyle=":", label="full attention")
        for method, style in (("statekv", "-o"), ("recency", "--s")):
            points = sorted((s.budget * (tokens_per_frame if method == "recency" else 1), counts[panel])
                            for s, counts in results.items() if s.method == method)
            xs = [x for x, _ in points]
            ys = [100 * c / n for _, (c, n) in points]
            # rounding can put an interval's end a hair inside 100%: clip, matplotlib refuses negative bars
            errors = [[max(0.0, y - wilson(c, n)[0]) for y, (_, (c, n)) in zip(ys, points, strict=True)],
                      [max(0.0, wilson(c, n)[1] - y) for y, (_, (c, n)) in zip(ys, points, strict=True)]]
            ax.errorbar(xs, ys, yerr=errors, fmt=style, capsize=2, markersize=4,
                        label="StateKV" if method == "statekv" else "recency (same carried tokens)")
        ax.axhline(25, color="grey", linewidth=0.6)
        ax.set_title(panel, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks([b for b in BUDGETS])
        ax.set_xticklabels([str(b) for b in BUDGETS])
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("carried tokens per step")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy (%)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8, frameon=False, bbox_to_anchor=(0.98, 0.08))
    fig.suptitle("Built-in model on the held-out synthetic set: accuracy vs carried budget (95% intervals)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/heldout"), help="held-out set (made if missing)")
    parser.add_argument("--runs", type=Path, default=Path("runs/accuracy"), help="run directories (resumable)")
    parser.add_argument("--out", type=Path, help="markdown file to write the ## Measured section into")
    parser.add_argument("--plot", type=Path, help="figure to write")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from statekv.api.videoqa import VideoQA
    from statekv.synthetic.benchmark import MANIFEST_FILE, QUESTIONS_FILE, make_benchmark
    from statekv.synthetic.tasks import FAMILIES

    if not (args.data / QUESTIONS_FILE).is_file():
        make_benchmark(args.data, videos=HELD_OUT_VIDEOS, seed=HELD_OUT_SEED, overwrite=True)
    adapter = VideoQA.from_pretrained("builtin", method="full").adapter
    tokens_per_frame = adapter.max_video_tokens(2) - adapter.max_video_tokens(1)
    results = {setting: tally(evaluate(setting, args.data, args.runs, args.threads))
               for setting in settings(tokens_per_frame)}
    families = [family for family in FAMILIES if family in results[Setting("full")]]
    command = "python benchmarks/accuracy.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    made = json.loads((args.data / MANIFEST_FILE).read_text(encoding="utf-8"))
    body = markdown(results, families, command.strip(), tokens_per_frame, made)
    print(body)
    if args.out:
        write_section(args.out, "Measured", body)
    if args.plot:
        plot(results, families, tokens_per_frame, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
