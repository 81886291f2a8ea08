"""An evicting stream's saves and files hold what it keeps, not its whole history: a saved state leaves out the rows
its cache gave back (`statekv.core.storage.host_pages.saved_rows`), a load writes only the rows kept, and a
disk-tier stream's files give back the blocks its evicted rows filled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from statekv import Stream
from statekv.api.step_lists import expanded
from statekv.api.stream_file import write_verified
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
CAP = 60_000  # bytes: a few dozen of the tiny model's frames


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _contents(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as handle:
        return json.loads(handle.metadata()["statekv"]), {name: handle.get_tensor(name) for name in handle.keys()}


def _released(buffer) -> list[tuple[int, int]]:
    return buffer.released.within(buffer.length)


BUFFERS = ("detailed", "key_codes", "value_codes", "value_scales", "key_scales", "block_keys", "step_samples",
           "segment_index")


def _buffers(storage) -> dict:
    """A layer storage's buffers by name (those it has)."""
    return {name: getattr(storage, name) for name in BUFFERS if getattr(storage, name, None) is not None}


@pytest.mark.parametrize("offload, kv_cache_dtype", [(True, None), (True, "int8"), ("disk", None)])
def test_a_saved_evicting_stream_holds_what_it_keeps(adapter, offload, kv_cache_dtype, tmp_path):
    disk = {"offload_dir": tmp_path / "tiers"} if offload == "disk" else {}
    cap = CAP * (3 if disk else 1)  # the disk tier counts its journal too
    settings = dict(offload=offload, max_cache_bytes=cap, cache_limit="evict-oldest", kv_cache_dtype=kv_cache_dtype,
                    **disk)
    qa = tiny_qa(adapter, "statekv", **settings)
    stream = qa.stream()
    frames = random_frames(160)
    for frame in frames[:40]:
        stream.push(frame)
    early = stream.save(tmp_path / "early.safetensors").stat().st_size
    for frame in frames[40:]:
        stream.push(frame)
    late = stream.save(tmp_path / "late.safetensors")
    assert len(stream.prefill.cache.evicted_steps) > 100
    assert late.stat().st_size < 1.3 * early  # four times the frames; saved whole, five times the bytes

    _, tensors = _contents(late)
    seen = stream.prefill.cache.seen_tokens
    first = "keys" if kv_cache_dtype is None else "key_codes"
    for layer in stream.prefill.cache.layers:
        runs = tensors[f"cache.layers.{layer.index}.{first}.released"]
        assert runs.dtype == torch.long and runs.shape[1] == 2 and len(runs)
        left_out = int((runs[:, 1] - runs[:, 0]).sum())
        assert tensors[f"cache.layers.{layer.index}.{first}"].shape[2] == seen - left_out < seen // 3

    loaded = Stream.load(late, tiny_qa(adapter, "statekv", **dict(settings, **(
        {"offload_dir": tmp_path / "loaded"} if disk else {}))))
    for mine, theirs in zip(stream.prefill.cache.layers, loaded.prefill.cache.layers):
        for name, buffer in _buffers(mine.storage).items():  # given back alike: the load wrote only the rows kept
            assert _released(_buffers(theirs.storage)[name]) == _released(buffer), name
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       stream.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
    for frame in random_frames(20, seed=1):  # and both go on alike (the disk tier's journal counted from its steps)
        stream.push(frame)
        loaded.push(frame)
        assert loaded.prefill.stats.held_bytes == stream.prefill.stats.held_bytes
    assert loaded.prefill.cache.evicted_steps == stream.prefill.cache.evicted_steps
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4), stream.ask_tokens(QUESTION, max_new_tokens=4))
    loaded.close()
    stream.close()


def test_an_evicting_stream_saved_from_one_tier_loads_into_the_other(adapter, tmp_path):
    settings = dict(max_cache_bytes=3 * CAP, cache_limit="evict-oldest")
    stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path / "a", **settings).stream()
    for frame in random_frames(120):
        stream.push(frame)
    path = stream.save(tmp_path / "s.safetensors")
    answer = stream.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)
    for offload in (True, "disk"):
        disk = {"offload_dir": tmp_path / "b"} if offload == "disk" else {}
        loaded = Stream.load(path, tiny_qa(adapter, "statekv", offload=offload, **disk, **settings))
        assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer), offload
        loaded.close()
    stream.close()


