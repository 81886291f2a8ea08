"""`StepValues`, a list of ints kept as arithmetic runs: it reads as the list it was given, and a steady stream's
lists take a few runs at any age."""

from __future__ import annotations

import bisect
import random

import pytest
import torch

from statekv.core.storage.step_values import StepValues


@pytest.mark.parametrize("seed", range(6))
def test_it_reads_as_the_list_it_was_given(seed):
    rng = random.Random(seed)
    values, kept = [], StepValues()
    for _ in range(rng.randrange(0, 300)):
        value = rng.choice([values[-1] if values else 0, (values[-1] + 7) if values else 3, rng.randrange(-50, 500)])
        values.append(value)
        kept.append(value)
        assert kept[-1] == value and len(kept) == len(values)
    assert kept == values and list(kept) == values and kept == StepValues(values)
    assert [kept[index] for index in range(-len(values), len(values))] == values + values if values else True
    for start, stop, step in [(0, None, None), (3, -2, None), (None, None, 3), (-5, None, None), (10, 4, -1)]:
        assert kept[start:stop:step] == values[start:stop:step]
    assert torch.equal(kept.tensor(), torch.tensor(values, dtype=torch.long))
    ascending = sorted(values)
    sorted_kept = StepValues(ascending)
    for probe in range(-60, 520, 7):
        assert bisect.bisect_right(sorted_kept, probe) == bisect.bisect_right(ascending, probe)
    with pytest.raises(IndexError):
        kept[len(values)]


def test_a_steady_streams_lists_take_a_few_runs_at_any_age():
    lengths, starts, frames = StepValues([3]), StepValues([0, 3]), StepValues([0])
    for _ in range(100_000):
        lengths.append(260)
        starts.append(starts[-1] + 260)
        frames.append(1)
    assert lengths.runs() == [[3, 257, 2], [260, 0, 99_999]] and len(starts.runs()) == 2
    assert frames.runs() == [[0, 1, 2], [1, 0, 99_999]] and sum(frames) == 100_000
    assert starts[-1] == 3 + 260 * 100_000 and lengths[50_000] == 260


def test_then_is_a_copy_with_one_more_value():
    kept = StepValues([3, 260, 260])
    more = kept.then(260)
    assert more == [3, 260, 260, 260] and kept == [3, 260, 260] and more.runs() == [[3, 257, 2], [260, 0, 2]]
    assert torch.tensor(more).tolist() == list(more) and tuple(more) == (3, 260, 260, 260)
