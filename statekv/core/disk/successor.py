"""A disk-tier stream's successor (`statekv.api.handover`): its backlog, kept durable in the stream's file set, and
the handover of the file set to it.

While a ``handover`` stream on the disk tier fits the model's range, its successor is a file set of its own in a
subfolder of the stream's folder (`successor_folders`). What a stream resumed after a kill rebuilds it from is the
backlog: each step's embeddings are written to ``backlog.bin`` before the journal record
that vouches for them, and that record names where they lie and their CRC-32 (`BacklogFile`, `read_backlog`). A
stream resumed before its handover removes any successor folder left behind and replays its backlog into a new
successor; at worst it replays the steps again. A stream closed with a successor that replayed steps keeps it:
its file set is synced, then a record naming it (`kept_record`) is journaled after the stream's last checkpoint, and
a stream resumed from that checkpoint resumes the successor too (`kept_successor`): the steps it replayed are not
replayed again, which a steering watch (its replays steered by the watches open then) would make another stream.

The handover gives the stream's folder to the successor's file set in an order that a kill at any point resumes
from: the successor's file set is checkpointed and synced, then ``handover.json`` is written atomically naming its
folder and files (`mark_handover`); from then on the stream is the successor's. `finish_handover` moves each of the
successor's files over the stream's file of that name, removes the stream's other files, then the subfolder and
the marker; a stream resumed from a folder that holds the marker finishes it first.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError, OutputError, os_reason
from ...flushing import flush_folder
from ...weak import weakly
from .buffers import pwrite_all
from .compaction import BACKLOG
from .files import FILE_SET, LOCK, MANIFEST, hold, read_checked, read_manifest, write_checked
from .open_files import close_all, closed_with
from .tier import DiskTier

log = logging.getLogger("statekv")

BACKLOG_FILE = "backlog.bin"
HANDOVER_MARKER = "handover.json"
KEPT = "successor"  # a journal record's field at close: the successor's file set kept beside the stream


class BacklogFile:
    """The steps' embeddings of a ``handover`` stream on the disk tier, in ``backlog.bin`` of its file set
    (``tier``), one after another in the model's dtype. ``end``: where the next step's go (the end of the last
    step booked; a step not taken is written over by the next)."""

    def __init__(self, tier: DiskTier, end: int = 0):
        self.tier, self.end = tier, end
        self._fd = -1
        self._files: list[int] = closed_with(self, [])  # the file, while open
        # on the device before a checkpoint vouching for the steps whose records name it: a power loss otherwise
        # left their embeddings lost and the successor dropped, even after a close
        tier.forced = weakly(self, lambda backlog: backlog.sync())

    def write(self, inputs_embeds: torch.Tensor) -> list[int]:
        """Write one step's embeddings ``[1, T, D]`` at ``end``; returns the record that vouches for them,
        ``[offset, bytes, crc]`` (`booked` once the step is taken). An `OutputError` when they cannot be written."""
        self.tier.check_owner()
        self._open()
        data = inputs_embeds.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        try:
            pwrite_all(self._fd, memoryview(data), self.end)
        except OutputError as error:
            raise OutputError(f"{error} (in {self.tier.folder})") from None
        return [self.end, len(data), zlib.crc32(data)]

    def read(self, entry: list[int], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The embeddings of shape ``shape`` that ``entry`` (`write`'s record) names, checked against its CRC-32; a
        one-line `InputError` when the file no longer holds them."""
        self._open()
        try:
            data = os.pread(self._fd, entry[1], entry[0])
        except OSError as error:
            raise OutputError(f"cannot read the disk cache in {self.tier.folder}: {os_reason(error)}") from None
        if len(data) != entry[1] or zlib.crc32(data) != entry[2]:
            raise InputError(f"{self.tier.folder}: the disk cache is damaged: {BACKLOG_FILE} does not hold a step's "
                             "embeddings as journaled")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)

    def booked(self, entry: list[int]) -> None:
        """The step whose embeddings ``entry`` (`write`'s record) names was taken: the next go after them."""
        self.end = entry[0] + entry[1]

    def sync(self) -> None:
        """Force what was written to the storage device."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            except OSError as error:
                raise OutputError(f"cannot write the disk cache in {self.tier.folder}: "
                                  f"{os_reason(error)}") from None

    def _open(self) -> None:
        if self._fd < 0:
            try:
                self._fd = os.open(self.tier.folder / BACKLOG_FILE, os.O_RDWR | os.O_CREAT, 0o644)
                self._files.append(self._fd)
            except OSError as error:
                raise OutputError(f"cannot write the disk cache in {self.tier.folder}: "
                                  f"{os_reason(error)}") from None

    def close(self) -> None:
        close_all(self._files)
        self._fd = -1


def read_backlog(folder: Path, records: list[dict[str, Any]], step_bytes: int) -> tuple[list[list[int]], int] | str:
    """Where the embeddings of every step the journal's step ``records`` name lie in ``folder``'s backlog file
    (``[offset, bytes, crc]`` each, checked against the file; ``step_bytes``: a token's bytes), and where the next
    step's go; or why they cannot be read back (a step journaled without them, a file that does not hold them as
    recorded)."""
    entries = [record.get(BACKLOG) for record in records]
    missing = next((index for index, entry in enumerate(entries) if not _entry(entry)), None)
    if missing is not None:
        return (f"its step {missing} was journaled without its embeddings (its successor was dropped or not made "
                "then, or the stream was loaded from a saved file since)")
    try:
        with open(folder / BACKLOG_FILE, "rb") as file:
            for index, ((offset, length, crc), record) in enumerate(zip(entries, records)):
                file.seek(offset)
                piece = file.read(length)
                if len(piece) != length or zlib.crc32(piece) != crc or length != int(record["tokens"]) * step_bytes:
                    return f"its backlog ({BACKLOG_FILE}) does not hold step {index}'s embeddings as journaled"
    except OSError:
        return f"its backlog ({BACKLOG_FILE}) cannot be read"
    return entries, entries[-1][0] + entries[-1][1] if entries else 0


def _entry(entry: Any) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) and v >= 0 for v in entry))


def successor_folders(folder: Path) -> list[Path]:
    """The successors' file sets in ``folder``: its subfolders (a stream's folder holds no other, and one a kill
    left half-made may lack its manifest)."""
    try:
        return sorted(path for path in folder.iterdir() if path.is_dir())
    except OSError:
        return []


def kept_record(tier: DiskTier, steps: int) -> dict[str, Any]:
    """The journal record of a stream closed with its successor kept: the successor's file set (``tier``, synced
    at its last step) and the ``steps`` it replayed."""
    return {KEPT: {"folder": tier.folder.name, FILE_SET: tier.file_set, "steps": steps}}


def kept_successor(folder: Path, records: list[dict[str, Any]]) -> tuple[Path, str, int, Any] | None:
    """The successor a stream in ``folder`` kept at its close, as the last of the journal's ``records`` after its
    last checkpoint names it (`kept_record`): its folder, file set and steps, and its lock, taken (so that making
    the stream's new successor leaves it, `remove_successors`); None when none is named, or it is gone or held."""
    kept = next((record[KEPT] for record in reversed(records) if KEPT in record), None)
    if (not isinstance(kept, dict) or not isinstance(kept.get("folder"), str) or not _plain(kept["folder"])
            or not isinstance(kept.get(FILE_SET), str) or type(kept.get("steps")) is not int or kept["steps"] < 1):
        return None
    if not (folder / kept["folder"]).is_dir():
        log.warning("%s: the successor its close kept, %s, is gone; it replays its backlog again", folder,
                    kept["folder"])
        return None
    try:
        lock = hold(folder / kept["folder"], "a stream resuming its successor")
    except InputError as error:
        log.warning("%s: the successor its close kept cannot be taken (%s); it replays its backlog again", folder,
                    str(error).splitlines()[0])
        return None
    return folder / kept["folder"], kept[FILE_SET], kept["steps"], lock


def remove_successors(folder: Path, *, backlog: bool = False) -> None:
    """Remove the successor file sets left in ``folder`` by a stream stopped before its handover (the backlog
    rebuilds its successor), each once its lock is taken (one another process opened, or a resume holds, is left);
    ``backlog``: the backlog file too (a stream going on without a successor)."""
    for path in successor_folders(folder):
        try:
            lock = hold(path, "a stream removing its successor's files")
        except InputError:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            lock.release()
    if backlog:
        (folder / BACKLOG_FILE).unlink(missing_ok=True)


def mark_handover(folder: Path, successor: Path, file_set: str) -> None:
    """From now on the stream in ``folder`` is the file set ``file_set`` in its subfolder ``successor``
    (checkpointed and synced by the caller): ``handover.json`` names it and its files, written and synced before
    it is renamed into place (`finish_handover` then moves them)."""
    files = sorted(path.name for path in successor.iterdir() if path.is_file() and path.name != LOCK)
    marker, partial = folder / HANDOVER_MARKER, folder / f"{HANDOVER_MARKER}.partial"
    try:
        flush_folder(successor, strict=True)  # its files' entries, and its own in the folder, before the marker
        flush_folder(folder, strict=True)
        write_checked(partial, {"folder": successor.name, "files": files, FILE_SET: file_set})
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, marker)
        flush_folder(folder, strict=True)
    except OSError as error:
        partial.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        raise OutputError(f"cannot write the disk cache in {folder}: {os_reason(error)}") from None


