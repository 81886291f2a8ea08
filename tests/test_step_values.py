"""`StepValues`, a list of ints kept as arithmetic runs: it reads as the list it was given, and a steady stream's
lists take a few runs at any age."""

from __future__ import annotations

import bisect
import random
from itertools import accumulate
from types import SimpleNamespace

import pytest
import torch

import statekv
from statekv.api.encoded import EncodedVideo
from statekv.core.storage.step_values import FEWEST_RUNS_DENSE, StepValues


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


def folded(values: list[int]) -> list[list[int]]:
    """The runs ``[first, difference, count]`` a plain fold of ``values`` gives (the model `runs` is checked on)."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][2] == 1:
            runs[-1][1:] = [value - runs[-1][0], 2]
        elif runs and runs[-1][0] + runs[-1][1] * runs[-1][2] == value:
            runs[-1][2] += 1
        else:
            runs.append([value, 0, 1])
    return runs


def regular(rng: random.Random, count: int, shortest: int = 20) -> list[int]:
    """Runs of ``shortest`` values or more: a constant or a steady climb, now and then another."""
    values: list[int] = []
    while len(values) < count:
        first, difference = rng.randrange(-1000, 1000), rng.choice([0, 0, 1, 260, -3])
        values += [first + difference * at for at in range(rng.randrange(shortest, shortest * 10))]
    return values[:count]


def irregular(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(0, 400) for _ in range(count)]


def agrees(kept: StepValues, values: list[int], rng: random.Random) -> None:
    """Every read of ``kept`` gives what the same read of the list ``values`` gives."""
    length = len(values)
    assert len(kept) == length and list(kept) == values and tuple(kept) == tuple(values)
    assert kept == values and values == kept and kept == tuple(values) and kept != values + [1]
    assert all(kept[index] == values[index] for index in range(-length, length))
    for index in (length, -length - 1, length + 5):
        with pytest.raises(IndexError):
            kept[index]
    bounds = [None, 0, 1, -1, length, -length, length + 3, -length - 3, length // 2, -(length // 3)]
    bounds += [rng.randrange(-length - 5, length + 5) for _ in range(6)]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1):
                assert kept[start:stop:step] == values[start:stop:step]
    for _ in range(20):
        start, stop = rng.choice(bounds), rng.choice(bounds)
        step = rng.choice([2, 3, -1, -2, 7])
        assert kept[start:stop:step] == values[start:stop:step]
    assert type(kept[1:3]) is list and kept.runs() == folded(values)
    assert torch.equal(kept.tensor(), torch.tensor(values, dtype=torch.long))
    assert kept.totals().tolist() == list(accumulate(values, initial=0))
    assert kept == StepValues(values) and StepValues(kept) == kept
    if values:
        assert kept != StepValues(values[:-1] + [values[-1] + 1])
    more = kept.then(-7)
    assert more == values + [-7] and kept == values and more.dense >= kept.dense


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", ["regular", "short runs", "irregular", "mixed", "irregular then regular",
                                   "short irregular"])
def test_both_forms_read_as_a_plain_list(seed, shape):
    rng = random.Random(seed)
    parts = {"regular": [regular(rng, 3000)], "short runs": [regular(rng, 3000, shortest=4)],
             "irregular": [irregular(rng, 1500)],
             "mixed": [regular(rng, 600), irregular(rng, 1500), regular(rng, 800)],
             "irregular then regular": [irregular(rng, 500), [260] * 2000],
             "short irregular": [irregular(rng, 60)]}[shape]
    values = [value for part in parts for value in part]
    kept, model, forms = StepValues(), [], {}
    checks = {0, 1, 2, 300, *rng.sample(range(len(values)), 3)}
    for index, value in enumerate(values):
        if index in checks:
            agrees(kept, model, rng)
            forms[index] = kept.dense
        kept.append(value)
        model.append(value)
    agrees(kept, model, rng)
    forms[len(values)] = kept.dense
    in_order = [forms[index] for index in sorted(forms)]
    turns = shape in ("irregular", "mixed", "irregular then regular")
    assert in_order[-1] == turns and in_order[:3] == [False] * 3 and in_order == sorted(in_order)
    assert forms.get(300, False) is (turns and shape != "mixed")  # the mixed list turns in its irregular middle
    assert shape != "short runs" or len(kept.runs()) > FEWEST_RUNS_DENSE  # many runs, yet not dense


def test_an_irregular_list_turns_dense_and_stays_so():
    rng = random.Random(0)
    steady, varied = StepValues([3]), StepValues()
    for _ in range(10_000):
        steady.append(260)
        varied.append(rng.randrange(100, 400))
    assert not steady.dense and len(steady.runs()) == 2
    assert varied.dense and len(varied) == 10_000
    for _ in range(10_000):
        varied.append(260)
    assert varied.dense and varied[-10_000:] == [260] * 10_000 and varied.runs()[-1][:2] == [260, 0]
    assert varied.then(5).dense and StepValues(varied).dense and not steady.then(260).dense


def test_a_streams_step_starts_grow_as_it_steps_and_follow_a_loaded_state(tiny_lm):
    """`TwoStateCache.step_starts` is kept as the steps commit (a tensor read earlier never changes, past many
    steps), and a state loaded over as many steps of other lengths gives that state's starts."""
    model = tiny_lm("qwen2")
    rng = random.Random(0)
    lengths = [rng.randrange(1, 4) for _ in range(150)]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    prefill, other = (statekv.StreamingPrefill(model, statekv.Recency(frames=2)) for _ in range(2))
    read = []
    for length, chunk in zip(lengths, torch.split(ids, lengths, dim=1)):
        prefill.step(input_ids=chunk)
        other.step(input_ids=chunk[:, :1] if length > 1 else chunk)  # as many steps, other lengths
        starts = prefill.cache.step_starts()
        assert starts.tolist() == list(accumulate(prefill.cache.chunk_lengths, initial=0))
        read.append((starts, starts.tolist()))
    assert all(starts.tolist() == values for starts, values in read)
    assert prefill.cache.step_of(sum(lengths) - 1) == (len(lengths) - 1, sum(lengths[:-1]))
    other.load_state_dict(*prefill.state_dict())
    assert other.cache.step_starts().tolist() == read[-1][1]
    assert other.cache.step_of(sum(lengths) - 1) == (len(lengths) - 1, sum(lengths[:-1]))


