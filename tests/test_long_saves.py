"""A capped stream that evicted for weeks is saved to its file and loaded back in memory that follows its runs, not
the steps it ever took: its per-step lists go from the cache's runs to the file's and back without a list a step."""

from __future__ import annotations

import hashlib
import json
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import statekv
from statekv import Stream
from statekv.api.stream_file import write_verified
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

SETTINGS = dict(offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest", positions="bounded")
MORE = 64_000  # evicted steps forged into the history (a multiple of the 16 steps of a segment)
LENGTH = 28  # tokens of each step of frames 10 to 99 (numbered with two digits)


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _forged(path, out, more: int):
    """``path``'s stream with ``more`` steps like its tenth inserted before it, all evicted: what it holds is as it
    was, its history ``more`` steps longer (its token positions, released runs and clock moved on to match)."""
    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["statekv"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    metadata.pop("checksums")
    cache, shift = metadata["cache"], LENGTH * more
    lengths = cache["chunk_lengths"]["runs"]
    assert lengths[-1][:2] == [LENGTH, 0], lengths
    start = sum(count * first + step * count * (count - 1) // 2 for first, step, count in lengths[:-1])
    for runs in (lengths, cache["evicted_steps"]["runs"], cache["positions"]["steps"]["runs"]):
        runs[-1][-1] += more
    cache["seen_tokens"] += shift
    for record, fields in ((metadata["state"], ("frames", "tokens", "next_position")),
                           (metadata["stats"], ("frames", "tokens", "chunks", "evicted_frames"))):
        for field in fields:
            record[field] += shift if field in ("tokens", "next_position") else more
    for field in ("pushed", "last_timestamp", "kept_timestamp", "encoded_timestamp"):
        metadata[field] += more
    for name, tensor in tensors.items():
        if name.endswith((".keys.released", ".values.released")):
            runs = tensor.clone()
            runs[(runs[:, 0] < start) & (runs[:, 1] >= start), 1] += shift
            runs[runs[:, 0] >= start] += shift
            tensors[name] = runs
        elif name.endswith((".block_keys.released", ".step_samples.released")):
            tensors[name] = tensor + torch.tensor([0, more])
        elif name.endswith(".segment_index.released"):
            tensors[name] = tensor + torch.tensor([0, more // 16])
        elif name.endswith(".carried_positions"):
            tensors[name] = torch.where(tensor >= start, tensor + shift, tensor)
    return write_verified(out, tensors, metadata)


def _traced(call):
    """``call()``'s result and the most Python memory it held at once (bytes)."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_weeks_long_evicting_stream_loads_and_saves_in_memory_that_follows_its_runs(adapter, tmp_path):
    """Before: a load expanded the file's runs into lists of every step's length, placement and eviction and
    checked them one by one (about 220 bytes a step: 14 MB here, 8 GB for a fortnight at 30 frames/s, and
    minutes), and a save listed them whole before folding them into runs again (about 220 bytes a step)."""
    qa = tiny_qa(adapter, "statekv", **SETTINGS)
    stream = qa.stream()
    for frame in random_frames(40):
        stream.push(frame)
    forged = _forged(stream.save(tmp_path / "young.safetensors"), tmp_path / "old.safetensors", MORE)
    stream.close()
    loaded, load_peak = _traced(lambda: Stream.load(forged, qa))
    cache = loaded.prefill.cache
    assert len(cache.chunk_lengths) == 41 + MORE and cache.evicted_steps.runs() == [[1, 40 + MORE]]
    saved, save_peak = _traced(lambda: loaded.save(tmp_path / "again.safetensors"))
    assert load_peak < 2 << 20, load_peak  # bytes: before, ~14 MB
    assert save_peak < 2 << 20, save_peak  # bytes: before, ~14 MB
    with safe_open(str(saved), "pt") as handle, safe_open(str(forged), "pt") as before:
        assert len(handle.metadata()["statekv"]) < len(before.metadata()["statekv"]) + 200
    loaded.push(random_frames(1, seed=1)[0])  # and it streams on
    assert loaded.frames == 41 + MORE and cache.evicted_steps.runs() == [[1, 41 + MORE]]
    loaded.close()


def _re_signed(path, change):
    """``path`` with its metadata changed by ``change`` and signed again (its tensors' checksums still vouch)."""
    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["statekv"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    change(metadata)
    text = json.dumps(metadata)
    save_file(tensors, str(path),
              metadata={"statekv": text, "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})
    return path


@pytest.mark.parametrize("forged", ["evicted_steps", "chunk_lengths"])
def test_a_successor_forged_to_list_a_trillion_steps_is_refused_in_one_line(checkpoint, tmp_path, forged):
    """Before: the successor's steps and evictions were listed one by one to be compared with the stream's (a
    MemoryError, or hours and all the memory there is, for a run of 2^40 steps)."""
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                         bounded_layout="handover", attention="eager")
    frames = random_frames(3)
    with qa.stream() as stream:
        stream.push(frames[0])
        stream.push(frames[1])
        stream.catch_up()
        stream.push(frames[2])  # the successor saved with the steps it replayed and its backlog
        assert stream.successor is not None
        path = stream.save(tmp_path / "s.safetensors")

    def change(metadata):
        more = 1 << 40
        for record in (metadata["cache"], metadata["successor"]):
            if forged == "evicted_steps":
                record["evicted_steps"] = {"runs": [[0, 1, more]]}
            else:
                record["chunk_lengths"]["runs"][-1][-1] += more
        if forged == "chunk_lengths":  # every count forged to agree
            tokens = more * metadata["cache"]["chunk_lengths"]["runs"][-1][0]
            for record, field in ((metadata["cache"], "seen_tokens"), (metadata["state"], "tokens"),
                                  (metadata["state"], "next_position"), (metadata["stats"], "tokens")):
                record[field] += tokens
            metadata["stats"]["chunks"] += more

    with pytest.raises(InputError) as refused:
        Stream.load(_re_signed(path, change), qa)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value), str(refused.value)
