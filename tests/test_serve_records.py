"""`statekv serve --state-dir` reading what earlier statekv versions and crashed or hand-edited processes left in
its state folder: each record is read as an older version's, or its stream is quarantined in one line naming the
file, never a traceback, never a server that does not start, never a sound stream lost with it.

Each server runs in this process (`test_hostile_service.Running`, the built-in model). Each case says what the
service did before.
"""

from __future__ import annotations

import json
import logging

import pytest

import statekv

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")

from test_hostile_service import Running, _error, _png, _stream  # noqa: E402
from test_hostile_service import options, qa  # noqa: E402,F401 -- the module's fixtures


@pytest.mark.parametrize("note", ["[1, 2]", '"st_x"', "{not json", ""], ids=["a list", "a string", "cut", "empty"])
def test_a_deletion_note_that_cannot_be_read_finishes_its_deletion_and_the_server_starts(qa, tmp_path, caplog,
                                                                                         note):
    """Before: a ``streams/ID.deleting`` that was JSON but not an object kept the server from starting (an
    AttributeError at start); one that was not JSON hid its stream for good, its files never removed, nothing
    said."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        kept, deleted = _stream(client, frames=1), _stream(client, frames=1, seed=10)
    (state / "streams" / f"{deleted}.deleting").write_text(note)
    with caplog.at_level(logging.WARNING, logger="statekv.serve"):
        with Running(state, qa) as server, server.client() as client:
            assert [entry["id"] for entry in client.get("/v1/streams").json()["data"]] == [kept]
            assert client.get(f"/v1/streams/{deleted}").status_code == 404
    assert not list((state / "streams").glob(f"{deleted}.*"))  # its deletion finished: nothing of it is left
    said = [r.getMessage() for r in caplog.records if f"{deleted}.deleting" in r.getMessage()]
    assert len(said) == 1 and "cannot be read" in said[0] and "\n" not in said[0], said


@pytest.mark.parametrize("seconds", ["1", [1.0], True, -5.0, {"t": 1}], ids=["text", "a list", "true", "negative",
                                                                           "an object"])
def test_a_record_whose_saved_time_is_no_stream_time_resumes_on_its_saves_clock(qa, tmp_path, seconds):
    """Before: the record's ``saved.seconds``, whatever it held, became the stream's time: its info showed it as
    ``seconds`` and ``resume_after_seconds``, and a push without ``t`` (timed after it) failed with a 500 and a
    traceback (a text or a list) or was timed from a negative time."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)  # at 0 s and 1 s
    path = state / "streams" / f"{stream_id}.json"
    record = json.loads(path.read_text())
    record["saved"]["seconds"] = seconds
    path.write_text(json.dumps(record))
    with Running(state, qa) as server, server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}").json()
        assert [repr(info[name]) for name in ("seconds", "resume_after_seconds")] == ["1.0", "1.0"], info
        pushed = client.post(f"/v1/streams/{stream_id}/frames", content=_png(5), headers={"Content-Type": "image/png"})
        assert pushed.status_code == 200, pushed.text
        assert pushed.json()["seconds"] == 2.0  # the next frame at the stream's rate (max_fps 1)