def test_the_frames_of_steps_are_read_from_the_running_totals():
    """`EncodedVideo.frames_of`: the frames each asked step holds, in the order asked, past the last step none."""
    frames = [0, 2, 0, 1, 3] + [1] * 100 + random.Random(0).choices(range(4), k=200)
    video = SimpleNamespace(step_frames=StepValues(frames))
    firsts = list(accumulate(frames, initial=0))
    for steps in [(1, 3, 4, 9_999), (2,), (), (0, 4, 1), tuple(range(len(frames))), (304, 150, 7)]:
        expected = tuple(frame for step in steps if step < len(frames)
                         for frame in range(firsts[step], firsts[step + 1]))
        assert EncodedVideo.frames_of(video, steps) == expected
    assert EncodedVideo.frames_of(video, (1, 3, 4)) == (0, 1, 2, 3, 4, 5)
    assert EncodedVideo.frames_of(video, None) is None


@pytest.mark.parametrize("shape", ["steady", "varied", "dense"])
def test_running_totals_read_as_accumulate(shape):
    rng = random.Random(1)
    values = {"steady": [3] * 50 + [5] * 40 + [1, 2, 3, 4] + [7] * 9,
              "varied": [rng.randrange(1, 9) for _ in range(30)],
              "dense": [rng.randrange(1, 9) for _ in range(400)]}[shape]
    held = StepValues(values)
    assert held.running_totals() == list(accumulate(values, initial=0))
    assert held.running_totals(7) == list(accumulate(values, initial=7))
    assert StepValues().running_totals() == [0]


def test_a_resumed_streams_step_starts_are_found_run_by_run(monkeypatch):
    """Before: the first `step_of` (or `evicted_tokens`, `step_starts`) after a resume walked every step the
    stream ever took (one `StepValues.append` a step: seconds for a stream weeks old); a steady stream's starts are
    now made a run at a time."""
    steps = 200_000
    cache = statekv.core.TwoStateCache(1, statekv.Recency(frames=2))
    lengths = StepValues([9, 4])
    lengths.extend_run(6, 0, steps - 2)
    cache.chunk_lengths = lengths
    cache.seen_tokens = lengths.total()
    appended = 0
    append = StepValues.append

    def counted(self, value):
        nonlocal appended
        appended += 1
        append(self, value)
    monkeypatch.setattr(StepValues, "append", counted)
    assert cache.step_of(13) == (2, 13) and cache.step_of(cache.seen_tokens - 1) == (steps - 1, 13 + 6 * (steps - 3))
    assert cache.evicted_tokens() == 0
    assert appended < 10, appended  # before: 200_000