def _allocated(folder: Path, pattern: str) -> int:
    return sum(os.stat(path).st_blocks * 512 for path in folder.rglob(pattern))


def test_an_evicting_disk_tier_stream_gives_back_the_blocks_of_what_it_evicted(adapter, tmp_path):
    folder = tmp_path / "tiers"
    stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=folder, max_cache_bytes=250_000,
                     cache_limit="evict-oldest").stream()
    frames = random_frames(300)
    allocated = []
    for number, frame in enumerate(frames, 1):
        stream.push(frame)
        if number in (100, 300):
            allocated.append(_allocated(folder, "*.detailed.*.bin"))
    assert len(stream.prefill.cache.evicted_steps) > 200
    # a step's rows are smaller than a block: punched one step at a time, no block was ever freed (3x here)
    assert allocated[1] < 1.25 * allocated[0], allocated
    stream.close()


@pytest.fixture(scope="module")
def saved(adapter, tmp_path_factory):
    """An evicting stream's file (its detailed cache saved without the rows it gave back)."""
    qa = tiny_qa(adapter, "statekv", offload=True, max_cache_bytes=CAP, cache_limit="evict-oldest")
    stream = qa.stream()
    for frame in random_frames(60):
        stream.push(frame)
    return stream.save(tmp_path_factory.mktemp("saved") / "s.safetensors"), qa


def _edited(path: Path, out: Path, edit) -> Path:
    metadata, tensors = _contents(path)
    metadata.pop("checksums")
    edit(tensors)
    return write_verified(out, tensors, metadata)


def _set(name: str, value):
    """``name`` set to ``value``; for the keys' runs the values' too (one buffer holds both)."""
    def edit(tensors):
        tensors[name] = value
        if name.endswith("keys.released"):
            tensors[name.replace("keys.released", "values.released")] = value.clone()
    return edit


def _overlapping(tensors):
    runs = tensors["cache.layers.0.keys.released"].clone()
    runs[-1, 0] = runs[0, 0]
    _set("cache.layers.0.keys.released", runs)(tensors)


def _carried_released(tensors):
    """A carried token listed among the released rows (the kept rows' count unchanged)."""
    runs = tensors["cache.layers.0.keys.released"]
    carried = int(tensors["cache.layers.0.carried_positions"].max())
    first = runs[0].tolist()
    moved = torch.cat([torch.tensor([[carried, carried + 1]]), runs])
    moved[1, 1] = first[1] - 1  # one row fewer in the first run: as many rows left out
    _set("cache.layers.0.keys.released", moved[moved[:, 0].argsort()])(tensors)


def _values_unlike_keys(tensors):
    runs = tensors["cache.layers.0.values.released"].clone()
    runs[0, 0] -= 1 if runs[0, 0] > 0 else -1
    tensors["cache.layers.0.values.released"] = runs


