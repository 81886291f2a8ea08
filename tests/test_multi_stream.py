"""Many streams of one VideoQA stepped together (`VideoQA.push_many`, pushes from threads): every stream ends
exactly as it does pushed alone (carried positions and greedy answers identical, float32 tensors within
rounding), for StateKV, recency and ReKV on tiny InternVL and Qwen3-VL checkpoints; a bad frame fails alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import statekv
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
FRAMES = 12
POLICIES = {"statekv": lambda: statekv.StateKV(budget=12), "recency": lambda: statekv.Recency(frames=2),
            "rekv": lambda: statekv.ReKV(frames=2, sinks=2)}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint):
    return {family: load_adapter(tiny_checkpoint(family))
            for family in ("internvl", "qwen3_vl")}


def _observe(stream) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(float tensors: the detailed cache and carried keys/values; integer tensors: carried positions)."""
    prefill = stream.prefill
    floats = [t for layer in prefill.detailed_cache.layers for t in (layer.keys, layer.values)]
    floats += [t for layer in prefill.cache.layers for t in layer.carried()]
    return [t.clone() for t in floats], [layer.positions().clone() for layer in prefill.cache.layers]


def _assert_same(stream, alone) -> None:
    (floats, positions), (floats_alone, positions_alone) = _observe(stream), _observe(alone)
    assert (stream.frames, stream.tokens, stream.state) == (alone.frames, alone.tokens, alone.state)
    assert len(positions) == len(positions_alone)
    assert all(torch.equal(a, b) for a, b in zip(positions, positions_alone))
    for a, b in zip(floats, floats_alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=6), alone.ask_tokens(QUESTION, max_new_tokens=6))


def _alone(qa, frames) -> statekv.Stream:
    stream = qa.stream(horizon_frames=FRAMES)
    for second, image in enumerate(frames):
        stream.push(image, float(second))
    stream.flush()
    return stream


@pytest.mark.parametrize("family", ["internvl", "qwen3_vl"])
@pytest.mark.parametrize("method", ["statekv", "recency", "rekv"])
def test_push_many_steps_streams_together_and_each_ends_as_alone(adapters, family, method):
    """Four streams; the third joins at frame 2, the first leaves after frame 7."""
    qa = tiny_qa(adapters[family], POLICIES[method]())
    videos = [random_frames(FRAMES, seed) for seed in range(4)]
    joins, leaves = [0, 0, 2, 0], [8, FRAMES, FRAMES, FRAMES]
    streams = [qa.stream(horizon_frames=FRAMES) for _ in videos]
    for tick in range(FRAMES):
        items = [(streams[s], videos[s][tick - joins[s]], float(tick - joins[s]))
                 for s in range(4) if joins[s] <= tick < leaves[s]]
        assert qa.push_many(items) == [True] * len(items)
    for stream in streams:
        stream.flush()
    assert qa.step_scheduler.batched_steps >= 2  # steady steps were shared
    for s, stream in enumerate(streams):
        _assert_same(stream, _alone(qa, videos[s][:leaves[s] - joins[s]]))


@pytest.mark.parametrize("family", ["internvl", "qwen3_vl"])
def test_pushes_from_threads_share_steps_and_each_stream_ends_as_alone(adapters, family):
    qa = tiny_qa(adapters[family], POLICIES["statekv"]())
    videos = [random_frames(FRAMES, 10 + seed) for seed in range(4)]
    streams = [qa.stream(horizon_frames=FRAMES) for _ in videos]
    errors = []
    start = threading.Barrier(len(streams))

    def push(index: int) -> None:
        try:
            for second, image in enumerate(videos[index]):
                start.wait()
                assert streams[index].push(image, float(second))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=push, args=(index,)) for index in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert qa.step_scheduler.batched_steps >= 1  # some pushes from different threads shared a forward
    for stream, frames in zip(streams, videos):
        stream.flush()
        _assert_same(stream, _alone(qa, frames))


