"""Disk-tier file sets whose stream's creation a kill cut short.

A server on the disk tier makes a stream's file set under ``offload_dir`` before it writes the stream's record: a
kill in between would leave a file set that no record names, and no deletion would ever reach it. So, before it
makes the stream, the server writes a note beside the file sets (``.creating-ID.json``, naming the stream and the
server's state), and removes it once the record is written. At the next start, a note of this server's state
whose stream has no record is a creation cut short: the file sets whose ``stream.json`` names that stream are
removed (one log line each), then the note. A file set another process holds (its lock taken) is left as it is,
and so is its note. Notes of another server's state (two servers sharing ``offload_dir``) are never followed."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Callable

from ..core.disk.files import hold
from ..errors import StateKVError
from .store import STREAM_ID, write_atomic

log = logging.getLogger("statekv.serve")

PREFIX = ".creating-"


def note_path(offload_dir: Path, stream_id: str) -> Path:
    return offload_dir / f"{PREFIX}{stream_id}.json"


def begin_creation(offload_dir: str | Path, stream_id: str, state: str) -> Path:
    """Note that stream ``stream_id`` of the server whose state is ``state`` is being made; returns the note, to
    remove (`end_creation`) once the stream's record is written. An `OSError` when it cannot be written."""
    folder = Path(offload_dir)
    folder.mkdir(parents=True, exist_ok=True)
    note = note_path(folder, stream_id)
    write_atomic(note, json.dumps({"id": stream_id, "state": state}).encode())
    return note


def end_creation(note: Path | None) -> None:
    if note is not None:
        with contextlib.suppress(OSError):  # left: the next start finds the stream's record and only removes it
            note.unlink(missing_ok=True)


def finish_creations(offload_dir: str | Path | None, state: str, recorded: Callable[[str], bool]) -> None:
    """At start: remove the file sets of the creations of this server's ``state`` that a stop cut short (their
    stream has no record: ``recorded(id)`` is False), and every note of this state whose work is done."""
    if offload_dir is None or not Path(offload_dir).is_dir():
        return
    folder = Path(offload_dir)
    for note in sorted(folder.glob(f"{PREFIX}st_*.json")):
        try:
            noted = json.loads(note.read_text())
        except (OSError, ValueError):
            continue
        stream_id = noted.get("id") if isinstance(noted, dict) else None
        if noted.get("state") != state or not isinstance(stream_id, str) or not STREAM_ID.match(stream_id):
            continue
        if recorded(stream_id) or all(_remove_orphan(file_set, stream_id) for file_set in _file_sets_of(folder,
                                                                                                         stream_id)):
            end_creation(note)


def _file_sets_of(folder: Path, stream_id: str) -> list[Path]:
    """The file sets under ``folder`` whose ``stream.json`` names stream ``stream_id``."""
    found = []
    for file_set in folder.iterdir():
        with contextlib.suppress(OSError, ValueError):
            if file_set.is_dir() and not file_set.is_symlink() and \
                    json.loads((file_set / "stream.json").read_text()).get("stream_id") == stream_id:
                found.append(file_set)
    return found


def _remove_orphan(file_set: Path, stream_id: str) -> bool:
    """Remove ``file_set`` unless another process holds it; whether it is gone."""
    try:
        lock = hold(file_set, "statekv serve, removing a creation cut short")
    except (StateKVError, OSError):
        return False
    try:
        shutil.rmtree(file_set, ignore_errors=True)
    finally:
        lock.release()
    log.warning("removed the disk-tier file set %s of stream %s, whose creation a stop cut short (the stream was "
                "never made)", file_set.name, stream_id)
    return not file_set.exists()
