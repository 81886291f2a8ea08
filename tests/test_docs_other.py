"""The docs no other test runs, held to the code: every ``statekv`` command of a code block in them parsed by the
CLI's own parser, and every dotted name of statekv in docs/architecture.md and docs/engine.md found under that name.

A name is checked when it starts with ``statekv.``, with one of statekv's modules (``core.answering.decoding.Prompt``)
or with a name ``statekv`` exports (``Stream.ask``, ``EncodedVideo.successor``): imported and looked up part by part,
a class's instance attributes being its dataclass fields and what its source sets on ``self``. Names relative to a
room (``batching.run_rows``) and the prose's objects (``qa.engine``) are left to review. docs/serving.md and
README.md are tests/test_docs.py's.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from typing import Any

import pytest

import statekv
from test_docs import REPO, blocks, logical_lines, parse_with_cli, statekv_argv

DOCS = ["engine", "evaluation", "models", "retrieval", "architecture", "analysis", "kernel", "flops",
        "accuracy", "benchmarks"]  # the last two are result logs: only their commands
WALKS = ["architecture", "engine"]
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")  # `a.b.c`, `a.b(...)`


def commands(doc: str) -> list[str]:
    return [line.strip() for _, text in blocks(REPO / "docs" / f"{doc}.md") for line in logical_lines(text)
            if line.strip().startswith("statekv ")]


def test_every_statekv_command_in_the_other_docs_parses():
    found = {doc: commands(doc) for doc in DOCS}
    assert all(found[doc] for doc in ("evaluation", "analysis", "flops")), found
    for doc, lines in found.items():
        for line in lines:
            parse_with_cli(statekv_argv(line))


def member(owner: Any, name: str) -> tuple[bool, Any]:
    """Whether ``owner`` has ``name`` (a submodule, an attribute, a class's dataclass field or an attribute its
    source sets on ``self``), and its value where the lookup can go on from it (None: an instance's attribute)."""
    if hasattr(owner, name):
        return True, getattr(owner, name)
    if inspect.ismodule(owner):
        try:
            return True, importlib.import_module(f"{owner.__name__}.{name}")
        except ModuleNotFoundError:
            return False, None
    if inspect.isclass(owner):
        if dataclasses.is_dataclass(owner) and name in {field.name for field in dataclasses.fields(owner)}:
            return True, None
        sets = re.compile(rf"\bself\.{name}\s*(?::[^=\n]*)?=[^=]")
        return any(base.__module__.startswith("statekv") and sets.search(inspect.getsource(base))
                   for base in owner.__mro__), None
    return False, None


def resolves(dotted: str) -> bool:
    owner: Any = statekv
    for name in dotted.split(".")[1:]:
        if owner is None:  # what an instance's attribute holds is not looked into
            return True
        found, owner = member(owner, name)
        if not found:
            return False
    return True


@pytest.mark.parametrize("doc", WALKS)
def test_every_dotted_name_of_statekv_in_the_walks_is_found(doc):
    modules = {module.name for module in pkgutil.iter_modules(statekv.__path__)}
    names = dict.fromkeys(DOTTED.findall((REPO / "docs" / f"{doc}.md").read_text()))
    checked = []
    for name in names:
        first = name.split(".")[0]
        if any(part.startswith("_") for part in name.split(".")):
            continue  # a module's own name: the docs may point at it, the tests do not reach it
        if first == "statekv":
            checked.append(name)
        elif first in modules or first in statekv.__all__:
            checked.append(f"statekv.{name}")
    assert len(checked) > 40, checked
    missing = [name for name in checked if not resolves(name)]
    assert missing == [], f"docs/{doc}.md names what statekv does not have: {missing}"
