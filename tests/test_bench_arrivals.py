"""`statekv bench serve`'s arrivals: what its flags schedule (the questions' rate whatever their burstiness), the
schedules it refuses in one line before anything starts, and which cameras it counts as held at real time."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")

from statekv.bench.load import Request, Run  # noqa: E402
from statekv.bench.summary import Targets, held_all, summarize  # noqa: E402

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
    from statekv.bench.load import LoadSettings, schedule

    settings = LoadSettings(fps=1.0, duration=30.0, question_rate=0.1, burstiness=burstiness, seed=0)
    asked = np.bincount([r.stream for r in schedule(2000, settings, 0.0) if r.kind == "question"], minlength=2000)
    assert asked.mean() == pytest.approx(3.0, abs=0.3)


def _served(stream: int, seconds: float, period: float, count: int) -> list[Request]:
    """A camera's frames, each sent when due or once the one before it is streamed, ``seconds`` each to stream."""
    frames, done = [], 0.0
    for k in range(count):
        sent = max(k * period, done)
        done = sent + seconds
        frames.append(Request("frame", stream, due=k * period, sent=sent, done=done))
    return frames


def test_a_camera_served_a_little_slower_than_real_time_is_not_held_however_small_its_lag_yet():
    """Before: held meant a p95 lag under the target alone, so a camera served at 97% of real time (its lag
    growing without bound) was held by a 30-s run, its p95 lag 0.98 s under the 1-s target."""
    period = 0.1
    slow = _served(0, period / 0.97, period, 300)
    fast = _served(1, period / 1.03, period, 300)
    row = summarize(Run(2, 0.0, slow + fast), fps=1 / period, duration=30.0, targets=Targets(), mean_batch=None)
    lags = [r.done - r.due for r in slow]
    assert float(np.percentile(lags, 95)) < 1.0 < lags[-1] + 0.1  # under the target, yet growing
    assert row["held_streams"] == 1 and row["goodput_streams"] == 1 and not held_all(row)
    alone = Run(1, 0.0, _served(0, period / 1.03, period, 300))
    row = summarize(alone, fps=1 / period, duration=30.0, targets=Targets(), mean_batch=None)
    assert row["held_streams"] == 1 and held_all(row)
