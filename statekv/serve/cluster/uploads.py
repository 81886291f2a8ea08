"""`ReplicaUploads`: where a replica keeps the files its page is feeding, a folder of its own under the state
folder's ``uploads/replicas/`` or, with none (replicas over an object store), this machine's
``<temp>/statekv-uploads/``. The replica holds the lock of ``<replica>.lock`` beside its folder for its whole life;
a replica starting removes every folder there whose lock nobody holds (its replica was killed mid-upload, and no
replica is ever named again), never one a live replica holds. A folder of uploads that is a link, or in this
machine's temp another user's, is neither used nor swept: whatever it leads to is not statekv's to remove."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ...errors import StateKVError
from ...locks import FileLock
from ..store import REPLICA_UPLOADS, UPLOADS

log = logging.getLogger("statekv.serve")
LOCK = ".lock"
LOCK_TRIES = 40


def uploads_root(state_dir: Path | None) -> Path:
    """The folder every replica's uploads folder is in: the state folder's, or this machine's."""
    if state_dir is not None:
        return Path(state_dir) / UPLOADS / REPLICA_UPLOADS
    return Path(tempfile.gettempdir()) / "statekv-uploads"


class ReplicaUploads:
    """Replica ``replica``'s uploads folder under ``root`` (`uploads_root`), locked until `close`."""

    def __init__(self, root: Path, replica: str):
        self.root, self.replica = Path(root), replica
        self.folder = self.root / replica
        self.lock: FileLock | None = None
        self.private = False  # a folder of its own outside ``root`` (`open`), removed at `close`

    def open(self) -> "ReplicaUploads":
        """Remove what replicas no longer alive left, then lock this replica's folder (made when first fed)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            found = os.lstat(self.root)
        except OSError as error:  # the page says so at an upload; serving goes on
            log.warning("cannot keep uploads in %s: %s", self.root, error.strerror or error)
            return self
        theirs = (self.root.parent == Path(tempfile.gettempdir()) and hasattr(os, "getuid")
                  and found.st_uid != os.getuid())
        if stat.S_ISLNK(found.st_mode) or theirs:  # never swept: the removals would follow it
            self.folder = Path(tempfile.mkdtemp(prefix=f"statekv-uploads-{self.replica}-"))
            self.private = True
            log.warning("%s is %s: replica %s keeps its uploads in %s and removes no other replica's", self.root,
                        "a link" if not theirs else "another user's", self.replica, self.folder)
            return self
        self.sweep()
        for _ in range(LOCK_TRIES):  # a replica sweeping as this one starts holds this lock for a moment
            try:
                self.lock = FileLock.acquire(self.root / f"{self.replica}{LOCK}",
                                             what=f"the uploads of {self.replica}", holder=f"replica {self.replica}",
                                             remove=True)
                break
            except StateKVError:
                time.sleep(0.05)
        else:
            log.warning("cannot lock the uploads of replica %s in %s: another replica may remove them", self.replica,
                        self.root)
        return self

    def sweep(self) -> None:
        """Remove each other replica's folder (and its lock file) whose lock no live replica holds. Where the file
        system has no locks nothing is removed: a live replica could not be told from a dead one."""
        try:
            names = {path.name[:-len(LOCK)] if path.name.endswith(LOCK) else path.name
                     for path in self.root.iterdir()}
        except OSError:
            return
        for name in sorted(names - {self.replica}):
            path = self.root / f"{name}{LOCK}"
            try:
                lock = FileLock.acquire(path, what=f"the uploads of {name}")
            except StateKVError:  # held: its replica is alive (or the file cannot be locked)
                continue
            try:
                if lock.locked and lock.owns():
                    self._remove(name)
                    path.unlink(missing_ok=True)  # while held: a replica of that name could not hold it now
            except OSError:
                pass
            finally:
                lock.release()

    def _remove(self, name: str) -> None:
        left = self.root / name
        if left.is_dir() and not left.is_symlink():
            files = sum(1 for path in left.iterdir() if path.is_file())
            shutil.rmtree(left, ignore_errors=True)
            if files:
                log.warning("removed %d video%s the page of replica %s was feeding when it stopped (its streams keep "
                            "the frames they saved)", files, "s" * (files > 1), name)

    def close(self) -> None:
        """At a clean stop: this replica's folder removed, its lock let go."""
        if self.private:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.lock is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.lock.release()
            self.lock = None
