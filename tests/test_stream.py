"""Live streams on a tiny InternVL checkpoint: push/ask equals offline encoding, asking changes nothing,
save -> load -> continue is bit-identical, the horizon and bad input are refused without touching the stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statekv
from statekv import Stream
from statekv.api.recent import RecentFrames
from statekv.models import load_adapter
from statekv.settings.values import HIGHEST_FPS, LATEST_TIMESTAMP
from statekv.testing import make_tiny_checkpoint
from statekv.video import open_video

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapters(checkpoint):
    return {layout: load_adapter(checkpoint, layout=layout) for layout in ("paper", "chat")}


def _observe(encoded: statekv.EncodedVideo) -> list[torch.Tensor]:
    prefill = encoded.prefill
    tensors = [t for layer in prefill.detailed_cache.layers for t in (layer.keys, layer.values)]
    for layer in prefill.cache.layers:
        tensors += [*layer.carried(), layer.positions()]
    return [t.to("cpu").clone() for t in tensors]


def _identical(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_making_a_stream_streams_nothing_until_it_starts(adapters):
    qa = tiny_qa(adapters["chat"])  # the chat layout has a prompt prefix before the first frame
    made = Stream(qa, 3)  # every attribute is set by the time anything is streamed
    assert (made.started, made.tokens, made.stats.chunks, made.pushed) == (False, 0, 0, 0)
    started = qa.stream(horizon_frames=3)
    assert started.started and started.tokens == started.prefix_tokens > 0
    assert made.start() is made and made.start() is made  # the prefix is streamed once
    assert (made.tokens, made.stats.chunks) == (started.tokens, 1)
    lazy = Stream(qa, 3)  # pushing starts it
    for stream in (lazy, started):
        for frame in random_frames(2):
            stream.push(frame)
    assert _identical(_observe(lazy), _observe(started))
    assert torch.equal(lazy.ask_tokens(QUESTION, max_new_tokens=4), started.ask_tokens(QUESTION, max_new_tokens=4))


@pytest.mark.parametrize("layout", ["paper", "chat"])
@pytest.mark.parametrize("method", ["statekv", "recency"])
def test_pushing_frames_equals_offline_encoding(adapters, layout, method):
    qa = tiny_qa(adapters[layout], method)
    video = open_video(random_frames(10), fps=2)
    offline = qa.encode(video, max_fps=1)
    stream = qa.stream(horizon_frames=5)
    for frame in video.sample(max_fps=1):  # the same 5 frames, as a live source would deliver them
        assert stream.push(frame)
    assert (stream.frames, stream.tokens) == (offline.frames, offline.tokens)
    assert _identical(_observe(stream), _observe(offline))
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=6), offline.ask_tokens(QUESTION, max_new_tokens=6))


def test_asking_mid_stream_changes_nothing(adapters):
    qa = tiny_qa(adapters["chat"])
    frames = random_frames(6)
    quiet, asked = qa.stream(horizon_frames=6), qa.stream(horizon_frames=6)
    answers = []
    for t, image in enumerate(frames):
        quiet.push(image, float(t))
        asked.push(image, float(t))
        if t in (1, 3):
            answers.append(asked.ask(QUESTION, max_new_tokens=4))
            assert isinstance(answers[-1], str)
    assert _identical(_observe(asked), _observe(quiet)) and asked.state == quiet.state


@pytest.mark.parametrize("method", ["statekv", "recency", "full"])
def test_save_load_continue_is_bit_identical(adapters, tmp_path, method):
    qa = tiny_qa(adapters["paper"], method)
    frames = random_frames(7)
    whole = qa.stream(horizon_frames=7, max_fps=1)
    whole.push_many((image, float(t)) for t, image in enumerate(frames))

    first = qa.stream(horizon_frames=7, max_fps=1)
    first.push_many((image, float(t)) for t, image in enumerate(frames[:3]))
    path = first.save(tmp_path / "stream.safetensors")
    first.close()
    resumed = Stream.load(path, qa)
    assert (resumed.frames, resumed.tokens, resumed.pushed) == (3, first.tokens, 3)
    assert resumed.stats.frame_seconds == first.stats.frame_seconds
    resumed.push_many((image, float(t)) for t, image in enumerate(frames[3:], start=3))
    assert _identical(_observe(resumed), _observe(whole)) and resumed.state == whole.state
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6), whole.ask_tokens(QUESTION, max_new_tokens=6))


def test_max_fps_keeps_one_frame_per_tick(adapters):
    stream = tiny_qa(adapters["paper"]).stream(horizon_frames=4, max_fps=1)
    kept = [stream.push(image, t * 0.25) for t, image in enumerate(random_frames(13))]  # 4 fps for 3 s
    assert kept == [t % 4 == 0 for t in range(13)] and stream.frames == 4 and stream.pushed == 13


def test_default_timestamps_follow_max_fps(adapters):
    stream = tiny_qa(adapters["paper"]).stream(horizon_frames=3, max_fps=2)
    assert all(stream.push(image) for image in random_frames(3)) and stream.last_timestamp == 1.0


def test_numpy_timestamps_are_taken_as_numbers(adapters):
    """Before: ``np.arange``'s times were refused as "not a finite number"."""
    stream = tiny_qa(adapters["paper"]).stream(horizon_frames=3, max_fps=1)
    times = [np.int64(0), np.float32(1.0), np.float64(2.5)]
    assert all(stream.push(image, seconds) for image, seconds in zip(random_frames(3), times))
    assert stream.last_timestamp == 2.5 and type(stream.last_timestamp) is float
    with pytest.raises(statekv.InputError, match="finite number"):
        stream.push(random_frames(1)[0], np.float64("nan"))


