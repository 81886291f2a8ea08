"""A disk-tier stream's files in blocks of rows: a stream that evicts for weeks keeps files of bounded number and
size (before: one file a part, a row for every token ever streamed, refused at its file system's largest file), it
answers and resumes as before, and a file set of format 4 (one file a part) still loads and resumes."""

from __future__ import annotations

import mmap
import os
import resource
import signal

import pytest
import torch

import statekv.core.disk.buffers as buffers
from statekv import Stream
from statekv.core.disk.buffers import MappedTokenBuffer
from statekv.core.disk.files import read_checked, write_checked
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")



def _files(folder, pattern="layer*.bin"):
    return {path.name: path.stat().st_size for path in folder.glob(pattern)}


def test_a_buffer_that_gives_rows_back_keeps_bounded_files_past_the_largest_file(tmp_path, small_blocks):
    """Rows are appended and the oldest given back, for ten times the rows the largest file holds: the files stay
    a few blocks, each a block long; the rows kept read back, also reopened as a resumed stream reopens them."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(256, dtype=torch.float32).view(1, 1, 1, 256)  # a row of 1 KiB
    block = mmap.PAGESIZE // 1024  # rows a block (given back a row at a time: holes, then the files removed)
    kept, seen = 3 * block, []
    try:
        buffer.write(0, rows, -rows)
        buffer.length = 1
        assert buffer.block_rows == block
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 * block * buffer.row_bytes, before[1]))
        for row in range(1, 40 * block):
            buffer.write(row, rows + row, -rows - row)
            buffer.length = row + 1
            if row >= kept:
                buffer.release(row - kept, row - kept + 1)
            files = _files(tmp_path)
            seen.append(len(files))
            assert set(files.values()) == {block * buffer.row_bytes}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, ignored)
    assert max(seen) <= 2 * (kept // block + 2) and max(seen[len(seen) // 2:]) == max(seen[: len(seen) // 2])
    length = buffer.length
    keys, values = buffer.view(length - kept, length)
    expected = rows + torch.arange(length - kept, length, dtype=torch.float32).view(1, 1, -1, 1)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert not buffer.view(0, length - kept)[0].any()  # given back: zeros, the files gone
    buffer.close()
    again = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    again.open((1, 1, 256), torch.float32, length, block_rows=block)
    assert torch.equal(again.gather(torch.tensor([length - 1, length - kept]))[1], -expected[:, :, [-1, 0]])
    assert not again.gather(torch.tensor([0, block]))[0].any()
    again.close()



def test_a_resumed_buffer_forces_the_blocks_it_adopted_at_its_next_sync(tmp_path, small_blocks, monkeypatch):
    """Rows written and never synced (the process killed, or a step the disk refused undone by reopening the files)
    are forced to the device, with the folder holding their files' names, by the next sync of the buffer reopened
    over them (before: only the blocks written since it was reopened were)."""
    import os

    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(256, dtype=torch.float32).view(1, 1, 1, 256)
    length = 3 * (mmap.PAGESIZE // 1024)  # three blocks
    for row in range(length):
        buffer.write(row, rows + row, -rows - row)
        buffer.length = row + 1
    row, dtype, block = buffer.row, buffer.dtype, buffer.block_rows
    buffer.close()
    buffer.open(row, dtype, length, block_rows=block)  # as a resume reopens it
    synced, flushed, fsync, flush = [], [], os.fsync, buffers.flush_folder
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    monkeypatch.setattr(buffers, "flush_folder", lambda folder, **kw: (flushed.append(folder), flush(folder, **kw))[1])
    buffer.sync()
    assert {os.path.basename(path) for path in synced} >= set(_files(tmp_path)) and len(_files(tmp_path)) == 6
    assert flushed == [tmp_path]
    buffer.close()


def test_a_block_file_left_past_the_checkpoint_has_its_name_forced_once_written_again(tmp_path, small_blocks,
                                                                                      monkeypatch):
    """A block's files a killed process made after the checkpoint a stream resumes from are there already when the
    stream writes that block again: the next sync forces the folder holding their names too (before: only for files
    it made or lengthened itself), so a power cut after it cannot lose them."""
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(256, dtype=torch.float32).view(1, 1, 1, 256)
    block = mmap.PAGESIZE // 1024
    for row in range(2 * block):
        buffer.write(row, rows + row, -rows - row)
        buffer.length = row + 1
    shape, dtype = buffer.row, buffer.dtype
    buffer.close()  # killed, the second block's files left; resumed from a checkpoint inside the first
    buffer.open(shape, dtype, block - 1, block_rows=block)
    buffer.sync()
    flushed, flush = [], buffers.flush_folder
    monkeypatch.setattr(buffers, "flush_folder", lambda folder, **kw: (flushed.append(folder), flush(folder, **kw))[1])
    for row in range(block - 1, block + 2):
        buffer.write(row, rows, -rows)
        buffer.length = row + 1
    buffer.sync()
    assert flushed == [tmp_path]
    buffer.close()

def _evicting(adapter, folder, policy="statekv"):
    qa = tiny_qa(adapter, policy, offload="disk", offload_dir=folder, max_cache_bytes=120_000,
                 cache_limit="evict-oldest")
    return qa, qa.stream()


@pytest.mark.parametrize("policy", ["recency", "statekv"])
def test_an_evicting_stream_in_blocks_keeps_bounded_files_and_answers_as_before(adapter, tmp_path, small_blocks,
                                                                                monkeypatch, policy):
    """The same evicting stream, its files in blocks and in format 4's one file a part: the same evictions and
    answers; in blocks its files stop growing in number and size once it evicts (what it carries of its evicted
    steps stays), and it resumes from its folder as the stream that never stopped goes on."""
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    frames = random_frames(80)
    qa, blocks = _evicting(adapter, tmp_path / "blocks", policy)
    counts, widest = {}, 0
    for number, frame in enumerate(frames):
        blocks.push(frame)
        files = _files(blocks.prefill.disk.folder)
        counts[number], widest = len(files), max(widest, *files.values())
    block = max(getattr(buffer, "mirror", buffer).block_rows * getattr(buffer, "mirror", buffer).row_bytes
                for layer in blocks.prefill.disk.buffers for buffer in layer.values())
    assert len(blocks.prefill.cache.evicted_steps) > 50 and widest <= block  # no file ever longer than a block
    layers = len(blocks.prefill.cache.layers)
    settled = 40 if policy == "recency" else 60  # what a layer carries of its evicted steps: in a few blocks
    # rows evicted are given back at the next checkpoint (every 4 steps here): the count swings within a few of them
    bound = max(counts[n] for n in range(settled, settled + 8)) + 2 * layers
    assert max(counts[n] for n in range(settled, 80)) <= bound, counts
    with monkeypatch.context() as old:
        old.setattr(MappedTokenBuffer, "BLOCK_BYTES", None)
        _, single = _evicting(adapter, tmp_path / "single", policy)
        for frame in frames:
            single.push(frame)
    assert len(_files(single.prefill.disk.folder, "layer0.*.bin")) == 5  # one file a part, as before
    assert single.prefill.cache.evicted_steps == blocks.prefill.cache.evicted_steps
    answer = blocks.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)
    assert torch.equal(answer, single.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
    single.close()
    blocks.close()
    _, stopped = _evicting(adapter, tmp_path / "stopped", policy)
    for frame in frames[:50]:
        stopped.push(frame)
    stopped.close()
    resumed = Stream.load(stopped.prefill.disk.folder, qa)
    for frame in frames[50:]:
        resumed.push(frame)
    assert resumed.prefill.cache.evicted_steps == blocks.prefill.cache.evicted_steps
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer)
    assert len(_files(resumed.prefill.disk.folder)) <= bound
    resumed.close()


def test_a_format_4_file_set_loads_resumes_and_goes_on_alike(adapter, tmp_path, monkeypatch):
    """A file set written one file a part (format 4, what statekv wrote before blocks) is resumed from where it
    stopped and goes on, in its own files, as the stream that never stopped."""
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    frames = random_frames(60)
    qa, whole = _evicting(adapter, tmp_path / "whole")
    for frame in frames:
        whole.push(frame)
    with monkeypatch.context() as old:
        old.setattr(MappedTokenBuffer, "BLOCK_BYTES", None)
        _, stopped = _evicting(adapter, tmp_path / "old")
        for frame in frames[:35]:
            stopped.push(frame)
        stopped.close()
    folder = stopped.prefill.disk.folder
    manifest = read_checked(folder / "manifest.json")
    write_checked(folder / "manifest.json", {**manifest, "version": 4})
    before = (folder / "layer0.detailed.0.bin").stat().st_size
    resumed = Stream.load(folder, qa)
    assert resumed.frames == 35
    for frame in frames[35:]:
        resumed.push(frame)
    assert (folder / "layer0.detailed.0.bin").stat().st_size > before  # its own file, continued
    assert not list(folder.glob("layer0.detailed.0.*.bin"))
    assert resumed.prefill.cache.evicted_steps == whole.prefill.cache.evicted_steps
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       whole.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
    resumed.close()
    whole.close()


def test_a_resumed_stream_whose_kept_segment_index_block_is_missing_is_refused(adapter, tmp_path, small_blocks,
                                                                                monkeypatch):
    """A block of the retrieval index removed by hand while a segment it indexes is only partly evicted (its row
    kept, the step that wrote it evicted: no checksum covers it) is refused in one line, not read back as zeros."""
    from statekv.errors import InputError

    frames = random_frames(30)
    qa, stream = _evicting(adapter, tmp_path)
    for frame in frames:
        stream.push(frame)
    assert 15 in stream.prefill.cache.evicted_steps and 0 not in stream.prefill.cache.evicted_steps
    stream.close()
    folder = stream.prefill.disk.folder
    for path in folder.glob("layer1.segment_index.*.0.bin"):
        path.unlink()
    with pytest.raises(InputError, match=r"layer1\.segment_index\.0\.0\.bin is missing"):
        Stream.load(folder, qa)


def test_a_blocks_files_grow_with_its_rows(tmp_path):
    """A block's files are as long as the rows written to them (grown geometrically, sparse), not a whole block
    from its first row: before, a stream of a few frames had files of 64 MiB each, which a copy by a tool blind to
    holes (Python's shutil, rsync without -S) wrote out whole, filling the disk."""
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(256, dtype=torch.float32).view(1, 1, 1, 256)  # a row of 1 KiB
    for row in range(10):
        buffer.write(row, rows + row, -rows - row)
        buffer.length = row + 1
    sizes = _files(tmp_path)
    assert buffer.block_rows * buffer.row_bytes >= 64 << 20 and len(sizes) == 2
    assert max(sizes.values()) <= MappedTokenBuffer.MIN_CAPACITY * buffer.row_bytes, sizes
    for row in range(10, 300):
        buffer.write(row, rows + row, -rows - row)
        buffer.length = row + 1
    assert 300 * buffer.row_bytes <= max(_files(tmp_path).values()) <= 2 * 300 * buffer.row_bytes
    keys, values = buffer.view(0, 300)
    assert torch.equal(keys[0, 0, :, 0], torch.arange(300, dtype=torch.float32)) and torch.equal(values, -keys)
    buffer.close()
    again = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    again.open((1, 1, 256), torch.float32, 300, block_rows=buffer.block_rows)
    assert torch.equal(again.gather(torch.tensor([299, 0]))[0][0, 0, :, 0], torch.tensor([299.0, 0.0]))
    again.close()


def test_verifying_a_resumed_stream_opens_each_block_file_a_bounded_number_of_times(adapter, tmp_path, small_blocks,
                                                                                  monkeypatch):
    """Resuming a stream whose blocks hold many steps' rows checks every step's checksum opening each block file at
    most three times (to write it, to read it in the pass, which closes the files it writes first, and to sync it;
    before: once a step, for a stream of millions of steps millions of opens), and so does journaling a saved stream
    loaded onto the disk tier; both answer alike."""
    import collections
    import os
    from pathlib import Path

    qa = tiny_qa(adapter, "recency", offload="disk", offload_dir=tmp_path / "disk")
    stream = qa.stream()
    for frame in random_frames(40):
        stream.push(frame)
    answer = stream.ask_tokens(QUESTION, max_new_tokens=4)
    saved = stream.save(tmp_path / "saved.statekv")
    stream.close()
    folder = stream.prefill.disk.folder
    assert len(list(folder.glob("layer0.step_means.0.*.bin"))) * 20 < len(stream.prefill.cache.chunk_lengths)
    for source in (folder, saved):
        opened, real_open = collections.Counter(), os.open
        with monkeypatch.context() as counting:
            counting.setattr(os, "open", lambda path, *args, **kw: (opened.update([str(path)]),
                                                                    real_open(path, *args, **kw))[1])
            resumed = Stream.load(source, qa)
        blocks = {path: count for path, count in opened.items() if Path(path).match("layer*.bin")}
        assert blocks and max(blocks.values()) <= 3, (source, collections.Counter(blocks).most_common(3))
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4), answer)
        resumed.close()


