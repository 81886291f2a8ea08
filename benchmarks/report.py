"""Writing benchmark results into ``docs/benchmarks.md``, one ``## section`` per benchmark."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# statekv is imported only when a check runs: gpu_suite.py reports a machine where it does not import, as a finding


def _values() -> Any:
    """``statekv.settings.values``, or None where statekv does not import (gpu_suite.py on a bare machine)."""
    try:
        import statekv.settings.values as values
    except ImportError:
        return None
    return values


def _refused(error: Exception) -> bool:
    try:
        from statekv.errors import StateKVError
    except ImportError:
        return isinstance(error, OSError)
    return isinstance(error, (StateKVError, OSError))


def positive_count(text: str) -> int:
    """An argparse type: a positive integer."""
    from statekv.settings.values import POSITIVE_INT

    return POSITIVE_INT(text)


def count_or_zero(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    from statekv.settings.values import NON_NEGATIVE_INT

    return NON_NEGATIVE_INT(text)


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (not NaN, not infinite)."""
    values = _values()
    if values is not None:
        return values.POSITIVE_FLOAT(text)
    number = float(text)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return number


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""
    def convert(text: str) -> int:
        from statekv.settings.values import argparse_type, integer

        return argparse_type(lambda value, name: integer(value, name, minimum=minimum),
                             f"an integer of at least {minimum}")(text)
    return convert


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse type: a comma-separated list of positive integers (``8,16,32``)."""
    from statekv.settings.values import positive_int

    try:
        return tuple(positive_int(part.strip(), "value") for part in text.split(","))
    except Exception as error:
        if not _refused(error):
            raise
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None


def _checked(flag: str, check_name: str) -> Callable[[str], Path]:
    def convert(text: str) -> Path:
        values = _values()
        if values is None:
            return Path(text)
        try:
            return getattr(values, check_name)(text, flag)
        except Exception as error:
            if not _refused(error):
                raise
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert


def output_file(flag: str) -> Callable[[str], Path]:
    """An argparse type: a file that can be written (checked before anything is measured)."""
    return _checked(flag, "check_output_file")


def output_dir(flag: str) -> Callable[[str], Path]:
    """An argparse type: a folder that is, or can be made, writable."""
    return _checked(flag, "check_output_dir")


def run_script(main: Callable[[], Any]) -> NoReturn:
    """Run a benchmark's ``main``: Ctrl-C, a refused setting or a file that cannot be read or written ends in one
    line naming it (no traceback); what was written before stays as it was."""
    name = Path(sys.argv[0]).name
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as error:
        if not _refused(error):
            raise
        if isinstance(error, OSError) and error.filename is not None:
            text = f"{error.filename}: {error.strerror or type(error).__name__}"
        else:
            text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"{name}: error: {text}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(code or 0)


def write_section(path: Path, title: str, body: str, level: int = 2) -> None:
    """Replace the ``## title`` section of the markdown file at ``path`` (``###`` with ``level`` 3: up to the next
    heading of that level or above), or append it if absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    header = f"{'#' * level} {title}\n"
    section = f"{header}\n{body.strip()}\n"
    at = re.search(rf"^{re.escape(header)}", text, re.MULTILINE)  # the heading itself, not "### title" or a mention
    if at is None:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    before, rest = text[:at.start()], text[at.end():]
    found = re.search(rf"^#{{2,{level}}} ", rest, re.MULTILINE)  # "# " lines are comments in code blocks
    after = "\n" + rest[found.start():] if found else ""
    path.write_text(before + section + after)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line naming the flag (no usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
