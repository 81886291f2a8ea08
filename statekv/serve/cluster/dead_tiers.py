"""`DeadTiers`: the disk-tier folders that dead replicas left on this node (``--offload disk``: each replica's
streams keep their file sets in its own subfolder of the tier root), removed by the replicas still running there.

A replica killed (its process, its node) removes nothing; its streams come back elsewhere from their saves, so its
folder is only garbage once it is dead: once its post on the replicas' board is older than the board's
`FORGET_SECONDS`, or gone (forgotten by a replica on another node, whose tier root is another disk). The board
alone does not tell a dead replica from one whose posts failed for that long, or one of that name running again
before its first post: a folder holding a file set that a live stream holds (its lock, `statekv.locks`) is kept,
whatever the board says (where the file system has no locks, the board alone tells). A folder that cannot be
removed whole is said in one line and tried again at each pass, rather than left to fill the disk unseen.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ...errors import StateKVError
from ...locks import FileLock
from ..entries import failure_reason
from ..store import remove_folder
from .board import FORGET_SECONDS, REPLICA_NAME

log = logging.getLogger("statekv.serve")


class DeadTiers:
    """The subfolders of ``tier_root`` (None: no disk tier, nothing to do) of replicas other than ``replica`` that
    are dead as ``board`` (a `board.ReplicaBoard` or `board.StoreBoard`) tells."""

    def __init__(self, tier_root: Path | None, replica: str, board: Any):
        self.tier_root, self.replica, self.board = tier_root, replica, board
        self.stuck: set[Path] = set()  # folders whose removal failed (said once, tried again at each pass)
        self.held: set[Path] = set()  # folders kept for a file set a live stream holds (said once)

    def sweep(self, live: set[str]) -> None:
        """Remove the folders of dead replicas; ``live``: the ids of the replicas posting now (theirs are kept
        without reading the board again)."""
        candidates = self._candidates(live)
        if not candidates:
            return
        ages = self.board.ages()
        for folder in candidates:
            if ages.get(folder.name, float("inf")) > FORGET_SECONDS and not self._in_use(folder):
                self._remove(folder)

    def _candidates(self, live: set[str]) -> list[Path]:
        """This node's folders of replicas not posting now, unchanged for `FORGET_SECONDS` (or whose removal failed
        part way): one just made by a replica starting here, before its first post, is never among them."""
        if self.tier_root is None:
            return []
        found, now = [], time.time()
        try:
            for folder in self.tier_root.iterdir():
                if folder.name == self.replica or folder.name in live or not REPLICA_NAME.fullmatch(folder.name):
                    continue
                if folder.is_dir() and not folder.is_symlink() and (
                        folder in self.stuck or now - folder.stat().st_mtime > FORGET_SECONDS):
                    found.append(folder)  # one removed in part has changed since: tried again all the same
        except FileNotFoundError:
            return []  # no stream on the disk tier here yet
        return sorted(found)

    def _in_use(self, folder: Path) -> bool:
        """Whether a file set in ``folder`` is held by a live stream (or its lock cannot be tried): its replica is
        alive, its posts failing or not made yet. Said once a folder."""
        try:
            sets = sorted(path for path in folder.iterdir() if path.is_dir() and not path.is_symlink())
        except OSError:
            return False  # the removal says what it cannot do
        for path in sets:
            try:
                FileLock.acquire(path, what=f"its file set {path.name}", advice="its replica is alive",
                                 note=path / "lock").release()  # the note a stream's `FolderLock` writes
            except StateKVError as error:
                if folder not in self.held:
                    log.warning("%s, the disk-tier folder of replica %s, is kept though the board says it is dead "
                                "(silent for %d s): %s", folder, folder.name, FORGET_SECONDS, error)
                self.held.add(folder)
                return True
        self.held.discard(folder)
        return False

    def _remove(self, folder: Path) -> None:
        try:
            remove_folder(folder)
        except OSError as error:
            if folder not in self.stuck:
                log.error("cannot remove all of %s, the disk-tier folder of replica %s, dead (silent for %d s) "
                          "(%s); tried again at each pass", folder, folder.name, FORGET_SECONDS,
                          failure_reason(error))
            self.stuck.add(folder)
            return
        self.stuck.discard(folder)
        log.info("removed %s, the disk-tier folder of replica %s, dead (silent for %d s); its streams come back "
                 "from their saves", folder, folder.name, FORGET_SECONDS)