def test_a_record_naming_another_streams_file_set_leaves_that_stream_served(qa, tmp_path, options):
    """A copy of a disk-tier stream's record under another id (a restored backup, a duplicated file) names the same
    file set. Before: the copy, loaded first, found the file set another stream's, moved it into the quarantine under
    the copy's id, and the stream whose file set it was came back damaged ("not in --offload-dir")."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    copy_id = "st_" + "0" * 24  # listed, and loaded, before the stream
    record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
    (state / "streams" / f"{copy_id}.json").write_text(json.dumps({**record, "id": copy_id}))
    file_sets = sorted(path.name for path in tier.iterdir())
    for _ in range(2):
        with Running(state, qa, options=disk) as server, server.client() as client:
            info = client.get(f"/v1/streams/{stream_id}").json()
            assert info["state"] == "ready" and info["frames"] == 2, info
            (copy,) = [stream for stream in client.get("/v1/streams").json()["data"] if stream["id"] == copy_id]
            assert copy["state"] == "damaged", copy
            assert "another stream" in copy["damaged"] and "left where it is" in copy["damaged"], copy
        assert sorted(path.name for path in tier.iterdir()) == file_sets and not list(state.glob("quarantine/*-*"))
    with Running(state, qa, options=disk) as server, server.client() as client:  # the copy deleted alone
        assert client.delete(f"/v1/streams/{copy_id}").status_code == 200  # before: 409, the file set held
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 2
    assert sorted(path.name for path in tier.iterdir()) == file_sets


def test_a_file_set_whose_owner_another_installation_recorded_stays_where_reown_finds_it(qa, tmp_path, options,
                                                                                        monkeypatch):
    """docs/serving.md: a server with another installation secret lists its streams as damaged; re-owning the save
    and the file set under --offload-dir serves them again. Before: the file set was moved into the quarantine, so
    ``statekv reown`` found nothing under --offload-dir, and the stream stayed damaged after it."""
    from statekv.cli import main

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "first.secret"))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "second.secret"))  # another machine's
    with Running(state, qa, options=disk) as server, server.client() as client:
        listed = client.get("/v1/streams").json()["data"]
        assert [stream["state"] for stream in listed] == ["damaged"], listed
        assert "another statekv installation" in listed[0]["damaged"], listed
        assert "left where it is" in listed[0]["damaged"], listed
    assert not list(state.glob("quarantine/*-*"))
    owner = json.loads((state / "streams" / f"{stream_id}.json").read_text())["owner"]
    (file_set,) = [path for path in tier.iterdir() if path.is_dir()]
    assert main(["reown", str(file_set), "--owner", owner]) == 0
    with Running(state, qa, options=disk) as server, server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}").json()
        assert info["state"] == "ready" and info["frames"] == 2, info


def test_a_record_whose_save_is_missing_says_so_as_it_comes_back_empty(qa, tmp_path, caplog):
    """Before: a stream whose record says frames were saved, but whose save is gone (removed by hand, a restore
    that left it out), came back empty with a log line saying it was resumed from "nothing (it was never saved)"."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    (state / "streams" / f"{stream_id}.safetensors").unlink()
    with caplog.at_level(logging.ERROR, logger="statekv.serve"):
        with Running(state, qa) as server, server.client() as client:
            info = client.get(f"/v1/streams/{stream_id}").json()
            assert info["frames"] == 0 and info["lost"] == {"pushed": 2, "frames": 2, "answers": 0}, info
    (said,) = [r.getMessage() for r in caplog.records if "came back without" in r.getMessage()]
    assert "never saved" not in said and "its save, which its record says held 2 frames pushed, is missing" in said