HOSTILE = {
    "runs as floats": (_set("cache.layers.0.keys.released", torch.tensor([[0.0, 1.0]])), "int64 [runs, 2]"),
    "runs past the rows": (_set("cache.layers.0.keys.released", torch.tensor([[0, 10 ** 9]])),
                           "ascending, disjoint runs"),
    "overlapping runs": (_overlapping, "ascending, disjoint runs"),
    "runs of a carried tensor": (_set("cache.layers.0.carried_keys.released", torch.tensor([[0, 1]])),
                                 "unexpected tensors"),
    "runs of a missing tensor": (_set("cache.layers.0.nothing.released", torch.tensor([[0, 1]])),
                                 "unexpected tensors"),
    # refused as a token its layer carries, or as one of a step the state did not evict, whichever is checked first
    "a carried token released": (_carried_released, ("gave back", "did not evict")),
    "runs of the open segment": (_set("cache.layers.0.segment_partial.released", torch.tensor([[0, 1]])),
                                 "unexpected tensors"),
    "values given back unlike keys": (_values_unlike_keys, "must list the runs"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_saved_state_with_bad_released_runs_is_refused_in_one_line(case, saved, tmp_path):
    path, qa = saved
    edit, needle = HOSTILE[case]
    _, tensors = _contents(path)
    assert len(tensors["cache.layers.0.keys.released"]) > 1
    with pytest.raises(InputError) as error:
        Stream.load(_edited(path, tmp_path / "edited.safetensors", edit), qa)
    needles = needle if isinstance(needle, tuple) else (needle,)
    assert any(each in str(error.value) for each in needles) and "\n" not in str(error.value), str(error.value)


def _with_metadata(path: Path, out: Path, edit) -> Path:
    metadata, tensors = _contents(path)
    metadata = expanded({key: value for key, value in metadata.items() if key != "checksums"}, "edit")
    edit(metadata["cache"])
    return write_verified(out, tensors, metadata)


def _evicted(change):
    def edit(cache):
        cache["evicted_steps"] = change(sorted(cache["evicted_steps"]))
    return edit


def _placed(step: int, column: int, change):
    def edit(cache):
        cache["positions"]["steps"][step][column] = change(cache["positions"]["steps"][step][column])
    return edit


FORGED = {  # a careful forger's edits: checksums recomputed, every list well-formed
    "no evicted step": (_evicted(lambda steps: []), "which the state did not evict"),
    "its first evicted step kept": (_evicted(lambda steps: steps[1:]), "which the state did not evict"),
    "its last evicted step kept": (_evicted(lambda steps: steps[:-1]), "which the state did not evict"),
    "the prompt prefix evicted": (_evicted(lambda steps: [0, *steps]), "the prompt prefix (step 0)"),
    "a step placed below position 0": (_placed(-1, 2, lambda base: -1000), "base -1000"),
    "a step spanning more than its tokens": (_placed(-1, 1, lambda span: span + 5), "spans 1 to its tokens"),
    "a step placed after a gap": (_placed(-2, 0, lambda first: first + 1), "follows the one before"),
}


@pytest.mark.parametrize("case", FORGED)
def test_a_forged_list_of_evicted_steps_or_positions_is_refused_in_one_line(case, saved, tmp_path):
    """Before: each loaded and answered otherwise, the rows a save left out read back as the stream's own keys and
    values (zeros), or its steps placed where no stream puts them."""
    path, qa = saved
    metadata, _ = _contents(path)
    assert metadata["cache"]["evicted_steps"] and metadata["cache"]["positions"]["mode"] == "bounded"
    edit, needle = FORGED[case]
    with pytest.raises(InputError) as error:
        Stream.load(_with_metadata(path, tmp_path / "forged.safetensors", edit), qa)
    assert needle in str(error.value) and "\n" not in str(error.value), str(error.value)
    Stream.load(_with_metadata(path, tmp_path / "as-saved.safetensors", lambda cache: None), qa).close()


def test_a_disk_tier_stream_counts_the_summaries_it_holds_as_one_in_memory_does(adapter, tmp_path):
    """Before: the segment index's copy in RAM (a disk tier keeps it there too) was a buffer made to be pinned, which
    counted the rows it had grown ahead of the stream and, pinned (a model on a GPU), kept the rows of the segments an
    evicting stream gave back: ``summary_bytes`` passed what the stream held. Now it counts, and holds, what an
    offloaded stream in memory does."""
    settings = dict(max_cache_bytes=CAP, cache_limit="evict-oldest")
    memory = tiny_qa(adapter, "statekv", offload=True, **settings).stream()
    disk = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, **settings).stream()
    try:
        for index, frame in enumerate(random_frames(40)):
            memory.push(frame)
            disk.push(frame)
            assert disk.prefill.stats.summary_bytes == memory.prefill.stats.summary_bytes, index
        assert disk.prefill.cache.evicted_steps
    finally:
        disk.close()
