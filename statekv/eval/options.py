"""Strict parsing of ``name=value`` options such as lmms-eval's ``--model_args``.

Values arrive as strings, or already converted by the caller (lmms-eval turns ``true``/``false`` into
booleans and digit strings into ints, but leaves ``yes``, ``off`` or ``None`` as strings). Each parser
accepts both and refuses anything else with a `ConfigurationError` whose one-line message names the
option and the value::

    spec = [Option("budget", positive_int, 4096), Option("offload", boolean, False)]
    parse_options({"budget": "1024", "offload": "off"}, spec)   # {"budget": 1024, "offload": False}
    parse_options({"bugdet": 1024}, spec)                       # ConfigurationError: unknown option bugdet; ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from statekv.core.errors import ConfigurationError

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NONE_WORDS = ("", "none", "null")

Parser = Callable[[Any, str], Any]


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
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and number < minimum:
        raise ConfigurationError(f"{name} must be at least {minimum}, got {value!r}")
    return number


def positive_int(value: Any, name: str) -> int:
    return integer(value, name, minimum=1)


def positive_float(value: Any, name: str) -> float:
    """A finite number greater than zero (int, float or a string of one)."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        number = _from_text(value, float)
    if number is None or not math.isfinite(number):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    if number <= 0:
        raise ConfigurationError(f"{name} must be greater than 0, got {value!r}")
    return number


def optional_text(value: Any, name: str) -> str | None:
    """A non-empty string, or None for None, ``""``, ``none``, ``null`` (any case)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a string, got {value!r}")
    return None if value.strip().lower() in NONE_WORDS else value.strip()


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

    return parse


def _from_text(text: str, convert: Callable[[str], Any]) -> Any:
    """``convert(text)`` without surrounding spaces, or None when it refuses the text."""
    try:
        return convert(text.strip())
    except ValueError:
        return None
