"""``statekv demo`` as a newcomer meets it: its minute of work says what it is doing, and its --help reads as
text."""

from __future__ import annotations

import json

import pytest
from statekv.cli import main


def test_the_demo_says_on_stderr_what_it_does_while_stdout_keeps_only_the_results(tmp_path, monkeypatch, capsys):
    """Before: nothing was printed for the half minute of work before the results (a newcomer saw a silent
    terminal)."""
    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--videos", "1", "--no-plot", "--max-new-tokens", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["builtin"]  # stdout: the document alone
    lines = [line for line in captured.err.splitlines() if line.startswith("statekv demo: ")]
    assert lines[0] == ("statekv demo: writing 1 held-out synthetic video to "
                        f"{tmp_path / 'cache' / 'demo-synthetic-v3-1'} (first run only)")
    assert lines[1] == "statekv demo: loading the built-in model"
    assert lines[2:] == [f"statekv demo: {label} ({index}/3): answering 6 questions about 1 video, then it as one "
                         "stream"
                         for index, label in enumerate(("full attention", "recency R=16", "StateKV B=64"), 1)]
    assert main(["demo", "--videos", "1", "--no-plot", "--max-new-tokens", "2", "--json"]) == 0
    assert "writing" not in capsys.readouterr().err  # the second run reuses the videos


def test_the_demos_help_shows_no_restructuredtext_marks(capsys):
    """Before: its description came from the module's docstring with its ``--video`` marks."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wide as the terminal
    assert "Without --video it runs on held-out synthetic videos" in out and "``" not in out
