"""Accuracy of the built-in model with a quantized detailed cache (``--kv-cache-dtype int8|int4``) against the
same runs without, on a held-out synthetic set: full attention and StateKV B=64, answering from the whole
cache and from 16 retrieved frames.

The runs are ordinary ``statekv eval synthetic`` runs (each resumes), one folder per setting under ``--runs``
named ``{method}_{whole|k16}_{auto|int8|int4}``; this script runs whichever are missing, then writes accuracy
with 95% Wilson intervals, the difference to the unquantized run and how many answers changed, to a
``## Quantized detailed cache`` section of ``--out``.

    statekv synthetic make --out data/heldout-9091 --videos 24 --seed 9091
    python benchmarks/quantized_accuracy.py --data data/heldout-9091 --seed 9091 --runs runs/quantized \\
        --out docs/accuracy.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402
from report import write_section  # noqa: E402

METHODS = {"full": ["--method", "full"], "statekv": ["--method", "statekv", "--budget", "64"]}
LABELS = {"full": "full attention", "statekv": "StateKV B=64"}
CONTEXTS = {"whole": [], "k16": ["--retrieve", "16"]}
STORED = ("auto", "int8", "int4")


def run_name(method: str, context: str, stored: str) -> str:
    return f"{method}_{context}_{stored}"


def evaluate(data: Path, runs: Path) -> None:
    for method in METHODS:
        for context in CONTEXTS:
            for stored in STORED:
                out = runs / run_name(method, context, stored)
                if (out / "results.json").exists():
                    continue
                arguments = ["eval", "synthetic", "--model", "builtin", *METHODS[method], *CONTEXTS[context],
                             "--kv-cache-dtype", stored, "--data-root", str(data), "--out", str(out)]
                print("statekv " + shlex.join(arguments), file=sys.stderr)
                # this interpreter's statekv, whether or not its environment is on PATH
                if subprocess.run([sys.executable, "-m", "statekv.cli", *arguments]).returncode:
                    raise SystemExit(f"statekv eval failed for {out.name} (its message is above)")


def answers(folder: Path) -> dict[str, bool | str]:
    from statekv.eval.records import run_records
    return {record.qid: (record.correct, record.parsed) for record in run_records(folder)}


def table(runs: Path) -> str:
    rows = ["| method | context | stored as | accuracy [95% CI] | vs model's dtype (points) | answers changed |",
            "|---|---|---|---:|---:|---:|"]
    for method in METHODS:
        for context in CONTEXTS:
            base = answers(runs / run_name(method, context, "auto"))
            base_accuracy = 100 * sum(correct for correct, _ in base.values()) / len(base)
            for stored in STORED:
                got = answers(runs / run_name(method, context, stored))
                if set(got) != set(base):
                    raise SystemExit(f"{run_name(method, context, stored)} answered other questions than the "
                                     "unquantized run")
                correct = sum(c for c, _ in got.values())
                low, high = wilson(correct, len(got))
                accuracy = 100 * correct / len(got)
                changed = sum(got[q][1] != base[q][1] for q in got)
                delta = "" if stored == "auto" else f"{accuracy - base_accuracy:+.1f}"
                context_name = "whole cache" if context == "whole" else "16 retrieved frames"
                rows.append(f"| {LABELS[method]} | {context_name} | {stored if stored != 'auto' else 'float32'} | "
                            f"{accuracy:.1f} [{low:.0f}, {high:.0f}] | {delta} | "
                            f"{'' if stored == 'auto' else f'{changed} of {len(got)}'} |")
    return "\n".join(rows)


def set_made(data: Path, seed: int) -> dict:
    """The manifest of the set in ``data``, refused unless `statekv synthetic make` wrote it with ``seed``."""
    from statekv.synthetic.benchmark import MANIFEST_FILE

    try:
        made = json.loads((data / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SystemExit(f"benchmarks/quantized_accuracy.py: --data {data} holds no set `statekv synthetic make` "
                         f"wrote ({error})") from None
    if made.get("seed") != seed:
        raise SystemExit(f"benchmarks/quantized_accuracy.py: --data {data} was made with seed {made.get('seed')}, "
                         f"not --seed {seed}")
    return made


def held_out(made: dict, questions: int) -> str:
    return (f"Held-out set: `statekv synthetic make --frames {made['num_frames']} --videos {made['videos']} --seed "
            f"{made['seed']}` ({questions} questions).  \n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a held-out set (statekv synthetic make)")
    parser.add_argument("--seed", type=int, required=True, help="the seed the held-out set was made with")
    parser.add_argument("--runs", type=Path, required=True, help="where the eval runs go (they resume)")
    parser.add_argument("--out", type=Path, default=None, help="the markdown file to write the section to")
    args = parser.parse_args(argv)
    made = set_made(args.data, args.seed)
    evaluate(args.data, args.runs)
    body = (f"Command: `python benchmarks/quantized_accuracy.py --data {args.data} --seed {args.seed} --runs "
            f"{args.runs} --out {args.out}` (runs `statekv eval synthetic --model builtin --method full|statekv "
            "--budget 64 [--retrieve 16] --kv-cache-dtype auto|int8|int4`)  \n"
            f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}.  \n"
            + held_out(made, len(answers(args.runs / run_name('full', 'whole', 'auto'))))
            + "The built-in model runs in float32; int8/int4 store its detailed cache quantized (keys per channel "
            "over each 4-token frame step, values per token; scales and zero points float32). Answers changed: "
            "questions whose parsed answer differs from the unquantized run's.\n\n" + table(args.runs))
    print(body)
    if args.out is not None:
        write_section(args.out, "Quantized detailed cache", body)


if __name__ == "__main__":
    main()
