"""What one question or watch evaluation over a stream that evicts builds follows the steps it holds, not every
step it ever took: a stream run for weeks holds tens of millions of steps, a few thousand of them held, and a
tensor or list of every step (eight bytes each) costs hundreds of MB and tens of ms per question."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from statekv.api.encoded import EncodedVideo
from statekv.core.cache.step_runs import StepRuns
from statekv.core.storage.step_values import StepValues
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

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


@pytest.fixture(scope="module")
def long_evicted(checkpoint):
    """A stream capped to hold about ten of its 121 steps (evict-oldest), its questions read past the range."""
    qa = tiny_qa(load_adapter(checkpoint, layout="chat"), "statekv", offload=True, max_cache_bytes=300_000,
                 cache_limit="evict-oldest")
    stream = qa.stream()
    for frame in random_frames(120):
        stream.push(frame)
    cache = stream.prefill.cache
    assert len(cache.chunk_lengths) > 100 and len(cache.chunk_lengths) - len(cache.evicted_steps) < 20
    return stream


def test_a_retrieving_question_and_watch_build_nothing_of_every_step_they_do_not_hold(long_evicted, built):
    """Before: each question made the starts of every step, every step's length and past the range every step's
    turns (and a watch's evaluation every step's rotations); now what they build follows the steps held."""
    long_evicted.ask("Why?", max_new_tokens=2, retrieve=2)
    asked = max(built, default=0)
    built.clear()
    watch = long_evicted.watch("What?", every=1000, retrieve=2, max_new_tokens=2)
    assert watch.error is None and asked < 40 and max(built, default=0) < 40, (asked, built)


@pytest.mark.parametrize("values", [[3] * 50 + [5] * 40 + [1, 2, 3, 4] + [7] * 9, list(range(0, 300, 7)),
                                    [(step * 7919) % 13 for step in range(400)], [4]])
def test_values_gathered_at_some_steps_read_as_the_whole_tensor_indexed(values):
    held = StepValues(values)
    index = torch.tensor([0, len(values) - 1, len(values) // 2, 0, len(values) // 3])
    assert held.gathered(index).tolist() == held.tensor()[index].tolist()
    assert held.gathered(torch.zeros(0, dtype=torch.long)).tolist() == []
