"""The disk tier after a power loss (not a kill): what was not forced to the device (fsync) is lost, in any order
between files. A power cut is simulated by recording each file's bytes at its last fsync and putting the folder
back to them; `Stream.load` resumes at the last checkpoint whose data is durable (what follows counted lost), and
still refuses a folder damaged before it."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import stat
import zlib
from pathlib import Path

import pytest
import torch

import statekv
from statekv import Stream
from statekv.errors import InputError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint

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


def test_a_journal_torn_by_a_power_cut_after_its_last_checkpoint_resumes_there(adapter, tmp_path, monkeypatch,
                                                                            caplog):
    """A page of the journal after the last checkpoint lost (zeros) while a later page reached the disk: before,
    refused as damaged; now resumed at the checkpoint, saying so. Damage before it is still refused."""
    device, frames = Device(monkeypatch), random_frames(12)
    qa, stream = _streamed(adapter, tmp_path, monkeypatch, frames)
    folder = stream.prefill.disk.folder
    cut = device.power_cut(folder, tmp_path / "cut")
    durable, whole = (cut / "journal").read_bytes(), (folder / "journal").read_bytes()
    gap = (len(whole) - len(durable)) // 2
    assert whole.startswith(durable) and whole[len(durable) + gap:].count(b"\n") > 1  # whole lines after the gap
    (cut / "journal").write_bytes(durable + b"\0" * gap + whole[len(durable) + gap:])
    damaged = shutil.copytree(cut, tmp_path / "damaged")
    with caplog.at_level(logging.WARNING, logger="statekv"):
        resumed = Stream.load(cut, qa)
    said = [r.getMessage() for r in caplog.records if "power loss" in r.getMessage()]
    assert len(said) == 1 and "the 3 step(s) journaled after it lost" in said[0], said
    assert resumed.frames_lost == 3  # as a kill's: the records after the gap counted too
    _resumes_as_streamed_to(resumed, adapter, frames, 7)
    data = bytearray(durable)
    data[len(durable) // 2: len(durable) // 2 + 40] = b"\0" * 40  # before the last checkpoint: durable, damaged
    (damaged / "journal").write_bytes(bytes(data))
    with pytest.raises(InputError, match="journal is damaged at line"):
        Stream.load(damaged, qa)
    stream.close()


def _journal_of_an_earlier_statekv(folder: Path) -> None:
    """The journal in ``folder`` as a statekv that forced nothing before a sync wrote it: no checkpoint marked."""
    lines = []
    for line in (folder / "journal").read_bytes().split(b"\n"):
        record = json.loads(line.partition(b" ")[2]) if line else None
        if isinstance(record, dict) and record.pop("synced", None) is not None:
            text = json.dumps(record, separators=(",", ":")).encode()
            line = b"%08x %s" % (zlib.crc32(text), text)
        lines.append(line)
    (folder / "journal").write_bytes(b"\n".join(lines))


def test_a_checkpoint_an_earlier_statekv_left_unsynced_gives_way_to_the_one_before(adapter, tmp_path, monkeypatch):
    """An earlier statekv's last checkpoint record survived a power cut, its slot's bytes did not: the checkpoint
    before it, in the other slot, resumes (before: refused). One this statekv marked durable is refused."""
    frames = random_frames(12)
    qa, stream = _streamed(adapter, tmp_path, monkeypatch, frames)
    folder = stream.prefill.disk.folder
    carries = [json.loads(line.partition(" ")[2]) for line in (folder / "journal").read_text().splitlines()
               if '"carry"' in line]
    assert [(c["carry"], c["slot"]) for c in carries] == [(0, 0), (3, 1), (7, 0)]
    marked = shutil.copytree(folder, tmp_path / "marked", ignore=shutil.ignore_patterns("lock"))
    earlier = shutil.copytree(folder, tmp_path / "earlier", ignore=shutil.ignore_patterns("lock"))
    stream.close()
    for copy in (marked, earlier):
        slot = copy / "carry.0.bin"
        slot.write_bytes(b"\0" * slot.stat().st_size)
    with pytest.raises(InputError, match="the carried state of step 7 does not match its checksum"):
        Stream.load(marked, qa)
    _journal_of_an_earlier_statekv(earlier)
    resumed = Stream.load(earlier, qa)
    assert resumed.frames_lost == 7  # frames 4 to 10: pushed after the checkpoint it resumed at
    _resumes_as_streamed_to(resumed, adapter, frames, 3)


def _damaged(folder: Path, to: Path, step: int) -> Path:
    """A copy of ``folder`` in ``to`` whose journal's record of step ``step`` does not read (a bit flipped)."""
    to = shutil.copytree(folder, to)
    lines = (to / "journal").read_bytes().split(b"\n")
    number = next(n for n, line in enumerate(lines) if b'{"step":%d,' % step in line)
    lines[number] = lines[number][:20] + bytes([lines[number][20] ^ 1]) + lines[number][21:]
    (to / "journal").write_bytes(b"\n".join(lines))
    return to


