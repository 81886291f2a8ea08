"""`statekv bench serve`'s arrivals: what its flags schedule (the questions' rate whatever their burstiness) and the
schedules it refuses in one line before anything starts."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

NOWHERE = ["--url", "http://127.0.0.1:9", "--api-key", "x", "--streams", "1"]


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1", "--duration", "1"],  # a traceback once the warm-up's stream was made
     "--seed: expected a non-negative integer, got '-1'"),
    (["--question-rate", "1e9", "--duration", "30"],  # scheduled for good, once the warm-up was done
     "--duration 30 s at --question-rate 1e+09 schedules more questions a camera than a run can send"),
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


@pytest.mark.parametrize("burstiness", [0.1, 0.25, 4.0])
def test_questions_arrive_at_their_rate_whatever_their_burstiness(burstiness):
    """Before: each stream's questions began at a question at the clock's start, so a 30-second run at 0.1 a second
    asked 6.8 questions per stream in bursts (burstiness 0.1) and 2.6 when regular (4), not 3."""
    import numpy as np

    from statekv.bench.load import LoadSettings, schedule

    settings = LoadSettings(fps=1.0, duration=30.0, question_rate=0.1, burstiness=burstiness, seed=0)
    asked = np.bincount([r.stream for r in schedule(2000, settings, 0.0) if r.kind == "question"], minlength=2000)
    assert asked.mean() == pytest.approx(3.0, abs=0.3)
