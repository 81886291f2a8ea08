"""`BlockBuffer` (an evicting stream's rows per token, in blocks) reads what a `TokenBuffer` reads, whatever was
written and released, and holds only the blocks with a row kept; a stream in blocks answers and saves bit for bit
as one in a single block."""

from __future__ import annotations

import random

import pytest
import torch

import statekv.core.storage.blocks as blocks
from statekv import Stream
from statekv.core.storage.blocks import BlockBuffer
from statekv.core.storage.buffers import TokenBuffer
from statekv.core.storage.host_pages import saved_rows
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


def _filled(seed: int, rows: int) -> tuple[BlockBuffer, TokenBuffer, random.Random]:
    """A block buffer and a token buffer given the same appends and releases (evict-oldest-like and scattered)."""
    chance = random.Random(seed)
    block, whole = BlockBuffer(2, rows=rows), TokenBuffer(2, pin=False)
    for _ in range(chance.randrange(5, 40)):
        length = chance.randrange(1, 3 * rows)
        parts = [torch.randn(1, 2, length, 3) for _ in range(2)]
        for buffer in (block, whole):
            buffer.write(buffer.length, *parts)
            buffer.length += length
        if chance.random() < 0.6:
            start = chance.randrange(0, block.length)
            end = min(block.length, start + chance.randrange(1, 4 * rows))
            block.release(start, end)
            whole.release(start, end)
    return block, whole, chance


@pytest.mark.parametrize("seed", range(40))
def test_a_block_buffer_reads_what_a_token_buffer_reads(seed):
    rows = random.Random(seed).choice([1, 2, 7, 16])
    block, whole, chance = _filled(seed, rows)
    n = block.length
    for _ in range(20):
        start = chance.randrange(0, n)
        end = chance.randrange(start, n + 1)
        assert all(torch.equal(a, b) for a, b in zip(block.view(start, end), whole.view(start, end))), (start, end)
        index = torch.tensor(sorted(chance.sample(range(n), chance.randrange(0, min(n, 50)))), dtype=torch.long)
        for order in (index, index.flip(0)):
            assert all(torch.equal(a, b) for a, b in zip(block.gather(order), whole.gather(order)))
    (kept_block, runs_block), (kept_whole, runs_whole) = saved_rows(block, n), saved_rows(whole, n)
    assert runs_block == runs_whole and all(torch.equal(a, b) for a, b in zip(kept_block, kept_whole))

    loaded = BlockBuffer(2, rows=rows)
    loaded.load(*kept_block, released=runs_block)
    assert loaded.length == n and all(torch.equal(a, b) for a, b in zip(loaded.view(0, n), whole.view(0, n)))
    assert sorted(loaded.blocks) == sorted(block.blocks)  # what it holds follows the rows kept, loaded or streamed


def test_a_block_is_freed_once_every_row_of_it_is_released_and_never_made_for_rows_never_written():
    buffer = BlockBuffer(1, rows=4)
    buffer.write(0, torch.arange(12.0).view(1, 1, 12, 1))
    buffer.length = 12
    assert sorted(buffer.blocks) == [0, 1, 2]
    buffer.release(4, 7)
    assert 1 in buffer.blocks and buffer.view(4, 8)[0].flatten().tolist() == [0, 0, 0, 7]
    buffer.release(7, 8)  # the rest of block 1: freed whole, reads as zeros
    assert sorted(buffer.blocks) == [0, 2] and buffer.view(3, 9)[0].flatten().tolist() == [3, 0, 0, 0, 0, 8]
    assert buffer.nbytes == (12 - 4) * 4
    buffer.write(40, torch.ones(1, 1, 1, 1))  # far ahead: only the block it falls in is made
    assert sorted(buffer.blocks) == [0, 2, 10]


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_an_evicting_stream_in_blocks_frees_what_it_evicted_and_answers_as_in_one_block(
        adapter, kv_cache_dtype, tmp_path, monkeypatch):
    settings = dict(offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest", kv_cache_dtype=kv_cache_dtype)
    frames = random_frames(150)
    streams = []
    for rows in (64, 8192):  # blocks of 64 rows; one block for the whole stream
        monkeypatch.setattr(blocks, "BLOCK_ROWS", rows)
        stream = tiny_qa(adapter, "statekv", **settings).stream()
        for frame in frames:
            stream.push(frame)
        streams.append(stream)
    small, one = streams
    storage = small.prefill.cache.layers[0].storage
    buffer = storage.detailed if kv_cache_dtype is None else storage.key_codes
    assert small.prefill.cache.evicted_steps and type(buffer) is BlockBuffer and buffer.length < 8192
    made = -(-buffer.length // 64)
    assert len(buffer.blocks) < made / 3, (len(buffer.blocks), made)  # the blocks evicted rows filled are freed
    assert small.prefill.stats.detailed_bytes == one.prefill.stats.detailed_bytes
    for retrieve in (None, 2):
        assert torch.equal(small.ask_tokens(QUESTION, max_new_tokens=4, retrieve=retrieve),
                           one.ask_tokens(QUESTION, max_new_tokens=4, retrieve=retrieve))
    first, second = small.prefill.state_dict(), one.prefill.state_dict()
    assert first[1] == second[1] and sorted(first[0]) == sorted(second[0])
    assert all(torch.equal(first[0][name], second[0][name]) for name in first[0])
    loaded = Stream.load(small.save(tmp_path / "small.safetensors"), tiny_qa(adapter, "statekv", **settings))
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4), one.ask_tokens(QUESTION, max_new_tokens=4))


