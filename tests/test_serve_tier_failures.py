"""A server on the disk tier whose offload folder (--offload-dir, the streams' file sets) fails while the state
folder is sound: the refusal names the folder that failed, alone or as a replica of several."""

from __future__ import annotations

import errno
import io
import os

import pytest

pytest.importorskip("fastapi")

import statekv  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402

from conftest import random_frames  # noqa: E402


def _png(image) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


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
    assert message.endswith("push the frame again once the offload folder (--offload-dir) can be written"), message
    assert "state folder" not in message and str(tmp_path) not in message
