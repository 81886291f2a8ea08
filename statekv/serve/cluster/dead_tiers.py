"""`DeadTiers`: the disk-tier folders that dead replicas left on this node (``--offload disk``: each replica's
streams keep their file sets in its own subfolder of the tier root), removed by the replicas still running there.

A replica killed (its process, its node) removes nothing; its streams come back elsewhere from their saves, so its
folder is only garbage once it is dead: once its post on the replicas' board is older than the board's
`FORGET_SECONDS`, or gone (forgotten by a replica on another node, whose tier root is another disk). A folder that
cannot be removed whole is said in one line and tried again at each pass, rather than left to fill the disk unseen.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

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

    def sweep(self, live: set[str]) -> None:
        """Remove the folders of dead replicas; ``live``: the ids of the replicas posting now (theirs are kept
        without reading the board again)."""
        candidates = self._candidates(live)
        if not candidates:
            return
        ages = self.board.ages()
        for folder in candidates:
            if ages.get(folder.name, float("inf")) > FORGET_SECONDS:
                self._remove(folder)

    def _candidates(self, live: set[str]) -> list[Path]:
        """This node's folders of replicas not posting now, unchanged for `FORGET_SECONDS`: one just made by a
        replica starting here, before its first post, is never among them."""
        if self.tier_root is None:
            return []
        found, now = [], time.time()
        try:
            for folder in self.tier_root.iterdir():
                if folder.name == self.replica or folder.name in live or not REPLICA_NAME.fullmatch(folder.name):
                    continue
                if folder.is_dir() and not folder.is_symlink() and now - folder.stat().st_mtime > FORGET_SECONDS:
                    found.append(folder)
        except FileNotFoundError:
            return []  # no stream on the disk tier here yet
        return sorted(found)

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
