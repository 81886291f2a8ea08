"""What a replica on the disk tier leaves on its own disk when a stream goes elsewhere: the stream's disk-tier file
set, removed; a file set that cannot be removed whole is said in one line and tried again at each pass over the
leases, rather than left to fill the disk unseen."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv.serve.auth import owner_of  # noqa: E402
from statekv.serve.cluster.leases import Leases  # noqa: E402
from statekv.serve.cluster.shared import SharedRegistry, SharedStreamFiles  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.metrics import Metrics  # noqa: E402
from statekv.serve.worker import ModelWorker  # noqa: E402

from conftest import random_frames  # noqa: E402

OWNER = owner_of("key")


def _replicas(tmp_path: Path) -> list[SharedRegistry]:
    """Two replicas over one shared folder, each with its disk-tier file sets in a folder of its own."""
    replicas = []
    for name in ("first", "second"):
        qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk",
                                             offload_dir=str(tmp_path / "tier" / name))
        config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", save_every_frames=1000, max_streams=4)
        files = SharedStreamFiles(tmp_path / "state", Leases(tmp_path / "state", name, seconds=60))  # no loop renews
        registry = SharedRegistry(config, qa, ModelWorker(), files)
        registry.metrics = Metrics(lambda: 0, lambda: 0)
        replicas.append(registry)
    return replicas


def test_a_tier_folder_that_cannot_be_removed_as_its_stream_moves_is_said_and_removed_later(tmp_path, unremovable,
                                                                                            caplog):
    """Before: the folder of a stream handed over was removed ignoring every error, silently: what could not go
    (a file held open, a disk gone read-only for a while) stayed on the replica's disk for good."""
    stuck = unremovable.stuck
    caplog.set_level(logging.INFO, "statekv.serve")

    async def scenario():
        first, second = _replicas(tmp_path)
        entry = await first.create(OWNER, {"horizon_frames": 16, "max_fps": None})
        for index, image in enumerate(random_frames(2, 31, 64, 48)):
            await first.push(entry, image, float(index))
        folder = entry.tier
        stuck.add(folder)
        taking = asyncio.ensure_future(second.find(OWNER, entry.id))
        while first.files.leases.peek(entry.id).handoff is None:
            await asyncio.sleep(0.02)
        await first.keep_leases()  # hands it over
        taken = await asyncio.wait_for(taking, 10)
        assert taken.stream.pushed == 2 and entry.id not in first.entries
        said = [message for message in caplog.messages if str(folder) in message]
        assert folder.exists() and len(said) == 1 and "Permission denied" in said[0], caplog.messages
        await first.keep_leases()
        assert folder.exists()  # still stuck: tried again, said once
        assert sum(str(folder) in message for message in caplog.messages) == 1
        stuck.clear()
        await first.keep_leases()
        assert not folder.exists() and taken.stream.durability.folder.exists()
        for registry in (first, second):
            registry.worker.close()

    asyncio.run(scenario())