def test_a_save_no_record_names_is_said_at_start_and_left_as_it_is(qa, tmp_path, caplog):
    """Before: a save whose record was gone (removed by hand, a restore that left it out) was passed over in
    silence: its stream was neither served nor listed, and nothing told anyone why."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        kept, unrecorded = _stream(client, frames=1), _stream(client, frames=1, seed=10)
    (state / "streams" / f"{unrecorded}.json").unlink()
    with caplog.at_level(logging.WARNING, logger="statekv.serve"):
        with Running(state, qa) as server, server.client() as client:
            assert [entry["id"] for entry in client.get("/v1/streams").json()["data"]] == [kept]
    (said,) = [r.getMessage() for r in caplog.records if unrecorded in r.getMessage()]
    assert f"streams/{unrecorded}.safetensors" in said and "has no record" in said, said
    assert (state / "streams" / f"{unrecorded}.safetensors").exists()


def test_an_older_records_loss_is_said_on_the_page_in_frames_not_as_none_pushed(qa, tmp_path):
    """A record an earlier statekv wrote (no ``seen``) tells its loss by its answers' frames alone: the API's
    ``lost`` has ``pushed`` 0. Before: the page said the stream "came back without 0 pushed (2 encoded)", as if
    nothing pushed were lost; the log says 2, as the page now does."""
    from statekv.serve.page_parts import lost_text

    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": "What?", "max_new_tokens": 1})
        assert asked.status_code == 200, asked.text
    path = state / "streams" / f"{stream_id}.json"
    record = json.loads(path.read_text())
    del record["seen"]  # as an earlier statekv wrote it
    path.write_text(json.dumps(record))
    (state / "streams" / f"{stream_id}.safetensors").unlink()  # the frames its answer was given over are lost
    with Running(state, qa) as server, server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}").json()
    assert info["lost"] == {"pushed": 0, "frames": 2, "answers": 1}, info
    said = lost_text(info["lost"], info)
    assert said.startswith("The server stopped before saving this stream's last frames: it came back without the "
                           "last 2 frames pushed (2 of them encoded); 1 answer below was given over frames it no "
                           "longer holds. The next frame to push is index 0"), said


@pytest.mark.parametrize("disk", [False, True], ids=["save", "disk-tier file set"])
def test_a_stream_another_installation_owns_is_listed_without_the_servers_secret_path(qa, tmp_path, options,
                                                                                     monkeypatch, disk):
    """A damaged stream's reason names no server path (docs/serving.md). Before: one whose owner another
    installation recorded named this server's secret file, its full path, to the client, and the file set's
    reason was cut short in the middle of the `statekv reown` command it gives. (A secret file given by a bare name
    is refused: `tests/test_environment_variables.py`.)"""
    monkeypatch.chdir(tmp_path)
    secret = tmp_path / "secrets" / "second.secret"
    served = options.with_changes(offload="disk", offload_dir=str(tmp_path / "tier")) if disk else options
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "first.secret"))
    with Running(tmp_path / "state", qa, options=served) as server, server.client() as client:
        _stream(client, frames=2)
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(secret))  # another machine's
    with Running(tmp_path / "state", qa, options=served) as server, server.client() as client:
        (listed,) = client.get("/v1/streams").json()["data"]
    assert listed["state"] == "damaged" and "another statekv installation" in listed["damaged"], listed
    assert str(tmp_path) not in listed["damaged"] and "secrets" not in listed["damaged"], listed
    assert "--owner NAME" in listed["damaged"], listed
    assert "its owner was recorded by another statekv installation" in listed["damaged"], listed


def test_a_save_made_with_another_setup_is_answered_as_sound_by_a_server_alone(qa, tmp_path, options):
    """Before: a server alone started with another dtype answered 409 calling a stream saved whole with the first
    "damaged" and telling to repair its files, kept in the state folder; they are sound: the setup is what to
    change, and a start with the first serves the stream."""
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    other = options.with_changes(dtype="bfloat16")
    with Running(state, statekv.VideoQA.from_options(other), options=other) as server, server.client() as client:
        message = _error(client.get(f"/v1/streams/{stream_id}"), 409)
        assert "files are sound" in message and "repair" not in message, message
    with Running(state, qa) as server, server.client() as client:
        assert client.get(f"/v1/streams/{stream_id}").json()["frames"] == 2


def test_a_deletion_cut_short_leaves_a_file_set_another_process_holds_until_a_start_that_can_take_it(qa, tmp_path,
                                                                                                     options, caplog):
    """A DELETE removes a disk-tier file set under its lock (409 while another process holds it); a kill between its
    deletion note and the removal leaves the rest to the next start. Before: that start removed the folder whatever
    held it (a `Stream.load` of it, another server on the same --offload-dir), its files gone under the holder."""
    from statekv.core.disk.files import hold

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    (file_set,) = [path for path in tier.iterdir() if path.is_dir()]
    # as `statekv serve` leaves it killed between the deletion's note and its removal of the file set
    note = {"id": stream_id, "tier": str(file_set.absolute()), "at": 0}
    (state / "streams" / f"{stream_id}.deleting").write_text(json.dumps(note))
    held = hold(file_set, "another process")
    try:
        with caplog.at_level(logging.ERROR, logger="statekv.serve"):
            with Running(state, qa, options=disk) as server, server.client() as client:
                assert client.get("/v1/streams").json()["data"] == []
                assert client.get(f"/v1/streams/{stream_id}").status_code == 404
        assert file_set.is_dir() and (file_set / "stream.json").exists()  # before: removed under its holder
        (said,) = [r.getMessage() for r in caplog.records if "cannot finish deleting" in r.getMessage()]
        assert stream_id in said and "next start" in said, said
    finally:
        held.release()
    with Running(state, qa, options=disk) as server, server.client() as client:
        assert client.get("/v1/streams").json()["data"] == []
    assert not file_set.exists() and not list((state / "streams").glob(f"{stream_id}.*"))


def test_a_copied_records_deletion_leaves_a_damaged_file_set_another_stream_s_record_names(qa, tmp_path, options):
    """A copy of a disk-tier stream's record under another id names the same file set; one that cannot be read (its
    stream.json damaged) does not say whose it is, and is left where it is while another process holds it. Before:
    a DELETE of the copy, once the file set was let go, removed it: the stream whose file set it was lost it."""
    from statekv.core.disk.files import hold

    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    copy_id = "st_" + "0" * 24
    record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
    (state / "streams" / f"{copy_id}.json").write_text(json.dumps({**record, "id": copy_id}))
    (file_set,) = [path for path in tier.iterdir() if path.is_dir()]
    setup = json.loads((file_set / "stream.json").read_text())
    (file_set / "stream.json").write_text(json.dumps({**setup, "checksum": "0" * 64}))
    held = hold(file_set, "another process")
    try:
        with Running(state, qa, options=disk) as server, server.client() as client:
            listed = client.get("/v1/streams").json()["data"]
            assert [stream["state"] for stream in listed] == ["damaged", "damaged"], listed
            held.release()
            assert client.delete(f"/v1/streams/{copy_id}").status_code == 200
            assert file_set.is_dir()  # before: removed with the copy
            assert [stream["id"] for stream in client.get("/v1/streams").json()["data"]] == [stream_id]
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200  # its own stream's deletion
    finally:
        held.release()
    assert not file_set.exists() and not list((state / "streams").iterdir())


def test_a_damaged_streams_deletion_says_it_leaves_a_file_set_that_is_a_link(qa, tmp_path, options, caplog):
    """A disk-tier file set in --offload-dir that is a link (to a folder on another disk, say) is never followed by
    a deletion. Before: a DELETE of the stream, listed as damaged (saved with another setup), answered 200 and
    removed the record alone: the link and every frame it names stayed for good, nothing said."""
    tier, state = tmp_path / "tier", tmp_path / "state"
    disk = options.with_changes(offload="disk", offload_dir=str(tier))
    with Running(state, qa, options=disk) as server, server.client() as client:
        stream_id = _stream(client, frames=2)
    (file_set,) = [path for path in tier.iterdir() if path.is_dir()]
    elsewhere = tmp_path / "elsewhere" / file_set.name
    elsewhere.parent.mkdir()
    file_set.rename(elsewhere)
    file_set.symlink_to(elsewhere, target_is_directory=True)
    kept = sorted(path.name for path in elsewhere.iterdir() if path.name != "lock")
    other = disk.with_changes(dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="statekv.serve"):
        with Running(state, statekv.VideoQA.from_options(other), options=other) as server, server.client() as client:
            assert client.get("/v1/streams").json()["data"][0]["state"] == "damaged"
            assert client.delete(f"/v1/streams/{stream_id}").status_code == 200
    assert sorted(path.name for path in elsewhere.iterdir() if path.name != "lock") == kept and file_set.is_symlink()
    (said,) = [r.getMessage() for r in caplog.records if "is a link" in r.getMessage()]
    assert stream_id in said and file_set.name in said and "remove them by hand" in said, said
