"""A capped stream that evicted for weeks resumes (or loads) in memory that follows what it holds: `CacheKeeper.adopt`
works on the runs of its evicted steps and tokens, never on a value per token or step it ever streamed."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import pytest
import torch

from statekv.core.cache.step_runs import StepRuns
from statekv.core.storage.limits import CacheKeeper, runs as runs_of
from statekv.core.storage.step_values import StepValues
from statekv.settings.engine import CacheLimit

STEPS = 200_001  # the prompt prefix, then steps of TOKENS tokens: 40 million tokens
PREFIX, TOKENS, PER_SEGMENT = 50, 200, 4


class Storage:
    """What a layer's storage is told to give back, as ``[start, end)`` runs."""

    segment_steps = PER_SEGMENT

    def __init__(self, kv_cache_dtype):
        self.kv_cache_dtype = kv_cache_dtype
        self.given = {"tokens": [], "steps": [], "segments": [], "scales": []}

    def release_tokens(self, runs):
        self._add("tokens", runs)

    def release_steps(self, runs):
        self._add("steps", runs)

    def release_segments(self, runs):
        self._add("segments", runs)

    def release_step_scales(self, runs):
        self._add("scales", runs)

    def _add(self, what, runs):
        if isinstance(runs, torch.Tensor):  # ascending positions, as they were once given
            runs = runs_of(runs)
        self.given[what] += [tuple(run) for run in runs]


class Layer:
    def __init__(self, index, carried, kv_cache_dtype):
        self.index, self.is_initialized, self.storage = index, True, Storage(kv_cache_dtype)
        self.carried = torch.tensor(carried, dtype=torch.long).view(1, 1, -1)

    def positions(self):
        return self.carried


class Cache:
    """A loaded cache of `STEPS` steps whose steps ``1 .. STEPS - 12`` and ``STEPS - 5`` were evicted."""

    tally = None

    def __init__(self, kv_cache_dtype):
        self.chunk_lengths = StepValues([PREFIX] + [TOKENS] * (STEPS - 1))
        self.seen_tokens = PREFIX + TOKENS * (STEPS - 1)
        self.starts = self.chunk_lengths.running_totals()  # as `TwoStateCache.starts` keeps them, as runs
        self.evicted_steps = StepRuns.from_runs([(1, STEPS - 12), (STEPS - 5, STEPS - 4)])
        # carried: prefix tokens, a token of evicted steps 3 and STEPS - 5 (retained), tokens of held steps
        self.carried = [0, 1, start(3) + 7, start(STEPS - 5), start(STEPS - 5) + 9, start(STEPS - 1) + 2]
        self.layers = [Layer(index, self.carried, kv_cache_dtype) for index in range(2)]

    def evicted_tokens(self):
        return TOKENS * len(self.evicted_steps)


def start(step):
    return 0 if step == 0 else PREFIX + TOKENS * (step - 1)


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_adopting_a_long_evicting_history_costs_what_it_holds(kv_cache_dtype):
    """Before: adopt made a boolean per token ever streamed, its copy and the int64 positions of every evicted
    token per layer (about 9 bytes a token: 9 GB for a fortnight of an 8B model at 30 frames/s), and a Python
    int per evicted step."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
    except OSError:
        pytest.skip("the peak resident size cannot be reset here")
    cache = Cache(kv_cache_dtype)
    keeper = CacheKeeper(CacheLimit(1 << 20, "evict-oldest"), cache, bytes_per_token=1, protect_tokens=PREFIX)
    before = rss_kib()
    Path("/proc/self/clear_refs").write_text("5")
    tracemalloc.start()
    try:
        keeper.adopt()
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    grown = peak_rss_kib() - before
    assert grown < 16 << 10, grown  # KiB: before, ~370 MB
    assert traced < 1 << 20, traced  # before, ~10 MB
    retained = [start(3) + 7, start(STEPS - 5), start(STEPS - 5) + 9]
    runs = [(PREFIX, start(STEPS - 12)), (start(STEPS - 5), start(STEPS - 4))]
    tokens = [(PREFIX, retained[0]), (retained[0] + 1, start(STEPS - 12)), (retained[1] + 1, retained[2]),
              (retained[2] + 1, start(STEPS - 4))]
    for layer in cache.layers:
        assert keeper.retained[layer.index].tolist() == retained
        assert layer.storage.given["tokens"] == tokens
        assert layer.storage.given["steps"] == [(1, STEPS - 12), (STEPS - 5, STEPS - 4)]
        assert layer.storage.given["segments"] == [(1, (STEPS - 12) // PER_SEGMENT)]
        scales = [(1, 3), (4, STEPS - 12)] if kv_cache_dtype else []
        assert layer.storage.given["scales"] == scales
    assert runs == [(start(a), start(b)) for a, b in cache.evicted_steps.runs()]
    assert keeper.released_segments == (STEPS - 12) // PER_SEGMENT - 1
    assert keeper.evicted_tokens == TOKENS * (STEPS - 12)
    # the oldest held step after the prompt prefix is the first evicted next
    assert keeper.make_room((1 << 20) - 1000)[:2] == [STEPS - 12, STEPS - 11]