def _written(folder, rows: int) -> MappedTokenBuffer:
    """A buffer of two parts in one-page blocks (``small_blocks``), ``rows`` rows of 1 KiB written, row r all r."""
    buffer = MappedTokenBuffer(2, None, folder / "layer0.detailed")
    row = torch.ones(1, 1, 1, 256)
    for at in range(rows):
        buffer.write(at, row * at, -row * at)
        buffer.length = at + 1
    return buffer


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the open descriptors in /proc")
def test_a_checksum_pass_within_a_pass_is_part_of_it(tmp_path, small_blocks):
    """Before: the inner pass dropped the files the outer one kept open (leaked) and the outer one's end raised a
    TypeError."""
    block = mmap.PAGESIZE // 1024
    buffer = _written(tmp_path, 3 * block)  # three blocks, the last one the tail (its files open for writing)
    assert buffer.block_rows == block
    before = _open_fds()
    with buffer.reading():
        first = buffer.read_rows(0, 1)
        with buffer.reading():
            assert buffer.read_rows(block, block + 1)[0] == torch.full((256,), float(block)).numpy().tobytes()
        assert buffer.read_rows(0, 1) == first
    assert _open_fds() == before - 2  # none leaked; the tail's two closed by the pass, opened by its next write
    buffer.close()


