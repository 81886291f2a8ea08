"""Files flushed to the disk before a rename makes them the ones others read: a power loss then leaves the old file
or the new one, never a name on data not yet written; and what of a file of lines appended is whole after a kill or
a power loss (`durable_end`).

A failed flush is never retried nor passed over (the rule every writer of statekv keeps): once ``os.fsync`` has
failed (EIO, ENOSPC, EDQUOT), Linux may have dropped the pages it could not write and marked them clean, so a later
fsync of the same file succeeds without them. What was written since the last flush that succeeded is therefore
lost as far as its writer knows: the error reaches the caller, and the writer vouches for nothing written before
it on the strength of a later flush (the disk tier refuses every checkpoint after it:
`statekv.core.disk.forcing`; the answers file takes the line back and writes no more:
`statekv.eval.records.ResultsWriter`). Only a system that cannot flush a folder at all is passed over where that is
allowed (`flush_folder`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


def write_flushed(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (made or truncated) and flush it to the disk."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_whole(path: str | os.PathLike, data: bytes, partial: str | os.PathLike | None = None) -> None:
    """Write ``data`` to ``path`` whole or not at all: into ``partial`` (default ``<name>.partial`` beside it, for a
    path one writer writes; writers at once each need a name of their own), flushed, renamed over ``path``, and the
    folder flushed. The partial file is removed when a step fails, and the error raised."""
    path = Path(path)
    partial = Path(partial) if partial is not None else path.with_name(f"{path.name}.partial")
    try:
        write_flushed(partial, data)
        os.replace(partial, path)
        flush_folder(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def flush_file(path: str | os.PathLike) -> None:
    """Flush a file written by someone else (a library's writer) to the disk."""
    handle = os.open(Path(path), os.O_RDWR)  # some systems flush only a file open for writing
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# what ``os.fsync`` of a folder says on a system (or file system) that cannot flush folders: nothing was lost
UNSUPPORTED = frozenset({errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def flush_folder(folder: str | os.PathLike, *, strict: bool = False) -> None:
    """Flush the entries of ``folder`` (a rename, a new file) to the disk, so a power loss cannot bring back the name
    as it was. strict: an `OSError` when it cannot be done; otherwise passed over where the system cannot open or
    flush a folder (`UNSUPPORTED`), but a flush that failed (EIO...) raises all the same: its entries may be lost."""
    try:
        handle = os.open(Path(folder), os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(handle)
    except OSError as error:
        if strict or error.errno not in UNSUPPORTED:
            raise
    finally:
        os.close(handle)


def durable_end(data: bytes) -> int:
    """Where the lines of ``data`` (JSON Lines, appended) that were written whole end: before an unterminated last
    line (a kill cut its write) and before last lines holding a NUL byte (a power loss zero-filled pages of a write
    not yet on the device, its newline kept or not: JSON text never holds one). A NUL byte before a whole line
    is damage, left for the reader to refuse."""
    end = data.rfind(b"\n") + 1
    while end:
        start = data.rfind(b"\n", 0, end - 1) + 1
        if b"\0" not in data[start:end]:
            break
        end = start
    return end
