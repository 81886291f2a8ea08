"""An evicting quantized stream's keys' scales (a row per step) are held in blocks as its rows per token are: what
they take follows the steps it keeps, not every step it streamed, and it answers, saves and resumes bit for bit as
with one allocation addressed by every step."""

from __future__ import annotations

import pytest
import torch

import statekv.core.storage.blocks as blocks
import statekv.core.storage.layer_storage as layer_storage
from statekv import Stream
from statekv.core.storage.blocks import BlockBuffer
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
EVICTING = dict(offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest")


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _rows_allocated(buffer) -> int:
    """Rows a buffer has memory (and address space) for: its blocks', or its one allocation's."""
    if isinstance(buffer, BlockBuffer):
        return sum(block[0].shape[2] for block in buffer.blocks.values())
    return buffer.capacity


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_an_evicting_streams_key_scales_take_rows_for_the_steps_it_holds_not_every_step_it_streamed(
        adapter, kv_cache_dtype, monkeypatch):
    """Before: one allocation addressed by every step streamed, doubled as steps came (256 rows for 150 steps
    holding 4). A step's scales are kept while a layer carries a token of it (here, under recency, the newest)."""
    monkeypatch.setattr(blocks, "BLOCK_ROWS", 16)
    stream = tiny_qa(adapter, "recency", kv_cache_dtype=kv_cache_dtype, **EVICTING).stream()
    for frame in random_frames(150):
        stream.push(frame)
    cache = stream.prefill.cache
    held = len(cache.chunk_lengths) - len(cache.evicted_steps)
    assert len(cache.chunk_lengths) > 100 and held < 16
    for layer in cache.layers:
        # the prompt prefix's block (never evicted), the newest steps' and one they may straddle into
        assert _rows_allocated(layer.storage.key_scales) <= 3 * 16, _rows_allocated(layer.storage.key_scales)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_key_scales_in_blocks_answer_save_and_resume_as_in_one_allocation(adapter, kv_cache_dtype, tmp_path,
                                                                          monkeypatch):
    settings = dict(kv_cache_dtype=kv_cache_dtype, **EVICTING)
    frames = random_frames(90)
    streams = []
    for in_blocks in (layer_storage.IN_BLOCKS, layer_storage.PER_TOKEN):  # key scales in blocks; in one tensor
        monkeypatch.setattr(layer_storage, "IN_BLOCKS", in_blocks)
        monkeypatch.setattr(blocks, "BLOCK_ROWS", 8)
        stream = tiny_qa(adapter, "statekv", **settings).stream()
        for frame in frames:
            stream.push(frame)
        streams.append(stream)
    split, whole = streams
    assert type(split.prefill.cache.layers[0].storage.key_scales) is BlockBuffer
    assert type(whole.prefill.cache.layers[0].storage.key_scales) is not BlockBuffer
    assert split.prefill.cache.evicted_steps == whole.prefill.cache.evicted_steps
    for retrieve in (None, 2):
        assert torch.equal(split.ask_tokens(QUESTION, max_new_tokens=4, retrieve=retrieve),
                           whole.ask_tokens(QUESTION, max_new_tokens=4, retrieve=retrieve))
        assert split.answer_info.read_frames == whole.answer_info.read_frames
    first, second = split.prefill.state_dict(), whole.prefill.state_dict()
    assert first[1] == second[1] and sorted(first[0]) == sorted(second[0])
    assert all(torch.equal(first[0][name], second[0][name]) for name in first[0])
    saved = whole.save(tmp_path / "whole.safetensors")  # written with the scales in one tensor, resumed in blocks
    monkeypatch.setattr(layer_storage, "IN_BLOCKS", (*layer_storage.PER_TOKEN, "key_scales"))
    loaded = Stream.load(saved, tiny_qa(adapter, "statekv", **settings))
    assert type(loaded.prefill.cache.layers[0].storage.key_scales) is BlockBuffer
    for frame in random_frames(20, seed=1):
        for stream in (loaded, split):
            stream.push(frame)
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       split.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
