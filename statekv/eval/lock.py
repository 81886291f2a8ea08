"""One evaluation at a time in a run folder: rank 0 holds an advisory lock on ``run.lock`` for the whole run.

A second run started on the same folder (same settings, so it would answer the same questions again) finds
the lock taken and stops with one line naming the run that holds it. The ranks of one ``torchrun`` launch share
the folder legitimately: only rank 0 locks, and it tells the others whether it could (`run_evaluation`).

The lock is the operating system's (``flock``): it goes away with its process, so a killed run never leaves
a stale lock behind and rerunning resumes at once. Where ``fcntl`` does not exist (Windows) runs are not locked.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from pathlib import Path
from typing import IO

from statekv.errors import OutputError

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLock:
    """The lock of the run folder ``folder`` (created if missing); ``acquire`` refuses when another process
    holds it, ``release`` gives it back (the file stays: removing it would race with a run starting)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the lock now."""
        return self._file is not None

    def acquire(self) -> None:
        if self._file is not None:
            return
        if fcntl is None:
            logger.warning("%s: runs are not locked on this system; do not start two on one folder", self.folder)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        file = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by another process
            file.seek(0)
            holder = file.readline(200).strip() or "another process"
            file.close()
            raise OutputError(f"{self.folder} is in use by another evaluation ({holder}); wait for it to finish, "
                              "or give this one another --out") from None
        except OSError as error:  # a file system without locks: run, but say so
            file.close()
            logger.warning("%s: cannot lock the run folder (%s); do not start two runs on it", self.folder,
                           error.strerror or error)
            return
        file.truncate(0)
        started = datetime.datetime.now().isoformat(timespec="seconds")
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
