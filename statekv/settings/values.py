"""Checking settings: one place for every "must be a positive integer" and every text-to-value conversion.

Two kinds of check, each raising a `ConfigurationError` whose one-line message names the setting and the value:

* ``check_*`` for values given in Python (``StateKV(budget=...)``, ``VideoQA.from_pretrained(...)``): the
  value must already have the right type (``True`` is not an integer, ``2.0`` is not a frame count).
* parsers ``(value, name) -> value`` for values that arrive as text (command-line flags, lmms-eval's
  ``--model_args``, which sometimes converts ``true`` or ``12`` itself): they accept the text or the converted
  value. :func:`parse_options` applies them to a ``name=value`` mapping and refuses unknown names;
  :func:`argparse_type` turns one into an ``argparse`` type.

    spec = [Option("budget", positive_int, 4096), Option("offload", boolean, False)]
    parse_options({"budget": "1024", "offload": "off"}, spec)   # {"budget": 1024, "offload": False}
    parse_options({"bugdet": 1024}, spec)                       # ConfigurationError: unknown option bugdet; ...

A `Kind` pairs the two for one kind of value (``POSITIVE``, ``NON_NEGATIVE``, ``BOOLEAN``, ``TEXT``, ``DTYPE``,
``DEVICE``, ``one_of(...)``, each with ``.optional``), with its ``argparse`` type; a setting is declared with its
kind (`statekv.settings.setting.Setting`).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, InputError, OutputError, StateKVError

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NONE_WORDS = ("", "none", "null")

Parser = Callable[[Any, str], Any]


# values given in Python -------------------------------------------------------------------------------------
# The largest integer any setting takes: a count times a frame's tokens, or times a row's bytes, still fits int64.
LARGEST_INT = 2**48
# A stream's time in seconds goes no further (an epoch's timestamps fit), and its max_fps no higher: the sampling
# clock's tick of any time it takes, saved as an int64, stays under 4e18 plus its rounding's slack, short of 2**62.
LATEST_TIMESTAMP = 1e11
HIGHEST_FPS = 4e7


def check_int(value: object, name: str, *, minimum: int = 1, maximum: int = LARGEST_INT,
              error: type[StateKVError] = ConfigurationError) -> int:
    """``value`` if it is an int (not a bool) from ``minimum`` (1: "a positive integer", 0: "a non-negative
    integer") to ``maximum``; else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise error(f"{name} must be {kind}, got {shown(value)}")
    if value > maximum:
        raise error(f"{name} must be at most {maximum:,}, got {shown(value)}")
    return value


def check_number(value: object, name: str, *, minimum: float = 0.0,
                 error: type[StateKVError] = ConfigurationError) -> float:
    """``value`` if it is a finite number (not a bool) greater than ``minimum`` (0: "> 0")."""
    if not is_finite_number(value) or value <= minimum:
        raise error(f"{name} must be a finite number > {minimum:g}, got {shown(value)}")
    return value


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is an int or a float (not a bool) that a float holds finite: JSON's and Python's ints have
    no bound, and ``math.isfinite`` of one past a float's range raises instead of answering."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def printable(path: Any) -> str:
    """``path`` with each character a line cannot show (a newline, say) escaped: a one-line error naming it keeps
    what it says after it."""
    text = str(path)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: object, limit: int = 80) -> str:
    """``value``'s repr for a one-line message, cut to ``limit`` characters (an int of thousands of digits has
    no repr: Python refuses to write it)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigurationError(f"unknown {name} {shown(value)}; choose one of {', '.join(choices)}")
    return value


def check_device(value: object, name: str = "device") -> str:
    """``value`` if it names a device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``...); else a
    one-line error saying what is missing (no CUDA at all, or fewer devices than the index)."""
    import torch

    if not isinstance(value, (str, torch.device)):
        raise ConfigurationError(f"{name} must be a device name such as cpu, cuda or cuda:1, got {value!r}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigurationError(f"{name} {str(value)!r} is not a device name (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu":
        return str(value)
    backend = getattr(torch, device.type, None)
    if device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    if backend is None or not hasattr(backend, "is_available"):
        raise ConfigurationError(f"{name} {str(value)!r}: statekv runs on cpu, cuda or another accelerator "
                                 f"torch can use, not {device.type}")
    if not backend.is_available():
        raise ConfigurationError(f"{name} {str(value)!r} is not available: this machine (torch {torch.__version__}) "
                                 f"has no {device.type} device")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ConfigurationError(f"{name} {str(value)!r} does not exist: this machine has {count} {device.type} "
                                 f"device{'s' if count != 1 else ''} ({device.type}:0"
                                 f"{f' to {device.type}:{count - 1}' if count > 1 else ''})")
    return str(value)


def torch_dtype(value: object, name: str = "dtype"):
    """A floating-point ``torch.dtype`` from itself or its name (``"bfloat16"``); None for None or ``"auto"``
    (the checkpoint's own)."""
    import torch

    if value is None or value == "auto":
        return None
    resolved = value if isinstance(value, torch.dtype) else getattr(torch, value, None) if isinstance(value, str) \
        else None
    if not isinstance(resolved, torch.dtype):
        raise ConfigurationError(f"unknown {name} {value!r}; use e.g. bfloat16, float16 or float32")
    if not resolved.is_floating_point:
        raise ConfigurationError(f"{name} must be a floating-point type (bfloat16, float16, float32), got {value!r}")
    if resolved not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # float8 types: no model runs
        raise ConfigurationError(f"{name} {value!r} is not one a model runs in: use bfloat16, float16, float32 or "
                                 "float64 (for a float8 cache, kv_cache_dtype int8 or int4)")
    return resolved


# output paths -----------------------------------------------------------------------------------------------
def check_output_file(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a `Path` if a file can be written there (it may exist; missing folders are made when it is
    written); else an `OutputError` saying why: it is a folder, or no file can be created where it would go.
    Nothing is left behind by the check."""
    path = _given_path(path, name)
    if str(path).endswith(os.sep) or (_exists(path, name, path) and path.is_dir()):
        raise OutputError(f"{name} {printable(path)} names a folder; give the name of a file to write")
    if path.exists() and not path.is_file():
        raise OutputError(f"{name} {printable(path)} is not a regular file")
    _check_creatable_in(path.parent, name, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{name} {printable(path)}: the file exists and is not writable")
    return path


def check_output_dir(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a `Path` if it is, or can be made, a folder where files can be written; else an `OutputError`
    (it is a file, or nothing can be created there). Nothing is left behind by the check."""
    path = _given_path(path, name)
    if _exists(path, name, path) and not path.is_dir():
        raise OutputError(f"{name} {printable(path)} exists and is not a folder")
    _check_creatable_in(path, name, path)
    return path


def is_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder (False: missing, or something else); a one-line `InputError` where the system
    cannot tell (a name too long, a link loop, a folder on the way that cannot be entered), which ``Path.is_dir``
    raises as a bare `OSError`."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as error:
        raise InputError(f"{printable(path)}: {error.strerror or type(error).__name__}") from None


def too_long(path: str | os.PathLike) -> str | None:
    """Why the system would refuse ``path`` as too long ("File name too long (a name of 300 bytes; ...)"), or None.
    Told before anything is made: the system tells it only once the folders on the way exist (until then it says
    one is missing), so a command would make them, or load a model, and only then fail."""
    text = os.fsencode(os.path.expanduser(os.fspath(path)))
    existing, names = text, []
    while existing and not os.path.lexists(existing):  # the names to be made, under the nearest existing folder
        existing, name = os.path.split(existing.rstrip(b"/"))
        names.append(name)
        if not name:
            break
    longest = max(names, key=len, default=b"")
    most_bytes = _pathconf(existing or b".", "PC_NAME_MAX", 255)
    if len(longest) > most_bytes:
        return (f"{os.strerror(errno.ENAMETOOLONG)} (a name of {len(longest):,} bytes; this file system takes "
                f"{most_bytes} at most)")
    most_bytes = _pathconf(existing or b".", "PC_PATH_MAX", 4096) - 1  # the system's limit counts the final NUL
    if len(text) > most_bytes:
        return f"{os.strerror(errno.ENAMETOOLONG)} ({len(text):,} bytes in all; the system takes {most_bytes} at most)"
    return None


def _pathconf(folder: bytes, what: str, otherwise: int) -> int:
    try:
        return os.pathconf(folder, what)
    except (OSError, ValueError, AttributeError):  # no such limit (or no pathconf, on Windows)
        return otherwise


def _exists(path: Path, name: str, target: Path) -> bool:
    """Whether ``path`` exists; an `OutputError` for what can be neither used nor made there: a symbolic link loop,
    a link to nothing, a name too long, a folder that cannot be entered."""
    try:
        os.stat(path)
        return True
    except NotADirectoryError:  # a file on the way: said where a folder would have to be made
        return False
    except FileNotFoundError:
        if os.path.lexists(path):
            raise OutputError(f"{name} {printable(target)}: {printable(path)} is a symbolic link to nothing") from None
        return False
    except OSError as error:
        raise OutputError(f"{name} {printable(target)}: {error.strerror or type(error).__name__} "
                          f"({printable(path)})") from None


def _given_path(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a `Path`, refusing what names no place: an empty or blank string (``Path("")`` would be the
    current folder), a NUL byte, a value that is not a path."""
    if not isinstance(path, (str, os.PathLike)):
        raise OutputError(f"{name} must be a path, got {path!r}")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise OutputError(f"{name} is empty; give the path to write")
    if "\0" in text:
        raise OutputError(f"{name} {text!r} holds a NUL byte")
    if (why := too_long(text)) is not None:
        raise OutputError(f"{name} {printable(text)}: {why}")
    return Path(text).expanduser()


def _check_creatable_in(folder: Path, name: str, target: Path) -> None:
    """Whether files can be created in ``folder`` (or, while it does not exist, in its nearest existing parent):
    tried for real with a temporary file, since permissions alone do not tell (read-only mounts, root)."""
    existing = folder
    while not _exists(existing, name, target):
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{name} {printable(target)}: {printable(existing)} is a file, so no folder can be made "
                          "there")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OutputError(f"{name} {printable(target)}: cannot write in {printable(existing)} ({reason})") from None


# values given as text -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One accepted option: its name, the parser applied to a given value, and the value when not given."""

    name: str
    parse: Parser
    default: Any = None
    help: str = ""


def parse_options(given: Mapping[str, Any], options: Iterable[Option], *, what: str = "option") -> dict[str, Any]:
    """``{name: parsed value}`` for every option in ``options`` (defaults for those not given).

    Refuses names not in ``options``, listing the known ones; ``what`` names the options in messages
    (e.g. ``"model arg"``).
    """
    options = list(options)
    known = [option.name for option in options]
    unknown = [name for name in given if name not in known]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigurationError(f"unknown {what}{plural} {', '.join(map(str, unknown))}; "
                                 f"known: {', '.join(known)}")
    return {option.name: option.parse(given[option.name], option.name) if option.name in given else option.default
            for option in options}


def argparse_type(parse: Parser, expected: str, *, largest: int | None = None) -> Callable[[str], Any]:
    """``parse`` as an ``argparse`` type: a refused value becomes argparse's one-line usage error
    ("argument --budget: expected a positive integer, got '0'"); an integer past ``largest`` is told the bound."""

    def convert(text: str) -> Any:
        try:
            return parse(text, "value")
        except ConfigurationError:
            number = _from_text(text, int) if largest is not None else None
            past = f" at most {largest:,}" if number is not None and number > largest else ""
            raise argparse.ArgumentTypeError(f"expected {expected}{past}, got {text!r}") from None

    convert.__name__ = expected
    return convert


def boolean(value: Any, name: str) -> bool:
    """True/False, 1/0, or one of true/false, 1/0, yes/no, on/off in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ConfigurationError(f"{name} must be a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def integer(value: Any, name: str, *, minimum: int | None = None) -> int:
    """An int, a string of one, or a float with an integral value; at least ``minimum`` when given."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        number = _from_text(value, int)
    if number is None:
        raise ConfigurationError(f"{name} must be an integer, got {shown(value)}")
    if minimum is not None and number < minimum:
        raise ConfigurationError(f"{name} must be at least {minimum}, got {shown(value)}")
    if number > LARGEST_INT:
        raise ConfigurationError(f"{name} must be at most {LARGEST_INT:,}, got {shown(value)}")
    return number


def positive_int(value: Any, name: str) -> int:
    return integer(value, name, minimum=1)


def non_negative_int(value: Any, name: str) -> int:
    return integer(value, name, minimum=0)


def optional_positive_int(value: Any, name: str) -> int | None:
    """A positive integer, or None for None, ``""``, ``none``, ``null``."""
    return None if _is_none(value) else positive_int(value, name)


def finite_number(value: Any, name: str) -> float:
    """A finite number (int, float or a string of one)."""
    number: float | None = None
    if is_finite_number(value):
        number = float(value)
    elif isinstance(value, str):
        number = _from_text(value, float)
    if number is None or not math.isfinite(number):
        raise ConfigurationError(f"{name} must be a number, got {shown(value)}")
    return number


def positive_float(value: Any, name: str) -> float:
    """A finite number greater than zero (int, float or a string of one)."""
    number = finite_number(value, name)
    if number <= 0:
        raise ConfigurationError(f"{name} must be greater than 0, got {shown(value)}")
    return number


def non_negative_float(value: Any, name: str) -> float:
    """A finite number of at least zero (int, float or a string of one)."""
    number = finite_number(value, name)
    if number < 0:
        raise ConfigurationError(f"{name} must be at least 0, got {shown(value)}")
    return number


def is_stream_rate(value: object) -> bool:
    """Whether ``value`` is a live stream's max_fps: a number above 0 and at most `HIGHEST_FPS`."""
    return is_finite_number(value) and 0 < value <= HIGHEST_FPS


def stream_rate(value: Any, name: str) -> float:
    """A live stream's max_fps (`is_stream_rate`), or text of one."""
    number = positive_float(value, name)
    if not is_stream_rate(number):
        raise ConfigurationError(f"{name} must be at most {HIGHEST_FPS:g}, got {shown(value)}")
    return number


def optional_text(value: Any, name: str) -> str | None:
    """A non-empty string, or None for None, ``""``, ``none``, ``null`` (any case)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a string, got {value!r}")
    return None if _is_none(value) else value.strip()


def required_text(value: Any, name: str) -> str:
    text = optional_text(value, name)
    if text is None:
        raise ConfigurationError(f"{name} must not be empty")
    return text


def choice(choices: Sequence[str]) -> Parser:
    """A parser accepting exactly one of ``choices`` (case-sensitive, surrounding spaces ignored)."""

    def parse(value: Any, name: str) -> str:
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        raise ConfigurationError(f"{name} must be one of {', '.join(choices)}, got {value!r}")

    parse.__name__ = "choice"
    return parse


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in NONE_WORDS)


def _from_text(text: str, convert: Callable[[str], Any]) -> Any:
    """``convert(text)`` without surrounding spaces, or None when it refuses the text."""
    try:
        return convert(text.strip())
    except ValueError:
        return None


BYTE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(value: Any, name: str) -> int:
    """A size in bytes: a positive int, or text like ``512M``, ``20G``, ``1.5T``, ``4096`` (K, M, G, T are powers of
    1024; an optional ``B``/``iB`` after them is accepted)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip().upper()
        text = text.removesuffix("IB") if text.endswith("IB") else text.removesuffix("B")
        unit = text[-1:] if text[-1:] in BYTE_UNITS else ""
        amount = _from_text(text[: len(text) - len(unit)], float)
        number = None if amount is None or not math.isfinite(amount) else int(amount * BYTE_UNITS[unit])
    else:
        number = None
    if number is None:
        raise ConfigurationError(f"{name} must be a size in bytes such as 512M or 20G, got {shown(value)}")
    if number < 1:
        raise ConfigurationError(f"{name} must be at least 1 byte, got {shown(value)}")
    if number > LARGEST_INT:
        raise ConfigurationError(f"{name} must be at most {format_bytes(LARGEST_INT)}, got {shown(value)}")
    return number


def optional_byte_size(value: Any, name: str) -> int | None:
    """A size in bytes (`byte_size`), or None for None, ``""``, ``none``, ``null``."""
    return None if _is_none(value) else byte_size(value, name)


def format_bytes(count: int) -> str:
    """``count`` bytes for people: ``20 GiB``, ``1.5 MiB``, ``300 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.4g} {unit}"
    return f"{count} B"


# command-line types (argparse)
POSITIVE_INT = argparse_type(positive_int, "a positive integer", largest=LARGEST_INT)
NON_NEGATIVE_INT = argparse_type(non_negative_int, "a non-negative integer", largest=LARGEST_INT)
POSITIVE_FLOAT = argparse_type(positive_float, "a positive number")
NON_NEGATIVE_FLOAT = argparse_type(non_negative_float, "a number of at least 0")
STREAM_RATE = argparse_type(stream_rate, f"frames per second above 0 and at most {HIGHEST_FPS:g}")
BYTE_SIZE = argparse_type(byte_size, "a size in bytes such as 512M or 20G")


# kinds of value: one object for how a setting is checked in Python, read from text and typed on the command line
@dataclass(frozen=True)
class Kind:
    """The values a setting takes.

    annotation: the Python type, as a dataclass field declares it (``"int | None"``). check ``(value, name)``: a
    value given in Python, of the right type already (raises, naming ``name``). parse ``(value, name)``: a value
    that may arrive as text, converted (a converted value is still checked with ``check``). cli: the ``argparse``
    type (None: the text itself). choices: the accepted names, asked for when they are needed (a registry may
    grow), or None.
    """

    annotation: str
    check: Parser
    parse: Parser
    cli: Callable[[str], Any] | None = None
    choices: Callable[[], Sequence[str]] | None = None

    @property
    def optional(self) -> "Kind":
        """The same values or None (from text: ``""``, ``none``, ``null``)."""
        if self.annotation.endswith("| None"):
            return self
        return Kind(f"{self.annotation} | None", lambda value, name: None if value is None else self.check(value, name),
                    lambda value, name: None if _is_none(value) else self.parse(value, name), self.cli, self.choices)


def check_dtype(value: object, name: str = "dtype") -> object:
    """``value`` if it names a floating-point dtype (see `torch_dtype`: a name, ``"auto"`` or a ``torch.dtype``)."""
    torch_dtype(value, name)
    return value


def check_question(question: object, what: str = "the question") -> str:
    """``question`` if it is text a tokenizer takes: a string, not blank, with no lone surrogate (a string decoded
    with ``surrogateescape``, say); else an `InputError` naming ``what``."""
    if not isinstance(question, str):
        raise InputError(f"{what} must be text, got {type(question).__name__}")
    if not question.strip():
        raise InputError(f"{what} is empty")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(f"{what} holds a lone surrogate (U+{ord(question[error.start]):04X}) at character "
                         f"{error.start}, which is no text") from None
    return question


def check_text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a string, got {value!r}")
    return value


def one_of(choices: Callable[[], Sequence[str]], check: Parser | None = None) -> Kind:
    """Names from ``choices()`` (looked up when a value is checked: names registered later are accepted too);
    ``check``: the registry's own lookup, whose message names the known ones (default: `check_choice`)."""
    return Kind("str", check or (lambda value, name: check_choice(value, name, choices())),
                lambda value, name: choice(choices())(value, name), choices=choices)


POSITIVE = Kind("int", check_int, positive_int, POSITIVE_INT)
NON_NEGATIVE = Kind("int", lambda value, name: check_int(value, name, minimum=0), non_negative_int, NON_NEGATIVE_INT)
BOOLEAN = Kind("bool", check_bool, boolean)
TEXT = Kind("str", check_text, required_text)
DTYPE = Kind("str", lambda value, name: check_dtype(value, name), required_text)
DEVICE = Kind("str", check_device, required_text)
# a size in bytes; also as text (512M, 20G), in Python as on the command line (see `byte_size`)
BYTES = Kind("int", lambda value, name: byte_size(value, name) if isinstance(value, str) else check_int(value, name),
             byte_size, BYTE_SIZE)


def _path_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (a NUL byte)")
    if (why := too_long(text)) is not None:  # else a traceback where it is first looked at, or half a folder made
        raise argparse.ArgumentTypeError(f"{printable(text)}: {why}")
    return text


def _path(text: str) -> Path:
    return Path(_path_text(text)).expanduser()


_path.__name__ = _path_text.__name__ = "path"
PATH = _path  # a command-line path: an empty string would otherwise be the current folder
PATH_TEXT = _path_text  # the same, kept as text (where a hub id or a URL may be given instead)
