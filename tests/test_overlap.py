"""The overlapped encoder: decoding, batched vision and the language model on three threads.

Batched vision must give every family's per-step features (fp32, 1e-5) and the same answers; the stages must
run where they are meant to, in batches fixed by the frame order; and no thread may outlive an encoding,
whether it ends normally, fails, or is interrupted.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import statekv
import bad_videos
from statekv.background import ThreadStages
from statekv.stopping import Stopped, signals_stop_like_ctrl_c
from statekv.models import load_adapter
from statekv.steps.overlap import default_vision_batch
from statekv.testing import draw_test_frame
from statekv.video import Frame, FrameDecodeError, open_video

from conftest import tiny_qa

QUESTION = "What is shown?"
FAMILIES = ("internvl", "qwen3_vl", "eagle")
POLICY = statekv.StateKV(budget=24)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return {family: load_adapter(path, trust_remote_code=family == "eagle", dtype=torch.float32)
            for family, path in checkpoints.items()}


def _video(frames: int, size: tuple[int, int] = (128, 128)) -> np.ndarray:
    """Frames Qwen3-VL keeps at 128x128 (16 tokens per step, as the others get per frame)."""
    return np.stack([draw_test_frame(i, size) for i in range(frames)])


def _encode_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("statekv-encode")]


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------
# Batched vision equals per-step vision, for every family
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_vision_equals_per_step_vision(adapters, family):
    adapter = adapters[family]
    frames = [Frame(i, i / 2, image) for i, image in enumerate(_video(7))]  # odd: Qwen3-VL's last step is alone
    per_step = adapter.frames_per_step
    state, steps = adapter.start(len(frames)), []
    for start in range(0, len(frames), per_step):
        steps.append(adapter.prepare_frames(frames[start:start + per_step], state))
        state = state.updated(steps[-1].state_update)
    batched = adapter.encode_vision(steps)
    alone = [adapter.encode_vision([step])[0] for step in steps]
    assert len(batched) == len(steps) == -(-7 // per_step)
    for together, single in zip(batched, alone):
        assert together.embeds.shape == single.embeds.shape and together.embeds.shape[0] == 16
        torch.testing.assert_close(together.embeds, single.embeds, rtol=1e-5, atol=1e-5)
        assert len(together.deepstack) == len(single.deepstack) == (2 if family == "qwen3_vl" else 0)
        for a, b in zip(together.deepstack, single.deepstack):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_encoding_gives_the_per_frame_answers(adapters, family, monkeypatch):
    adapter = adapters[family]
    qa = tiny_qa(adapter, POLICY)
    calls = []
    encode_vision = adapter.encode_vision
    monkeypatch.setattr(adapter, "encode_vision", lambda steps: calls.append(len(steps)) or encode_vision(steps))
    video = _video(9)
    one_by_one = qa.encode(video, vision_batch=1)
    assert calls == [1] * (-(-9 // adapter.frames_per_step))
    calls.clear()
    batched = qa.encode(video, vision_batch=4)
    # Batches of 4 frames: 4 + 4 + 1 InternVL frames; 2 + 2 + 1 Qwen3-VL steps of 2 frames (the last alone)
    assert calls == ([4, 4, 1] if adapter.frames_per_step == 1 else [2, 2, 1])
    assert (batched.frames, batched.tokens) == (one_by_one.frames, one_by_one.tokens) and batched.stats.vision_batch == 4
    for a, b in zip(batched.prefill.detailed_cache.layers, one_by_one.prefill.detailed_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    assert torch.equal(batched.ask_tokens(QUESTION, max_new_tokens=6), one_by_one.ask_tokens(QUESTION, max_new_tokens=6))


def test_stages_run_on_their_own_threads(adapters, monkeypatch):
    adapter = adapters["internvl"]
    threads = {"prepare": set(), "vision": set(), "layout": set()}

    def recorded(name, method):
        def call(*args):
            threads[name].add(threading.current_thread().name)
            return method(*args)
        return call

    monkeypatch.setattr(adapter, "prepare_frames", recorded("prepare", adapter.prepare_frames))
    monkeypatch.setattr(adapter, "encode_vision", recorded("vision", adapter.encode_vision))
    monkeypatch.setattr(adapter, "features_chunk", recorded("layout", adapter.features_chunk))
    encoded = tiny_qa(adapter, POLICY).encode(_video(6), vision_batch=2)
    assert threads == {"prepare": {"statekv-encode-decode"}, "vision": {"statekv-encode-vision"},
                       "layout": {threading.current_thread().name}}
    assert _encode_threads() == [] and encoded.frames == 6


def test_default_vision_batch_depends_on_the_device(adapters):
    assert default_vision_batch("cpu") == 4 and default_vision_batch(torch.device("cuda", 1)) == 16
    assert tiny_qa(adapters["internvl"], POLICY).vision_batch == 4


# ---------------------------------------------------------------------------------------------------
# Stage timings
# ---------------------------------------------------------------------------------------------------


def test_stats_split_each_frame_by_stage(adapters):
    seen = []
    started = time.perf_counter()
    encoded = tiny_qa(adapters["internvl"], POLICY).encode(_video(6), vision_batch=4,
                                               progress=lambda done, planned: seen.append(done))
    wall = time.perf_counter() - started
    stats = encoded.stats
    assert seen == [1, 2, 3, 4, 5, 6] and stats.vision_batch == 4
    for values in (stats.frame_seconds, stats.decode_seconds, stats.vision_seconds, stats.language_seconds):
        assert len(values) == 6 and all(value > 0 for value in values)
    assert stats.seconds <= wall and stats.frames_per_second == pytest.approx(6 / stats.seconds)
    # the frames of one vision batch share its time equally
    assert stats.vision_seconds[0] == stats.vision_seconds[3] and stats.vision_seconds[4] == stats.vision_seconds[5]
    summary = stats.summary()
    assert "frames/s" in summary and all(f"{stage} " in summary for stage in ("decode", "vision", "language"))
    document = stats.to_dict()
    assert set(document["mean_stage_seconds"]) == {"decode", "vision", "language"}


# ---------------------------------------------------------------------------------------------------
# Live streams
# ---------------------------------------------------------------------------------------------------


def test_a_stream_frame_waits_for_at_most_one_batch_and_ask_encodes_waiting_steps(adapters):
    qa = tiny_qa(adapters["internvl"], POLICY)
    frames = _video(5)
    batched, single = qa.stream(horizon_frames=8, vision_batch=3), qa.stream(horizon_frames=8)
    waiting = []
    for t, image in enumerate(frames):
        batched.push(image, float(t))
        single.push(image, float(t))
        waiting.append(len(batched.pending))
        assert single.pending == []
    assert waiting == [1, 2, 0, 1, 2] and batched.frames == 3
    answer = batched.ask_tokens(QUESTION, max_new_tokens=6)  # encodes the two waiting frames first
    assert batched.frames == 5 and batched.pending == []
    assert torch.equal(answer, single.ask_tokens(QUESTION, max_new_tokens=6))


def test_a_two_frame_step_still_waits_for_its_pair_when_asked(adapters):
    qa = tiny_qa(adapters["qwen3_vl"], POLICY)
    stream = qa.stream(horizon_frames=8, vision_batch=4)
    stream.push_many((image, float(t)) for t, image in enumerate(_video(3)))
    assert (stream.frames, len(stream.pending)) == (0, 3)
    stream.ask(QUESTION, max_new_tokens=2)  # the complete step goes in; the lone frame waits for its partner
    assert (stream.frames, len(stream.pending)) == (2, 1)


# ---------------------------------------------------------------------------------------------------
# Failures: named frames, nothing encoded lost, no thread left behind
# ---------------------------------------------------------------------------------------------------


def _folder_with_a_broken_frame(folder, frames: int, broken: int):
    for index, image in enumerate(_video(frames)):
        Image.fromarray(image).save(folder / f"frame_{index}.png")
    (folder / f"frame_{broken}.png").write_bytes(b"not a png" * 20)
    return folder


def test_a_frame_that_fails_to_decode_is_named_and_the_frames_before_it_stay_encoded(adapters, tmp_path):
    source = _folder_with_a_broken_frame(tmp_path, frames=8, broken=5)
    with pytest.raises(FrameDecodeError) as info:
        tiny_qa(adapters["internvl"], POLICY).encode(source, vision_batch=4)
    before = sum(index < 5 for index in open_video(source).sample_indices())  # the sampler may repeat a frame
    message = _one_line(info.value)
    assert "frame 5 (at 5.00 s)" in message and "not a readable image" in message
    assert f"the {before} sampled frames before it are encoded" in message
    assert (info.value.index, info.value.timestamp) == (5, 5.0)
    encoded = info.value.encoded
    assert encoded.frames == before >= 5  # the last of them shared a vision batch with the broken frame
    assert encoded.ask_tokens(QUESTION, max_new_tokens=3).shape[1] >= 1
    assert _encode_threads() == []


def test_a_file_cut_in_the_middle_keeps_what_was_encoded(adapters, tmp_path):
    path = bad_videos.cut_after_header(tmp_path, frames=40, fps=4, keep=0.6)
    with pytest.raises(FrameDecodeError, match=r"frame \d+ \(at about [\d.]+ s\)") as info:
        tiny_qa(adapters["internvl"], POLICY).encode(path, max_fps=4, max_frames=40)
    _one_line(info.value)
    assert 0 < info.value.encoded.frames <= info.value.index < 40 and _encode_threads() == []


@pytest.mark.parametrize("where", ["prepare", "vision", "language", "ctrl-c"])
def test_no_thread_outlives_a_failed_or_interrupted_encoding(adapters, monkeypatch, where):
    adapter = adapters["internvl"]
    qa = tiny_qa(adapter, POLICY)
    failure = KeyboardInterrupt if where == "ctrl-c" else RuntimeError
    calls = []

    def fail_on_third(method):
        def call(*args):
            calls.append(1)
            if len(calls) == 3:
                raise failure(where)
            return method(*args)
        return call

    progress = lambda done, planned: None  # noqa: E731
    if where == "prepare":
        monkeypatch.setattr(adapter, "prepare_frames", fail_on_third(adapter.prepare_frames))
    elif where == "vision":
        monkeypatch.setattr(adapter, "encode_vision", fail_on_third(adapter.encode_vision))
    elif where == "language":
        monkeypatch.setattr(adapter, "features_chunk", fail_on_third(adapter.features_chunk))
    else:
        progress = fail_on_third(lambda done, planned: None)  # as if Ctrl-C arrived while streaming frame 3
    with pytest.raises(failure, match=where):
        qa.encode(_video(40), max_frames=40, vision_batch=2, progress=progress)
    assert _encode_threads() == []


def test_stages_are_bounded_and_a_failure_arrives_after_the_items_before_it():
    produced, received = [], []

    def source(_upstream, emit):
        for index in range(30):
            produced.append(index)
            emit(index)
        raise ValueError("broken at 30")

    with ThreadStages("test-stages") as stages:
        doubled = stages.add(lambda upstream, emit: [emit(2 * item) for item in upstream],
                             stages.add(source, None, maxsize=2, name="source"), maxsize=2, name="double")
        with pytest.raises(ValueError, match="broken at 30"):
            for item in doubled:
                time.sleep(0.002)
                # at most: 2 queued in each stage, 1 held by each stage, 1 held here
                assert len(produced) - len(received) <= 2 + 2 + 1 + 1 + 1
                received.append(item)
    assert received == [2 * index for index in range(30)] and stages.alive == 0


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="sends itself SIGTERM")
def test_a_stop_asked_while_a_stage_starts_leaves_no_thread_it_cannot_join(monkeypatch):
    start = threading.Thread.start

    def signalled_start(thread):  # the signal's handler runs before the stage's thread has started
        if thread.name == "test-stage":
            os.kill(os.getpid(), signal.SIGTERM)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", signalled_start)
    with signals_stop_like_ctrl_c(), pytest.raises(Stopped):
        with ThreadStages("test") as stages:
            stages.add(lambda upstream, emit: emit(1), None, maxsize=1, name="stage")
    assert stages.alive == 0


def test_closing_stages_stops_a_producer_blocked_on_a_full_queue():
    def endless(_upstream, emit):
        index = 0
        while True:
            emit(index)
            index += 1

    started = time.perf_counter()
    with ThreadStages("test-stop") as stages:
        items = stages.add(endless, None, maxsize=1, name="endless")
        assert next(items) == 0
    assert stages.alive == 0 and time.perf_counter() - started < 5


# ---------------------------------------------------------------------------------------------------
# Bad settings: one line each
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"], ids=repr)
def test_vision_batch_must_be_a_positive_integer(adapters, checkpoints, bad):
    adapter = adapters["internvl"]
    attempts = [lambda: tiny_qa(adapter, POLICY, vision_batch=bad),
                lambda: tiny_qa(adapter, POLICY).encode(_video(2), vision_batch=bad),
                lambda: tiny_qa(adapter, POLICY).stream(horizon_frames=4, vision_batch=bad),
                lambda: statekv.VideoQA.from_pretrained(checkpoints["internvl"], vision_batch=bad)]
    for attempt in attempts:
        with pytest.raises(statekv.ConfigurationError, match="vision_batch must be a positive integer") as info:
            attempt()
        _one_line(info.value)
