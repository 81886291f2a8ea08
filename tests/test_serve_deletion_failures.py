"""A deletion whose disk-tier file set cannot be removed whole (a file the disk will not let go) is answered as
begun, the stream never served again, and its note kept, so the next start removes what was left rather than
forget it."""

from __future__ import annotations

import errno
import json
import os

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.errors import InputError  # noqa: E402

from test_hostile_service import BUDGET, Running, _stream  # noqa: E402


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin", budget=BUDGET))


def _refusing_the_journal(monkeypatch) -> None:
    """As a disk that fails to remove one file of a file set (its journal), and removes the others."""
    unlink = os.unlink

    def refused(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "journal":
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refused)


def _left(state, tier) -> list[str]:
    """What is left of the streams in the state folder and --offload-dir."""
    return sorted([path.name for path in (state / "streams").iterdir()] + [path.name for path in tier.iterdir()] +
                  [path.name for path in (state / "quarantine").glob("*")])


def test_a_file_set_a_deletion_cannot_remove_whole_is_removed_at_the_next_start(qa, tmp_path, monkeypatch):
    """Before: what was left of the file set was forgotten (the deletion's note removed with the record), left in
    --offload-dir for good."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = ModelOptions(model="builtin", budget=BUDGET, offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        kept, deleted = _stream(client, frames=2), _stream(client, frames=3, seed=5)
        folder = tier / json.loads((state / "streams" / f"{deleted}.json").read_text())["tier"]
        with monkeypatch.context() as patched:
            _refusing_the_journal(patched)
            assert client.delete(f"/v1/streams/{deleted}").status_code == 200
        assert client.get(f"/v1/streams/{deleted}").status_code == 404
        assert client.get(f"/v1/streams/{kept}").json()["frames"] == 2
        assert folder.is_dir()  # what would not go is still there, until the next start
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert [s["id"] for s in client.get("/v1/streams").json()["data"]] == [kept]
    assert not folder.exists() and not any(deleted in name for name in _left(state, tier))


def test_a_quarantined_file_set_a_deletion_cannot_remove_whole_is_removed_at_the_next_start(qa, tmp_path,
                                                                                         monkeypatch):
    """Before: the file set moved into the quarantine stayed there for good, the stream's note and record gone."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = ModelOptions(model="builtin", budget=BUDGET, offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)

    def damaged(path, *args, **kwargs):
        raise InputError(f"{path}: its journal is damaged")

    with monkeypatch.context() as patched:
        patched.setattr(statekv.Stream, "load", damaged)
        with Running(state, qa, options=disk) as server, server.client() as client:
            assert list(state.glob(f"quarantine/{stream_id}-*"))  # moved there
            _refusing_the_journal(patched)
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
            assert client.get("/v1/streams").json()["data"] == []
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"] == []
    assert not any(stream_id in name for name in _left(state, tier))
