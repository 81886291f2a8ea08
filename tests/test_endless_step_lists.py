"""A stream that never ends holds flat host memory under an evicting cache cap: nothing it keeps of its steps grows
with the steps it ever took (a steady stream's lists as runs; the per-step tallies of the steps it still holds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from statekv.api.retrieved import held_frames
from statekv.core.cache.step_runs import StepRuns
from statekv.core.storage.step_values import StepValues
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
CAPPED = dict(offload=True, max_cache_bytes=60_000)


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _pushed(stream, frames) -> None:
    for frame in frames:
        stream.push(frame)


def test_an_evicting_streams_step_starts_take_no_memory_a_step(adapter):
    """Before: `TwoStateCache.step_starts` kept a tensor of every step's first token for good, extended as
    questions read it (eight bytes a step, doubled): four times the steps held about four times the bytes."""
    stream = tiny_qa(adapter, "statekv", cache_limit="evict-oldest", **CAPPED).stream()
    frames = random_frames(80)  # frames 10 to 99 take one step length (their numbers two digits)
    cache = stream.prefill.cache
    sizes = []
    for part in (frames[:20], frames[20:]):
        _pushed(stream, part)
        stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2)  # a question with retrieval reads every start
        sizes.append(cache.step_bytes)
    assert len(cache.chunk_lengths) > 80 and len(cache.evicted_steps) > 70
    assert cache.step_starts().tolist() == [0, *cache.starts[1:]]
    assert sizes[1] == sizes[0], sizes


def test_an_evicting_streams_attention_tally_holds_the_steps_it_holds_not_every_step(adapter):
    """Before: evict-least-attended's `AttentionTally` kept a total and an end for every step streamed (16 bytes a
    step, doubled), the evicted steps' too, though none was read again."""
    stream = tiny_qa(adapter, "statekv", cache_limit="evict-least-attended", **CAPPED).stream()
    frames = random_frames(80)
    cache = stream.prefill.cache
    for part in (frames[:20], frames[20:]):
        _pushed(stream, part)
        held = len(cache.chunk_lengths) - len(cache.evicted_steps)
        assert cache.tally.nbytes <= 16 * held, (cache.tally.nbytes, held)
    assert len(cache.chunk_lengths) > 80 and len(cache.evicted_steps) > 70
    steps, totals = cache.tally.export(cache.evicted_steps)
    assert steps.numel() and bool((totals > 0).all())


def test_the_frames_a_long_stream_holds_are_counted_by_runs_not_a_step_at_a_time():
    """Before: the count a too-wide retrieval's refusal words (`held_frames`) built a tensor of every step's frames
    and a mask of every step ever taken; a stream of a trillion steps (a forged history) could not be counted."""
    steps = 10**12
    starts, frames = StepValues([0]), StepValues([0])  # the prompt prefix: a step of three tokens, no frame
    starts.extend_run(3, 6, steps)
    frames.extend_run(1, 0, steps - 1)
    evicted = StepRuns.from_runs([(1, steps // 2), (steps // 2 + 10, steps // 2 + 20)])
    video = SimpleNamespace(prefill=SimpleNamespace(cache=SimpleNamespace(starts=starts, evicted_steps=evicted)),
                            step_frames=frames)
    assert held_frames(video, keep_tokens=3) == 10 + steps - (steps // 2 + 20)
    assert held_frames(video, keep_tokens=9) == held_frames(video, keep_tokens=3)  # step 1 evicted anyway
