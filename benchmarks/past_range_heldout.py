"""Past the range on held-out seeds, through the public commands only: `statekv synthetic make --frames N` and
`statekv eval synthetic --retrieve 16 --model builtin` (every frame streamed, `--positions` default: bounded past
the range), for each engine configuration of `RUNS`, with the short set's accuracy as the reference.

Each run is an `statekv eval` run folder under ``--runs`` (rerunning resumes it; a finished run is only read), so
the table can be rebuilt at any time from what is done. Cells: % correct [95% Wilson interval]; "target" pools
needle, attribute, order and first_last (issue #45's group); count and position are reported apart.

    python benchmarks/past_range_heldout.py --long data/held-2400 --long-seed 4820 --long-videos 12 \\
        --short data/held-short --short-seed 4810 --short-videos 48 --runs runs --out docs/accuracy.md \\
        --longest data/held-24000 --longest-seed 4830 --longest-videos 4

``--longest`` adds the 24,000-frame set (40 times the built-in model's range; small frames) and its runs: about
17 minutes each with one thread on a 2-core machine. ``--more-longest FOLDER,SEED,VIDEOS`` (repeatable) adds further
24,000-frame sets, each streamed with the defaults only (``longest-statekv-r16-handover``, in a run folder named
with its seed; ``--only`` leaves them out unless it names that run), and a row pooling that run over every
24,000-frame set; ``--section`` writes the table under another heading. The note above the table names the sets of
its rows only.

    python benchmarks/past_range_heldout.py --long data/held-2400 --short data/held-short --runs runs/held-longest \\
        --longest data/held-24000 --more-longest data/held-24000-4840,4840,8 --more-longest \\
        data/held-24000-4850,4850,4 --only longest-statekv-r16-handover --out docs/accuracy.md \\
        --section "Past the range: 24,000 frames, more videos"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402
from bounded_positions import make_set  # noqa: E402
from report import write_section  # noqa: E402

TARGET = ("needle", "attribute", "order", "first_last")
APART = ("count", "position")
# name, set ("long", "short" or "longest"), the label, the eval's flags besides the set and the model (the
# own-then-cache runs keep the names they had as the defaults)
STATEKV = ["--method", "statekv", "--budget", "64"]
OWN = ["--bounded-layout", "own-then-cache"]
RUNS = (
    ("short-statekv-r16", "short", "StateKV B=64, inside the range", STATEKV),
    ("long-statekv-r16-handover", "long", "StateKV B=64, handover, spread 384 (defaults)", STATEKV),
    ("long-statekv-r16", "long", "StateKV B=64, `--bounded-layout own-then-cache`, spread 384", STATEKV + OWN),
    ("long-statekv-r16-packed", "long", "StateKV B=64, own-then-cache, packed (`--question-span 0`)",
     STATEKV + OWN + ["--question-span", "0"]),
    ("long-statekv-r16-cache", "long", "StateKV B=64, `--bounded-layout cache`, spread 384",
     STATEKV + ["--bounded-layout", "cache"]),
    ("short-statekv-r16-bounded", "short", "StateKV B=64, `--positions bounded` (other settings the defaults), inside",
     STATEKV + ["--positions", "bounded"]),
    ("short-statekv-r16-cache", "short", "StateKV B=64, `--positions bounded --bounded-layout cache`, inside",
     STATEKV + ["--positions", "bounded", "--bounded-layout", "cache"]),
    ("short-full-r16", "short", "full attention, inside the range", ["--method", "full"]),
    ("long-full-r16", "long", "full attention, grouped past the range, spread 384 (defaults)", ["--method", "full"]),
    ("longest-statekv-r16-handover", "longest", "StateKV B=64, handover, spread 384 (defaults)", STATEKV),
    ("longest-statekv-r16", "longest", "StateKV B=64, `--bounded-layout own-then-cache`, spread 384",
     STATEKV + OWN),
    ("longest-statekv-r16-cache", "longest", "StateKV B=64, `--bounded-layout cache`, spread 384",
     STATEKV + ["--bounded-layout", "cache"]),
)
RETRIEVE = 16


def command(data: Path, out: Path, flags: list[str]) -> list[str]:
    return ["eval", "synthetic", "--model", "builtin", "--retrieve", str(RETRIEVE), *flags, "--data-root", str(data),
            "--out", str(out), "--no-progress"]


def tally(out: Path) -> dict[str, tuple[int, int]] | None:
    """``{family: (correct, questions)}`` of a finished run, with ``target`` pooled; None if it is not done."""
    results = out / "results.json"
    if not results.is_file():
        return None
    groups = json.loads(results.read_text(encoding="utf-8"))["score"]["groups"]["task_type"]
    counts = {family: (row["correct"], row["questions"]) for family, row in groups.items()}
    counts["target"] = tuple(sum(counts[f][i] for f in TARGET if f in counts) for i in (0, 1))
    return counts


def run_weights(out: Path) -> str | None:
    """The fingerprint of the weights a run answered with (its `run.json`), None when it has not run."""
    record = out / "run.json"
    if not record.is_file():
        return None
    return json.loads(record.read_text(encoding="utf-8")).get("content", {}).get("weights")


def cell(counts: tuple[int, int]) -> str:
    correct, total = counts
    if not total:
        return "–"
    low, high = wilson(correct, total)
    return f"{100 * correct / total:.1f} [{low:.0f}, {high:.0f}]"


def frames_streamed(out: Path) -> set[int]:
    rows = (out / "answers.rank000.jsonl").read_text(encoding="utf-8").splitlines()
    return {json.loads(row)["extra"]["frames"] for row in rows if row.strip()}


def markdown(rows: list[tuple[str, str, dict, set[int], float | None]], note: str) -> str:
    families = ("target", *TARGET, *APART)
    lines = ["| set | configuration | " + " | ".join(families) + " | frames streamed |",
             "|---|---|" + "---:|" * (len(families) + 1)]
    for which, label, counts, frames, _ in rows:
        lines.append(f"| {which} | {label} | " + " | ".join(cell(counts.get(f, (0, 0))) for f in families)
                     + f" | {', '.join(map(str, sorted(frames)))} |")
    return note + "\n\n" + "\n".join(lines) + "\n"


DEFAULTS_RUN = "longest-statekv-r16-handover"  # the run a further 24,000-frame set gets, and the pooled row's


def further_set(text: str) -> tuple[Path, int, int]:
    folder, seed, videos = text.rsplit(",", 2)
    return Path(folder), int(seed), int(videos)


def further_name(seed: int) -> str:
    return DEFAULTS_RUN.replace("longest-", f"longest-{seed}-", 1)


def further_longest(args, sets: dict, statekv_main) -> list[tuple]:
    """The defaults' run on each further 24,000-frame set (``--more-longest``), then one row pooling it over every
    24,000-frame set whose run is done: ``(set, run folder or None for the pooled row, the row markdown takes)``."""
    label, flags = next((label, flags) for name, _, label, flags in RUNS if name == DEFAULTS_RUN)
    rows, pooled, seeds, frames = [], {}, [], set()
    first = args.runs / DEFAULTS_RUN
    if args.longest is not None and tally(first) is not None:
        pooled, seeds, frames = dict(tally(first)), [args.longest_seed], frames_streamed(first)
    for _, seed, _ in args.more_longest:
        out = args.runs / further_name(seed)
        seconds = None
        if not args.table_only and tally(out) is None:
            started = time.monotonic()
            if statekv_main(command(sets[f"longest-{seed}"], out, flags)):
                raise SystemExit(f"statekv eval failed for {out.name}")
            seconds = time.monotonic() - started
            print(f"{out.name}: {seconds:.0f} s", file=sys.stderr, flush=True)
        counts = tally(out)
        if counts is None:
            continue
        rows.append((f"longest-{seed}", out, (f"longest, seed {seed}", label, counts, frames_streamed(out), seconds)))
        for family, (correct, total) in counts.items():
            before = pooled.get(family, (0, 0))
            pooled[family] = (before[0] + correct, before[1] + total)
        seeds.append(seed)
        frames |= frames_streamed(out)
    if len(seeds) > 1:
        rows.append((None, None, (f"longest, seeds {', '.join(map(str, seeds))} pooled", label, pooled, frames,
                                  None)))
    return rows


def set_made(args, which: str) -> str:
    """The `statekv synthetic make` flags of a set (``long``, ``short``, ``longest``, ``longest-SEED``) and its name."""
    if which == "long":
        return f"--frames {args.long_frames} --videos {args.long_videos} --seed {args.long_seed}` (long)"
    if which == "short":
        return f"--videos {args.short_videos} --seed {args.short_seed}` (short, 96 frames)"
    if which == "longest":
        named = f", seed {args.longest_seed}" if args.more_longest else ""
        return f"--frames {args.longest_frames} --videos {args.longest_videos} --seed {args.longest_seed}` " \
               f"(longest{named})"
    seed = int(which.split("-")[1])
    videos = next(videos for _, given, videos in args.more_longest if given == seed)
    return f"--frames {args.longest_frames} --videos {videos} --seed {seed}` (longest, seed {seed})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", type=Path, required=True, help="the long set's folder (made here if absent)")
    parser.add_argument("--long-seed", type=int, default=4820)
    parser.add_argument("--long-videos", type=int, default=12)
    parser.add_argument("--long-frames", type=int, default=2400)
    parser.add_argument("--longest", type=Path, default=None,
                        help="the 24,000-frame set's folder (made here if absent; none: its runs are skipped)")
    parser.add_argument("--longest-seed", type=int, default=4830)
    parser.add_argument("--longest-videos", type=int, default=4)
    parser.add_argument("--longest-frames", type=int, default=24000)
    parser.add_argument("--more-longest", type=further_set, action="append", default=[], metavar="FOLDER,SEED,VIDEOS",
                        help="a further 24,000-frame set, streamed with the defaults (repeatable)")
    parser.add_argument("--short", type=Path, required=True)
    parser.add_argument("--short-seed", type=int, default=4810)
    parser.add_argument("--short-videos", type=int, default=48)
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--only", default=None, help="comma-separated run names of RUNS (default: all)")
    parser.add_argument("--table-only", action="store_true", help="only read the runs done; run nothing")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write the section to")
    parser.add_argument("--machine", default="", help="what else the machine was doing (written after its name)")
    parser.add_argument("--section", default="Past the range: held-out", help="the heading --out writes under")
    args = parser.parse_args(argv)
    from statekv.cli import main as statekv_main

    sets = {"long": args.long, "short": args.short, "longest": args.longest}
    if not args.table_only:
        make_set(args.long, args.long_videos, args.long_seed, args.long_frames)
        make_set(args.short, args.short_videos, args.short_seed, 96)
        if args.longest is not None:
            make_set(args.longest, args.longest_videos, args.longest_seed, args.longest_frames)
    chosen = None if args.only is None else set(args.only.split(","))
    further = args.more_longest if chosen is None or DEFAULTS_RUN in chosen else []
    needing = sorted(name for name, which, _, _ in RUNS if sets[which] is None and chosen and name in chosen
                     and not (name == DEFAULTS_RUN and further))
    if needing:
        raise SystemExit(f"{', '.join(needing)} run on the 24,000-frame set: give its folder with --longest")
    seeds = [seed for _, seed, _ in args.more_longest] + ([args.longest_seed] if args.longest is not None else [])
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"--more-longest: a 24,000-frame set's seed is given twice ({', '.join(map(str, seeds))})")
    for folder, seed, videos in further:
        if not args.table_only:
            make_set(folder, videos, seed, args.longest_frames)
        sets[f"longest-{seed}"] = folder
    shown = []  # (set, run folder or None, row)
    for name, which, label, flags in RUNS:
        if (chosen is not None and name not in chosen) or sets[which] is None:
            continue
        out = args.runs / name
        seconds = None
        if not args.table_only and tally(out) is None:
            started = time.monotonic()
            if statekv_main(command(sets[which], out, flags)):
                raise SystemExit(f"statekv eval failed for {name}")
            seconds = time.monotonic() - started
            print(f"{name}: {seconds:.0f} s", file=sys.stderr, flush=True)
        counts = tally(out)
        if counts is not None:
            named = f"{which}, seed {args.longest_seed}" if which == "longest" and further else which
            shown.append((which, out, (named, label, counts, frames_streamed(out), seconds)))
    if further:
        args.more_longest = further
        shown += further_longest(args, sets, statekv_main)
    made = list(dict.fromkeys(which for which, _, _ in shown if which is not None))
    listed = [("`statekv synthetic make " if not index else "`") + set_made(args, which)
              for index, which in enumerate(made)]
    note = ("Held-out sets: " + (", ".join(listed[:-1]) + " and " + listed[-1] if len(listed) > 1 else
                                 "".join(listed) or "none run yet")
            + f"; each run `statekv eval synthetic --model builtin --retrieve {RETRIEVE}` and its flags. "
            f"Command: `python benchmarks/past_range_heldout.py "
            + shlex.join(argv if argv is not None else sys.argv[1:]) + "`. Machine: "
            f"{platform.machine()}, {os.cpu_count()} CPUs, torch {__import__('torch').__version__}"
            + (f", {args.machine}" if args.machine else "") + ".")
    weights = {run_weights(out) for _, out, _ in shown if out is not None} - {None}
    if weights:
        note += " Weights (the fingerprint each run's `run.json` records): " + ", ".join(
            f"`{digest[:12]}`" for digest in sorted(weights)) + "."
    text = markdown([row for _, _, row in shown], note)
    print(text)
    if args.out:
        write_section(args.out, args.section, text)


if __name__ == "__main__":
    main()
