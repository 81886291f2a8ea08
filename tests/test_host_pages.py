"""Host memory given back as rows are released: released rows read as zeros, the pages that runs of them cover go back
to the OS (counted with mincore), and a buffer that grows copies only the rows it keeps."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

from statekv.core.storage.buffers import TokenBuffer
from statekv.core.storage.host_pages import ReleasedRuns

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under ``tensor`` that are resident (mincore)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
    vector = (ctypes.c_ubyte * ((end - start) // page))()
    assert _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) == 0
    return sum(byte & 1 for byte in vector) * page


def test_released_runs_merge_and_say_what_is_kept():
    runs = ReleasedRuns()
    assert runs.add(10, 12) == (10, 12) and runs.add(20, 25) == (20, 25)
    assert runs.add(12, 14) == (10, 14)  # touching: one run
    assert runs.add(5, 30) == (5, 30) and (runs.starts, runs.ends) == ([5], [30])
    runs.add(40, 41)
    assert runs.kept(50) == [(0, 5), (30, 40), (41, 50)] and runs.within(35) == [(5, 30)]
    assert ReleasedRuns().kept(3) == [(0, 3)]


def test_a_buffer_gives_back_the_pages_its_released_rows_cover_and_grows_without_them():
    row = 1024  # floats: 4 KiB a row of each head
    buffer = TokenBuffer(parts=2, device="cpu")
    written = torch.randn(2, 1, 2, 600, row).unbind(0)
    for step in range(600):  # one row a step, the oldest released from row 100 on: as evict-oldest does
        buffer.write(step, written[0][:, :, step: step + 1], written[1][:, :, step: step + 1])
        buffer.length = step + 1
        if step >= 100:
            buffer.release(step - 100, step - 99)
    assert buffer.capacity >= 600
    kept = (slice(None), slice(None), slice(500, 600))
    for tensor, original in zip(buffer.tensors, written):  # (reading a page given back maps the zero page)
        held = resident_bytes(tensor)
        assert held <= (100 + 4) * 2 * row * 4, held  # the kept rows of both heads, and their edges' pages
        assert not tensor[:, :, :500].any() and torch.equal(tensor[kept], original[kept])
    buffer.release(500, 550)
    buffer.reserve(written[0], 2 * buffer.capacity + 1)  # grows: only what is kept is copied
    for tensor, original in zip(buffer.tensors, written):
        assert resident_bytes(tensor) <= (50 + 4) * 2 * row * 4
        assert not tensor[:, :, :550].any() and torch.equal(tensor[:, :, 550:600], original[:, :, 550:600])


def test_rows_smaller_than_a_page_are_given_back_once_a_run_covers_the_page():
    buffer = TokenBuffer(parts=1, device="cpu")
    buffer.write(0, torch.ones(1, 1, 4096, 16))  # 64-byte rows: 64 to a page
    buffer.length = 4096
    before = resident_bytes(buffer.tensors[0])
    for row in range(1024):  # one row at a time: no single release covers a page
        buffer.release(row, row + 1)
    assert before - resident_bytes(buffer.tensors[0]) >= 15 * mmap.PAGESIZE
    assert not buffer.tensors[0][:, :, :1024].any() and buffer.tensors[0][:, :, 1024:].eq(1).all()
