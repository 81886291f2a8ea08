"""statekv as a user installs it: what a missing extra says, and what the built distributions hold."""

from __future__ import annotations

import subprocess
import sys

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