def test_a_bad_frame_fails_alone_and_the_other_streams_go_on(adapters, monkeypatch):
    adapter = adapters["internvl"]
    qa = tiny_qa(adapter, POLICIES["statekv"]())
    videos = [random_frames(FRAMES, 20 + seed) for seed in range(3)]
    streams = [qa.stream(horizon_frames=FRAMES) for _ in videos]
    prepare = adapter.prepare_frames

    def refusing(frames, state):  # a frame the model cannot take (say, a corrupt one): all black here
        if any(not frame.image.any() for frame in frames):
            raise InputError("this frame cannot be read")
        return prepare(frames, state)

    monkeypatch.setattr(adapter, "prepare_frames", refusing)
    black = np.zeros_like(videos[0][0])
    for tick in range(FRAMES):
        bad = tick == 5
        items = [(stream, black if bad and s == 1 else frames[tick], float(tick))
                 for s, (stream, frames) in enumerate(zip(streams, videos))]
        results = qa.push_many(items, return_exceptions=True)
        assert [isinstance(result, InputError) for result in results] == [False, bad, False]
        if bad:
            with pytest.raises(InputError, match="cannot be read"):
                qa.push_many([(streams[1], black, float(tick))])
            assert (streams[1].frames, streams[1].pushed, streams[1].pending) == (5, 5, [])  # untouched
            qa.push_many([(streams[1], videos[1][tick], float(tick))])  # the stream goes on
    monkeypatch.undo()
    for stream, frames in zip(streams, videos):
        _assert_same(stream, _alone(qa, frames))


def test_a_frame_streamed_before_its_batch_failed_is_counted_once(adapters, monkeypatch):
    """A caller whose batch another thread led gets its job back streamed but failed (the leader's watch follow-up
    raised, say): its frame has left ``pending`` and is counted, its error is its result."""
    from statekv.errors import StateKVError

    qa = tiny_qa(adapters["internvl"], POLICIES["statekv"]())
    stream = qa.stream(horizon_frames=FRAMES)
    frames = random_frames(3, 7)
    run = qa.step_scheduler.run

    def led_elsewhere(jobs):
        run(jobs)
        for job in jobs:
            job.error = StateKVError("the batch's follow-up failed")

    monkeypatch.setattr(qa.step_scheduler, "run", led_elsewhere)
    results = qa.push_many([(stream, frames[0], 0.0)], return_exceptions=True)
    assert isinstance(results[0], StateKVError)
    assert (stream.frames, stream.pushed, stream.pending) == (1, 1, [])
    monkeypatch.undo()
    for index, frame in enumerate(frames[1:], start=1):
        qa.push_many([(stream, frame, float(index))])
    _assert_same(stream, _alone(qa, frames))


def test_push_many_refuses_what_is_not_an_item(adapters):
    qa = tiny_qa(adapters["internvl"], POLICIES["statekv"]())
    with pytest.raises(InputError, match="stream, frame, seconds"):
        qa.push_many([np.zeros((4, 4, 3), np.uint8)])
    other = tiny_qa(adapters["internvl"], POLICIES["statekv"]()).stream(horizon_frames=2)
    with pytest.raises(InputError, match="another VideoQA"):
        qa.push_many([(other, random_frames(1, 0)[0], 0.0)])


def test_a_batch_that_fails_as_a_whole_is_each_stepped_items_error(adapters, monkeypatch):
    """With ``return_exceptions=True`` an error of the whole batch (not an interrupt) is returned in the place of
    each item it stepped, not raised; the streams go on as if the failed frames had not come."""
    qa = tiny_qa(adapters["internvl"], POLICIES["statekv"]())
    streams = [qa.stream(horizon_frames=FRAMES) for _ in range(2)]
    frames = random_frames(3, 11)
    run = qa.step_scheduler.run
    calls = []

    def failing_once(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("the device is gone")
        run(jobs)

    monkeypatch.setattr(qa.step_scheduler, "run", failing_once)
    results = qa.push_many([(stream, frames[0], 0.0) for stream in streams], return_exceptions=True)
    assert [str(result) for result in results] == ["the device is gone"] * 2
    with pytest.raises(RuntimeError, match="the device is gone"):
        calls.clear()
        qa.push_many([(stream, frames[0], 0.0) for stream in streams])
    monkeypatch.undo()
    for stream in streams:
        for index, frame in enumerate(frames[1:], start=1):
            stream.push(frame, float(index))
        _assert_same(stream, _alone(qa, frames[1:]))