def test_a_block_made_after_a_load_reads_its_released_rows_as_zeros():
    """A loaded buffer makes only the blocks holding a kept row; a block made later, below the length (here by the
    next write), must not show what its memory held before where rows were released."""
    for rows in (8, 64, 1024):
        dirty = [torch.full((1, 2, rows, 4), 7.0) for _ in range(50)]  # memory handed back dirty to the allocator
        del dirty
        buffer = BlockBuffer(2, rows=rows)
        buffer.load(torch.empty(1, 2, 0, 4), torch.empty(1, 2, 0, 4), released=[(0, rows + 4)])  # all given back
        assert not buffer.blocks
        buffer.write(rows + 4, torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
        assert list(buffer.blocks) == [1]
        assert not any(part.any() for part in buffer.view(rows, rows + 4)), rows


def test_a_disk_buffer_saved_with_many_runs_of_kept_rows_opens_and_maps_it_once(tmp_path):
    """A save reads a buffer's kept runs: from one view of its files, not one mapping (and, with Python's mmap, one
    open file) per run, which ran out of file descriptors."""
    import os
    import resource

    from statekv.core.disk.buffers import MappedTokenBuffer

    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(4000.0).view(1, 1, 4000, 1).expand(1, 2, 4000, 4).contiguous()
    buffer.write(0, rows, -rows)
    buffer.length = 4000
    for start in range(0, 4000, 4):  # 1,000 runs of kept rows
        buffer.release(start, start + 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    try:  # a few dozen files to spare: the save must not need one a run
        (keys, values), released = saved_rows(buffer, 4000)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    index = torch.tensor([row for row in range(4000) if row % 4 >= 2])
    assert len(released) == 1000 and torch.equal(keys, rows[:, :, index]) and torch.equal(values, -rows[:, :, index])
    buffer.close()


class _Looked(dict):
    """A block buffer's blocks, failing once more than ``limit`` of them were looked up by number."""

    def __init__(self, blocks: dict, limit: int):
        super().__init__(blocks)
        self.looked, self.limit = 0, limit

    def get(self, number, default=None):
        self.looked += 1
        assert self.looked <= self.limit, "a release looked up block numbers it does not hold"
        return super().get(number, default)


def test_releasing_a_run_of_a_whole_history_visits_only_the_blocks_held():
    """Before: a release stepped through every block number of its run, held or not: the run of 10**12 rows a
    stream that evicted for weeks gives back as it loads took 10**12 / BLOCK_ROWS steps (hours); now it looks up
    the blocks it holds alone, and gives back the same rows."""
    far = 10**12
    buffer = BlockBuffer(2, rows=4)
    rows = torch.arange(1.0, 11.0).view(1, 1, 10, 1)
    buffer.write(0, rows, -rows)
    buffer.length = 10
    buffer.write(far, rows + 100, -rows - 100)
    buffer.length = far + 10
    buffer.blocks = _Looked(buffer.blocks, limit=20)
    buffer.release(3, far + 5)
    assert buffer.blocks.looked <= 6 and sorted(buffer.blocks) == [0, far // 4 + 1, far // 4 + 2]
    keys, values = buffer.view(0, 4)
    assert torch.equal(keys.flatten(), torch.tensor([1.0, 2.0, 3.0, 0.0])) and torch.equal(values, -keys)
    keys, values = buffer.view(far + 4, far + 10)
    assert torch.equal(keys.flatten(), torch.tensor([0.0, 106.0, 107.0, 108.0, 109.0, 110.0]))
    assert torch.equal(values, -keys) and buffer.released.rows == far + 2
