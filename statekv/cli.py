"""The ``statekv`` command.

Each subcommand lives in its own module, which exposes ``register(subparsers)``: it adds its parser and sets
``run`` (a function of the parsed arguments returning an exit code) as a default. Adding a subcommand is one
line in :data:`COMMANDS`. Modules should import heavy dependencies inside ``run`` so ``statekv --help`` stays
fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "statekv.demo",
    "statekv.flops.command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statekv",
        description="Linear-time long-video encoding for video VLMs (StateKV).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``statekv`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as error:  # statekv's own input errors subclass these
        print(f"statekv {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
