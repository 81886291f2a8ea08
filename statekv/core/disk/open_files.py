"""How many files this process may hold open: a disk-tier stream holds a few a layer (`MappedTokenBuffer`: the files
of the block it writes, or of the block a checksum pass reads), which for one stream of an 80-layer model passes the
usual soft limit of 1,024. The soft limit is raised to the hard one when a disk tier opens
(`raise_open_files_limit`, which `statekv serve` also calls at start); past the hard limit,
`statekv.errors.os_reason` names it."""

from __future__ import annotations

import errno
import logging
import os
import resource
import weakref

from ...errors import OutputError, os_reason

MOST_OPEN_FILES = 1 << 20  # what the soft limit is raised to at most

log = logging.getLogger("statekv")
_warned = False  # a limit that cannot be raised is said once


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (never lowering it): a disk-tier stream holds
    a few files a layer open (about 200 for a 28-layer model)."""
    global _warned
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = MOST_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MOST_OPEN_FILES)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError) as error:  # kept as it is: what does not fit then fails in one line (`os_reason`)
        if not _warned:
            _warned = True
            log.warning("cannot raise the limit on open files: %s", error)


def refuse_out_of_files(error: OSError, folder: object) -> None:
    """A one-line `OutputError` naming the limit when ``error`` says this process (or the system) holds as many
    files open as it may: a file of ``folder`` that could not be opened then, not one that is damaged or missing."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        raise OutputError(f"cannot read the disk cache in {folder}: {os_reason(error)}") from None


def close_all(fds: list[int]) -> None:
    """Close the descriptors in ``fds``, emptying it."""
    while fds:
        os.close(fds.pop())


def closed_with(owner: object, fds: list[int]) -> list[int]:
    """``fds`` (a list its owner adds the descriptors it opens to, and empties with `close_all` when it closes them),
    closed when ``owner`` is collected still holding some: a stream dropped without `close` leaves none open."""
    weakref.finalize(owner, close_all, fds)
    return fds
