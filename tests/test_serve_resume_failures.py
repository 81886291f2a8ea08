"""A server that cannot read a disk-tier stream's healthy file set as it starts (too many open files, a disk that
fails: an `OutputError`, not damage) leaves the file set where it is and serves the stream at the next start."""

from __future__ import annotations

import errno
import json
import os

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.errors import OutputError  # noqa: E402

from test_hostile_service import BUDGET, Running, _stream  # noqa: E402


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_options(ModelOptions(model="builtin", budget=BUDGET))


def test_a_file_set_that_cannot_be_read_at_a_start_is_left_in_place_and_served_at_the_next(qa, tmp_path,
                                                                                         monkeypatch):
    """Before: the healthy file set was moved into the quarantine, its stream damaged for good."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = ModelOptions(model="builtin", budget=BUDGET, offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=3)
    folder = tier / json.loads((state / "streams" / f"{stream_id}.json").read_text())["tier"]
    loaded = statekv.Stream.load

    def out_of_files(path, *args, **kwargs):
        raise OutputError(f"cannot read the disk cache in {path}: too many open files: raise the limit")

    monkeypatch.setattr(statekv.Stream, "load", out_of_files)
    with Running(state, qa, options=disk) as server, server.client() as client:
        reason = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}[stream_id]["damaged"]
        assert "too many open files" in reason and "left where it is" in reason and "\n" not in reason
    assert folder.is_dir() and not list(state.glob(f"quarantine/{stream_id}-*"))
    monkeypatch.setattr(statekv.Stream, "load", loaded)
    with Running(state, qa, options=disk) as server, server.client() as client:  # tried again: it resumes
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3


def test_a_file_set_whose_lock_cannot_be_taken_for_want_of_files_is_left_in_place(qa, tmp_path, monkeypatch):
    """Before: the lock's "Too many open files" was an `InputError`, read as damage: the healthy file set was moved
    into the quarantine (its lock taken a moment later), its stream damaged for good."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = ModelOptions(model="builtin", budget=BUDGET, offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=3)
    folder = tier / json.loads((state / "streams" / f"{stream_id}.json").read_text())["tier"]
    opened, refused = os.open, []

    def out_of_files_once(path, *args, **kwargs):
        if os.fspath(path) == str(folder) and not refused:
            refused.append(path)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", out_of_files_once)
    with Running(state, qa, options=disk) as server, server.client() as client:
        reason = {s["id"]: s for s in client.get("/v1/streams").json()["data"]}[stream_id]["damaged"]
        assert "ulimit -n" in reason and "left where it is" in reason and "\n" not in reason
    assert refused and folder.is_dir() and not list(state.glob(f"quarantine/{stream_id}-*"))
    monkeypatch.setattr(os, "open", opened)
    with Running(state, qa, options=disk) as server, server.client() as client:  # tried again: it resumes
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 3
