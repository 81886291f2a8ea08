"""Disk-tier file sets whose stream's creation a kill cut short.

A server on the disk tier makes a stream's file set under ``offload_dir`` before it writes the stream's record: a
kill in between would leave a file set that no record names, and no deletion would ever reach it. So, before it
makes the stream, the server writes a note beside the file sets (``.creating-ID.json``, naming the stream, the
server's state and when), and removes it once the record is written, or once a failed creation's file set is gone.
At the next start, a note of this server's state whose stream has no record is a creation cut short: its file sets
are removed (one log line each), then the note, and any note's partial file that a kill left mid-write. A start
that loads a recorded stream from its save into a new file set notes it alike, until the record names the new file
set; a note of such a load marks the stream's file sets that its record does not name (made by the load a kill
cut short) for removal. Its file sets are those whose ``stream.json`` names the stream, and
those made after the note that no ``stream.json`` describes yet (a kill between the two). A file set another process
holds (its lock taken) is left as it is, and so is its note. Notes of another server's state (two servers sharing
``offload_dir``) are never followed."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ..api.stream_disk import SETUP
from ..core.disk.files import MANIFEST, hold
from ..errors import StateKVError
from .errors import ServiceError
from .store import STREAM_ID, write_atomic

log = logging.getLogger("statekv.serve")

PREFIX = ".creating-"
STALE_PARTIAL_SECONDS = 600.0  # a note's partial file this old is a kill's leftover, not a write under way
DESCRIPTION = f"{SETUP}.json"  # a stream's description in its file set


class CreationNotes:
    """The creation notes of one server: ``state`` names where it keeps its streams (its host and state folder, or
    its object store), ``record_of(id)`` a stream's record (None when it has none, an exception when it cannot be
    read)."""

    def __init__(self, state: str, record_of: Callable[[str], dict[str, Any] | Exception | None]):
        self.state, self.record_of = f"{socket.gethostname()} {state}", record_of

    async def begin(self, stream_id: str, engine: Any) -> Path | None:
        """Note a stream's creation before its file set is made; None off the disk tier. A one-line 503 when the
        note cannot be written (then no stream is made)."""
        if engine.offload != "disk":
            return None
        try:
            return await asyncio.to_thread(begin_creation, engine.offload_dir, stream_id, self.state)
        except OSError as error:
            raise ServiceError(503, f"cannot write in the disk tier's folder ({error.strerror or error}); no stream "
                               "was made") from None

    def begin_load(self, stream_id: str, engine: Any) -> Path | None:
        """Note a recorded stream's load, which may make it a new file set; None off the disk tier, or when the note
        cannot be written (the load, writing there too, then says why)."""
        if engine.offload != "disk":
            return None
        try:
            return begin_creation(engine.offload_dir, stream_id, self.state, loading=True)
        except OSError:
            return None

    def finish(self, offload_dir: str | Path | None) -> None:
        """At start: `finish_creations` of this server's notes."""
        finish_creations(offload_dir, self.state, self.record_of)

    def settle(self, note: Path | None) -> None:
        """After a load that failed: remove the file set it made, if any (`finish_creation` of its ``note``)."""
        if note is not None:
            finish_creation(note, self.state, self.record_of)


def begin_creation(offload_dir: str | Path, stream_id: str, state: str, *, loading: bool = False) -> Path:
    """Note that stream ``stream_id`` of the server whose state is ``state`` is being made (``loading``: loaded from
    its save); returns the note, to remove (`end_creation`) once the stream's record is written. An `OSError` when
    it cannot be written."""
    folder = Path(offload_dir)
    folder.mkdir(parents=True, exist_ok=True)
    note = folder / f"{PREFIX}{stream_id}.json"
    noted = {"id": stream_id, "state": state, "at": time.time(), **({"loading": True} if loading else {})}
    write_atomic(note, json.dumps(noted).encode())
    return note


def end_creation(note: Path | None) -> None:
    if note is not None:
        with contextlib.suppress(OSError):  # left: the next start finds the stream's record and only removes it
            note.unlink(missing_ok=True)


def finish_creations(offload_dir: str | Path | None, state: str,
                     record_of: Callable[[str], dict[str, Any] | Exception | None]) -> None:
    """At start: remove the file sets of the creations of this server's ``state`` that a stop cut short (their
    stream has no record: ``record_of(id)`` is None; for a load, those its record does not name), and every note of
    this state whose work is done."""
    if offload_dir is None or not Path(offload_dir).is_dir():
        return
    folder = Path(offload_dir)
    for partial in folder.glob(f"{PREFIX}st_*.json.*.partial"):  # another server's too: none writes for so long
        with contextlib.suppress(OSError):
            if partial.is_file() and time.time() - partial.stat().st_mtime > STALE_PARTIAL_SECONDS:
                partial.unlink()
    for note in sorted(folder.glob(f"{PREFIX}st_*.json")):
        finish_creation(note, state, record_of)


def finish_creation(note: Path, state: str, record_of: Callable[[str], dict[str, Any] | Exception | None]) -> None:
    """`finish_creations` of one ``note`` (also right after a load that failed, whose file set, if it made one, no
    record names)."""
    try:
        noted = json.loads(note.read_text())
    except (OSError, ValueError, RecursionError):
        return
    if not isinstance(noted, dict) or noted.get("state") != state:
        return
    stream_id, since = noted.get("id"), noted.get("at")
    if not isinstance(stream_id, str) or not STREAM_ID.match(stream_id) or not isinstance(since, (int, float)):
        return
    record = record_of(stream_id)
    if record is not None and not noted.get("loading"):  # the creation was recorded (damaged or not)
        end_creation(note)
        return
    if isinstance(record, Exception):  # a load's record that cannot be read now: which file set it names is unknown
        return
    named = "" if record is None else str(record.get("tier") or "")
    why = ("made by a load that did not finish (its record names another)" if record is not None else
           "whose creation a stop cut short (the stream was never made)")
    if all([_remove_orphan(file_set, stream_id, why) for file_set in _file_sets_of(note.parent, stream_id, since)
            if file_set.name != named]):
        end_creation(note)


def _file_sets_of(folder: Path, stream_id: str, since: float) -> list[Path]:
    """The file sets under ``folder`` of stream ``stream_id``: those whose description names it, and those made
    at or after ``since`` (seconds since the epoch) that no description names yet."""
    found = []
    for file_set in folder.iterdir():
        with contextlib.suppress(OSError, ValueError, RecursionError, TypeError, AttributeError):
            if not file_set.is_dir() or file_set.is_symlink():
                continue
            if (file_set / DESCRIPTION).exists():
                if json.loads((file_set / DESCRIPTION).read_text()).get("stream_id") == stream_id:
                    found.append(file_set)
            elif _made_at(file_set) >= since:
                found.append(file_set)
    return found


def _made_at(file_set: Path) -> float:
    """When the file set was made, as its manifest says (seconds since the epoch)."""
    made = json.loads((file_set / MANIFEST).read_text())["created"]
    return datetime.datetime.fromisoformat(made).timestamp()


def _remove_orphan(file_set: Path, stream_id: str, why: str) -> bool:
    """Remove ``file_set`` unless another process holds it (``why``: what made it an orphan, for the log); whether it
    is gone."""
    try:
        lock = hold(file_set, "statekv serve, removing a creation cut short")
    except (StateKVError, OSError):
        return False
    try:
        shutil.rmtree(file_set, ignore_errors=True)
    finally:
        lock.release()
    if file_set.exists():
        return False
    log.warning("removed the disk-tier file set %s of stream %s, %s", file_set.name, stream_id, why)
    return True
