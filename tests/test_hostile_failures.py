"""A failed call changes nothing: every push, save and ask of a stream either completes or leaves the stream as it
was, whichever of its writes fails (a full disk, a folder made read-only, a device error) or however it is
killed, and the error says, in one line, what was kept.

Each write a disk-tier push makes (the journal, every layer's files, the carried-state slot) is made to fail in
turn; after each failure the stream is checked to be exactly as before, and after all of them it must still be
exactly the stream a clean run makes, in memory and when resumed from its files.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from statekv import Stream
from statekv.errors import InputError, OutputError
from statekv.models import load_adapter
from hostile import noise_frames, small_qa

QUESTION = "Why?"
CHILD_TIMEOUT = 120


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint)


def _snapshot(stream) -> dict:
    """Everything a failed call must leave as it was."""
    layers = stream.prefill.cache.layers
    return {
        "carried": [t.clone() for layer in layers if layer.carried_length
                    for t in (*layer.carried(), layer.positions())],
        "lengths": [layer.storage.length for layer in layers],
        "steps": list(stream.prefill.cache.chunk_lengths),
        "counts": (stream.frames, stream.pushed, len(stream.pending), stream.tokens, stream.next_tick,
                   stream.last_timestamp, stream.stats.chunks, stream.stats.frames),
    }


def _same(a: dict, b: dict) -> bool:
    return (a["lengths"] == b["lengths"] and a["steps"] == b["steps"] and a["counts"] == b["counts"]
            and len(a["carried"]) == len(b["carried"])
            and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a["carried"], b["carried"])))


class FailingWrites:
    """Makes the ``fail_at``-th of the next writes (``os.write``, ``os.pwrite``) raise ``number``; counts them."""

    def __init__(self, monkeypatch, number: int = errno.ENOSPC):
        self.number, self.count, self.fail_at = number, 0, None
        for name in ("write", "pwrite"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(real))

    def _wrap(self, real):
        def write(*args):
            self.count += 1
            if self.fail_at is not None and self.count == self.fail_at:
                raise OSError(self.number, os.strerror(self.number))
            return real(*args)
        return write

    def arm(self, fail_at: int | None) -> None:
        self.count, self.fail_at = 0, fail_at


def _goes_on_as_never_failed(stream, qa, adapter, frames) -> None:
    """``stream``, two frames pushed and its third failed, takes frames 2 to 4 and is then, in memory and in its files,
    the stream of frames 0 to 4 that never failed: nothing lost, nothing twice."""
    for t in (2, 3, 4):
        stream.push(frames[t], float(t))
    reference = small_qa(adapter).stream(horizon_frames=5, max_fps=1)
    for t in range(5):
        reference.push(frames[t], float(t))
    assert _same(_snapshot(stream), _snapshot(reference))
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=4), reference.ask_tokens(QUESTION, max_new_tokens=4))
    stream.close()
    resumed = Stream.load(stream.prefill.disk.folder, qa)
    assert resumed.frames_lost == 0 and _same(_snapshot(resumed), _snapshot(reference))


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS], ids=["disk full", "read-only"])
def test_every_write_of_a_disk_tier_push_can_fail_and_the_stream_is_as_it_was(adapter, tmp_path, monkeypatch,
                                                                               number):
    frames = noise_frames(5)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=5, max_fps=1)
    stream.push(frames[0], 0.0)
    writes = FailingWrites(monkeypatch, number)
    writes.arm(None)
    stream.push(frames[1], 1.0)
    per_push = writes.count  # the journal's push record, every layer's files, the carried-state slot, the step
    assert per_push >= 3 + 2 * len(stream.prefill.cache.layers)
    reason = os.strerror(number)
    for fail_at in range(1, per_push + 1):
        before = _snapshot(stream)
        writes.arm(fail_at)
        with pytest.raises(OutputError) as error:
            stream.push(frames[2], 2.0)
        message = str(error.value)
        assert "\n" not in message and reason in message and ("as it was" in message or "as before" in message)
        writes.arm(None)
        assert _same(_snapshot(stream), before), f"write {fail_at} of {per_push} changed the stream"
    _goes_on_as_never_failed(stream, qa, adapter, frames)


def test_steps_the_disk_refused_once_and_took_again_resume_from_their_files(adapter, tmp_path, monkeypatch):
    """Before: the bytes a refused step had written still counted in the checksum its retry journaled (each file's
    running CRC was not started again when the step was undone), so the folder read as damaged at that step: the
    stream could not be resumed. The test above missed it: its last refusal, at the step's journal record, came
    after the CRCs were taken."""
    frames = noise_frames(7)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=7, max_fps=1)
    stream.push(frames[0], 0.0)
    writes = FailingWrites(monkeypatch)
    for t in range(1, 7):
        writes.arm(t + 1)  # a different write of each step: the push record's is the first
        with pytest.raises(OutputError):
            stream.push(frames[t], float(t))
        writes.arm(None)
        stream.push(frames[t], float(t))
    stream.close()
    reference = small_qa(adapter).stream(horizon_frames=7, max_fps=1)
    for t, frame in enumerate(frames):
        reference.push(frame, float(t))
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert resumed.frames_lost == 0 and _same(_snapshot(resumed), _snapshot(reference))


@pytest.mark.parametrize("call", ["fsync", "replace", "ftruncate"])
@pytest.mark.parametrize("vision_batch", [1, 3])
def test_a_first_step_whose_files_the_disk_refused_is_taken_at_the_next_push(adapter, tmp_path, monkeypatch, call,
                                                                               vision_batch):
    """The first step opens every layer's files: a description written and synced, then the files grown. Before:
    refused there, the layers counted as started and their files as opened, so the next push failed with a
    traceback (``'NoneType' object has no attribute 'shape'``). Now the push is refused in one line and the frame,
    pushed again, is taken; the stream ends as a clean run's, and resumes as one."""
    frames = noise_frames(5)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(max_fps=1, vision_batch=vision_batch)
    for t in range(vision_batch - 1):
        stream.push(frames[t], float(t))
    real, calls = getattr(os, call), []

    def refused(*args):
        calls.append(call)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, call, refused)
    t = vision_batch - 1
    with pytest.raises(OutputError) as error:
        stream.push(frames[t], float(t))
    assert "\n" not in str(error.value) and os.strerror(errno.ENOSPC) in str(error.value)
    assert str(error.value).endswith("; the step was not taken: the stream holds its 0 tokens as before it")
    for t in range(t, 5):
        stream.push(frames[t], float(t))
    stream.flush()
    reference = small_qa(adapter).stream(max_fps=1, vision_batch=vision_batch)
    for t, frame in enumerate(frames):
        reference.push(frame, float(t))
    reference.flush()
    assert _same(_snapshot(stream), _snapshot(reference))
    stream.close()
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert resumed.frames_lost == 0 and _same(_snapshot(resumed), _snapshot(reference))


