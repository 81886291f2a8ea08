"""A disk-tier file of format 4 (one file a part) keeps a row for every token a stream streams, evicted or not, so a
stream that runs for weeks reaches its file system's largest file (16 TiB on ext4: about 13 days at 30 frames a
second for an 8B model's 256 tokens a frame, before its files doubled past it); files in blocks never do
(`tests/test_disk_blocks.py`). Here a process's file size limit (``RLIMIT_FSIZE``, refused as a file system refuses
a file past its largest, ``EFBIG``) stands for it."""

from __future__ import annotations

import resource
import signal

import pytest
import torch

from statekv.core.disk.buffers import MappedTokenBuffer
from statekv.errors import OutputError


@pytest.fixture
def largest_file():
    """Set the largest file this process may write (bytes), as long as the test runs."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python starts: the write fails with EFBIG
    yield lambda size: resource.setrlimit(resource.RLIMIT_FSIZE, (size, before[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, before)
    signal.signal(signal.SIGXFSZ, ignored)


def test_a_format_4_buffer_grows_up_to_its_file_systems_largest_file_then_says_so(tmp_path, largest_file,
                                                                                  monkeypatch):
    """It used to double its files' size ahead of its rows and fail once that doubling passed the largest file, at
    half the stream age the file system allows; now a file set of format 4 (one file a part, what a resumed one
    goes on writing) grows to the largest file, then refuses with one line."""
    monkeypatch.setattr(MappedTokenBuffer, "BLOCK_BYTES", None)  # format 4's layout
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(2 * 64, dtype=torch.float32).view(1, 2, 1, 64)  # a row of 512 bytes
    buffer.write(0, rows.expand(1, 2, 64, 64), -rows.expand(1, 2, 64, 64))  # 64 rows: the first capacity
    largest_file(100 * buffer.row_bytes)  # doubling to 128 rows would pass it
    for row in range(64, 100):
        buffer.write(row, rows + row, -rows - row)
    buffer.length = 100
    assert buffer.capacity == 100  # the most rows the limit takes
    keys, values = buffer.view(98, 100)
    assert torch.equal(keys[:, :, 1:], rows + 99) and torch.equal(values[:, :, :1], -rows - 98)
    with pytest.raises(OutputError, match="largest file its file system allows.*every token of the stream"):
        buffer.write(100, rows, -rows)
    assert buffer.capacity == 100 and torch.equal(buffer.view(0, 1)[0], rows)
    buffer.close()
