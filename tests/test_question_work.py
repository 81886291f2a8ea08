"""What one question or watch evaluation over a stream that evicts builds follows the steps it holds, not every
step it ever took: a stream run for weeks holds tens of millions of steps, a few thousand of them held, and a
tensor or list of every step (eight bytes each) costs hundreds of MB and tens of ms per question."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from statekv.api.encoded import EncodedVideo
from statekv.core.cache.step_runs import StepRuns
from statekv.core.storage.step_values import StepValues

WEEKS = 36_000_000  # steps of a fortnight at 30 frames a second


@pytest.fixture
def built(monkeypatch):
    """The lengths of the per-step tensors built while the test runs (every `StepValues` and `StepRuns` tensor)."""
    lengths: list[int] = []

    def counted(method):
        def made(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            lengths.append(len(out))
            return out
        return made

    for owner, name in ((StepValues, "tensor"), (StepValues, "totals"), (StepRuns, "mask"), (StepRuns, "tensor")):
        monkeypatch.setattr(owner, name, counted(getattr(owner, name)))
    return lengths


def test_the_frames_of_a_few_steps_are_read_without_a_tensor_of_every_step(built):
    """Before: `frames_of` (every answer's `read_frames`) made the running totals of every step streamed."""
    frames = StepValues([0])
    frames.extend_run(1, 0, WEEKS)  # one frame a step, as one run
    video = SimpleNamespace(step_frames=frames)
    assert EncodedVideo.frames_of(video, (WEEKS, 5, WEEKS - 1, WEEKS + 3)) == (WEEKS - 1, 4, WEEKS - 2)
    assert max(built, default=0) < 100