def test_an_eviction_the_journal_refused_leaves_the_stream_as_it_was_and_says_so(adapter, tmp_path, monkeypatch):
    """Under a cache limit a step first journals the frames it evicts. Before: refused there, the push failed with
    the disk's reason alone, not saying that the step was not taken."""
    frames = noise_frames(24)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path, max_cache_bytes=300_000, cache_limit="evict-oldest")
    stream = qa.stream(max_fps=1)
    real, refused = os.write, []

    def write(fd, data):
        if b'"evict"' in bytes(data):
            refused.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    for t, frame in enumerate(frames):
        before = _snapshot(stream)
        monkeypatch.setattr(os, "write", write)
        try:
            stream.push(frame, float(t))
        except OutputError as error:
            assert str(error) == (f"cannot write the disk cache in {stream.prefill.disk.folder}: "
                                  f"{os.strerror(errno.ENOSPC)}; the step was not taken: the stream holds its "
                                  f"{stream.tokens} tokens as before it")
            assert _same(_snapshot(stream), before)
            monkeypatch.undo()
            stream.push(frame, float(t))
        monkeypatch.undo()
    assert refused, "no step evicted: the limit is too loose to test anything"
    reference = small_qa(adapter, offload="disk", offload_dir=tmp_path / "reference", max_cache_bytes=300_000,
                         cache_limit="evict-oldest").stream(max_fps=1)
    for t, frame in enumerate(frames):
        reference.push(frame, float(t))
    assert _same(_snapshot(stream), _snapshot(reference))
    stream.close()
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert resumed.frames_lost == 0 and _same(_snapshot(resumed), _snapshot(reference))


