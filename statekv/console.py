"""What every ``statekv`` command shares: sampling and output options, quiet libraries, JSON output, and turning
statekv's own errors into one line.

A `statekv.StateKVError` (anything a user can cause) becomes ``statekv COMMAND: error: <one line>`` and exit
status 2; Ctrl-C exits 130; SIGTERM (``timeout``, schedulers, systemd) and SIGHUP (a closed terminal) stop a
command the way Ctrl-C does (a `Stopped`, so whatever keeps work on Ctrl-C keeps it on them too) and exit
128 + the signal's number; any other exception is a bug and keeps its traceback. Every one of these signals
only asks to stop: the stop happens where no step, save or answer is half done (`statekv.stopping`). A signal the
command was started ignoring (SIGHUP under ``nohup``, SIGINT in a shell's background) stays ignored.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .errors import ConfigurationError, StateKVError
from .stopping import Stopped, notes_kept, signals_stop_like_ctrl_c, stop_of  # Stopped: what commands catch
from .settings.values import POSITIVE_FLOAT, POSITIVE_INT


def check_extra(extra: str, modules: tuple[str, ...], what: str) -> None:
    """A one-line `ConfigurationError` naming the extra to install where one of ``modules`` (top-level names) is
    not installed, before anything starts."""
    missing = next((name for name in modules if not _installed(name)), None)
    if missing is not None:
        raise ConfigurationError(f"{what} needs the {extra} extra ({missing} is missing): pip install "
                                 f"'statekv[{extra}]' (in a checkout: pip install -c constraints.txt -e '.[{extra}]')")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module put in sys.modules without a spec
        return False


def add_sampling_arguments(parser: argparse.ArgumentParser, *, every_frame: str | None = None) -> None:
    """--max-fps and --max-frames; ``every_frame``: why --max-frames defaults to no cap (None) instead of 512."""
    group = parser.add_argument_group("frame sampling")
    group.add_argument("--max-fps", type=POSITIVE_FLOAT, default=1.0, metavar="F",
                       help="at most F frames per second of video (default: 1)")
    default = f"every frame: {every_frame}" if every_frame else "512"
    group.add_argument("--max-frames", type=POSITIVE_INT, default=None if every_frame else 512, metavar="N",
                       help=f"at most N frames in all (default: {default})")


def add_output_arguments(parser: argparse.ArgumentParser, *,
                         json_help: str = "print one JSON document instead of text", max_new_tokens: int = 128) -> None:
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, default=max_new_tokens,
                        metavar="K", help=f"longest answer in tokens (default: {max_new_tokens})")
    parser.add_argument("--json", action="store_true", help=json_help)


PROGRESS_SECONDS = 10.0  # off a terminal, how often a line says how far a long job is
TERMINAL_SECONDS = 0.1  # on one, how often its line is redrawn


class ProgressLine:
    """How far a long job is, on stderr: one line kept up to date on a terminal (redrawn at most every
    `TERMINAL_SECONDS`, and when done), else a line every `PROGRESS_SECONDS` (none when done: the job's own report
    follows). ``label`` starts each line."""

    def __init__(self, label: str = ""):
        self.label = label
        self.started = self.said = time.monotonic()
        self.drawn = -math.inf  # on a terminal the first step is drawn at once

    def __call__(self, done: int, total: int, what: str) -> None:
        """``done`` of ``total`` ``what`` (the work counted: "videos written", "steps") are done."""
        if interactive():
            if done == total or time.monotonic() - self.drawn >= TERMINAL_SECONDS:
                self.drawn = time.monotonic()
                print(f"\r{self.label}{done}/{total} {what}", end="\n" if done == total else "", file=sys.stderr,
                      flush=True)
        elif done < total and time.monotonic() - self.said >= PROGRESS_SECONDS:
            self.said = time.monotonic()
            print(f"{self.label}{done}/{total} {what} in {self.said - self.started:.0f} s", file=sys.stderr,
                  flush=True)


def interactive() -> bool:
    """Progress bars only when a person watches stderr."""
    return sys.stderr.isatty()


def quiet_libraries() -> None:
    """Keep transformers' loading bars and advice out of the output unless stderr is a terminal."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    if not interactive():
        logging.disable_progress_bar()