def test_pushing_past_the_horizon_fails_before_touching_the_stream(adapters):
    stream = tiny_qa(adapters["paper"]).stream(horizon_frames=2)
    stream.push_many((image, float(t)) for t, image in enumerate(random_frames(2)))
    before = _observe(stream)
    with pytest.raises(statekv.HorizonError, match="horizon_frames") as info:
        stream.push(random_frames(1)[0], 5.0)
    assert "\n" not in str(info.value)
    assert _identical(_observe(stream), before) and stream.frames == 2 and stream.pushed == 2
    assert stream.ask(QUESTION, max_new_tokens=2) is not None


def test_a_failed_step_leaves_the_stream_unchanged(adapters, monkeypatch):
    stream = tiny_qa(adapters["paper"]).stream(horizon_frames=3)
    stream.push(random_frames(1)[0], 0.0)
    before, state = _observe(stream), stream.state

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(stream.prefill.decoder.layers[1].mlp, "forward", broken)
    with pytest.raises(RuntimeError):
        stream.push(random_frames(1, seed=1)[0], 1.0)
    monkeypatch.undo()
    assert _identical(_observe(stream), before) and stream.state == state and not stream.pending
    assert stream.pushed == 1 and stream.push(random_frames(1, seed=1)[0], 1.0)