def test_a_push_interrupted_between_two_partial_writes_of_its_record_leaves_the_journal_whole(adapter, tmp_path,
                                                                                           monkeypatch):
    """Before: a KeyboardInterrupt (or any error but the disk's) raised after the push's journal record was half
    written left the half line; the next record followed it on the same line, and the stream, closed, could not
    be resumed at all ("the disk cache's journal is damaged at line 6"). Now the record goes whole or not at all."""
    frames = noise_frames(4)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=4, max_fps=1)
    stream.push(frames[0], 0.0)
    real, torn = os.write, []

    def write(fd, data):
        if not torn and b'"push"' in bytes(data):
            torn.append(fd)
            return real(fd, bytes(data)[:len(data) // 2])  # the disk took half (a signal, a nearly full disk)
        if torn and fd == torn[0]:
            raise KeyboardInterrupt  # before the rest was written
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(KeyboardInterrupt):
        stream.push(frames[1], 1.0)
    monkeypatch.undo()
    for t in (1, 2, 3):
        stream.push(frames[t], float(t))
    stream.close()
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert (resumed.frames, resumed.frames_lost) == (4, 0)


def test_a_step_refused_after_its_evictions_says_they_stay(adapter, tmp_path, monkeypatch):
    """A step evicts to make room (journaled first), then the disk refuses to grow its files: the step is not
    taken, the frames it evicted stay evicted, and the message says so (before: "as before it")."""
    frames = noise_frames(24)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path, max_cache_bytes=300_000, cache_limit="evict-oldest")
    stream = qa.stream(max_fps=1)
    real_write, real_truncate, evicting = os.write, os.ftruncate, []

    def write(fd, data):
        if b'"evict"' in bytes(data):
            evicting.append(fd)
        return real_write(fd, data)

    def truncate(fd, length):
        if evicting:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_truncate(fd, length)

    refused = []
    for t, frame in enumerate(frames):
        evicting.clear()
        evicted = len(stream.prefill.cache.evicted_steps)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "ftruncate", truncate)
        try:
            stream.push(frame, float(t))
        except OutputError as error:
            monkeypatch.undo()
            refused.append(t)
            assert len(stream.prefill.cache.evicted_steps) > evicted and "\n" not in str(error)
            assert str(error).endswith(f"; the step was not taken: the stream holds its {stream.tokens} tokens less "
                                       "the frames evicted to make room for it"), str(error)
            stream.push(frame, float(t))
            break
        monkeypatch.undo()
    assert refused, "no step grew its files after evicting: nothing was tested"
    stream.close()
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert resumed.frames_lost == 0 and resumed.frames == refused[0] + 1


def test_a_closed_disk_tier_stream_refuses_a_push_in_one_line(adapter, tmp_path):
    """Before: a push into a closed disk-tier stream (closed by its caller, or by a first step its disk refused)
    journaled the frame first, into a journal closed with it: ``OSError: [Errno 9] Bad file descriptor``."""
    frames = noise_frames(2)
    stream = small_qa(adapter, offload="disk", offload_dir=tmp_path).stream(max_fps=1)
    stream.push(frames[0], 0.0)
    stream.close()
    with pytest.raises(InputError, match="^this stream was closed .* it can no longer step or decode$"):
        stream.push(frames[1], 1.0)


def test_a_write_raising_memory_error_midway_leaves_the_disk_tier_stream_as_it_was(adapter, tmp_path, monkeypatch):
    frames = noise_frames(5)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=5, max_fps=1)
    stream.push(frames[0], 0.0)
    writes = FailingWrites(monkeypatch)
    writes.arm(None)
    stream.push(frames[1], 1.0)
    per_push = writes.count
    monkeypatch.undo()
    for fail_at in range(1, per_push + 1):  # not an OSError: raised as itself, the step undone all the same
        before = _snapshot(stream)
        real = os.write, os.pwrite
        count = [0]

        def failing(real_write):
            def write(*args):
                count[0] += 1
                if count[0] == fail_at:
                    raise MemoryError("no memory left")
                return real_write(*args)
            return write

        monkeypatch.setattr(os, "write", failing(real[0]))
        monkeypatch.setattr(os, "pwrite", failing(real[1]))
        with pytest.raises(MemoryError, match="no memory left"):
            stream.push(frames[2], 2.0)
        monkeypatch.undo()
        assert _same(_snapshot(stream), before), f"write {fail_at} of {per_push} changed the stream"
    _goes_on_as_never_failed(stream, qa, adapter, frames)


@pytest.mark.parametrize("raised", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), MemoryError("no memory left")],
                         ids=["disk full", "out of memory"])
def test_a_failed_write_in_a_batched_push_fails_that_stream_alone(adapter, tmp_path, monkeypatch, raised):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    streams = [qa.stream(horizon_frames=6, name=f"s{i}") for i in range(3)]
    frames = [noise_frames(6, seed=i) for i in range(3)]
    for t in range(3):
        qa.push_many([(stream, frames[i][t], float(t)) for i, stream in enumerate(streams)])
    before = [_snapshot(stream) for stream in streams]
    sick = streams[1].prefill.disk.folder
    real = os.pwrite

    def pwrite(fd, data, offset):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == sick:
            raise raised
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    results = qa.push_many([(stream, frames[i][3], 3.0) for i, stream in enumerate(streams)], return_exceptions=True)
    assert isinstance(results[1], OutputError if isinstance(raised, OSError) else MemoryError)
    assert results[0] is True and results[2] is True
    assert _same(_snapshot(streams[1]), before[1])
    monkeypatch.undo()
    for t in range(3, 6):
        results = qa.push_many([(stream, frames[i][t], float(t)) for i, stream in enumerate(streams)
                                if t > 3 or i == 1])
    for i, stream in enumerate(streams):
        reference = small_qa(adapter).stream(horizon_frames=6)
        for t in range(6):
            reference.push(frames[i][t], float(t))
        assert _same(_snapshot(stream), _snapshot(reference)), stream.name


