"""Files flushed to the disk before a rename makes them the ones others read: a power loss then leaves the old file
or the new one, never a name on data not yet written."""

from __future__ import annotations

import os
from pathlib import Path


def write_flushed(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (made or truncated) and flush it to the disk."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def flush_file(path: str | os.PathLike) -> None:
    """Flush a file written by someone else (a library's writer) to the disk."""
    handle = os.open(Path(path), os.O_RDWR)  # some systems flush only a file open for writing
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def flush_folder(folder: str | os.PathLike, *, strict: bool = False) -> None:
    """Flush the entries of ``folder`` (a rename, a new file) to the disk, so a power loss cannot bring back the name
    as it was. strict: an `OSError` when it cannot be done; otherwise done where the system allows it."""
    try:
        handle = os.open(Path(folder), os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
    except OSError:
        if strict:
            raise
