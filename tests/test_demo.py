"""`statekv demo`: the README's first command runs offline and reports what it claims."""

from __future__ import annotations

import json

from statekv.cli import main


def test_demo_streams_all_three_methods(capsys):
    argv = ["demo", "--json", "--frames", "8", "--tokens-per-frame", "16", "--budget", "40", "--window", "2"]
    assert main(argv) == 0
    rows = {row["method"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"full", "recency", "statekv"}
    assert all(row["tokens"] == 8 * 16 and row["frames"] == 8 for row in rows.values())
    assert rows["full"]["carried"] == 128 and rows["full"]["max_diff_vs_one_shot"] < 1e-4
    assert rows["recency"]["carried"] == 2 * 16
    assert rows["statekv"]["carried"] == 40
    assert rows["statekv"]["max_diff_vs_one_shot"] > 1e-4  # it does approximate: the state really is pruned


def test_demo_rejects_a_non_positive_budget(capsys):
    assert main(["demo", "--budget", "0"]) == 2
    assert "--budget must be a positive integer" in capsys.readouterr().err
