"""A force to the device that fails (``os.fsync`` raising EIO, ENOSPC, EDQUOT): Linux may drop the pages it could
not write and mark them clean, so a later fsync of the same file succeeds without them. No writer of statekv
vouches for what it wrote before such a failure on the strength of a later fsync (`statekv.flushing`)."""

from __future__ import annotations

import errno
import json
import os

import pytest

import statekv
from statekv import Stream, flushing
from statekv.errors import OutputError
from statekv.models import load_adapter

from conftest import failing_folders, random_frames, tiny_qa


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def failing_once(monkeypatch, name: str, skip: int = 0) -> list[str]:
    """``os.fsync`` raises EIO once, on its ``skip + 1``-th call for a file named ``name``, then forces as before
    (as Linux does: the pages it could not write are clean now). Returns the names it failed on."""
    real, failed, seen = os.fsync, [], [0]

    def fsync(fd):
        if not failed and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
            seen[0] += 1
            if seen[0] > skip:
                failed.append(name)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def synced_checkpoints(folder) -> list[int]:
    """The steps of the checkpoints the journal in ``folder`` marks forced to the device."""
    records = [json.loads(line.partition(" ")[2]) for line in (folder / "journal").read_text().splitlines()]
    return [record["carry"] for record in records if "carry" in record and record.get("synced")]


@pytest.mark.parametrize("name,skip", [("journal", 0), ("journal", 1), ("carry.1.bin", 0)])
def test_a_checkpoint_whose_force_failed_is_never_vouched_for_by_a_later_one(adapter, tmp_path, monkeypatch, name,
                                                                            skip):
    """Before: the step was undone and, pushed again, checkpointed with a record marked synced once the retried
    fsync succeeded, vouching for journal lines and rows the failed one may have lost (a power loss then left the
    stream refused as damaged). Now the tier checkpoints no more, and the folder resumes at the checkpoint before."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    frames = random_frames(12)
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = qa.stream(horizon_frames=12)
    for frame in frames[:10]:
        stream.push(frame)
    folder = stream.prefill.disk.folder
    assert synced_checkpoints(folder) == [0, 3, 7]
    failed = failing_once(monkeypatch, name, skip)
    with pytest.raises(OutputError) as error:
        stream.push(frames[10])  # its step is due a checkpoint
    assert failed == [name] and "\n" not in str(error.value)
    assert f"{folder} to the device: {name}: {os.strerror(errno.EIO)}" in str(error.value)
    for retry in (lambda: stream.push(frames[10]), stream.sync):  # each fsync would succeed now
        with pytest.raises(OutputError, match=f"an earlier force failed \\({name}: "):
            retry()
    assert synced_checkpoints(folder) == [0, 3, 7]
    with pytest.raises(OutputError, match="resumes from its last checkpoint"):
        stream.close()
    monkeypatch.undo()
    resumed = Stream.load(folder, qa)
    assert resumed.frames == 7
    resumed.close()


def test_a_folder_whose_flush_failed_is_never_passed_over(tmp_path, monkeypatch):
    """Before: ``flush_folder`` passed over every `OSError` unless strict, an EIO from the flush itself too, so a
    file renamed into place was taken for durable whose name a power loss could take back (`write_whole`)."""
    failing_folders(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        flushing.flush_folder(tmp_path)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        flushing.write_whole(tmp_path / "a.json", b"new")


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EBADF, errno.ENOTSUP])
def test_a_system_that_cannot_flush_a_folder_is_passed_over_unless_strict(tmp_path, monkeypatch, code):
    failing_folders(monkeypatch, code)
    flushing.flush_folder(tmp_path)
    flushing.write_whole(tmp_path / "a.json", b"new")
    assert (tmp_path / "a.json").read_bytes() == b"new"
    with pytest.raises(OSError):
        flushing.flush_folder(tmp_path, strict=True)


def test_an_answer_whose_fsync_failed_is_taken_back_and_nothing_written_after_it(tmp_path, monkeypatch):
    """Before: its line stayed (counted answered by a rerun, though perhaps never on the device) and the next
    answer's fsync, succeeding, vouched for it."""
    from statekv.eval.parsing import DEFAULT_PARSER
    from statekv.eval.prompts import DEFAULT_PROTOCOL
    from statekv.eval.records import AnswerRecord, ResultsWriter, completed_qids

    def record(qid: str) -> AnswerRecord:
        return AnswerRecord(benchmark="synthetic", qid=qid, video_id="v0", prediction="A", parsed="A", correct=True,
                            answer="A", letters="ABCD", parser=DEFAULT_PARSER, protocol=DEFAULT_PROTOCOL,
                            model="builtin", method="statekv", budget=64, task_type="needle")

    path = tmp_path / "answers.rank000.jsonl"
    with ResultsWriter(path) as writer:
        writer.write(record("q1"))
        failing_once(monkeypatch, path.name)
        with pytest.raises(OSError, match=os.strerror(errno.EIO)) as error:
            writer.write(record("q2"))
        assert error.value.filename == str(path)
        with pytest.raises(OSError, match="an earlier fsync failed"):
            writer.write(record("q3"))
    assert completed_qids(tmp_path) == {"q1"}


def test_a_key_whose_name_could_not_be_forced_is_not_left_for_the_next_start(tmp_path, monkeypatch):
    """Before: the key's digest stayed in ``keys.json`` though the start was refused and the key never shown, so
    the next start made none and served under a key nobody holds."""
    from statekv.errors import ConfigurationError
    from statekv.serve.auth import KeyFile

    failing_folders(monkeypatch, errno.EIO)
    with pytest.raises(ConfigurationError, match=os.strerror(errno.EIO)):
        KeyFile(tmp_path).make()
    monkeypatch.undo()
    assert KeyFile(tmp_path).stored() == [] and sorted(p.name for p in tmp_path.iterdir()) == []
    assert KeyFile(tmp_path).make() is not None


def test_an_answers_file_whose_name_could_not_be_forced_is_made_again_by_a_rerun(tmp_path, monkeypatch):
    """Before: the file stayed, so the rerun, finding it, never forced its name, and each answer it wrote was said
    durable while a power loss could take the file away with every answer in it."""
    from statekv.eval.records import ResultsWriter

    path = tmp_path / "answers.rank000.jsonl"
    failing_folders(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        ResultsWriter(path)
    assert not path.exists()


def test_a_save_whose_folder_flush_failed_after_its_rename_says_the_file_there_is_the_new_one(adapter, tmp_path,
                                                                                             monkeypatch):
    """Before: the error said a file already there "is as it was", while the rename had put this save in its
    place (a power loss alone may bring the old one back)."""
    qa = tiny_qa(adapter)
    stream = qa.stream(horizon_frames=8)
    frames = random_frames(4)
    for frame in frames[:2]:
        stream.push(frame)
    path = stream.save(tmp_path / "stream.safetensors")
    for frame in frames[2:]:
        stream.push(frame)
    failing_folders(monkeypatch, errno.EIO)
    with pytest.raises(OutputError) as error:
        stream.save(path)
    monkeypatch.undo()
    message = str(error.value)
    assert "\n" not in message and "is as it was" not in message, message
    assert f"its folder could not be forced to the device ({os.strerror(errno.EIO)}); the file there now is this " \
           "save, but a power loss may bring back the one it replaced" in message
    loaded = Stream.load(path, qa)
    assert loaded.frames == stream.frames == 4
    loaded.close()
    stream.close()
