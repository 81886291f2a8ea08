"""Checks of the values a JSON record read from a file holds (a saved stream's metadata, `statekv.api.stream_file`;
a disk-tier stream's description, `statekv.api.stream_disk`), built from small parts: each is called with the value
and the name it goes by in messages, and returns the value or raises a one-line `InputError` naming it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InputError
from ..settings.values import check_int, is_finite_number

Check = Callable[[Any, str], Any]


def integer_check(minimum: int = 0) -> Check:
    # a saved count or tick is refused past int64 only: a clock of epoch seconds at a high rate ticks past 2^48
    return lambda value, name: check_int(value, name, minimum=minimum, maximum=2**63 - 1, error=InputError)


def number_check(*, positive: bool = False, highest: float | None = None) -> Check:
    def check(value: Any, name: str) -> float:
        if not is_finite_number(value) or value < 0 or (positive and value == 0):
            raise InputError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        if highest is not None and value > highest:
            raise InputError(f"{name} must be at most {highest:g}, got {value!r}")
        return value
    return check


def type_check(kind: type, description: str) -> Check:
    def check(value: Any, name: str) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InputError(f"{name} must be {description}, got {value!r}"[:200])
        return value
    return check


def optional_check(check: Check) -> Check:
    return lambda value, name: None if value is None else check(value, name)


def list_check(check: Check, *, length: int | None = None) -> Check:
    def check_list(value: Any, name: str) -> list:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            size = f" of {length}" if length is not None else ""
            raise InputError(f"{name} must be a list{size}, got {value!r}"[:200])
        return [check(item, f"{name}[{index}]") for index, item in enumerate(value)]
    return check_list


def record_check(fields: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """A JSON object with exactly ``fields``, and any of ``optional``, each checked."""
    optional = optional or {}
    def check(value: Any, name: str) -> dict:
        if not isinstance(value, dict):
            raise InputError(f"{name} must be an object, got {value!r}"[:200])
        missing = [key for key in fields if key not in value]
        unknown = [key for key in value if key not in fields and key not in optional]
        if missing or unknown:
            problem = f"lacks {missing[0]!r}" if missing else f"has unknown field {unknown[0]!r}"
            raise InputError(f"{name} {problem}")
        every = {**fields, **{key: check for key, check in optional.items() if key in value}}
        return {key: every[key](value[key], f"{name}.{key}") for key in every}
    return check


def dataclass_check(cls: type, optional: tuple[str, ...] = ()) -> Check:
    """A record of a dataclass's fields, each checked by its default: counts, lists of seconds, optional counts,
    mappings; those named in ``optional`` may be absent."""
    checks: dict[str, Check] = {}
    for field in dataclasses.fields(cls):
        factory = field.default_factory
        if factory is list:
            checks[field.name] = list_check(number_check())
        elif factory is dict:
            checks[field.name] = type_check(dict, "an object")
        elif field.default is None:
            checks[field.name] = optional_check(integer_check())
        elif isinstance(field.default, float):
            checks[field.name] = number_check()
        else:
            checks[field.name] = integer_check()
    return record_check({k: v for k, v in checks.items() if k not in optional},
                   {k: v for k, v in checks.items() if k in optional})