def test_a_checksum_pass_reads_a_block_removed_or_made_during_it_as_it_now_is(tmp_path, small_blocks):
    """Before: the files a pass kept open read a block given back whole as it was (its files removed), and a block
    made after the pass found it gone read as zeros."""
    block = mmap.PAGESIZE // 1024
    buffer = _written(tmp_path, 3 * block)
    zeros = bytes(buffer.row_bytes)  # a row of one part
    with buffer.reading():
        assert buffer.read_rows(0, 1)[0] == zeros  # row 0 is all 0
        assert buffer.read_rows(1, 2)[0] != zeros
        buffer.release(0, block)  # the whole first block: its files removed
        assert not (tmp_path / "layer0.detailed.0.0.bin").exists()
        assert buffer.read_rows(1, 2) == [zeros, zeros]
        assert buffer.read_rows(4 * block, 4 * block + 1) == [zeros, zeros]  # not made yet: zeros
        row = torch.ones(1, 1, 1, 256)
        for at in (4 * block, 5 * block):  # made, then not the tail
            buffer.write(at, row * 7, -row * 7)
            buffer.length = at + 1
        assert buffer.read_rows(4 * block, 4 * block + 1)[0] == torch.full((256,), 7.0).numpy().tobytes()
    buffer.close()


def test_releasing_a_long_run_visits_only_the_blocks_whose_files_there_are(tmp_path, small_blocks, monkeypatch):
    """Before: a release stepped through every block of its run, removing the files of each (two calls a block even
    where none were ever made): a capped stream of weeks, whose evicted runs are given back as it resumes, made
    millions of calls per buffer. Now the blocks whose files there are alone, with the same result."""
    block = mmap.PAGESIZE // 1024
    far = 10**5 * block  # rows of 1 KiB: ten thousand blocks between the two runs written
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    row = torch.ones(1, 1, 1, 256)
    for at in [*range(2 * block), *range(far, far + 2 * block)]:
        buffer.write(at, row * at, -row * at)
        buffer.length = at + 1
    removed, unlink = [], os.unlink

    def counted(path, *args, **kwargs):
        removed.append(os.path.basename(path))
        assert len(removed) <= 20, "a release removed the files of blocks it never made"
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", counted)
    buffer.release(block // 2, far + block + block // 2)
    assert sorted(removed) == sorted(f"layer0.detailed.{p}.{b}.bin" for p in (0, 1) for b in (1, far // block))
    assert sorted(_files(tmp_path)) == sorted(f"layer0.detailed.{p}.{b}.bin" for p in (0, 1)
                                              for b in (0, far // block + 1))
    expected = [at if at < block // 2 or at >= far + block + block // 2 else 0
                for at in [*range(block), *range(far + block, far + 2 * block)]]
    keys = torch.cat([buffer.view(0, block)[0], buffer.view(far + block, far + 2 * block)[0]], 2)
    assert keys[0, 0, :, 0].tolist() == expected
    buffer.close()
