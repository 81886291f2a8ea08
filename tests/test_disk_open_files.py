"""The files a disk-tier stream holds open: a few a layer while it streams (the files of the block each of its
buffers writes), as many more while a checksum pass reads (a resume, a saved stream loaded onto the disk tier). A
library user keeps the usual soft limit of 1,024, which one stream of an 80-layer model passes: the disk tier raises
it to the hard limit as it opens, as `statekv serve` does at start. Each check whose limit would leak runs in a
process of its own."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

import statekv
from statekv import Stream
from statekv.core.disk.buffers import MappedTokenBuffer, rows_crc
from statekv.errors import InputError, OutputError
from statekv.locks import FileLock
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames

LAYERS = 8  # files enough that a soft limit a few files above what a process holds refuses the stream

CHILD = """
import os, resource, sys
import statekv
from statekv import Stream

checkpoint, saved, folder, offload_dir = sys.argv[1:5]
qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", offload="disk", offload_dir=offload_dir,
                                     attention="eager")

def lowered():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))

lowered()
with Stream.load(saved, qa) as loaded:  # onto the disk tier: its files written, then every step checksummed
    print("loaded", loaded.frames)
lowered()
with Stream.load(folder, qa) as resumed:
    print("resumed", resumed.frames)
"""


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("deep") / "ckpt",
                                text_config={"num_hidden_layers": LAYERS})


def saved_and_folder(checkpoint, tmp_path):
    """A six-frame stream saved to a file, and the same stream's disk-tier folder, closed; and the VideoQA on the
    disk tier that streamed it."""
    frames = random_frames(6)
    with statekv.VideoQA.from_pretrained(checkpoint, method="statekv", offload=True,
                                         attention="eager").stream() as stream:
        for frame in frames:
            stream.push(frame)
        saved = stream.save(tmp_path / "s.safetensors")
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", offload="disk",
                                         offload_dir=tmp_path / "disk", attention="eager")
    with qa.stream() as stream:
        for frame in frames:
            stream.push(frame)
        folder = stream.folder
    return saved, folder, qa


def run_child(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_a_library_stream_on_the_disk_tier_raises_the_soft_limit_on_open_files(deep_checkpoint, tmp_path):
    """Before: a soft limit below what the stream's layers hold open refused the load and the resume with a
    traceback (``OSError: [Errno 24] Too many open files``), where `statekv serve` would have raised it."""
    saved, folder, _ = saved_and_folder(deep_checkpoint, tmp_path)
    child = run_child(CHILD, deep_checkpoint, saved, folder, tmp_path / "child")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["loaded", "6", "resumed", "6"]


REFUSED = """
import os, resource, sys
import statekv
from statekv import Stream

checkpoint, saved, folder, offload_dir = sys.argv[1:5]
qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", offload="disk", offload_dir=offload_dir,
                                     attention="eager")
limit = len(os.listdir("/proc/self/fd")) + 16
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the hard limit too: this process cannot raise it
for source in (folder, saved):
    try:
        Stream.load(source, qa).close()
    except statekv.errors.StateKVError as error:
        print(type(error).__name__, "|", str(error).replace(chr(10), "<newline>"))
"""


def test_a_hard_limit_on_open_files_too_low_refuses_in_one_line_and_loses_nothing(deep_checkpoint, tmp_path):
    """Before: a resume under a hard limit its layers' files do not fit in raised ``OSError: [Errno 24] Too many
    open files`` with a traceback, and a load onto the disk tier said only "Too many open files". Now each is one
    line naming the limit and ``ulimit -n``, and the folder and the saved file load once the limit allows."""
    saved, folder, qa = saved_and_folder(deep_checkpoint, tmp_path)
    child = run_child(REFUSED, deep_checkpoint, saved, folder, tmp_path / "child")
    assert child.returncode == 0, child.stderr[-2000:]
    refusals = child.stdout.splitlines()
    assert len(refusals) == 2, child.stdout + child.stderr[-2000:]
    for refusal in refusals:
        kind, message = refusal.split(" | ", 1)
        assert kind == "OutputError" and "<newline>" not in message, refusal
        assert "too many open files: this process may hold" in message and "ulimit -n" in message, refusal
    assert not list((tmp_path / "child").glob("*"))  # the load left no half-made folder
    for source in (folder, saved):
        with Stream.load(source, qa) as loaded:
            assert loaded.frames == 6


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's open files in /proc")
def test_a_checksum_pass_holds_no_more_files_of_a_buffer_than_its_writes_do(tmp_path, small_blocks):
    """Before: a pass over a buffer (a resume's, a load onto the disk tier's) kept the files of the block it read
    open beside those of the block it writes: twice the files a layer the stream holds as it streams."""
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    before = open_files()
    rows = torch.arange(8.0).view(1, 1, -1, 1).expand(1, 2, -1, 2048).contiguous()  # 16 KiB a row and part
    buffer.write(0, rows, -rows)
    buffer.length = 8
    assert buffer.block_rows < 8  # the files of a later block are the ones open for its writes
    writing = open_files() - before
    with buffer.reading():
        crcs = [rows_crc(buffer, row, row + 1) for row in range(8)]
        assert open_files() - before <= writing
    assert crcs == [rows_crc(buffer, row, row + 1) for row in range(8)]
    buffer.write(8, rows[:, :, :1], -rows[:, :, :1])  # writes on after it
    buffer.length = 9
    assert torch.equal(buffer.view(0, 9)[1][:, :, 8], -rows[:, :, 0])
    buffer.close()
    assert open_files() == before


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOSPC])
def test_a_lock_refused_for_want_of_room_is_an_output_error_not_the_callers(tmp_path, monkeypatch, code):
    """Before: the lock raised the caller's error (a disk tier's: an `InputError`, read as a damaged or held file set)
    saying a bare "Too many open files"; it is now an `OutputError` (retry once there is room), naming the limit."""
    opened = os.open

    def refused(path, *args, **kwargs):
        if os.fspath(path).startswith(str(tmp_path)):
            raise OSError(code, os.strerror(code))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(OutputError) as caught:
        FileLock.acquire(tmp_path / "set.lock", what="the set", error=InputError)
    assert not isinstance(caught.value, InputError) and "\n" not in str(caught.value)
    assert ("ulimit -n" if code == errno.EMFILE else "No space left") in str(caught.value)


def test_a_disk_tier_sync_past_the_limit_on_open_files_names_it(tmp_path, monkeypatch):
    """Before: a sync (a server's save) writing its watches past the limit said a bare "Too many open files"."""
    import builtins

    qa = statekv.VideoQA.from_options(statekv.ModelOptions(model="builtin", budget=64, offload="disk",
                                                           offload_dir=str(tmp_path)))
    stream = qa.stream(16, max_fps=1.0)
    for t, frame in enumerate(random_frames(2, height=48, width=64)):
        stream.push(frame, float(t))
    stream.watch("What colour?", every=1, max_new_tokens=2)
    opened = builtins.open

    def out_of_files(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(str(tmp_path)):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), os.fspath(path))
        return opened(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(builtins, "open", out_of_files)
        with pytest.raises(OutputError, match="ulimit -n") as caught:
            stream.sync()
    assert "\n" not in str(caught.value)
    stream.sync()  # once there are files to spare
    stream.close()