def test_bad_pushes_and_loads(adapters, tmp_path):
    qa = tiny_qa(adapters["paper"])
    stream = qa.stream(horizon_frames=3)
    stream.push(random_frames(1)[0], 2.0)
    with pytest.raises(statekv.InputError, match="non-decreasing"):
        stream.push(random_frames(1)[0], 1.0)
    with pytest.raises(statekv.InputError, match="RGB uint8"):
        stream.push(np.zeros((4, 4), np.float32), 3.0)
    for bad in (0, -1, 2.5):
        with pytest.raises(statekv.InputError, match="horizon_frames"):
            qa.stream(horizon_frames=bad)
    with pytest.raises(statekv.InputError, match="max_fps"):
        qa.stream(horizon_frames=2, max_fps=0)
    for make in (qa.stream, lambda frames, max_fps: RecentFrames(qa, frames, max_fps=max_fps)):
        for rate in (4.0000001e7, 1e20, 10**400):  # above HIGHEST_FPS, however little
            with pytest.raises(statekv.InputError, match=r"max_fps must be a number above 0 and at most 4e\+07"):
                make(2, max_fps=rate)
    fastest = qa.stream(horizon_frames=2, max_fps=HIGHEST_FPS)  # the latest time a stream takes has its tick
    assert fastest.push(random_frames(1)[0], LATEST_TIMESTAMP) and fastest.next_tick < 2**62
    with Stream.load(fastest.save(tmp_path / "fastest.safetensors"), qa) as loaded:
        assert loaded.next_tick == fastest.next_tick and loaded.max_fps == HIGHEST_FPS
    with pytest.raises(statekv.InputError, match="no such saved stream"):
        Stream.load(tmp_path / "missing.safetensors", qa)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(statekv.InputError, match="not a saved statekv stream"):
        Stream.load(junk, qa)
    path = stream.save(tmp_path / "s.safetensors")
    with pytest.raises(statekv.InputError, match="StateKV"):
        Stream.load(path, tiny_qa(adapters["paper"], "full"))
    with pytest.raises(statekv.InputError, match="layout"):
        Stream.load(path, tiny_qa(adapters["chat"]))


def test_offload_keeps_the_detailed_cache_in_cpu_memory_and_answers_the_same(adapters):
    frames = random_frames(4)
    resident = tiny_qa(adapters["chat"]).encode(frames)
    offloaded = tiny_qa(adapters["chat"], offload=True).encode(frames)
    for layer in offloaded.prefill.cache.layers:
        assert layer.detailed.keys.device.type == "cpu" and layer.carried()[0].device == offloaded.adapter.device
    assert torch.equal(offloaded.ask_tokens(QUESTION, max_new_tokens=6), resident.ask_tokens(QUESTION, max_new_tokens=6))


def test_two_frame_steps_wait_for_their_pair_and_survive_save_load(tmp_path):
    """Qwen3-VL streams one temporal patch (two frames) per step: an odd frame waits, also across a save."""
    checkpoint = make_tiny_checkpoint("qwen3_vl", tmp_path / "qwen")
    qa = statekv.VideoQA(load_adapter(checkpoint), statekv.StateKV(budget=10), attention="eager", reserve_tokens=40)
    frames = random_frames(7)
    whole = qa.stream(horizon_frames=7)
    whole.push_many((image, float(t)) for t, image in enumerate(frames))
    assert (whole.frames, len(whole.pending)) == (6, 1)
    whole.flush()
    assert (whole.frames, len(whole.pending)) == (7, 0)

    first = qa.stream(horizon_frames=7)
    first.push_many((image, float(t)) for t, image in enumerate(frames[:3]))
    assert (first.frames, len(first.pending)) == (2, 1)
    resumed = Stream.load(first.save(tmp_path / "qwen.safetensors"), qa)
    assert len(resumed.pending) == 1 and np.array_equal(resumed.pending[0].image, frames[2])
    resumed.push_many((image, float(t)) for t, image in enumerate(frames[3:], start=3))
    resumed.flush()
    assert _identical(_observe(resumed), _observe(whole)) and resumed.state == whole.state


    # Pushed with the offline encoding's vision batches (two steps per vision call), a stream is bit-identical
    video = open_video(random_frames(14), fps=2)  # sampled at 1 fps: 7 distinct frames
    offline = qa.encode(video, max_fps=1, vision_batch=4)
    live = qa.stream(horizon_frames=7, vision_batch=4)
    live.push_many(video.sample(max_fps=1))
    assert (live.frames, len(live.pending)) == (4, 3)  # the second batch waits for its fourth frame
    live.flush()
    assert offline.frames == live.frames == 7 and _identical(_observe(live), _observe(offline))
    assert torch.equal(live.ask_tokens(QUESTION, max_new_tokens=4), offline.ask_tokens(QUESTION, max_new_tokens=4))
