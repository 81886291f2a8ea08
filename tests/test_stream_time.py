"""The time a prompt shows: a frame's own, or, for a stream timed by another clock (an epoch's, a live camera's),
the seconds since its first frame, kept through a save, a load and the disk tier."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import statekv
from statekv.models import load_adapter
from statekv.testing import write_test_video
from conftest import random_frames, tiny_qa

EPOCH = 1.7e9  # a live camera's wall-clock seconds
QUESTION = "What happens in the video?"
FAMILIES = ["qwen3_vl", "eagle"]  # the families whose prompts show each frame's time


@pytest.fixture(scope="module", params=FAMILIES)
def qa(request, tiny_checkpoint):
    adapter = load_adapter(tiny_checkpoint(request.param), dtype=torch.float32, trust_remote_code=True)
    return tiny_qa(adapter)


def pushed(stream, frames, start: float, first: int = 0):
    for index, image in enumerate(frames):
        stream.push(image, start + first + index)
    return stream


def answer(stream) -> tuple[int, list[int]]:
    return stream.tokens, stream.ask_tokens(QUESTION, max_new_tokens=6).tolist()


def test_a_stream_on_an_epoch_clock_answers_as_one_timed_from_zero(qa):
    frames = random_frames(6)
    with qa.stream(horizon_frames=8, max_fps=None) as zero, qa.stream(horizon_frames=8, max_fps=None) as epoch:
        assert answer(pushed(epoch, frames, EPOCH)) == answer(pushed(zero, frames, 0.0))
        assert epoch.last_timestamp == EPOCH + 5  # what a stream reports stays on the pushing clock


@pytest.mark.parametrize("offload", [False, "disk"])
def test_a_resumed_epoch_stream_shows_the_times_of_an_uninterrupted_one(qa, tmp_path, offload):
    frames = random_frames(8)
    with qa.stream(horizon_frames=8, max_fps=None) as whole:
        expected = answer(pushed(whole, frames, EPOCH))
    settings = {"offload": "disk", "offload_dir": tmp_path / "tier"} if offload else {}
    moved = statekv.VideoQA(qa.adapter, qa.policy, attention="eager", reserve_tokens=40, **settings)
    first = pushed(moved.stream(horizon_frames=8, max_fps=None), frames[:4], EPOCH)
    if offload:
        first.sync()
        where = first.folder
    else:
        where = first.save(tmp_path / "s.safetensors")
    first.close()
    with statekv.Stream.load(where, moved) as resumed:
        assert answer(pushed(resumed, frames[4:], EPOCH, first=4)) == expected


def _without_origin(path):
    """The stream file at ``path`` as a statekv from before the origin was kept wrote it."""
    with safe_open(str(path), "pt") as opened:
        metadata = json.loads(opened.metadata()["statekv"])
    del metadata["state"]["extra"]["time_origin"]
    text = json.dumps(metadata)
    save_file(load_file(str(path)), str(path), metadata={"statekv": text,
                                                         "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})


def test_a_save_from_before_the_origin_was_kept_goes_on_counting_from_zero(qa, tmp_path):
    frames = random_frames(6)
    with qa.stream(horizon_frames=8, max_fps=None) as stream:
        path = pushed(stream, frames[:4], EPOCH).save(tmp_path / "s.safetensors")
        _without_origin(path)
        with statekv.Stream.load(path, qa) as old:
            before = old.tokens
            pushed(old, frames[4:], EPOCH, first=4).flush()
            pushed(stream, frames[4:], EPOCH, first=4).flush()
            # its prompt went on with the times it showed (epoch seconds: longer texts), and it answers
            assert old.tokens - before > stream.tokens - before
            assert old.ask(QUESTION, max_new_tokens=2) is not None


def test_an_encoded_file_shows_its_frames_own_times_as_the_models_processor_does(qa, tmp_path, monkeypatch):
    """A file is sampled at the centres of its parts, its first frame half a part in (here 0.5 s of a 4 s clip at
    1 fps): its prompt shows each frame's own time in the file, as Qwen3-VL's and Eagle's processors do for those
    frames (before, the times were counted from that first frame, every one shifted by 0.5 s)."""
    path = write_test_video(tmp_path / "clip.mp4", frames=8, fps=2.0, size=(64, 48))
    texts = []
    laid_out = qa.adapter.features_chunk

    def recorded(step, features, state):
        chunk = laid_out(step, features, state)
        texts.append(qa.adapter.tokenizer.decode(chunk.input_ids[0]))
        return chunk

    monkeypatch.setattr(qa.adapter, "features_chunk", recorded)
    with qa.encode(path, max_fps=1.0) as video:  # frames at 0.5, 1.5, 2.5 and 3.5 s
        assert video.frames == 4
    shown = [float(time) for text in texts for time in re.findall(r"<([0-9.]+) seconds>|sample at ([0-9.]+)s", text)
             for time in time if time]
    # Qwen3-VL: each pair's mean time; Eagle: each frame's
    assert shown == ([1.0, 3.0] if qa.adapter.frames_per_step == 2 else [0.5, 1.5, 2.5, 3.5])
