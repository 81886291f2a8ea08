"""What a `statekv serve` replica leaves behind when it is killed: the videos its page was feeding, removed by the
next replica to start unless their replica is alive; and a server alone, which keeps them in its state folder."""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")

import statekv  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


def _replica(tmp_path, qa, name: str, folder: bool):
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state" if folder else None, api_keys=("key",),
                         page=False, save_every_seconds=600)
    store = None if folder else (tmp_path / "bucket").as_uri()
    return TestClient(create_app(config, qa=qa, hosting=ReplicaHosting(config, name, lease_seconds=60, store=store)))


@pytest.mark.parametrize("folder", [True, False], ids=["shared-folder", "store-alone"])
def test_a_replica_starting_removes_the_uploads_a_killed_replica_left_and_keeps_a_live_ones(tmp_path, qa, folder,
                                                                                         monkeypatch):
    """Before: a replica killed while its page fed a video left the file (``/tmp/statekv-uploads-<replica>/``, or
    the shared state folder's ``uploads/``) for good: no replica is named again, and only a server alone swept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine"))
    with _replica(tmp_path, qa, "first", folder) as first:
        live = first.app.state.service.uploads
        live.mkdir(parents=True, exist_ok=True)
        (live / "fedcba9876543210.mp4").write_bytes(b"\0" * 1000)  # being fed
        killed = live.parent / "killed"  # as a replica killed mid-upload left it
        killed.mkdir()
        (killed / "0123456789abcdef.mp4").write_bytes(b"\0" * 1000)
        with _replica(tmp_path, qa, "second", folder) as second:
            assert second.app.state.service.uploads.parent == live.parent
            assert not killed.exists(), list(killed.iterdir())
            assert (live / "fedcba9876543210.mp4").exists()  # its replica is alive: kept
        assert (live / "fedcba9876543210.mp4").exists()
    assert not live.exists()  # a clean stop takes its own


def test_uploads_in_a_linked_folder_are_neither_swept_nor_kept_there(tmp_path, monkeypatch):
    """Before: ``<temp>/statekv-uploads`` made a link (by another user of the machine) to some folder had every
    folder in it removed by the first replica to start, as if a killed replica had left it."""
    from statekv.serve.cluster.uploads import ReplicaUploads, uploads_root

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "work").mkdir(parents=True)
    (elsewhere / "work" / "notes.txt").write_text("kept")
    machine = tmp_path / "machine"
    machine.mkdir()
    (machine / "statekv-uploads").symlink_to(elsewhere)
    monkeypatch.setattr(tempfile, "tempdir", str(machine))
    uploads = ReplicaUploads(uploads_root(None), "replica1").open()
    try:
        assert (elsewhere / "work" / "notes.txt").read_text() == "kept"
        assert sorted(path.name for path in elsewhere.iterdir()) == ["work"]
        assert uploads.folder.is_dir() and elsewhere not in uploads.folder.resolve().parents
    finally:
        uploads.close()
    assert not uploads.folder.exists()


def test_a_server_alone_without_a_state_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """Before: ``statekv.serve.create_app`` given ``state_dir=None`` (meant only for replicas over an object store)
    failed with a TypeError traceback; its page's uploads would have gone to a ``<temp>/statekv-uploads-<pid>``
    that nothing ever swept."""
    from statekv.serve import create_app

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine"))
    config = ServeConfig(options=statekv.ModelOptions(model="builtin", budget=64), state_dir=None, api_keys=("key",),
                         page=False)
    with pytest.raises(statekv.ConfigurationError, match="needs a state folder") as refused:
        create_app(config)  # refused before the model loads
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "machine").exists()
