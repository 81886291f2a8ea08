"""``statekv flops``: video-prefill FLOPs tables, JSON and the paper's compute figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from statekv.console import ProgressLine
from statekv.errors import ConfigurationError
from statekv.settings.values import NON_NEGATIVE_INT, PATH, POSITIVE_INT, check_output_dir, check_output_file

DEFAULT_MODELS = ["internvl3-1b", "internvl3-2b", "internvl3-8b"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``flops`` subcommand to the ``statekv`` parser."""
    from .analytic import SCORE_PASSES
    from .paper import BENCHMARKS
    from .presets import PRESETS

    parser = subparsers.add_parser(
        "flops", help="video-prefill FLOPs: tables, JSON, figures",
        description="Analytic video-prefill FLOPs per frame (vision encoder, projector, LM linears, LM attention, "
                    "StateKV score pass) for full attention, recency (ReKV) and StateKV, with break-even frames.",
    )
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, metavar="NAME",
                        help=f"presets, or 'all' (default: {' '.join(DEFAULT_MODELS)}); known: {', '.join(PRESETS)}")
    parser.add_argument("--budgets", nargs="*", type=POSITIVE_INT, default=[4096], metavar="B",
                        help="StateKV budgets in tokens (default: 4096)")
    parser.add_argument("--recency", nargs="*", type=POSITIVE_INT, default=[16], metavar="R",
                        help="recency windows R in frames (Qwen3-VL carries ceil(R/2) 2-frame steps, as in "
                             "evaluation) (default: 16)")
    parser.add_argument("--rekv", nargs="*", type=POSITIVE_INT, default=[], metavar="R",
                        help="ReKV windows R in frames to add (its sinks and window while encoding)")
    parser.add_argument("--retrieve", type=POSITIVE_INT, default=64, metavar="K",
                        help="frames retrieved per question, for the cost of answering (default: 64, ReKV's)")
    parser.add_argument("--frames", type=POSITIVE_INT, default=512, help="horizon in frames (default: 512)")
    parser.add_argument("--at", nargs="+", type=POSITIVE_INT, metavar="N",
                        help="frame numbers to tabulate (default: 1, 64 and the horizon)")
    parser.add_argument("--score", choices=SCORE_PASSES, default="eager",
                        help="StateKV score pass: eager (free: sums existing probabilities) or recompute (QK^T again)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="DIR", type=PATH,
                        help="write flops_vs_frames.png and compute_accuracy_frontier.png into DIR")
    parser.add_argument("--benchmark", choices=BENCHMARKS, default="videomme",
                        help="accuracies for the frontier figure (default: videomme)")
    parser.add_argument("--measure", type=NON_NEGATIVE_INT, default=0, metavar="STEPS",
                        help="also count the first STEPS steps through the real code on meta tensors and compare")
    parser.set_defaults(run=run)


MAX_FRAMES = 100_000
FIGURES = ("flops_vs_frames.png", "compute_accuracy_frontier.png")  # what --plot writes


def run(args: argparse.Namespace) -> int:
    from . import report
    from .memory import cache_table, format_cache_table
    from .presets import PRESETS

    models = list(PRESETS) if args.models == ["all"] else list(dict.fromkeys(args.models))  # each once, in order
    if args.plot:
        check_output_dir(args.plot, "--plot")
        for name in FIGURES:
            check_output_file(args.plot / name, "--plot")  # a folder of that name in it, say
    if args.frames > MAX_FRAMES:  # the curves hold per-frame arrays for every model and method
        raise ConfigurationError(f"--frames {args.frames} is more than the {MAX_FRAMES} frames this report "
                                 "covers (over 27 hours at 1 frame per second)")
    if args.measure > args.frames:
        raise ConfigurationError(f"--measure {args.measure} counts more steps than the --frames {args.frames} the "
                                 "report covers; measure at most that many")
    at = sorted(set(args.at or (f for f in (1, 64, args.frames) if f <= args.frames)))  # each once, in order
    bad = [f for f in at if not 1 <= f <= args.frames]
    if bad:
        raise ConfigurationError(f"--at frames {bad} are outside 1..{args.frames}")
    budgets, windows, rekv = (list(dict.fromkeys(values)) for values in (args.budgets, args.recency, args.rekv))
    curves = report.sweep(models, budgets, windows, args.frames, args.score, rekv)  # each value once
    pairs = report.break_even_pairs(curves)
    output = report.to_json(curves, pairs, at, args.score)
    output["questions"] = report.question_costs(models, args.frames, args.retrieve)
    cache = cache_table(models)
    output["cache_bytes"] = [row.as_dict() for row in cache]
    if args.measure:
        output["measured"] = _measure(curves, args.measure, args.score)
    if args.plot:
        output["figures"] = _plot(curves, pairs, args)
    if args.json:
        print(json.dumps(output, indent=2))
        return 0
    print(report.format_tables(curves, pairs, at, args.score))
    print(f"\nAnswering one question (32 tokens, 16 generated) after {args.frames} frames, TFLOPs:")
    for row in output["questions"]:
        retrieved = f"{row['retrieve']} retrieved frames" if row["retrieve"] < row["frames"] else \
            f"{row['frames']} retrieved frames (all there are)"
        print(f"  {row['model']}: whole detailed cache {row['whole_cache'] / 1e12:.3f}, {retrieved} "
              f"{row['retrieved'] / 1e12:.3f}")
    print()
    print(format_cache_table(cache))
    if args.measure:
        print("\nMeasured (FlopCounterMode, StreamingPrefill + HF vision forward on meta) vs analytic, per step:")
        for m in output["measured"]:
            print(f"  {m['label']}: steps {m['steps']}, largest relative difference {m['max_rel_diff']:.2e}")
    for path in output.get("figures", []):
        print(f"wrote {path}")
    return 0


def _measure(curves, n_steps: int, score: str) -> list[dict]:
    from .analytic import step_flops
    from .measured import measure_prefill

    if score != "eager":
        raise ConfigurationError("--measure runs the eager score path (the only one meta tensors support); "
                                 "drop --score recompute")
    rows, line = [], ProgressLine("statekv flops: measuring ")
    for done, c in enumerate(curves):
        measured = measure_prefill(c.model, c.method, n_steps,
                                   on_step=lambda step, before=done * n_steps: line(before + step,
                                                                                   len(curves) * n_steps, "steps"))
        worst = 0.0
        for step, m in enumerate(measured):
            expected = sum(step_flops(c.model, c.method, step).values())
            worst = max(worst, abs(m["total"] - expected) / expected)
        rows.append({"label": c.label, "steps": n_steps, "max_rel_diff": worst,
                     "measured_total": [m["total"] for m in measured]})
    return rows


def _plot(curves, pairs, args) -> list[str]:
    from . import plots, report

    curve, frontier = FIGURES
    figures = [plots.plot_flops_vs_frames(curves, pairs, args.plot / curve),
               plots.plot_frontier(report.frontier(args.benchmark, 512, args.score),
                                   args.plot / frontier, args.benchmark, 512)]
    return [str(p) for p in figures]
