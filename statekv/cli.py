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

from .console import run_command

COMMANDS = (
    "statekv.commands.demo",
    "statekv.commands.answer",
    "statekv.commands.stream",
    "statekv.commands.serve",
    "statekv.analysis.command",
    "statekv.eval.command",
    "statekv.flops.command",
    "statekv.synthetic.command",
    "statekv.builtin.command",
)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes get one line (``statekv answer: error: ...``), like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="statekv",
        description="Linear-time long-video encoding for video VLMs (StateKV).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``statekv`` console script; returns the exit status."""
    from .settings.options import normalize_argv

    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else list(argv)))
    return run_command(args.command, lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