def warn_free_form(command: str, model: Any, questions: list[str]) -> None:
    """One line on stderr when the built-in model (or weights `statekv train-builtin` wrote) is asked a question
    without lettered options: it was trained on multiple-choice questions alone, and answers others with words it
    repeats."""
    from .settings.options import is_builtin_kind
    from .synthetic.prompts import POST_PROMPT

    if is_builtin_kind(model) and any("\nA. " not in question for question in questions):
        print(f"statekv {command}: warning: the built-in model answers multiple-choice questions only (a question, "
              f"its options on lines 'A. ...' to 'D. ...', then '{POST_PROMPT}'); it was trained on no other",
              file=sys.stderr, flush=True)


def json_sizes(options: Any) -> dict[str, Any]:
    """A command's JSON sizes of its `ModelOptions`: ``budget`` and ``frames_window`` (null where the method reads
    none), and every size the method reads (``sizes``)."""
    read = options.sizes
    return {"budget": read.get("budget"), "frames_window": read.get("frames"), "sizes": read}


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2), flush=True)


def one_line(error: BaseException | str) -> str:
    """The message on one line: its first, and the next when the first ends in ":" (which then says what)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] + (" " + lines[1] if lines[0].endswith(":") and len(lines) > 1 else "")


def _kept(error: BaseException) -> str:
    """What the command kept when it was stopped, as its handlers noted it (`statekv.stopping.note_kept`)."""
    return "".join(f"; {note}" for note in notes_kept(error))


def run_command(name: str, run: Callable[[], int | None]) -> int:
    """Run a command's body; statekv's errors become one line on stderr and status 2, Ctrl-C status 130,
    SIGTERM / SIGHUP 128 + their number (after the command kept its work, as on Ctrl-C), a closed stdout (its
    reader left) 128 + SIGPIPE, silently."""
    # where nothing configured logging (the server and eval do), the engine's own warnings (a handover given up)
    # are said in the command's voice rather than bare
    previous_last_resort = logging.lastResort
    logging.lastResort = _CommandVoice(name, previous_last_resort)
    try:
        with signals_stop_like_ctrl_c():
            return run() or 0
    except StateKVError as error:
        print(f"statekv {name}: error: {one_line(error)}{_kept(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        return _stopped(name, stop)
    except BrokenPipeError as error:  # the reader of stdout left (`statekv ... | head`): stop quietly, as a shell
        # tool does; if a stop was being handled (Ctrl-C reaches the reader too), the command ends as that stop
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again, with a traceback
        return 128 + signal.SIGPIPE if stop_of(error) is None else _stopped(name, error)
    finally:
        logging.lastResort = previous_last_resort


class _CommandVoice(logging.StreamHandler):
    """The handler of last resort while a command runs: statekv's own warnings as the command's lines
    (``statekv NAME: warning: ...``); anything else (its errors, which the command says as it raises them; other
    libraries' records) to the handler it replaced (None: dropped, as Python drops them with none)."""

    def __init__(self, name: str, previous: logging.Handler | None):
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.command, self.previous = name, previous

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and (record.name == "statekv" or record.name.startswith("statekv.")):
            super().emit(record)
        elif self.previous is not None and record.levelno >= self.previous.level:
            self.previous.handle(record)

    def format(self, record: logging.LogRecord) -> str:
        text = f"statekv {self.command}: warning: {record.getMessage().removeprefix('statekv: ')}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def _stopped(name: str, error: BaseException) -> int:
    """Say how the command was stopped (``error``: the stop, or what was raised while it was handled) and what it
    kept, in one line; return its status."""
    stop = stop_of(error)
    how = f"stopped by {signal.Signals(stop.signal_number).name}" if isinstance(stop, Stopped) else "interrupted"
    with contextlib.suppress(OSError):  # stderr may have gone with stdout's reader (`2>&1 | head`)
        print(f"statekv {name}: {how}{_kept(error)}", file=sys.stderr)
    return stop.exit_status if isinstance(stop, Stopped) else 130


def omp_threads() -> int | None:
    """The threads ``OMP_NUM_THREADS`` asks for (its first level, as OpenMP reads ``4,2``); None when it is unset or
    not a positive count (a command then takes its own default)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isascii() and first.isdigit() and int(first) > 0 else None
