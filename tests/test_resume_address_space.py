"""Resuming a disk-tier stream maps only what it reads: the address space it asks for follows the blocks its files
still hold, not every row the stream ever streamed (a capped 8B stream of a day and a half would ask for more than
the 128 TiB of a process's addresses, although its cap bounds what it holds)."""

from __future__ import annotations

import pytest
import torch

import statekv.core.disk.buffers as buffers
import statekv.core.disk.tier as tier
from statekv import Stream
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


@pytest.fixture
def small_blocks(small_blocks, monkeypatch):
    """Blocks of one page, so a short stream fills many and gives most of them back, checkpointed often."""
    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)


def _asked(monkeypatch) -> list[int]:
    """The sizes of the runs of addresses the disk tier's buffers ask for from now on."""
    sizes: list[int] = []
    anonymous = buffers.anonymous

    def counted(size: int):
        sizes.append(size)
        return anonymous(size)

    monkeypatch.setattr(buffers, "anonymous", counted)
    return sizes


def _held_bytes(folder) -> int:
    """Bytes of the layers' files (each block a file): what the stream still holds on disk."""
    return sum(path.stat().st_size for path in folder.glob("layer*.bin"))


def _streamed_bytes(stream) -> int:
    """Bytes of every row its layers' files were ever written, evicted or not."""
    return sum(mapped.length * mapped.row_bytes * mapped.parts for layer in stream.prefill.disk.buffers
               for buffer in layer.values() for mapped in [getattr(buffer, "mirror", buffer)])


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_a_resume_maps_what_its_files_hold_not_its_whole_history(adapter, tmp_path, small_blocks, monkeypatch,
                                                                 kv_cache_dtype):
    """Before: every buffer of every layer was mapped whole (one run of addresses as long as its history) to be
    handed to the layers, which adopt the files without reading those rows."""
    frames = random_frames(70)
    settings = {"kv_cache_dtype": kv_cache_dtype, "max_cache_bytes": 60_000} if kv_cache_dtype else {}
    qa = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, **{
        "max_cache_bytes": 120_000, "cache_limit": "evict-oldest", **settings})
    whole = qa.stream()
    stopped = qa.stream()
    for number, frame in enumerate(frames):
        whole.push(frame)
        if number < 50:
            stopped.push(frame)
    stopped.close()
    folder = stopped.prefill.disk.folder
    held, streamed = _held_bytes(folder), _streamed_bytes(stopped)
    assert held < streamed  # much of its history given back
    with monkeypatch.context() as counting:
        sizes = _asked(counting)
        resumed = Stream.load(folder, qa)
    assert sum(sizes) <= held, (sum(sizes), held, streamed)  # before: about ``streamed``
    for frame in frames[50:]:
        resumed.push(frame)
    assert resumed.prefill.cache.evicted_steps == whole.prefill.cache.evicted_steps
    assert (resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2).tolist()
            == whole.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2).tolist())
    resumed.close()
    whole.close()


def test_a_quantized_disk_stream_reads_a_token_without_mapping_its_scales_history(adapter, tmp_path, small_blocks,
                                                                                  monkeypatch):
    """Before: every read of a quantized disk-tier stream's tokens asked where its keys' scales live by mapping
    every step's scales (a run of addresses growing with the stream's age, walked block by block)."""
    qa = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, kv_cache_dtype="int8")
    stream = qa.stream()
    for frame in random_frames(24):
        stream.push(frame)
    storage = stream.prefill.cache.layers[0].storage
    read = {name: getattr(storage, name) for name in ("key_codes", "value_codes", "key_scales", "value_scales")}
    assert read["key_scales"].length > read["key_scales"].block_rows  # scales of more than one block
    last = storage.length - 1
    expected = storage.read_tokens(torch.tensor([last]))
    with monkeypatch.context() as counting:
        sizes = _asked(counting)
        keys, values = storage.read_tokens(torch.tensor([last]))
        ranged = storage.read_range(last, last + 1)
    block = sum(buffer.block_rows * buffer.row_bytes * buffer.parts for buffer in read.values())
    assert sum(sizes) <= 2 * block  # a block of each buffer each read: the last token's
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert torch.equal(ranged[0], keys) and torch.equal(ranged[1], values)
    stream.close()
