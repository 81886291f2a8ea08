"""``statekv synthetic make``: write a synthetic long-video QA set (videos and a question file).

    statekv synthetic make --out data/synthetic --videos 24 --seed 0
    statekv eval synthetic --model builtin --method statekv --budget 64 --data-root data/synthetic --out runs/s
    statekv synthetic make --streaming --out data/streaming --videos 24 --seed 1     # questions asked while it plays
    statekv eval synthetic --mode streaming --model builtin --method simplestream --data-root data/streaming ...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("synthetic", help="make a synthetic long-video QA set",
                                   description="Synthetic long-video question answering (see docs/accuracy.md).")
    commands = parser.add_subparsers(dest="synthetic_command", required=True, metavar="make")
    from statekv.settings.values import PATH, POSITIVE_INT

    make = commands.add_parser(
        "make", help="write videos and a question file",
        description="Write N videos (one still per second, lossless H.264) with one four-option question of "
                    "each family per video, deterministically from the seed. A make that was stopped goes on "
                    "where it stopped when the same command is run again.")
    make.add_argument("--out", required=True, type=PATH,
                      help="folder to write (new, empty, or a stopped make of the same set)")
    make.add_argument("--videos", required=True, type=POSITIVE_INT, metavar="N", help="how many videos")
    make.add_argument("--seed", required=True, type=_seed, metavar="S",
                      help="evaluation seed, 0 to 999999 (larger seeds are reserved for training)")
    make.add_argument("--frames", type=_frames, default=96, metavar="F",
                      help="frames (seconds) per video, 12 to 36000 (default: 96)")
    make.add_argument("--families", default=None, metavar="A,B",
                      help="comma-separated question families (default: all)")
    make.add_argument("--streaming", action="store_true",
                      help="timestamped questions asked while the video plays, whose evidence comes before, at or "
                           "after their time (backward, real-time and forward groups), in OVO-Bench's format "
                           "(streaming.json); --families does not apply")
    make.add_argument("--overwrite", action="store_true", help="replace the set the folder already holds")
    make.set_defaults(run=run_make)


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None


def _frames(text: str) -> int:
    from statekv.settings.values import argparse_type, check_int, integer
    from statekv.synthetic.benchmark import MAX_FRAMES, MIN_FRAMES

    def parse(value, name):
        return check_int(integer(value, name), name, minimum=MIN_FRAMES, maximum=MAX_FRAMES)

    return argparse_type(parse, f"frames per video from {MIN_FRAMES} to {MAX_FRAMES}")(text)


def run_make(args: argparse.Namespace) -> int:
    from statekv.synthetic.benchmark import MAKING_FILE, VIDEO_DIR, holds_set, make_benchmark
    from statekv.synthetic.tasks import FAMILIES

    from statekv.console import ProgressLine
    from statekv.errors import ConfigurationError

    if args.streaming and args.families is not None:
        raise ConfigurationError("--families does not apply to --streaming (its tasks are fixed: see "
                                 "docs/accuracy.md)")
    families = tuple(FAMILIES) if args.families is None else tuple(name.strip() for name in args.families.split(","))
    settings = dict(videos=args.videos, seed=args.seed, num_frames=args.frames, families=families,
                    streaming=args.streaming)
    if not args.overwrite and holds_set(args.out, **settings):
        print(f"{args.out} holds this set already (a make of it finished); nothing written (--overwrite makes it "
              "anew)")
        return 0
    started, line = time.monotonic(), ProgressLine()
    resumed = not args.overwrite and (Path(args.out) / MAKING_FILE).is_file()
    kept = sum(1 for path in (Path(args.out) / VIDEO_DIR).glob("v*.mp4") if not path.name.endswith(".partial.mp4")) \
        if resumed else 0  # videos a stopped make of this set wrote whole
    path = make_benchmark(args.out, **settings, overwrite=args.overwrite,
                          progress=lambda done, total: line(done, total, "videos written"))
    questions = args.videos * (5 if args.streaming else len(families))
    earlier = f" ({kept} of them written by the make this one went on from)" if kept else ""
    print(f"wrote {args.videos} video{'s' * (args.videos != 1)}{earlier} and {questions} "
          f"question{'s' * (questions != 1)} to {args.out} ({path.name}) in {time.monotonic() - started:.1f} s")
    return 0
