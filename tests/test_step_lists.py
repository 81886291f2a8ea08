"""A saved stream's per-step lists are kept in its file as arithmetic runs (`statekv.api.step_lists`): what a steady
stream's header holds of them stays the same size at any age, the lists read back exactly, files that list them
whole (format 2) still load, and malformed runs are refused in one line."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from statekv import Stream
from statekv.api.step_lists import (arithmetic_runs, expand_runs, expanded, held_runs, values_budget,
                                    written_runs)
from statekv.api.stream_file import read_verified, write_verified
from statekv.core.cache.step_runs import StepRuns
from statekv.core.storage.step_values import StepValues
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
SETTINGS = dict(offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest", positions="bounded")


@pytest.mark.parametrize("seed", range(30))
def test_runs_give_back_the_entries_they_were_made_from(seed):
    chance = random.Random(seed)
    count = chance.randrange(1, 60)
    lists = [[chance.choice([4, 4, 4, chance.randrange(1, 9)]) for _ in range(count)],
             sorted(chance.sample(range(200), count)),
             [[chance.randrange(50), chance.choice([6, 6, 3]), chance.choice([64, 64, 7])] for _ in range(count)]]
    for entries in lists:
        columns = 3 if isinstance(entries[0], list) else 1
        assert expand_runs(json.loads(json.dumps(arithmetic_runs(entries))), "x", columns) == entries



@pytest.mark.parametrize("seed", range(20))
def test_the_engines_runs_are_written_as_the_lists_they_hold_would_be(seed):
    """Before: rows were cut wherever a column's own run ended, and a set's steps were written a run of consecutive
    steps each, so a save wrote other (and more) runs than `arithmetic_runs` of the same lists."""
    chance = random.Random(seed)
    count = chance.randrange(1, 300)
    lengths = [chance.choice([4, 4, 4, chance.randrange(1, 9)]) for _ in range(count)]
    placed = [[chance.choice([6 * n, 6 * n, chance.randrange(50)]), chance.choice([6, 6, 3]), 64]
              for n in range(count)]
    steps = sorted(chance.sample(range(2 * count), count))
    assert written_runs(StepValues(lengths)) == arithmetic_runs(lengths)
    assert written_runs(tuple(StepValues(column) for column in zip(*placed))) == arithmetic_runs(placed)
    assert written_runs(StepRuns(steps)) == arithmetic_runs(steps)
    assert written_runs(StepValues()) == written_runs(StepRuns()) == []


@pytest.mark.parametrize("runs", [[[3, 0, 4]], [[3, 0, 2], [1, 1, 5]], [[7, 0, 1], [2, 2, 3], [9, -1, 3]]])
def test_a_set_of_steps_reads_back_as_its_list_does(runs):
    """Before: a step listed several times (a run of step 0) was refused as "not a saved statekv stream (range() arg
    3 must not be zero)", while the same list written whole loaded, each step once."""
    saved = {"runs": runs}
    assert held_runs(saved, "x", as_set=True) == StepRuns(expand_runs(saved, "x"))

def test_a_steady_stream_lists_its_steps_in_a_few_runs():
    assert arithmetic_runs([3] + [4] * 10_000) == {"runs": [[3, 1, 2], [4, 0, 9_999]]}
    assert len(arithmetic_runs(list(range(5, 50_000)))["runs"]) == 1
    placed = [[6 * n, 6, 64] for n in range(10_000)]
    assert arithmetic_runs(placed) == {"columns": 3, "runs": [[0, 6, 64, 6, 0, 0, 10_000]]}


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _raw(path) -> dict:
    with safe_open(str(path), "pt") as handle:
        return json.loads(handle.metadata()["statekv"])


def _write_raw(path, tensors: dict, metadata: dict) -> None:
    """``metadata`` written as it is (no runs made of its lists), signed as a file's header is."""
    text = json.dumps(metadata)
    signature = hashlib.sha256(text.encode()).hexdigest()
    save_file(tensors, str(path), metadata={"statekv": text, "statekv_sha256": signature})


def test_an_old_evicting_streams_file_holds_its_steps_in_as_few_characters_as_a_young_ones(adapter, tmp_path):
    stream = tiny_qa(adapter, "statekv", **SETTINGS).stream()
    frames = random_frames(180)
    sizes = []
    for count in (60, 180):
        for frame in frames[len(sizes) and 60: count]:
            stream.push(frame)
        path = stream.save(tmp_path / f"at{count}.safetensors")
        sizes.append(len(json.dumps(_raw(path)["cache"])))
    assert len(stream.prefill.cache.evicted_steps) > 100
    assert sizes[1] <= sizes[0] + 100, sizes  # listed one by one, each frame added about 25 characters
    metadata, _ = read_verified(path)
    _, live = stream.prefill.state_dict(as_runs=True)  # read back as runs, as the cache holds them
    assert metadata["cache"]["chunk_lengths"] == live["chunk_lengths"]
    assert metadata["cache"]["evicted_steps"] == live["evicted_steps"]
    assert metadata["cache"]["positions"] == live["positions"]
    loaded = Stream.load(path, tiny_qa(adapter, "statekv", **SETTINGS))
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4), stream.ask_tokens(QUESTION, max_new_tokens=4))
    loaded.close()
    stream.close()


