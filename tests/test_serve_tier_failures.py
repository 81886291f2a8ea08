"""A server on the disk tier whose offload folder (--offload-dir, the streams' file sets) fails while the state
folder is sound: the refusal names the folder that failed, alone or as a replica of several."""

from __future__ import annotations

import errno
import io
import logging
import os

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402

from conftest import random_frames  # noqa: E402


HEADERS = {"Authorization": "Bearer key"}


def _png(image) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def failing_once(monkeypatch, folder) -> list[bool]:
    """The device under ``folder`` failing the first fsync there (EIO) once armed (``armed[0] = True``), as
    Linux's: its pages clean after it."""
    fsync, armed = os.fsync, [False]

    def fsync_or_fail(fd):
        if armed[0] and os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            armed[0] = False
            raise OSError(errno.EIO, "Input/output error")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_or_fail)
    return armed


def push_png(client, stream_id: str, index: int, frame: bytes):
    return client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=frame,
                       headers={**HEADERS, "Content-Type": "image/png"})


def pushed_till_force_failed(client, stream_id: str, frames: list[bytes], armed: list[bool]) -> None:
    """Three frames pushed, then a fourth whose save meets the failed force (503)."""
    for index in range(3):
        assert push_png(client, stream_id, index, frames[index]).status_code == 200
    armed[0] = True
    assert push_png(client, stream_id, 3, frames[3]).status_code == 503


@pytest.mark.parametrize("replica", [False, True])
def test_a_push_refused_because_the_offload_folder_fails_names_that_folder(tmp_path, monkeypatch, replica):
    """Before: the 503 said to push again once the state folder (or the object store) can be written, a folder
    that was sound, while the offload folder was the one failing."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                         save_every_frames=1)  # a save before each push after the first
    fsync, failing = os.fsync, [False]

    def fsync_or_fail(fd):  # the device under the offload folder failing, the state folder's sound
        if any(failing) and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "tier")):
            raise OSError(errno.EIO, "Input/output error")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_or_fail)
    hosting = {"hosting": ReplicaHosting(config, "first", lease_seconds=60)} if replica else {}
    headers = {"Authorization": "Bearer key"}
    frames = [_png(image) for image in random_frames(2, 31, 48, 64)]
    with TestClient(create_app(config, qa=qa, **hosting)) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
        pushed = []
        for index, frame in enumerate(frames):
            failing[:] = [index == 1]
            pushed.append(client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=frame,
                                      headers={**headers, "Content-Type": "image/png"}))
        failing.clear()
    assert pushed[0].status_code == 200 and pushed[1].status_code == 503, pushed[1].text
    message = pushed[1].json()["error"]["message"]
    assert "brings it back from its offload folder" in message, message  # a force failed: it is never saved again
    assert "state folder" not in message and str(tmp_path) not in message


@pytest.mark.parametrize("fails", ["in a save", "in a step's checkpoint"])
def test_a_stream_whose_force_failed_is_brought_back_from_its_folder(tmp_path, monkeypatch, fails):
    """Before: every later push answered 503 "push the frame again once the offload folder can be written", for
    good, though the stream would never checkpoint again (its force failed once: `DiskTier.force_failed`). Now the
    server brings it back from its folder at its last checkpoint forced, and the client is told where to push again
    from (409, ``resume_from``)."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app

    if fails == "in a step's checkpoint":  # else only saves checkpoint: the frame after the last save is lost
        monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 2)
    qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                         save_every_frames=100 if fails == "in a step's checkpoint" else 1)
    failing = failing_once(monkeypatch, tmp_path / "tier")
    headers = HEADERS
    frames = [_png(image) for image in random_frames(8, 31, 48, 64)]
    with TestClient(create_app(config, qa=qa)) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16}, headers=headers).json()["id"]

        def push(index: int):
            return push_png(client, stream_id, index, frames[index])

        for index in range(3):
            assert push(index).status_code == 200
        failing[0] = True
        index, answer = 3, push(3)
        while answer.status_code == 200 and index < 5:  # up to a step due a checkpoint
            index, answer = index + 1, push(index + 1)
        first = answer.json()["error"]["message"]
        assert answer.status_code == 503 and "\n" not in first, first
        assert "brings it back from its offload folder at its last checkpoint forced to the device" in first
        again = push(index)
        assert again.status_code == 409, again.text
        resume_from = client.get(f"/v1/streams/{stream_id}", headers=headers).json()["resume_from"]
        assert f"push again from frame {resume_from} (resume_from)" in again.json()["error"]["message"]
        assert resume_from < index
        for index in range(resume_from, len(frames)):
            assert push(index).status_code == 200
        described = client.get(f"/v1/streams/{stream_id}", headers=headers).json()
    assert (described["frames"], described["pushed"], described["save_error"]) == (len(frames), len(frames), None)


