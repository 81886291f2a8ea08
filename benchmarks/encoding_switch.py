"""Past the range: does it matter where the default layout switches to cache order, or whether the prompt prefix
stays carried? Each run is `statekv eval synthetic --model builtin --retrieve 16 --method statekv --budget 64` on a
held-out long set (every frame streamed, bounded positions), with one change:

* ``defaults``: `--bounded-layout own-then-cache` (the default before the handover layout), which switches to cache
  order once the stream passes the range's cap;
* ``switch-N``: own-then-cache switching once the stream passes N positions (every later frame is encoded with
  the carried state in cache order, as the cache layout does from the first frame);
* ``prefix``: own-then-cache, with the prompt prefix always carried (`WithSinks(StateKV(64), sinks=0)`: attention
  sinks, as StreamingLLM keeps them);
* ``cache``: `--bounded-layout cache` (cache order from the first frame);
* ``handover``: the default now, no flag (`statekv.api.handover`: own-then-cache while the stream fits the range,
  the cache layout's engine once past it).

The switch runs stand their layout in for own-then-cache's (`layouts.BOUNDED_LAYOUTS`) while they run.

Each run is an `statekv eval` run folder under ``--runs`` (a finished one is only read). Cells: % correct [95%
Wilson interval]; "target" pools needle, attribute, order and first_last (issue #45's group).

    python benchmarks/encoding_switch.py --long data/held-2400 --switch 512,1024 --runs runs/switch \\
        --out docs/accuracy.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from past_range_heldout import APART, TARGET, cell, command, tally  # noqa: E402
from report import write_section  # noqa: E402

from statekv.core.positions import layouts  # noqa: E402
from statekv.core.rules import StateKV, WithSinks  # noqa: E402
from statekv.settings.methods import MethodSpec, at_most_budget, register_method  # noqa: E402

SECTION = "Runs of benchmarks/encoding_switch.py"  # a subsection of "Past the range: where the encoding switches"
FLAGS = ["--method", "statekv", "--budget", "64"]
OWN = ["--bounded-layout", "own-then-cache"]


@dataclass(frozen=True)
class SwitchAt(layouts.OwnThenCache):
    """Own-then-cache whose chunks stay at their own positions only up to ``own`` positions."""

    name: ClassVar[str] = "own-then-cache-switch"
    own: int = 512

    def ceiling(self, span: int, carried: int, limit: int) -> int:
        return min(super().ceiling(span, carried, limit), self.own - span)


def runs(switches: list[int]) -> list[tuple[str, str, list[str], layouts.BoundedLayout]]:
    """``(name, label, eval flags, the layout standing in for own-then-cache)`` of every configuration."""
    own = layouts.OwnThenCache()
    plan = [("defaults", "own-then-cache, switching at the range's cap (the defaults before handover)",
             FLAGS + OWN, own)]
    plan += [(f"switch-{n}", f"own-then-cache, switching at {n:,} positions", FLAGS + OWN, SwitchAt(own=n))
             for n in switches]
    plan += [("prefix", "own-then-cache, the prompt prefix always carried",
              ["--method", "statekv-prefix", "--budget", "64"] + OWN, own),
             ("cache", "`--bounded-layout cache` (cache order from the first frame)",
              FLAGS + ["--bounded-layout", "cache"], own),
             ("handover", "handover (the defaults now: own-then-cache inside the range, the cache layout's engine "
              "past it)", FLAGS, own)]
    return plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", type=Path, required=True, help="a held-out long set (`statekv synthetic make`)")
    parser.add_argument("--switch", default="512,1024", help="comma-separated positions to switch at")
    parser.add_argument("--runs", type=Path, default=Path("runs/switch"))
    parser.add_argument("--out", type=Path, default=None,
                        help=f"markdown file whose '### {SECTION}' subsection is replaced (appended if absent)")
    parser.add_argument("--machine", default="", help="what else the machine was doing (written after its name)")
    args = parser.parse_args(argv)
    if not (args.long / "benchmark.json").is_file():
        raise SystemExit(f"{args.long} is not a synthetic set: make one with `statekv synthetic make --frames 2400`")
    from statekv.cli import main as statekv_main

    switches = [int(n) for n in args.switch.split(",") if n]
    register_method(MethodSpec("statekv-prefix", "StateKV with the prompt prefix always carried", "budget",
                               lambda s, f: WithSinks(StateKV(budget=s.budget), sinks=0), at_most_budget,
                               "StateKV, prefix carried"))
    rows = []
    try:
        for name, label, flags, layout in runs(switches):
            out = args.runs / name
            if tally(out) is None:
                layouts.BOUNDED_LAYOUTS[layouts.OwnThenCache.name] = layout
                if statekv_main(command(args.long, out, flags)):
                    raise SystemExit(f"statekv eval failed for {name}")
            rows.append((label, tally(out)))
    finally:
        layouts.BOUNDED_LAYOUTS[layouts.OwnThenCache.name] = layouts.OwnThenCache()
    families = ("target", *TARGET, *APART)
    made = json.loads((args.long / "benchmark.json").read_text(encoding="utf-8"))
    lines = [f"Set: `{args.long}` (`statekv synthetic make --frames {made['num_frames']} --videos {made['videos']} "
             f"--seed {made['seed']}`), each run `statekv eval synthetic --model "
             "builtin --retrieve 16 --method statekv --budget 64` and its change. Command: `python "
             f"benchmarks/encoding_switch.py {shlex.join(argv if argv is not None else sys.argv[1:])}`. Machine: "
             f"{platform.machine()}, {os.cpu_count()} CPUs" + (f", {args.machine}" if args.machine else "") + ". A run "
             "already finished under `--runs` is read, not rerun.",
             "", "| configuration | " + " | ".join(families) + " |", "|---|" + "---:|" * len(families)]
    for label, counts in rows:
        lines.append(f"| {label} | " + " | ".join(cell(counts.get(f, (0, 0))) for f in families) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, SECTION, text, level=3)


if __name__ == "__main__":
    main()
