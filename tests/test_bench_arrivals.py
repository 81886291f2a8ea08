"""`statekv bench serve`'s arrivals: what its flags schedule (the questions' rate whatever their burstiness) and the
schedules it refuses in one line before anything starts."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

NOWHERE = ["--url", "http://127.0.0.1:9", "--api-key", "x", "--streams", "1", "--duration", "1"]


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed: expected a non-negative integer, got '-1'"),  # a traceback once the streams were made
])
def test_flags_no_schedule_can_follow_are_one_line_and_start_nothing(args, message, capsys):
    from statekv.cli import main

    try:
        code = main(["bench", "serve", *NOWHERE, *args])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err
