"""Resuming a disk-tier stream that evicted for weeks reads into RAM only the segment index rows whose blocks it still
holds: the index of its whole history is never copied in to be given back again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from statekv.core.disk.buffers import MappedTokenBuffer
from statekv.core.disk.mirrored import MirroredTokenBuffer

ROWS = 131_072  # segments streamed: 2 KiB a row, 256 MiB of index
HELD = 10  # the last ones, still held


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_a_resumed_segment_index_copies_in_only_the_blocks_it_holds(tmp_path, monkeypatch):
    """Before: the RAM half of the index was loaded from a copy of every row of the files' views, the blocks given
    back reading as zeros (a temporary peak growing with the stream's age: 2 GB a layer for a fortnight's 8B
    stream), then given back again as the evicted segments were."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
    except OSError:
        pytest.skip("the peak resident size cannot be reset here")
    monkeypatch.setattr(MappedTokenBuffer, "BLOCK_BYTES", 1 << 20)
    index = MirroredTokenBuffer(1, tmp_path / "segment_index", evicts=True)
    rows = torch.randn(1, 2, HELD, 256)
    index.write(ROWS - HELD, rows)  # only the last block's files are made: the others were given back whole
    index.length = ROWS
    mirror = index.mirror
    block_rows, row, dtype = mirror.block_rows, mirror.row, mirror.dtype
    mirror.close()
    mirror.open(row, dtype, ROWS, block_rows=block_rows)  # as a resume reopens it
    before = rss_kib()
    Path("/proc/self/clear_refs").write_text("5")
    index.load(*mirror.view(0, ROWS))
    grown = peak_rss_kib() - before
    assert grown < 32 << 10, grown  # KiB: before, ~512 MiB
    assert index.length == ROWS
    assert torch.equal(index.view(ROWS - HELD, ROWS)[0], rows)
    assert not index.view(ROWS - 2 * block_rows, ROWS - HELD)[0].any()
    assert not index.gather(torch.tensor([0, ROWS // 2]))[0].any()
    index.write(ROWS, rows[:, :, :1])  # and it goes on
    assert torch.equal(index.view(ROWS, ROWS + 1)[0], rows[:, :, :1])
    assert torch.equal(mirror.view(ROWS - HELD, ROWS + 1)[0], torch.cat([rows, rows[:, :, :1]], 2))
