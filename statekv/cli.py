"""The ``statekv`` command.

Each subcommand lives in its own module, which exposes ``register(subparsers)``: it adds its parser and sets
``run`` (a function of the parsed arguments returning an exit code) as a default. Adding a subcommand is one
line in :data:`COMMANDS`. Modules should import heavy dependencies inside ``run`` so ``statekv --help`` stays
fast.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import signal
import sys
import threading

COMMANDS = (
    "statekv.commands.demo",
    "statekv.commands.answer",
    "statekv.commands.stream",
    "statekv.commands.serve",
    "statekv.commands.reown",
    "statekv.bench.command",
    "statekv.analysis.command",
    "statekv.eval.command",
    "statekv.flops.command",
    "statekv.synthetic.command",
    "statekv.builtin.command",
)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes get one line (``statekv answer: error: ...``), like every other bad input; helps made when
    first shown (`LaterText`) are formatted as text."""

    def __init__(self, *args, **kwargs):
        from .settings.setting import LaterHelpFormatter

        kwargs.setdefault("formatter_class", LaterHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.endswith(": expected one argument"):  # argparse reads a value that starts with '-' as a flag
            flag = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += f" (a value that starts with '-' is given as {flag}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no parser took are refused by the subcommand that was given them, with
        its help and the closest flag it has."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.given_command(parsed)
            flags = [option for action in command._actions for option in action.option_strings]
            given = next((extra.split("=", 1)[0] for extra in extras if extra.startswith("--")), None)
            close = difflib.get_close_matches(given, flags, n=1) if given else []
            hint = f"; did you mean {close[0]}?" if close else ""
            if not hint and any(not extra.startswith("-") for extra in extras):
                hint = getattr(command, "extra_hint", "")  # what a subcommand takes instead of a bare word
            command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def given_command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost (sub)command ``parsed`` was given to (``statekv eval synthetic``'s parser)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                inner = action.choices[getattr(parsed, action.dest)]
                return inner.given_command(parsed) if isinstance(inner, _Parser) else inner
        return self


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="statekv",
        description="Linear-time long-video encoding for video VLMs (StateKV).",
        epilog="environment: STATEKV_CACHE (statekv's cache folder, default ~/.cache/statekv), STATEKV_SECRET_FILE, "
               "STATEKV_API_KEYS, OMP_NUM_THREADS and others (README.md: Environment variables)",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"statekv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``statekv`` console script; returns the exit status."""
    interrupted = []

    def interrupt(signal_number, frame):
        interrupted.append(signal_number)
        raise KeyboardInterrupt

    # torch and transformers load, for seconds, while a subcommand's help lists the methods or a --method is checked:
    # a Ctrl-C meanwhile is one line too. An import it interrupts may raise something else (transformers reports a
    # failed lazy import as its own error).
    # only the main thread can take signals; a SIGINT ignored (a background job's) stays ignored
    in_main_thread = (threading.current_thread() is threading.main_thread()
                      and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    previous = signal.signal(signal.SIGINT, interrupt) if in_main_thread else None
    previous_hook = sys.unraisablehook

    def unraisable(unraised):  # a Ctrl-C that fell in a destructor is swallowed there: said once, below
        if not (interrupted and isinstance(unraised.exc_value, KeyboardInterrupt)):
            previous_hook(unraised)

    sys.unraisablehook = unraisable
    try:
        from .console import run_command
        from .settings.options import normalize_argv

        args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else list(argv)))
        if interrupted:
            raise KeyboardInterrupt
    except BaseException as error:
        if not (interrupted or isinstance(error, KeyboardInterrupt)):
            raise
        print("statekv: interrupted while starting; nothing was done", file=sys.stderr, flush=True)
        if argv is None:  # the process itself: an import cut short can make its teardown end it by SIGINT instead
            sys.stdout.flush()
            os._exit(130)
        return 130
    finally:
        sys.unraisablehook = previous_hook
        if in_main_thread:  # a handler not installed from Python (None) cannot be put back: Python's own then
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    status = run_command(args.command, lambda: args.run(args))
    if argv is None and in_main_thread and status in _STOPPED:
        # stopped, kept and said: a Ctrl-C pressed again (or another stop) as the process ends would only cut its
        # teardown (atexit callbacks, finalizers) with a traceback and end it by SIGINT
        for number in _STOPPED.values():
            signal.signal(number, signal.SIG_IGN)
    return status


_STOPPED = {128 + number: number for number in (getattr(signal, name, None) for name in ("SIGINT", "SIGTERM", "SIGHUP"))
            if number is not None}


if __name__ == "__main__":
    sys.exit(main())
