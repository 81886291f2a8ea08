"""`StepRuns`, the set a stream's evicted steps are kept in: a set of ints, as its runs of consecutive steps."""

from __future__ import annotations

import random

import pytest
import torch

from statekv import Stream
from statekv.core.cache.step_runs import StepRuns
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def test_step_runs_is_the_set_of_its_steps():
    rng = random.Random(0)
    for _ in range(100):
        reference, runs = set(), StepRuns()
        for _ in range(200):
            step = rng.randrange(60)
            if rng.random() < 0.7:
                reference.add(step)
                runs.add(step)
            else:
                reference.discard(step)
                runs.discard(step)
            assert runs == reference and reference == runs and list(runs) == sorted(reference)
        assert all((step in runs) == (step in reference) for step in range(-1, 62))
        assert all(start < end for start, end in runs.runs())
        assert all(end < start for (_, end), (start, _) in zip(runs.runs(), runs.runs()[1:]))  # never adjacent
        total, first = rng.randrange(70), rng.randrange(70)
        assert [s for a, b in runs.held_runs(total) for s in range(a, b)] == [s for s in range(total)
                                                                              if s not in reference]
        assert runs.count_from(first) == sum(1 for step in reference if step >= first)
        assert set(runs.below(first)) == {step for step in reference if step < first}
        values = [rng.randrange(9) for _ in range(70)]
        prefix = [0]
        for value in values:
            prefix.append(prefix[-1] + value)
        assert runs.total_over(prefix) == sum(values[step] for step in reference)
        assert runs.mask(total).nonzero().squeeze(1).tolist() == sorted(s for s in reference if s < total)
        assert runs.tensor().tolist() == sorted(reference)
        assert StepRuns.from_runs(runs.runs()) == runs == StepRuns(reference) == runs.copy()


def test_an_evicting_stream_keeps_its_evicted_steps_as_a_few_runs(adapter, tmp_path):
    """Evicting for as long as it streams, a stream keeps the gaps between the steps it holds, not one entry a step
    (a question used to walk every step ever evicted, so its cost grew with the stream's age); a saved copy holds
    the same steps and answers alike."""
    for policy in ("evict-oldest", "evict-least-attended"):
        qa = tiny_qa(adapter, "statekv", offload=True, max_cache_bytes=120_000, cache_limit=policy)
        stream = qa.stream()
        for frame in random_frames(150):
            stream.push(frame)
        evicted = stream.prefill.cache.evicted_steps
        assert len(evicted) > 100 and len(evicted.runs()) * 4 < len(evicted), policy  # far fewer runs than steps
        if policy == "evict-oldest":
            assert len(evicted.runs()) == 1
        loaded = Stream.load(stream.save(tmp_path / f"{policy}.safetensors"), qa)
        assert loaded.prefill.cache.evicted_steps == evicted
        for retrieve in (None, 2):
            assert torch.equal(loaded.ask_tokens("Why?", max_new_tokens=4, retrieve=retrieve),
                               stream.ask_tokens("Why?", max_new_tokens=4, retrieve=retrieve))
