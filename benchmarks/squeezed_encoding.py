"""Full attention past the range with the distances each frame is encoded against squeezed into a short span: a
check of docs/accuracy.md ("Past the range: the handover layout", full attention), not an engine layout.

Past the range full attention places a frame's history by `GroupedDistances`: distances up to half the range kept,
the rest grouped so the whole stream fits the range, so a frame is encoded against keys thousands of positions
away, which the built-in model never saw in training (at most about 400). This script registers, in its own
process only, a layout that fits the whole history into the last ``--reach`` positions before each chunk (the
nearest ``--near`` exact, the rest grouped by the smallest factor that fits), then runs `statekv eval synthetic`
with it, so its answers can be set beside the engine's own run of the same command without ``--bounded-layout``:

    python benchmarks/squeezed_encoding.py --reach 384 --near 64 -- --data-root data/held-2400 \\
        --out runs/squeezed-full --model builtin --retrieve 16 --method full
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import ClassVar

import statekv.settings.engine as engine_settings
from statekv.core.positions import layouts


@dataclass(frozen=True)
class SqueezedDistances(layouts.GroupedDistances):
    """`GroupedDistances` within the last ``reach`` positions before the chunk instead of the whole range."""

    name: ClassVar[str] = "squeezed"
    reach: int = 384
    near: int = 64

    def place(self, first, base, span, limit, flat=True, moved=False):
        return layouts.grouped_places(first, base, self.near, self.reach)


def register(reach: int, near: int) -> str:
    """Register the layout under ``squeezed`` (this process only) and return its name."""
    if not 0 <= near < reach:
        raise SystemExit(f"--near {near} must be at least 0 and below --reach {reach}")
    layout = SqueezedDistances(reach=reach, near=near)
    layouts.BOUNDED_LAYOUTS[layout.name] = layout
    if layout.name not in engine_settings.BOUNDED_LAYOUTS:
        engine_settings.BOUNDED_LAYOUTS = (*engine_settings.BOUNDED_LAYOUTS, layout.name)
    return layout.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reach", type=int, default=384, help="positions the history is placed in")
    parser.add_argument("--near", type=int, default=64, help="distances kept exactly")
    parser.add_argument("eval_args", nargs=argparse.REMAINDER, help="after --: `statekv eval synthetic`'s flags")
    args = parser.parse_args(argv)
    name = register(args.reach, args.near)
    from statekv.cli import main as statekv_main

    flags = [flag for flag in args.eval_args if flag != "--"]
    return statekv_main(["eval", "synthetic", *flags, "--bounded-layout", name])


if __name__ == "__main__":
    sys.exit(main())
