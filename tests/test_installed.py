"""statekv as a user installs it: what a missing extra says, and what the built distributions hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest


def _run_without(modules: tuple[str, ...], argv: list[str], cwd) -> subprocess.CompletedProcess:
    """``statekv ARGV`` in a fresh interpreter in which ``modules`` are not installed."""
    program = (f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n"
               f"from statekv.cli import main\nsys.exit(main({argv!r}))")
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("missing", ["fastapi", "nicegui"])
def test_serve_without_the_serve_extra_says_which_extra_in_one_line(tmp_path, missing):
    """Before: a traceback (without nicegui, only after the model had loaded and the port was bound)."""
    result = _run_without((missing,), ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"statekv serve: error: statekv serve needs the serve extra ({missing} is missing): pip install "
        "'statekv[serve]' (in a checkout: pip install -c constraints.txt -e '.[serve]')"]
    assert not (tmp_path / "state").exists()


def test_serve_without_the_page_needs_no_nicegui(tmp_path):
    """--no-page serves the API alone: its missing page library is not asked for (the server starts: refused
    here by a bad flag checked after the extra)."""
    result = _run_without(("nicegui",), ["serve", "--no-page", "--store", "s3://bucket/streams"], tmp_path)
    assert result.returncode == 2 and "--store is for a Ray cluster" in result.stderr, result.stderr


_NOT_SOURCE = {"build", "dist", "runs", "data", "statekv-state"}  # a checkout's outputs, beside hidden folders


def _not_source(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == Path(__file__).resolve().parents[1]
    return {name for name in names if name == "__pycache__" or name.endswith((".pyc", ".egg-info"))
            or top and (name.startswith(".") or name in _NOT_SOURCE)}


def test_the_sdist_holds_what_its_test_suite_needs(tmp_path):
    """Before: the sdist held tests/test_*.py alone, without conftest.py, the tests' helpers and data, or the docs
    and benchmarks they read, so no test ran from it."""
    repo = Path(__file__).resolve().parents[1]
    # built from a copy: a checkout's statekv.egg-info (pip install -e) lists the files of earlier builds, which
    # setuptools adds to the sdist whatever its rules say now
    source = tmp_path / "source"
    shutil.copytree(repo, source, ignore=_not_source)
    build = "from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", f"import sys; {build}", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, cwd=source)
    assert result.returncode == 0, result.stderr
    name = result.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        held = {member.split("/", 1)[1] for member in sdist.getnames() if "/" in member}
    needed = {path.relative_to(repo).as_posix() for folder in ("tests", "docs", "benchmarks")
              for path in (repo / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}
    needed |= {"LICENSE", "README.md", "pyproject.toml", "CHANGELOG.md", "Makefile", "constraints.in",
               "constraints.txt",
               "statekv/builtin/weights/model.safetensors", "statekv/builtin/weights/tokenizer.json"}
    assert sorted(needed - held) == []
    assert not [path for path in held if "__pycache__" in path or path.endswith(".pyc")]