def test_every_write_of_a_push_ending_a_vision_batch_can_fail_and_the_frame_pushed_again_ends_as_a_clean_run(
        adapter, tmp_path, monkeypatch):
    """Under ``vision_batch=2`` the push that completes a batch streams the frame that waited and its own; a write
    failing in the second step leaves the first streamed (`Stream.settle`: what was durable stays) and the frame
    pushed not taken, so the batches fall one frame later from there. Pushed again after each failure, the stream
    holds, once flushed, exactly what a clean run holds, and resumes from its files as that."""
    frames = noise_frames(8)
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=8, max_fps=1, vision_batch=2)
    for t in range(3):
        stream.push(frames[t], float(t))
    writes, refused = FailingWrites(monkeypatch), []
    t, fail_at = 3, 1
    while t < len(frames):
        writes.arm(fail_at)
        try:
            stream.push(frames[t], float(t))
        except OutputError as error:
            refused.append(str(error))
            assert stream.pushed == t  # not taken
            fail_at += 1
            continue
        t, fail_at = t + 1, 1
    writes.arm(None)
    assert len(refused) > 2 * (len(frames) - 3)
    stream.flush()
    reference = small_qa(adapter).stream(horizon_frames=8, max_fps=1, vision_batch=2)
    for t, frame in enumerate(frames):
        reference.push(frame, float(t))
    reference.flush()
    assert _same(_snapshot(stream), _snapshot(reference))
    stream.close()
    with Stream.load(stream.prefill.disk.folder, qa) as resumed:
        assert resumed.frames_lost == 0 and _same(_snapshot(resumed), _snapshot(reference))


def test_a_failed_save_leaves_the_stream_and_the_file_there_as_they_were(adapter, tmp_path, monkeypatch):
    import statekv.api.stream_file as stream_file

    stream = small_qa(adapter).stream(horizon_frames=4)
    for frame in noise_frames(2):
        stream.push(frame)
    target = stream.save(tmp_path / "s.safetensors")
    saved = target.read_bytes()
    stream.push(noise_frames(3)[2])
    before = _snapshot(stream)
    real = stream_file.save_file

    def half_written(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as file:  # the disk filled up half way
            file.truncate(os.path.getsize(filename) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(stream_file, "save_file", half_written)
    with pytest.raises(OutputError) as error:
        stream.save(target)
    assert "\n" not in str(error.value) and "No space left on device" in str(error.value)
    assert "stream is unchanged" in str(error.value)
    assert target.read_bytes() == saved and sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]
    assert _same(_snapshot(stream), before)
    monkeypatch.undo()
    assert Stream.load(stream.save(target), stream.qa).frames == 3


def test_a_disk_that_fails_a_sync_fails_the_save_in_one_line(adapter, tmp_path, monkeypatch):
    stream = small_qa(adapter, offload="disk", offload_dir=tmp_path / "cache").stream(horizon_frames=4)
    for frame in noise_frames(2):
        stream.push(frame)
    before = _snapshot(stream)

    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputError) as error:
        stream.save(tmp_path / "s.safetensors")
    assert "\n" not in str(error.value) and "Input/output error" in str(error.value)
    assert not (tmp_path / "s.safetensors").exists() and _same(_snapshot(stream), before)


def test_an_ask_whose_waiting_steps_cannot_be_written_keeps_every_frame(adapter, tmp_path, monkeypatch):
    frames = noise_frames(8)
    stream = small_qa(adapter, offload="disk", offload_dir=tmp_path).stream(horizon_frames=8, vision_batch=4)
    for frame in frames[:7]:
        stream.push(frame)  # a batch of 4 encoded, 3 waiting for the next: ask encodes them first
    before = _snapshot(stream)
    writes = FailingWrites(monkeypatch)
    writes.arm(2)
    with pytest.raises(OutputError) as error:
        stream.ask(QUESTION, max_new_tokens=2)
    writes.arm(None)
    assert "\n" not in str(error.value)
    after = _snapshot(stream)  # the same frames: some may now be encoded, none lost
    assert after["counts"][0] + after["counts"][2] == before["counts"][0] + before["counts"][2] == 7
    assert after["counts"][1] == before["counts"][1]
    stream.push(frames[7])
    reference = small_qa(adapter).stream(horizon_frames=8)
    for frame in frames:
        reference.push(frame)
    stream.flush()
    assert _same(_snapshot(stream), _snapshot(reference))


