"""A setting declared once (`Setting`: its field, check, flag and text form) and `settings_class`, which makes a
frozen, checked dataclass from a table of them: the engine's settings (`statekv.settings.engine.EngineSettings`)
and `statekv.settings.options.ModelOptions`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .values import Kind, Option, Parser


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: a field of the class `settings_class` makes, its check, its flag and its text
    form.

    name: the field (the flag is ``--name`` with dashes; a boolean that defaults to True is ``--no-name``).
    default: its value when not given. kind: the values it takes (`Kind`: the Python check, the text parser, the
    command-line type and choices). help: the flag's help (argparse expands ``%(default)s``), or a function making
    it when the help is first shown. metavar: the flag's placeholder. check: instead of the kind's check. offered_by:
    a switch of the command that must be on for the flag to be offered (``"reserve"``). binding: a saved stream
    made under one value cannot be resumed under another (its state depends on it).
    """

    name: str
    default: Any
    kind: Kind
    help: str | Callable[[], str]
    metavar: str | None = None
    check: Parser | None = None
    offered_by: str | None = None
    binding: bool = False

    def validate(self, value: Any) -> None:
        """Raise a one-line `ConfigurationError` naming the setting if ``value`` is not one it takes."""
        (self.check or self.kind.check)(value, self.name)

    @property
    def text_option(self) -> Option:
        """How the setting is read from text (see `parse_options`)."""
        return Option(self.name, self.kind.parse, self.default)

    @property
    def flag(self) -> str:
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.default is True else f"--{dashed}"

    def with_changes(self, **changes: Any) -> "Setting":
        return replace(self, **changes)

    def add_to(self, group: argparse._ArgumentGroup, **overrides: Any) -> None:
        """Add the setting's flag to ``group`` (``overrides``: argparse keywords replacing the derived ones)."""
        arguments: dict[str, Any] = {"help": LaterText(self.help) if callable(self.help) else self.help}
        if self.kind.annotation.startswith("bool"):  # a switch: on (or, by default on, off) when given
            arguments.update(action="store_false" if self.default is True else "store_true", dest=self.name)
            if self.default is None:
                arguments["default"] = None
        else:
            arguments.update(default=self.default, metavar=self.metavar)
            if self.kind.cli is not None:
                arguments["type"] = self.kind.cli
            if self.kind.choices is not None:
                arguments["choices"] = LaterChoices(self.kind.choices)
        arguments.update(overrides)
        group.add_argument(self.flag, **arguments)


class LaterText:
    """A flag's help made when argparse first formats it, not as the parser is built (the methods' help needs the
    engine loaded: ``statekv --help`` does not)."""

    def __init__(self, make: Callable[[], str]):
        self.make, self.text = make, None

    def __str__(self) -> str:
        if self.text is None:
            self.text = self.make()
        return self.text

    def __bool__(self) -> bool:  # asked as the parser is built: a help is never empty
        return True

    def __mod__(self, values: Any) -> str:
        return str(self) % values

    def __contains__(self, part: str) -> bool:
        return part in str(self)

    def strip(self) -> str:
        return str(self).strip()


class LaterHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, reading a `LaterText` help as its text (argparse formats only strings)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return str(action.help)


class LaterChoices:
    """A flag's choices looked up when argparse checks a value or formats its help (see `LaterText`); a flag whose
    choices need the engine names a metavar, since argparse lists the choices as the flag is added to show none."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def __iter__(self):
        return iter(tuple(self.make()))

    def __contains__(self, value: Any) -> bool:
        return value in tuple(self.make())

    def __len__(self) -> int:
        return len(tuple(self.make()))


def settings_class(settings: tuple[Setting, ...]) -> Callable[[type], type]:
    """A class decorator making a frozen dataclass whose fields are ``settings`` (names, defaults and types, in
    order); the class reads its checks, flags and text forms from ``cls.SETTINGS``."""

    def build(cls: type) -> type:
        cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}),
                               **{setting.name: setting.kind.annotation for setting in settings}}
        for setting in settings:
            setattr(cls, setting.name, setting.default)
        cls.SETTINGS = settings
        return dataclass(frozen=True)(cls)

    return build