def finish_handover(folder: Path) -> bool:
    """Finish a handover marked in ``folder`` (`mark_handover`), whose lock the caller holds: each file of the
    successor's replaces the stream's of that name, the stream's others are removed, then the successor's
    subfolder and the marker. Run again after a kill, it picks up where it stopped. False: no handover was
    marked. A one-line `InputError` when the marker is damaged; an `OutputError` when the folder cannot be
    changed (the marker then stays, for the next try)."""
    marker = folder / HANDOVER_MARKER
    if not marker.is_file():
        return False
    described = read_checked(marker)
    name, files, file_set = described.get("folder"), described.get("files"), described.get(FILE_SET)
    if (not isinstance(name, str) or not _plain(name) or not isinstance(files, list) or not isinstance(file_set, str)
            or not all(isinstance(file, str) and _plain(file) for file in files) or MANIFEST not in files):
        raise InputError(f"{folder}: the disk cache is damaged: {HANDOVER_MARKER} does not name a successor's files")
    successor, kept = folder / name, set(files) | {HANDOVER_MARKER, LOCK}
    if not successor.is_dir() and read_manifest(folder)[FILE_SET] != file_set:
        marker.unlink()  # nothing of the successor's reached the folder: the stream is its own file set still
        return False
    try:
        for file in files:
            if (successor / file).is_file():
                os.replace(successor / file, folder / file)
        flush_folder(folder, strict=True)
        if read_manifest(folder)[FILE_SET] != file_set:  # its files are not there: nothing of the stream's goes
            raise InputError(f"{folder}: the disk cache is damaged: the successor's files that {HANDOVER_MARKER} "
                             "names are missing")
        for path in folder.iterdir():
            if path.is_file() and path.name not in kept:
                path.unlink()
        shutil.rmtree(successor, ignore_errors=True)
        marker.unlink()
        flush_folder(folder, strict=True)
    except OSError as error:
        raise OutputError(f"cannot finish the handover of the disk cache in {folder}: "
                          f"{os_reason(error)}") from None
    return True


def _plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
