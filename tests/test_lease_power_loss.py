"""A shared state folder's lease history (`statekv.serve.cluster.leases`) after a power loss, not a kill: what was
not forced to the device is lost, so each file is put back to its bytes at its last fsync (as
tests/test_disk_power_loss.py does); the history still names every taking the lease file holds, and one whose end a
power loss zero-filled is read, and written on, from its whole lines."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from statekv.serve.cluster import leases as lease_module
from statekv.serve.cluster.leases import Leases

STREAM = "st_" + "0" * 24


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _power_cut(folder: Path, synced: dict, to: Path) -> Path:
    """``folder`` as a power cut leaves it in ``to``: each file as last forced to the device (never: empty)."""
    to.mkdir(parents=True)
    for path in folder.iterdir():
        info = path.stat()
        (to / path.name).write_bytes(synced.get((info.st_dev, info.st_ino), b""))
    return to


def _recording_fsync(monkeypatch) -> dict:
    synced, real = {}, os.fsync

    def fsync(fd):
        real(fd)
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            with open(os.readlink(f"/proc/self/fd/{fd}"), "rb") as handle:
                synced[info.st_dev, info.st_ino] = handle.read()

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_a_power_loss_leaves_a_history_naming_every_taking_its_lease_holds(tmp_path, monkeypatch):
    """Before: history lines were appended without being forced, and a cut history renamed over the old one
    unforced, so a power loss kept the lease (forced at each write) at its latest token while its history lost
    the takings that led there, or all of it."""
    monkeypatch.setattr(lease_module, "HISTORY_LINES", 6)
    monkeypatch.setattr(lease_module, "HISTORY_BYTES", 1200)  # cut every few turns
    synced, clock = _recording_fsync(monkeypatch), Clock()
    first, second = (Leases(tmp_path / "state", name, seconds=10, clock=clock) for name in ("first", "second"))
    for turn in range(23):
        holder = (first, second)[turn % 2]
        holder.release(holder.acquire(STREAM))
    taken = first.acquire(STREAM)
    cut = _power_cut(tmp_path / "state" / "leases", synced, tmp_path / "cut" / "leases")
    after = Leases(tmp_path / "cut", "third", clock=clock)
    assert after.peek(STREAM) == taken
    history = after.history(STREAM)
    assert history and history[-1]["event"] == "taken" and history[-1]["token"] == taken.token == 24, history
    assert [line["token"] for line in history] == sorted(line["token"] for line in history)
    assert sorted(path.name for path in cut.iterdir()) == [STREAM, f"{STREAM}.history"]


def test_a_history_whose_end_a_power_loss_zero_filled_is_read_and_written_on_from_its_whole_lines(tmp_path):
    """Before: a line cut short or zero-filled (a power loss, a full disk) made every later reading of the history
    fail to parse, and the next line was appended onto it."""
    clock = Clock()
    leases = Leases(tmp_path, "first", seconds=10, clock=clock)
    leases.release(leases.acquire(STREAM))
    history_file = tmp_path / "leases" / f"{STREAM}.history"
    whole = history_file.read_bytes()
    with open(history_file, "ab") as history:
        history.write(b'{"event": "taken", "hol' + b"\0" * 40)
    assert [line["event"] for line in leases.history(STREAM)] == ["taken", "let go"]
    leases.acquire(STREAM)
    assert [(line["event"], line["token"]) for line in leases.history(STREAM)] == [
        ("taken", 1), ("let go", 1), ("taken", 2)]
    assert history_file.read_bytes().startswith(whole) and b"\0" not in history_file.read_bytes()
