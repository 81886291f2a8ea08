"""The disk tier after a power loss (not a kill): what was not forced to the device (fsync) is lost, in any order
between files. A power cut is simulated by recording each file's bytes at its last fsync and putting the folder
back to them; `Stream.load` resumes at the last checkpoint whose data is durable (what follows counted lost)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import statekv
from statekv import Stream
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


class Device:
    """What reached the storage device: each file's bytes as of its last ``os.fsync`` (by inode, so a file renamed
    after it is followed)."""

    def __init__(self, monkeypatch):
        self.synced: dict[tuple[int, int], bytes] = {}
        real = os.fsync

        def fsync(fd):
            real(fd)
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode):
                with open(os.readlink(f"/proc/self/fd/{fd}"), "rb") as handle:
                    self.synced[info.st_dev, info.st_ino] = handle.read()

        monkeypatch.setattr(os, "fsync", fsync)

    def power_cut(self, folder: Path, to: Path, *, whole: tuple[str, ...] = ()) -> Path:
        """``folder``'s files as a power cut leaves them, in ``to``: each as last forced to the device (a file never
        forced: empty), those named in ``whole`` as they are (written back by the kernel before the cut)."""
        to.mkdir()
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.name != "lock":
                info = path.stat()
                data = path.read_bytes() if path.name in whole else self.synced.get((info.st_dev, info.st_ino), b"")
                (to / path.name).write_bytes(data)
        return to


def _carried(stream) -> list[torch.Tensor]:
    return [t.cpu() for layer in stream.prefill.cache.layers for t in (*layer.carried(), layer.positions())]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _streamed(adapter, tmp_path, monkeypatch, frames):
    """A disk-tier stream checkpointed every 4 steps, 10 frames pushed: checkpoints after steps 0, 3 and 7."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = qa.stream(horizon_frames=12)
    for frame in frames[:10]:
        stream.push(frame)
    return qa, stream


def _resumes_as_streamed_to(resumed, adapter, frames, count: int) -> None:
    """``resumed`` holds what a stream that pushed only ``frames[:count]`` does, and goes on as it."""
    reference = tiny_qa(adapter).stream(horizon_frames=12)
    for frame in frames[:count]:
        reference.push(frame)
    assert resumed.frames == count and _same(_carried(resumed), _carried(reference))
    for frame in frames[count:]:
        resumed.push(frame)
        reference.push(frame)
    assert _same(_carried(resumed), _carried(reference))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6), reference.ask_tokens(QUESTION, max_new_tokens=6))
    resumed.close()


def test_a_power_cut_resumes_at_the_last_checkpoint_forced_to_the_device(adapter, tmp_path, monkeypatch):
    """Before: a checkpoint was never forced to the device, so a power cut left an empty journal (every frame
    lost, the folder refused), or a whole journal vouching for data that never reached the disk (refused as
    damaged: `statekv serve` quarantined the stream)."""
    device, frames = Device(monkeypatch), random_frames(12)
    qa, stream = _streamed(adapter, tmp_path, monkeypatch, frames)
    folder = stream.prefill.disk.folder
    cut = Stream.load(device.power_cut(folder, tmp_path / "cut"), qa)
    assert cut.frames_lost == 0  # the records of the frames after it were lost with them
    _resumes_as_streamed_to(cut, adapter, frames, 7)
    journal_kept = Stream.load(device.power_cut(folder, tmp_path / "journal kept", whole=("journal",)), qa)
    assert journal_kept.frames_lost == 3  # counted as after a kill
    _resumes_as_streamed_to(journal_kept, adapter, frames, 7)
    stream.close()  # closing forces it all: a power cut then loses nothing
    closed = Stream.load(device.power_cut(folder, tmp_path / "closed"), qa)
    assert (closed.frames, closed.frames_lost) == (10, 0)
    closed.close()