def test_an_earlier_statekvs_journal_damaged_before_a_checkpoint_is_refused(adapter, tmp_path, monkeypatch):
    """An earlier statekv's journal (no checkpoint marked) with a record that does not read before a checkpoint's
    that does: damage, refused naming its line as before (before: taken for a power loss, the stream resumed at
    the checkpoint before the damage, every step after it dropped and its files cut, or refused for a slot)."""
    frames = random_frames(12)
    qa, stream = _streamed(adapter, tmp_path, monkeypatch, frames)
    earlier = shutil.copytree(stream.prefill.disk.folder, tmp_path / "earlier", ignore=shutil.ignore_patterns("lock"))
    stream.close()
    _journal_of_an_earlier_statekv(earlier)
    for step, line in ((5, 15), (1, 5)):  # between the checkpoints of steps 3 and 7; before that of step 3
        with pytest.raises(InputError, match=f"journal is damaged at line {line}$"):
            Stream.load(_damaged(earlier, tmp_path / f"step {step}", step), qa)
    torn = _damaged(earlier, tmp_path / "after its last", 9)  # after its last checkpoint: dropped (a power loss)
    resumed = Stream.load(torn, qa)
    assert (resumed.frames, resumed.frames_lost) == (7, 3)  # frame 9's push record, after the gap, counted too
    resumed.close()


@pytest.fixture(scope="module")
def short_range(tmp_path_factory):
    """A tiny checkpoint trained on 512 positions: a ``handover`` stream of 20 frames keeps a successor beside it."""
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("short") / "ckpt",
                                vision_config={"image_size": 112},
                                text_config={"max_position_embeddings": 512,
                                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})


def test_a_handover_stream_closed_before_a_power_cut_keeps_its_successor(short_range, tmp_path, monkeypatch):
    """Before: its backlog (the steps' embeddings its successor replays) was forced only by a save or a sync, not
    by a checkpoint or a close, so a power cut after a close left it empty and the resumed stream dropped its
    successor ("alone: its backlog (backlog.bin) does not hold step 0's embeddings as journaled")."""
    device = Device(monkeypatch)
    qa = statekv.VideoQA.from_pretrained(short_range, reserve_tokens=24, budget=24, bounded_layout="handover",
                                         attention="eager", offload="disk", offload_dir=str(tmp_path / "disk"))
    stream = qa.stream()
    for frame in random_frames(20, seed=3, height=32, width=32):
        stream.push(frame)
    assert stream.handover == "beside"
    folder = stream.folder
    stream.close()
    resumed = Stream.load(device.power_cut(folder, tmp_path / "cut"), qa)
    assert (resumed.frames, resumed.frames_lost, resumed.handover) == (20, 0, "beside")
    resumed.close()


def test_rows_evicted_after_the_last_checkpoint_outlive_a_power_cut_that_loses_their_eviction(adapter, tmp_path,
                                                                                              monkeypatch):
    """A stream evicting under a cap, cut a few steps after its last checkpoint, each of which evicted: the layers'
    files as they are (the file system commits holes and removed files on its own), the journal and the slots as
    last forced. Before: the rows of those steps were given back at once, their ``evict`` records lost with the
    journal's tail, so the checkpoint's steps failed their checksums and the folder was refused as damaged; now it
    resumes at the checkpoint and goes on as a stream that pushed the same frames up to it."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 8)
    device, frames = Device(monkeypatch), random_frames(40)
    settings = dict(offload="disk", max_cache_bytes=120_000, cache_limit="evict-oldest")
    qa = tiny_qa(adapter, offload_dir=tmp_path / "tier", **settings)
    stream = qa.stream()
    for frame in frames[:36]:
        stream.push(frame)
    folder = stream.prefill.disk.folder
    layers = tuple(path.name for path in folder.glob("layer*.bin"))
    resumed = Stream.load(device.power_cut(folder, tmp_path / "cut", whole=layers), qa)
    count = resumed.frames
    assert count < 36 and resumed.prefill.evicted_steps != stream.prefill.evicted_steps  # evicted after it
    reference = tiny_qa(adapter, offload_dir=tmp_path / "reference", **settings).stream()
    for frame in frames[:count]:
        reference.push(frame)
    assert resumed.prefill.evicted_steps == reference.prefill.evicted_steps
    assert _same(_carried(resumed), _carried(reference))
    for frame in frames[count:]:
        resumed.push(frame)
        reference.push(frame)
    assert resumed.prefill.evicted_steps == reference.prefill.evicted_steps
    assert _same(_carried(resumed), _carried(reference))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=2),
                       reference.ask_tokens(QUESTION, max_new_tokens=6, retrieve=2))
    for opened in (resumed, reference, stream):
        opened.close()


def test_a_new_streams_folder_is_named_on_the_device_by_its_first_checkpoint(adapter, tmp_path, forced_folders):
    """Before: the stream's folder was flushed, the offload folder holding its name never, so a power loss could
    take back the whole file set of a stream its first checkpoint called durable."""
    stream = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier").stream(horizon_frames=4)
    stream.push(random_frames(1)[0])
    assert str(tmp_path / "tier") in forced_folders and str(stream.prefill.disk.folder) in forced_folders
    stream.close()


def test_a_question_after_a_resume_reads_the_rows_it_holds_and_no_more(adapter, tmp_path, monkeypatch):
    """A capped stream resumed gives every row it ever evicted back again, at its next checkpoint (its evictions are
    journaled again, unforced): a question meanwhile reads the rows it holds alone. Before, every read zeroed the
    rows waiting in what it mapped, a private page each: a question faulted in the stream's whole evicted history,
    per layer (here some 2,000 pages, not 60); now as many pages as once they were given back."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier", max_cache_bytes=120_000,
                 cache_limit="evict-oldest")
    stream = qa.stream()
    for frame in random_frames(300):
        stream.push(frame)
    stream.close()
    resumed = Stream.load(stream.prefill.disk.folder, qa)
    answers = []

    def faults() -> int:  # the fewest pages one of three questions faulted in
        counts = []
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            answers.append(resumed.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2))
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return min(counts)

    waiting = faults()
    resumed.sync()  # its evictions forced: the rows given back
    assert waiting <= faults() + 200
    assert all(torch.equal(answer, answers[0]) for answer in answers)
    resumed.close()