def test_a_server_stopping_with_a_stream_whose_force_failed_says_so_once_and_the_next_start_resumes_it(
        tmp_path, monkeypatch, caplog):
    """Before: the stop tried to save the stream, which can never be saved again (its force failed), and then to
    close it, whose checkpoint is refused as expected: two errors, the second "cannot close stream" as if something
    else failed. Now one line says its files could not be forced and that the next start resumes it from its folder
    at its last checkpoint forced; the next start does."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app

    def served():
        qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
        config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                             save_every_frames=1)
        return TestClient(create_app(config, qa=qa))

    failing = failing_once(monkeypatch, tmp_path / "tier")
    headers = HEADERS
    frames = [_png(image) for image in random_frames(4, 31, 48, 64)]
    with served() as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16}, headers=headers).json()["id"]
        pushed_till_force_failed(client, stream_id, frames, failing)
        caplog.clear()
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and stream_id in errors[0], errors
    assert "could not be forced to the device" in errors[0] and "at its last checkpoint forced" in errors[0]
    with served() as client:
        described = client.get(f"/v1/streams/{stream_id}", headers=headers).json()
    assert (described["frames"], described["resume_from"], described["lost"]["pushed"]) == (2, 2, 1), described


def test_a_stream_brought_back_after_its_force_failed_is_no_longer_counted_unsaved(tmp_path, monkeypatch):
    """Before: the save that met the failed force stayed the stream's ``save_error``, and it was counted in
    statekv_streams_unsaved, once it was brought back at its last checkpoint forced (its record and folder agreeing,
    nothing unsaved), until a later push saved it: for good on a stream pushed no more. Now it is saved as it is."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app

    qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                         save_every_frames=1)
    failing = failing_once(monkeypatch, tmp_path / "tier")
    headers = HEADERS
    frames = [_png(image) for image in random_frames(4, 31, 48, 64)]
    with TestClient(create_app(config, qa=qa)) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16}, headers=headers).json()["id"]
        pushed_till_force_failed(client, stream_id, frames, failing)
        described = client.get(f"/v1/streams/{stream_id}", headers=headers).json()  # brought back
        metrics = client.get("/metrics").text.splitlines()
    assert (described["frames"], described["pushed"], described["save_error"]) == (2, 2, None), described
    assert "statekv_streams_unsaved 0.0" in metrics


