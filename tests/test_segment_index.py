"""The segment index a storage keeps step by step is bit for bit the direct computation (the minimum, maximum and
sum of each segment's keys, in the keys' dtype), signed zeros, infinities and NaNs included; a step staged but
never committed changes nothing; a saved open segment resumes exactly, at a segment's end too."""

from __future__ import annotations

import math

import torch

from statekv.core.storage.layer_storage import SEGMENT_STEPS, LayerStorage

D = 4


def step_keys(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``[1, 2, T, D]`` keys per step, with -0.0 beside +0.0, infinities and a NaN in some channels."""
    generator = torch.Generator().manual_seed(seed)
    keys = []
    for step in range(steps):
        k = torch.randn(1, 2, 3, D, generator=generator).to(torch.bfloat16)
        k[0, 0, :, 0] = torch.tensor([0.0, -0.0, 0.0]) if step % 2 else torch.tensor([-0.0, -0.0, -0.0])
        if step % 5 == 1:
            k[0, 1, 1, 1] = math.inf
        if step % 7 == 2:
            k[0, 1, 2, 2] = -math.inf
        if step == 3:
            k[0, 0, 0, 3] = math.nan
        keys.append(k)
    return keys


def direct(keys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(index rows, the open segment as saved) by the definition, one step at a time."""
    rows, open_segment = [], None
    for number, k in enumerate(keys):
        chunk = torch.cat([k.amin(2, keepdim=True), k.amax(2, keepdim=True), k.sum(2, keepdim=True)], -1)
        if number % SEGMENT_STEPS == 0:
            open_segment = chunk
        else:
            open_segment = torch.cat([torch.minimum(open_segment[..., :D], chunk[..., :D]),
                                      torch.maximum(open_segment[..., D:2 * D], chunk[..., D:2 * D]),
                                      open_segment[..., 2 * D:] + chunk[..., 2 * D:]], -1)
        if (number + 1) % SEGMENT_STEPS == 0:
            rows.append(open_segment)
    return torch.cat(rows, 2) if rows else keys[0].new_empty(1, 2, 0, 3 * D), open_segment


def take(storage: LayerStorage, k: torch.Tensor, commit: bool = True) -> None:
    if storage.segment_open is None:
        storage.start(k)
    storage.prepare(k.shape[2])
    storage.stage_summaries(k, torch.tensor([storage.block_keys.length]))
    storage.detailed.reserve(k, storage.length + k.shape[2])
    storage.stage_chunk(torch.arange(storage.length, storage.length + k.shape[2]), k, k)
    if commit:
        storage.commit_device()
        storage.commit_host(k.shape[2])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_index_is_the_direct_computation_bit_for_bit():
    keys = step_keys(2 * SEGMENT_STEPS + 3)
    storage = LayerStorage(None, "cpu", lambda: None)
    for count, k in enumerate(keys, start=1):
        take(storage, k)
        rows, open_segment = direct(keys[:count])
        assert same_bits(storage.segments.index, rows)
        assert same_bits(storage.saved_segment(), open_segment)  # at a segment's end: that segment's, as saved
    index = storage.segments.index
    assert index.shape[2] == 2 and torch.isnan(index).any() and torch.isinf(index).any()


def test_a_step_staged_but_not_committed_changes_nothing():
    keys = step_keys(SEGMENT_STEPS + 2, seed=1)
    clean, failed = LayerStorage(None, "cpu", lambda: None), LayerStorage(None, "cpu", lambda: None)
    for number, k in enumerate(keys):
        if number in (3, SEGMENT_STEPS - 1):
            take(failed, keys[-1] * 7, commit=False)  # staged, then the step failed
        take(failed, k)
        take(clean, k)
        assert same_bits(failed.saved_segment(), clean.saved_segment())
        assert same_bits(failed.segments.index, clean.segments.index)


def test_a_saved_open_segment_resumes_exactly():
    keys = step_keys(2 * SEGMENT_STEPS + 4, seed=2)
    for cut in (5, SEGMENT_STEPS, SEGMENT_STEPS + 1):  # mid-segment, right at a segment's end, right after
        whole, first = LayerStorage(None, "cpu", lambda: None), LayerStorage(None, "cpu", lambda: None)
        for k in keys[:cut]:
            take(first, k)
        saved = {name: t.clone() for name, t in first.export().items()}
        resumed = LayerStorage(None, "cpu", lambda: None)
        resumed.load(saved, [k.shape[2] for k in keys[:cut]], torch.device("cpu"))
        for k in keys:
            take(whole, k)
        for k in keys[cut:]:
            take(resumed, k)
        assert same_bits(resumed.segments.index, whole.segments.index)
        assert same_bits(resumed.saved_segment(), whole.saved_segment())


def test_a_state_saved_before_summaries_and_index_loads_with_its_step_lengths_as_runs():
    """A resume gives the step lengths as runs (`StepValues`): recomputing the summaries and the segment index from
    the keys (a state saved before they were kept) takes them as it takes a list. Before: a `TypeError`."""
    from statekv.core.storage.step_values import StepValues

    keys = step_keys(SEGMENT_STEPS + 2)
    every = torch.cat(keys, 2)
    loaded = []
    for steps in ([k.shape[2] for k in keys], StepValues(k.shape[2] for k in keys)):
        storage = LayerStorage(None, "cpu", lambda: None)
        storage.load({"keys": every, "values": every}, steps, torch.device("cpu"))
        loaded.append((storage.segments.index, storage.saved_segment(), storage.block_keys.view(0, len(keys))[0]))
    rows, open_segment = direct(keys)
    assert same_bits(loaded[1][0], rows) and same_bits(loaded[1][1], open_segment)
    assert all(same_bits(a, b) for a, b in zip(*loaded))
