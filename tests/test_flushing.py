"""Files written whole (`statekv.flushing.write_whole`): flushed before the rename that makes them the ones read,
the folder flushed after it, and on a failure the old file left as it was with nothing beside it."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from statekv import flushing
from statekv.eval.parsing import DEFAULT_PARSER
from statekv.eval.prompts import DEFAULT_PROTOCOL
from statekv.eval.records import AnswerRecord
from statekv.eval.report import write_summary


def _flushes(monkeypatch) -> list[str]:
    """What ``os.fsync`` is called on from now on: ``"file"`` or ``"folder"``, in order."""
    seen, real = [], os.fsync

    def fsync(fd):
        seen.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_file_written_whole_is_flushed_then_its_folder(tmp_path, monkeypatch):
    flushes = _flushes(monkeypatch)
    flushing.write_whole(tmp_path / "a.json", b"new")
    assert (tmp_path / "a.json").read_bytes() == b"new" and flushes == ["file", "folder"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("failing", ["write", "rename"])
def test_a_failed_write_leaves_the_old_file_and_nothing_beside_it(tmp_path, monkeypatch, failing):
    target = tmp_path / "a.json"
    target.write_bytes(b"old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failing == "write":
        real = flushing.write_flushed

        def half_written(path, data):  # the disk fills after part of it is written
            real(path, data[:1])
            full()
        monkeypatch.setattr(flushing, "write_flushed", half_written)
    else:
        monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        flushing.write_whole(target, b"new", partial=tmp_path / "a.json.1234.partial")
    assert target.read_bytes() == b"old" and sorted(path.name for path in tmp_path.iterdir()) == ["a.json"]


def _record(qid: str) -> AnswerRecord:
    return AnswerRecord(benchmark="synthetic", qid=qid, video_id="v0", prediction="A", parsed="A", correct=True,
                        answer="A", letters="ABCD", parser=DEFAULT_PARSER, protocol=DEFAULT_PROTOCOL, model="builtin",
                        method="statekv", budget=64, task_type="needle")


def test_a_run_summary_is_written_whole(tmp_path, monkeypatch):
    """Before: ``results.json`` was written unflushed through a ``.tmp`` file that a failed write left behind."""
    record = _record("q1")
    write_summary(tmp_path, [record])
    before = (tmp_path / "results.json").read_bytes()
    monkeypatch.setattr(flushing, "write_flushed", lambda path, data: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(OSError):
        write_summary(tmp_path, [record, _record("q2")])
    assert (tmp_path / "results.json").read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results.json"]


def test_a_new_installation_secret_is_flushed_then_its_name(tmp_path, monkeypatch):
    """Before: its name was never forced to the device, so a power loss could take back a secret streams were
    already owned under, and the next start made another."""
    from statekv.user_cache import installation_secret

    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "installation.secret"))
    flushes = _flushes(monkeypatch)
    secret = installation_secret(create=True)
    assert flushes == ["file", "folder"] and installation_secret(create=False) == secret