def test_a_feed_whose_push_met_a_failed_force_does_not_save_and_says_how_a_feed_goes_on(tmp_path, monkeypatch,
                                                                                           caplog):
    """Before: the feed whose push met the failed force then saved what it pushed, a save certain to fail (its tier
    refuses every sync after the failure): a second "cannot save stream" error and a second save failure counted;
    and its client was told to "push this frame again", which a feed's client has no frame to do. Now it does not
    save, and says to feed the file again from the frames of it the stream holds once brought back (``skip``)."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.testing.videos import write_test_video

    media = tmp_path / "media"
    media.mkdir()
    write_test_video(media / "v.mp4", frames=8, fps=4)
    qa = statekv.VideoQA.from_pretrained("builtin", budget=64, offload="disk", offload_dir=str(tmp_path / "tier"))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                         save_every_frames=2, media_root=media)
    fsync, forced, failing_at = os.fsync, [0], [None]

    def fsync_or_fail(fd):  # the device under the offload folder failing once, a few frames into the feed
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "tier")):
            forced[0] += 1
            if forced[0] == failing_at[0]:
                raise OSError(errno.EIO, "Input/output error")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_or_fail)
    headers = {"Authorization": "Bearer key"}
    with TestClient(create_app(config, qa=qa)) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16, "max_fps": None},
                                headers=headers).json()["id"]
        assert client.post(f"/v1/streams/{stream_id}/frames?t=0", content=_png(random_frames(1, 31, 48, 64)[0]),
                           headers={**headers, "Content-Type": "image/png"}).status_code == 200
        caplog.clear()
        failing_at[0] = forced[0] + 40  # in a save a few frames into the feed
        fed = client.post(f"/v1/streams/{stream_id}/frames", json={"source": "v.mp4", "t": 1}, headers=headers)
        errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
        failures = [line for line in client.get("/metrics").text.splitlines()
                    if line.startswith("statekv_save_failures_total")]
        resume_from = client.get(f"/v1/streams/{stream_id}", headers=headers).json()["resume_from"]  # brought back
        again = [client.post(f"/v1/streams/{stream_id}/frames", json={"source": "v.mp4", "skip": resume_from - 1},
                             headers=headers) for _ in range(2)]  # as it says: refused once (409), then fed
    assert fed.status_code == 503 and len(errors) == 1 and failures == ["statekv_save_failures_total 1.0"], errors
    message = fed.json()["error"]["message"]
    assert "push this frame again" not in message, message
    assert 'send {"source": "v.mp4", "skip": N} to go on, N being its resume_from less 1' in message, message
    assert 1 < resume_from < 9 and again[0].status_code == 409, again[0].text
    assert again[1].status_code == 200 and again[1].json()["frames"] == 9, again[1].text


def test_a_stream_whose_successor_force_failed_is_brought_back_and_hands_over(tmp_path, monkeypatch):
    """Before: a force of a handover stream's successor's files that failed made every later replay checkpoint of
    the successor fail (its tier refuses them), the handover put off again and again till the successor was dropped:
    the stream passed the model's range without it, for good. Now the stream is brought back from its folder, which
    rebuilds its successor from its backlog, and it hands over as ever."""
    from pathlib import Path

    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "ckpt", text_config=short,
                                      vision_config={"image_size": 112})
    tier = tmp_path / "tier"
    qa = statekv.VideoQA.from_pretrained(checkpoint, budget=24, reserve_tokens=24, attention="eager", offload="disk",
                                         offload_dir=str(tier))
    config = ServeConfig(options=qa.options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                         save_every_frames=4)
    fsync, journaled, failed = os.fsync, [False], []

    def fsync_or_fail(fd):  # a successor's file (in its stream's folder) failing once, after its first checkpoint
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if tier in path.parents and len(path.relative_to(tier).parts) == 3 and not path.name.endswith(".partial"):
            if journaled[0] and not failed and path.name.startswith("layer"):  # its next checkpoint's
                failed.append(path.name)
                raise OSError(errno.EIO, "Input/output error")
            journaled[0] = journaled[0] or path.name == "journal"
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_or_fail)
    headers = {"Authorization": "Bearer key"}
    frames = [_png(image) for image in random_frames(40, seed=3, height=32, width=32)]
    with TestClient(create_app(config, qa=qa)) as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": None}, headers=headers).json()["id"]

        def push(index: int):
            return client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=frames[index],
                               headers={**headers, "Content-Type": "image/png"})

        index = 0
        while not failed and index < len(frames):
            assert push(index).status_code == 200
            index += 1
        assert failed and index < 30, index  # in the successor's replay, before the handover
        brought_back = client.get(f"/v1/streams/{stream_id}", headers=headers).json()
        assert brought_back["resume_from"] == index and brought_back["lost"] is None  # its own files were sound
        for index in range(index, index + 10):
            assert push(index).status_code == 200
        described = client.get(f"/v1/streams/{stream_id}", headers=headers).json()
    assert described["handover"] == "handed over", described["handover"]
