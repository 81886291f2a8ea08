"""A replica that dies (its process killed, its node lost) while it holds streams: what it left on its node's disk
(its disk-tier folder) is removed by the replicas still running there, whichever replica forgot its post, and a
folder that cannot be removed is said and tried again; its streams come back elsewhere from their last saves."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv.serve.cluster.board import FORGET_SECONDS, ReplicaBoard  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402

KEY = "cluster-key"


def _until(check, seconds: float = 15.0):
    deadline = time.monotonic() + seconds
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def _aged(path: Path, seconds: float) -> None:
    """``path`` (a folder, or a post on the board) last changed ``seconds`` ago."""
    if path.suffix == ".json":
        posted = json.loads(path.read_text())
        path.write_text(json.dumps({**posted, "updated": time.time() - seconds}))
    else:
        os.utime(path, (time.time() - seconds, time.time() - seconds))


def _tier_folder(root: Path, replica: str, age: float) -> Path:
    """A replica's disk-tier folder with one stream's file set in it, unchanged for ``age`` seconds."""
    (root / replica / "st_x").mkdir(parents=True)
    (root / replica / "st_x" / "cache.bin").write_bytes(b"\0" * 4096)
    _aged(root / replica, age)
    return root / replica


@pytest.mark.parametrize("case", ["forgotten on another node", "removal fails"])
def test_a_dead_replicas_disk_tier_folder_is_removed_by_the_replicas_of_its_node(tmp_path, unremovable, caplog, case):
    """Before: the folder was removed only by the replica that forgot the dead one's post, once, every error
    ignored: when a replica on another node (another disk) forgot it first, or the removal failed (a file held open,
    a disk read-only for a while), the dead replica's file sets stayed on the node's disk for good, unsaid."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    state, root = tmp_path / "state", tmp_path / "tier"
    qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(root / "live"))
    config = ServeConfig(options=qa.options, state_dir=state, api_keys=(KEY,), page=False)
    dead = _tier_folder(root, "dead", FORGET_SECONDS + 60)
    sibling = _tier_folder(root, "sibling", FORGET_SECONDS + 60)  # alive, its streams held for long
    starting = _tier_folder(root, "starting", 1)  # a replica starting here, not posted yet
    ReplicaBoard(state, "sibling").post(1, b"")
    if case == "removal fails":
        ReplicaBoard(state, "dead").post(2, b"")
        _aged(state / "replicas" / "dead.json", FORGET_SECONDS + 1)
    # else: its post is gone already, forgotten by a replica on another node
    unremovable.watched.add(dead)
    stuck, tries = unremovable.stuck, unremovable.tries
    if case == "removal fails":
        stuck.add(dead)
    caplog.set_level(logging.INFO, "statekv.serve")
    hosting = ReplicaHosting(config, "live", lease_seconds=10, tier_root=root)
    with TestClient(create_app(config, qa=qa, hosting=hosting)):
        if stuck:
            assert _until(lambda: tries.count(False) >= 2)  # tried again at the next pass
            said = [message for message in caplog.messages if str(dead) in message]
            assert dead.exists() and len(said) == 1 and "Permission denied" in said[0], caplog.messages
            assert "\n" not in said[0]
            stuck.clear()
        assert _until(lambda: not dead.exists()), caplog.messages
        assert sibling.exists() and starting.exists()
    assert any(f"removed {dead}" in message for message in caplog.messages)


@pytest.mark.parametrize("post", ["never posted", "post silent for long"])
def test_a_replica_folder_whose_file_set_a_live_stream_holds_is_kept_whatever_the_board_says(tmp_path, caplog, post):
    """Before: a replica whose posts failed for ten minutes (or whose post could not be read, or one of that name
    running again before its first post) had its disk-tier folder removed under its live streams, their file sets
    gone while they served. A file set a live stream holds (its lock) tells its replica is alive: the folder stays,
    said once, and goes once no stream holds it."""
    from statekv.locks import FolderLock
    from statekv.serve.cluster.dead_tiers import DeadTiers

    state, root = tmp_path / "state", tmp_path / "tier"
    folder = _tier_folder(root, "stalled", FORGET_SECONDS + 60)
    held = FolderLock.acquire(folder / "st_x", what="stream st_x", holder="stream 'st_x'")
    board = ReplicaBoard(state, "live")
    if post == "post silent for long":
        ReplicaBoard(state, "stalled").post(1, b"")
        _aged(state / "replicas" / "stalled.json", FORGET_SECONDS + 1)
    caplog.set_level(logging.INFO, "statekv.serve")
    sweeper = DeadTiers(root, "live", board)
    try:
        for _ in range(2):
            sweeper.sweep({"live"})
        assert (folder / "st_x" / "cache.bin").exists()
        said = [message for message in caplog.messages if str(folder) in message]
        assert len(said) == 1 and "in use" in said[0] and "\n" not in said[0], caplog.messages
    finally:
        held.release()
    _aged(folder, FORGET_SECONDS + 60)
    sweeper.sweep({"live"})  # no stream holds it now: dead
    assert not folder.exists()


def test_a_dead_folder_removed_in_part_is_tried_again_at_the_next_pass(tmp_path, monkeypatch, caplog):
    """Before: a removal that took some of the folder's file sets changed the folder (its time), so it was no longer
    "unchanged for ten minutes" and was tried again only ten minutes later, not at each pass as said."""
    from statekv.serve.cluster.dead_tiers import DeadTiers

    root = tmp_path / "tier"
    folder = _tier_folder(root, "dead", FORGET_SECONDS + 60)
    (folder / "st_y").mkdir()
    _aged(folder, FORGET_SECONDS + 60)
    rmtree, stuck = shutil.rmtree, [True]

    def partly(path, ignore_errors=False, *args, **kwargs):  # st_x goes, st_y will not (for now)
        if Path(path) == folder and stuck:
            rmtree(folder / "st_x", True)
            if ignore_errors:
                return None
            raise PermissionError(errno.EACCES, "Permission denied", str(folder / "st_y"))
        return rmtree(path, ignore_errors, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", partly)
    caplog.set_level(logging.INFO, "statekv.serve")
    sweeper = DeadTiers(root, "live", ReplicaBoard(tmp_path / "state", "live"))
    sweeper.sweep({"live"})
    assert folder.exists() and not (folder / "st_x").exists()
    stuck.clear()
    sweeper.sweep({"live"})
    assert not folder.exists(), caplog.messages
