"""A damaged stream's disk-tier file set moved into the quarantine from another file system (copied, then the
original removed): the copy is on the device before any of the original goes, so a power loss cannot leave a
zero-filled copy and no original."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from statekv.serve.store import StreamFiles  # noqa: E402

from conftest import failing_folders  # noqa: E402


def test_a_file_set_copied_into_the_quarantine_is_forced_to_the_device_before_its_original_goes(tmp_path,
                                                                                              monkeypatch):
    """Before: the copy's files were never forced, and the original was removed before the quarantine's new name
    was: a power cut could leave the copy zero-filled (or unnamed) and the original gone."""
    files, stream_id = StreamFiles(tmp_path / "state"), "st_" + "c" * 24
    folder = tmp_path / "tier" / "s-1234abcd"
    (folder / "steps").mkdir(parents=True)
    for name, data in (("journal", b"x" * 100), ("carry.0.bin", b"y" * 4096), ("steps/0.bin", b"z" * 512)):
        (folder / name).write_bytes(data)
    events: list[tuple[str, object]] = []
    rename, fsync, rmtree = os.rename, os.fsync, shutil.rmtree

    def across(source, target):
        if Path(source) == folder:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        events.append(("rename", Path(target).name))
        return rename(source, target)

    def forced(fd):
        info = os.fstat(fd)
        events.append(("file" if stat.S_ISREG(info.st_mode) else "folder", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def removed(path, *args, **kwargs):
        events.append(("rmtree", str(path)))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", across)
    monkeypatch.setattr(os, "fsync", forced)
    monkeypatch.setattr(shutil, "rmtree", removed)
    where = files.move_to_quarantine(stream_id, folder)
    moved = tmp_path / "state" / where
    assert not folder.exists() and (moved / "steps" / "0.bin").read_bytes() == b"z" * 512
    gone = events.index(("rmtree", str(folder)))
    before = events[:gone]
    for name in ("journal", "carry.0.bin", "steps/0.bin"):  # each copied file forced (as its partial copy)
        assert any(kind == "file" and path.endswith(f".partial/{name}") for kind, path in before), (name, events)
    assert ("rename", moved.name) in before
    renamed = before.index(("rename", moved.name))
    assert ("folder", str(files.quarantine)) in before[renamed:], events  # the new name forced before removal


def test_a_file_set_moved_whose_folders_could_not_be_forced_is_said_moved_not_left(tmp_path, monkeypatch, caplog):
    """Before: the folders' flush after the rename raised (EIO), so the stream was said left where it was, since
    it could not be moved, while it lay in the quarantine."""
    files, stream_id = StreamFiles(tmp_path / "state"), "st_" + "d" * 24
    folder = tmp_path / "tier" / "s-5678abcd"
    folder.mkdir(parents=True)
    (folder / "journal").write_bytes(b"x" * 100)
    failing_folders(monkeypatch, errno.EIO)
    with caplog.at_level("WARNING", logger="statekv.serve"):
        where = files.move_to_quarantine(stream_id, folder)
    assert not folder.exists() and (tmp_path / "state" / where / "journal").read_bytes() == b"x" * 100
    assert any("could not be forced" in record.getMessage() for record in caplog.records)