def test_a_format_2_file_listing_its_steps_whole_still_loads(adapter, tmp_path):
    stream = tiny_qa(adapter, "statekv", **SETTINGS).stream()
    for frame in random_frames(90):
        stream.push(frame)
    new = stream.save(tmp_path / "new.safetensors")
    _, tensors = read_verified(new)
    old = tmp_path / "old.safetensors"
    _write_raw(old, tensors, {**expanded(_raw(new), "new"), "version": 2})  # as format 2 wrote it: every list whole
    assert isinstance(_raw(old)["cache"]["chunk_lengths"], list)
    loaded = Stream.load(old, tiny_qa(adapter, "statekv", **SETTINGS))
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4), stream.ask_tokens(QUESTION, max_new_tokens=4))
    loaded.close()
    stream.close()


@pytest.mark.parametrize("runs, message", [
    ({"runs": [[4, 0, 0]]}, "metadata.cache.chunk_lengths must be a list or its runs"),
    ({"runs": [[4, 0]]}, "metadata.cache.chunk_lengths must be a list or its runs"),
    ({"runs": [[4, 0, 2]], "extra": 1}, "metadata.cache.chunk_lengths must be a list or its runs"),
    ({"columns": 3, "runs": [[4, 0, 0, 0, 0, 0, 2]]}, "metadata.cache.chunk_lengths must be a list or its runs"),
    ({"runs": [[4, 1 << 62, 3]]}, "metadata.cache.chunk_lengths lists an entry past the 64-bit integers"),
    ({"runs": [[5, 1 << 70, 1]]}, "metadata.cache.chunk_lengths lists an entry past the 64-bit integers"),
    # a run as long as a stream could be is held as one run, never expanded: the stream's count refuses it
    ({"runs": [[4, 0, 1 << 50]]}, "stats.chunks is 13, inconsistent with the rest (1125899906842624)"),
    # well formed, but not the stream's count: its own checks refuse it
    ({"runs": [[4, 0, 5]]}, "stats.chunks is 13, inconsistent with the rest (5)"),
])
def test_malformed_runs_are_refused_in_one_line(adapter, tmp_path, runs, message):
    stream = tiny_qa(adapter, "statekv", **SETTINGS).stream()
    for frame in random_frames(12):
        stream.push(frame)
    metadata, tensors = read_verified(stream.save(tmp_path / "s.safetensors"))
    stream.close()
    metadata.pop("checksums")
    path = write_verified(tmp_path / "forged.safetensors", tensors, metadata)
    raw = _raw(path)
    raw["cache"]["chunk_lengths"] = runs
    _write_raw(path, tensors, raw)
    with pytest.raises(InputError) as refused:
        Stream.load(path, tiny_qa(adapter, "statekv", **SETTINGS))
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_files_lists_share_one_budget_checked_before_they_are_expanded():
    """Each list may be within the budget and all of them together not: refused before the last is expanded. The
    budget is what the memory available holds once expanded."""
    from statekv.api.step_lists import MIN_VALUES

    assert values_budget() >= MIN_VALUES
    metadata = {"cache": {"chunk_lengths": {"runs": [[4, 0, 10]]},
                          "positions": {"steps": {"columns": 3, "runs": [[0, 4, 0, 4, 0, 0, 331]]}}}}
    with pytest.raises(InputError, match=r"^f: malformed stream metadata: metadata\.cache\.positions\.steps lists more "
                                         r"steps than this machine's memory holds once expanded \(its per-step lists "
                                         r"hold 993 values; 990 more fit in the memory available\)$"):
        expanded(metadata, "f", budget=1000)
    assert metadata["cache"]["chunk_lengths"] == [4] * 10


def test_a_stream_whose_metadata_a_load_would_refuse_is_not_saved(adapter, tmp_path, monkeypatch):
    import statekv.api.stream_file as stream_file
    from statekv.errors import OutputError

    stream = tiny_qa(adapter, "statekv", **SETTINGS).stream()
    for frame in random_frames(4):
        stream.push(frame)
    monkeypatch.setattr(stream_file, "MAX_METADATA_CHARS", 1_000)
    with pytest.raises(OutputError, match="its metadata is .* characters, more than a saved stream holds \\(1,000\\)"):
        stream.save(tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()
    stream.close()
