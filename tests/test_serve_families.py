"""The service over the other families' tiny checkpoints (most service tests run the built-in InternVL): a
Qwen3-VL stream, which encodes its frames in pairs, so a frame pushed may wait for its partner.

Each case says what the service did before.
"""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest

pytest.importorskip("httpx", reason="statekv[serve] and its test clients are part of .[test]")
pytest.importorskip("fastapi")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from test_hostile_service import Running  # noqa: E402 -- the in-process server

QUESTION = "What happens?"


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    checkpoint = tiny_checkpoint("qwen3_vl")
    return checkpoint, statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=64)


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)


def _push(client, stream_id: str, seed: int, t: float) -> dict:
    png = io.BytesIO()
    Image.fromarray(_image(seed)).save(png, format="PNG")
    pushed = client.post(f"/v1/streams/{stream_id}/frames?t={t}", content=png.getvalue(),
                         headers={"Content-Type": "image/png"})
    assert pushed.status_code == 200, pushed.text
    return pushed.json()


def test_an_answer_names_the_time_of_the_last_frame_it_read_not_of_one_waiting_for_its_partner(qwen, tmp_path):
    """Three frames pushed to a Qwen3-VL stream: the third waits for its partner, so an answer reads two frames,
    the last at 1 s, as a watch's event says. Before: the answer said 2.0 s, the time of the frame it had not
    read."""
    checkpoint, qa = qwen
    with Running(tmp_path / "state", qa, options=ModelOptions(model=str(checkpoint), budget=64)) as server, \
            server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": None}).json()["id"]
        watch = client.post(f"/v1/streams/{stream_id}/watches", json={"question": QUESTION, "every": 2,
                                                                      "max_new_tokens": 2}).json()["id"]
        for index in range(3):
            _push(client, stream_id, index, float(index))
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 2})
        assert asked.status_code == 200, asked.text
        events = client.get(f"/v1/streams/{stream_id}/watches/{watch}").json()["events"]
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2,
            "statekv": {"stream_id": stream_id}}).json()
    assert asked.json()["frames"] == 2 and asked.json()["seconds"] == 1.0, asked.json()
    assert [(event["frame"], event["seconds"]) for event in events] == [(2, 1.0)]
    assert chat["statekv"]["frames"] == 2 and chat["statekv"]["seconds"] == 1.0, chat["statekv"]


@pytest.mark.parametrize("times", [[0.0, 1.0, 2.0], [0.0, 1.0, 1.5]], ids=["waiting for its partner", "dropped"])
def test_a_disk_tier_stream_killed_after_a_save_with_a_frame_not_in_a_step_comes_back(qwen, tmp_path, times):
    """A disk-tier save (its file set made durable) when the last frame pushed is in no step: waiting for its
    Qwen3-VL partner, or dropped by max_fps. The server is killed after the next push; the start brings the stream
    back from its file set, says what it lost, and pushed again from resume_from it answers as the Python API
    does. Before: its record said the save held every frame pushed, more than its file set does, so the start
    quarantined the stream as damaged (409 to every request)."""
    checkpoint, qa = qwen
    tier, state, killed = tmp_path / "tier", tmp_path / "state", tmp_path / "killed"
    disk = ModelOptions(model=str(checkpoint), budget=64, offload="disk", offload_dir=str(tier))
    times = [*times, 7.0]
    with Running(state, qa, options=disk, save_every_frames=3) as server, server.client() as client:
        stream_id = client.post("/v1/streams", json={"max_fps": 1.0}).json()["id"]
        for index, t in enumerate(times):  # saved before the fourth push
            _push(client, stream_id, index, t)
        shutil.copytree(state, killed / "state")
        shutil.copytree(tier, killed / "tier")
    shutil.rmtree(state)
    shutil.rmtree(tier)
    shutil.move(killed / "state", state)
    shutil.move(killed / "tier", tier)
    with Running(state, qa, options=disk) as server, server.client() as client:
        info = client.get(f"/v1/streams/{stream_id}")
        assert info.status_code == 200, info.text
        assert info.json()["frames"] == 2 and info.json()["resume_from"] == 2, info.json()
        for index in range(info.json()["resume_from"], len(times)):
            _push(client, stream_id, index, times[index])
        asked = client.post(f"/v1/streams/{stream_id}/ask", json={"question": QUESTION, "max_new_tokens": 4})
    alone = qa.stream(max_fps=1.0)
    for index, t in enumerate(times):
        alone.push(_image(index), t)
    assert asked.status_code == 200 and asked.json()["answer"] == alone.ask(QUESTION, max_new_tokens=4), asked.text
    assert asked.json()["frames"] == alone.frames