def test_a_stream_on_a_full_tmpfs_fails_its_push_in_one_line_and_keeps_going_once_there_is_room(adapter, tmp_path):
    """A real full disk (a tmpfs of a few hundred KiB), where the system allows mounting one."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (the monkeypatched failures above cover every write)")
    try:
        frames = noise_frames(40)
        stream = small_qa(adapter, offload="disk", offload_dir=mount).stream(horizon_frames=40)
        pushed = 0
        with pytest.raises(OutputError) as error:
            for frame in frames:
                before = _snapshot(stream)
                stream.push(frame)
                pushed += 1
        assert "No space left on device" in str(error.value) and "\n" not in str(error.value)
        assert _same(_snapshot(stream), before) and stream.frames == pushed
        subprocess.run(["mount", "-o", "remount,size=4m", str(mount)], check=True)  # room: it goes on from there
        for frame in frames[pushed:pushed + 3]:
            stream.push(frame)
        reference = small_qa(adapter).stream(horizon_frames=40)
        for frame in frames[:pushed + 3]:
            reference.push(frame)
        assert _same(_snapshot(stream), _snapshot(reference))
        stream.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


KILLED_SAVER = """
import sys, numpy as np, statekv
from statekv.models import load_adapter
adapter = load_adapter(sys.argv[1])
qa = statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40)
stream = qa.stream(horizon_frames=400)
for index, frame in enumerate(np.random.default_rng(0).integers(0, 256, (400, 24, 32, 3), dtype=np.uint8)):
    stream.push(frame)
    stream.save(sys.argv[2])
    print("saved", index, flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_the_file_before_it_loadable(adapter, checkpoint, tmp_path):
    target = tmp_path / "s.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_SAVER), str(checkpoint), str(target)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, saved = time.monotonic() + CHILD_TIMEOUT, -1
    while time.monotonic() < deadline and saved < 4:
        line = child.stdout.readline()
        if not line:
            break
        saved = int(line.split()[1]) if line.startswith("saved ") else saved
    time.sleep(np.random.default_rng().uniform(0, 0.05))  # lands inside a save, or between two
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=CHILD_TIMEOUT)
    assert saved >= 4, child.stderr
    resumed = Stream.load(target, small_qa(adapter))
    assert resumed.frames >= saved + 1


def test_a_close_the_full_disk_refuses_still_closes_and_the_folder_resumes(adapter, tmp_path, monkeypatch):
    """Before: the close's checkpoint failed with the disk full, and the stream kept its files and its folder's lock,
    so `Stream.load` of the folder was refused as in use by this very process until it ended."""
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(max_fps=1)
    for index, frame in enumerate(noise_frames(3)):
        stream.push(frame, float(index))
    folder = stream.folder
    for name in ("write", "pwrite"):  # every write fails: the disk stays full
        monkeypatch.setattr(os, name, lambda *args: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OutputError, match="the stream is closed and .* resumes from its last checkpoint") as error:
        stream.close()
    assert "\n" not in str(error.value)
    monkeypatch.undo()
    resumed = Stream.load(folder, qa)
    assert 1 <= resumed.frames < 3
    resumed.close()


def test_a_close_interrupted_by_memory_error_leaves_the_stream_open_with_its_watches(adapter, tmp_path, monkeypatch):
    """Before: the watches were closed before the close's writes, so a close a MemoryError interrupted left the
    stream open without them, and the close that followed wrote a folder that reopened none."""
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=6, max_fps=1)
    frames = noise_frames(5)
    for index in range(4):
        stream.push(frames[index], float(index))
    stream.watch("What?", every=2)
    monkeypatch.setattr(os, "write", lambda *args: (_ for _ in ()).throw(MemoryError("no memory left")))
    with pytest.raises(MemoryError, match="no memory left"):
        stream.close()
    monkeypatch.undo()
    assert len(stream.watches) == 1 and not stream.prefill.closed
    stream.push(frames[4], 4.0)  # it goes on, its watch with it
    events = len(stream.watches[0].events)
    stream.close()
    with Stream.load(stream.folder, qa) as resumed:
        assert resumed.frames == 5 and [len(watch.events) for watch in resumed.watches] == [events]
