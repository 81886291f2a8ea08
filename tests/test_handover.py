"""The handover layout of bounded positions (`statekv.api.handover`): while a stream fits the model's range it is
the own-then-cache stream bit for bit, its steps kept in a backlog that its successor replays as the cache-layout
stream; once past the range it is the cache-layout stream; saved and resumed in either phase it goes on as if never
stopped; where no successor can be made, or its replay fails, it is the own-then-cache stream and says why."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import statekv
from statekv import Stream
from statekv.api.handover import StoredStep
from statekv.core import StateKV, StreamingPrefill
from statekv.errors import ConfigurationError, InputError, OutputError
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames

RANGE = 512  # the tiny model's trained range: a frame takes a few dozen positions
QUESTION = "what is shown?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    short = {"max_position_embeddings": RANGE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("handover") / "ckpt", text_config=short,
                                vision_config={"image_size": 112})


def loaded(checkpoint, layout: str | None, method: str = "statekv", **settings) -> statekv.VideoQA:
    sizes = {"budget": settings.pop("budget", 24)} if method == "statekv" else {}
    if method == "recency":
        sizes = {"frames": settings.pop("frames", 2)}
    return statekv.VideoQA.from_pretrained(checkpoint, method=method, reserve_tokens=24, bounded_layout=layout,
                                           attention="eager", **sizes, **settings)


def pushed(qa: statekv.VideoQA, frames) -> Stream:
    stream = qa.stream()
    for frame in frames:
        stream.push(frame)
    return stream


def fingerprint(prefill: StreamingPrefill) -> str:
    """Every tensor of the engine's state, bit for bit, and where its steps were placed."""
    tensors, metadata = prefill.state_dict()
    digest = hashlib.sha256(repr(metadata.get("positions")).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


FRAMES = random_frames(40, seed=3, height=32, width=32)


@pytest.fixture(scope="module")
def references(checkpoint):
    """``{(layout, frames): stream}`` for own-then-cache and cache, 3 frames (inside the range) and 40 (past it)."""
    made = {(layout, count): pushed(loaded(checkpoint, layout), FRAMES[:count])
            for layout in ("own-then-cache", "cache") for count in (3, 40)}
    assert not made["own-then-cache", 3].prefill.positions.moved and made["own-then-cache", 40].prefill.positions.moved
    yield made
    for stream in made.values():
        stream.close()


def held(stream: Stream) -> list[str]:
    """Fingerprints of what a stream holds: each engine that took steps, and its successor's backlog."""
    kept = [fingerprint(engine) for engine in stream.engines if engine.seen_tokens]
    if stream.backlog.steps:
        kept.append(hashlib.sha256(stream.backlog.tensor().contiguous().view(torch.uint8).numpy()).hexdigest())
    return kept


def test_inside_the_range_it_is_own_then_cache_and_its_successor_takes_no_step(checkpoint, references):
    with pushed(loaded(checkpoint, "handover"), FRAMES[:3]) as stream:
        assert stream.handover == "beside"
        assert fingerprint(stream.prefill) == fingerprint(references["own-then-cache", 3].prefill)
        assert stream.successor.seen_tokens == 0
        assert stream.backlog.spans == stream.prefill.cache.chunk_lengths  # every step, the prompt prefix first
        assert stream.ask(QUESTION, max_new_tokens=4) == references["own-then-cache", 3].ask(QUESTION, max_new_tokens=4)
        assert stream.stats.cache_bytes == stream.prefill.stats.detailed_bytes + stream.backlog.nbytes > 0


def test_caught_up_its_successor_is_the_cache_layout_stream_and_goes_on_from_there(checkpoint, references):
    with pushed(loaded(checkpoint, "handover"), FRAMES[:3]) as stream:
        stream.catch_up()
        assert stream.handover == "beside" and not stream.backlog.steps and stream.backlog.nbytes == 0
        assert fingerprint(stream.successor) == fingerprint(references["cache", 3].prefill)
        assert fingerprint(stream.prefill) == fingerprint(references["own-then-cache", 3].prefill)
        for frame in FRAMES[3:]:
            stream.push(frame)
        assert stream.handover == "handed over"
        assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)


def test_past_the_range_it_is_the_cache_layout_stream(checkpoint, references):
    with pushed(loaded(checkpoint, "handover"), FRAMES) as stream:
        peak = stream.stats.peak_cache_device_bytes  # both detailed caches, held at the handover
        assert peak > stream.prefill.stats.peak_device_bytes
        stream.ask(QUESTION, max_new_tokens=1, retrieve=1)
        assert stream.stats.peak_cache_device_bytes >= peak  # a peak never falls
        assert stream.handover == "handed over" and stream.successor is None
        assert stream.engines == (stream.prefill,)
        assert stream.prefill.positions.layout.name == "cache"
        assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)
        for retrieve in (2, None):
            assert (stream.ask(QUESTION, max_new_tokens=4, retrieve=retrieve)
                    == references["cache", 40].ask(QUESTION, max_new_tokens=4, retrieve=retrieve))


@pytest.mark.parametrize("count, caught_up, settings", [
    (3, 0, {}), (3, 2, {}), (3, 3, {}), (30, 0, {}),
    (3, 2, {"max_cache_bytes": 1_400_000, "cache_limit": "evict-oldest", "offload": True}),
])
def test_saved_and_resumed_it_goes_on_as_if_never_stopped(checkpoint, tmp_path, count, caught_up, settings):
    """``caught_up``: frames pushed before `catch_up` (the successor saved with the steps it replayed)."""
    qa = loaded(checkpoint, "handover", **settings)
    with pushed(qa, FRAMES[:caught_up]) as stream:
        stream.catch_up()
        for frame in FRAMES[caught_up:count]:
            stream.push(frame)
        path = stream.save(tmp_path / "s.safetensors")
        phase = stream.handover
        with Stream.load(path, qa) as resumed:
            assert resumed.handover == phase
            assert held(resumed) == held(stream)
            for frame in FRAMES[count:]:
                stream.push(frame)
                resumed.push(frame)
            assert resumed.handover == stream.handover == "handed over"
            assert fingerprint(resumed.prefill) == fingerprint(stream.prefill)
            with Stream.load(resumed.save(tmp_path / "again.safetensors"), qa) as again:  # saved after a resume
                assert again.handover == "handed over"
                assert fingerprint(again.prefill) == fingerprint(stream.prefill)


@pytest.mark.parametrize("method, settings, why", [
    ("full", {}, "carries more than the cache layout can place"),
    ("statekv", {"max_cache_bytes": 900_000}, "cannot hold its detailed cache twice"),
])
def test_where_no_successor_can_be_made_it_is_own_then_cache_and_says_why(checkpoint, method, settings, why):
    reference = pushed(loaded(checkpoint, "own-then-cache", method, **settings), FRAMES[:30])
    with pushed(loaded(checkpoint, "handover", method, **settings), FRAMES[:30]) as stream, reference:
        assert stream.successor is None and stream.handover.startswith("alone: ") and why in stream.handover
        assert fingerprint(stream.prefill) == fingerprint(reference.prefill)


def held_during_steps(stream: Stream, monkeypatch, held: list[int], watched: set) -> None:
    """From now on, at each step of the stream's engine (its cap's `make_room`, before the step is taken), what both
    engines and the backlog hold with the step added, into ``held`` (``watched``: the engines' caps seen so far)."""
    keeper = stream.prefill.keeper
    if id(keeper) in watched:
        return
    watched.add(id(keeper))
    make_room = keeper.make_room

    def counted(chunk_len, batch=1):
        step = (chunk_len * keeper.bytes_per_token + keeper.bytes_per_step) * batch
        held.append(sum(engine.keeper.held_bytes for engine in stream.engines) + stream.backlog.nbytes + step)
        return make_room(chunk_len, batch)
    monkeypatch.setattr(keeper, "make_room", counted)


def test_a_cap_found_too_small_midway_drops_the_successor_and_holds_at_every_step(checkpoint, monkeypatch):
    """A cap above what the stream is known at its first frame to hold at its handover, but below what it holds
    there: the successor, caught up after every push, is dropped midway; at every step (before it is taken) both
    engines and the backlog stay under the cap, and the stream goes on as own-then-cache under it."""
    cap = {"max_cache_bytes": 1_165_000}
    held: list[int] = []
    watched: set = set()
    with loaded(checkpoint, "handover", **cap).stream() as stream, \
            pushed(loaded(checkpoint, "own-then-cache", **cap), FRAMES) as reference:
        kept = 0  # frames pushed with the successor still beside the stream
        for frame in FRAMES:
            held_during_steps(stream, monkeypatch, held, watched)
            stream.push(frame)
            if stream.successor is not None:
                stream.catch_up()
                kept += 1
        assert 1 < kept < len(FRAMES)  # dropped past the first frame, before the end
        assert stream.handover.startswith("alone: ") and "cannot hold its detailed cache twice" in stream.handover
        assert len(held) == len(stream.prefill.cache.chunk_lengths) and max(held) <= cap["max_cache_bytes"]
        assert fingerprint(stream.prefill) == fingerprint(reference.prefill)


def test_under_a_cache_cap_that_holds_it_twice_it_hands_over_and_keeps_to_the_cap(checkpoint):
    """Both engines and the backlog stay under the cap at every push (the handover's included), and past the range
    the stream evicts as the cache-layout stream under the same cap does."""
    cap = {"max_cache_bytes": 1_400_000, "cache_limit": "evict-oldest", "offload": True}
    frames = random_frames(80, seed=3, height=32, width=32)
    with loaded(checkpoint, "handover", **cap).stream() as stream, \
            pushed(loaded(checkpoint, "cache", **cap), frames) as reference:
        for frame in frames:
            stream.push(frame)
            stream.catch_up()  # the successor as full as it gets: the cap still holds the next step
            held = sum(engine.keeper.held_bytes for engine in stream.engines) + stream.backlog.nbytes
            assert held <= cap["max_cache_bytes"]
        assert stream.handover == "handed over" and stream.stats.evicted_frames > 0
        assert stream.stats.evicted_frames == reference.stats.evicted_frames
        assert fingerprint(stream.prefill) == fingerprint(reference.prefill)
        assert (stream.ask(QUESTION, max_new_tokens=4, retrieve=2)
                == reference.ask(QUESTION, max_new_tokens=4, retrieve=2))


def test_a_cap_too_small_for_two_caches_leaves_the_successor_at_the_first_frame_or_on_resuming(checkpoint, tmp_path):
    """What the stream will hold at its handover is known at its first frame step; a stream saved without a cap
    and resumed under one too small for two caches leaves its successor as it is loaded."""
    with pushed(loaded(checkpoint, "handover", max_cache_bytes=900_000), FRAMES[:1]) as stream:
        assert stream.successor is None and "cannot hold its detailed cache twice" in stream.handover
    with pushed(loaded(checkpoint, "handover"), FRAMES[:3]) as stream:
        stream.catch_up(2)
        path = stream.save(tmp_path / "s.safetensors")
    with Stream.load(path, loaded(checkpoint, "handover", max_cache_bytes=120_000)) as resumed:
        assert resumed.successor is None and "cannot hold its detailed cache twice" in resumed.handover
        assert not resumed.backlog.steps


def test_a_successor_whose_replay_fails_is_dropped_and_the_stream_goes_on(checkpoint, references):
    with pushed(loaded(checkpoint, "handover"), FRAMES[:2]) as stream:
        stream.successor.close()  # its replay is refused
        for frame in FRAMES[2:]:
            stream.push(frame)
        assert stream.successor is None and not stream.backlog.steps
        assert stream.handover.startswith("alone: the successor's step failed")
        assert fingerprint(stream.prefill) == fingerprint(references["own-then-cache", 40].prefill)


def test_a_replay_stopped_midway_loses_no_step_and_goes_on(checkpoint, references, monkeypatch):
    """Each step replayed leaves the backlog with it: stopped between two, the successor and its backlog still
    hold every step of the stream once, and the replay goes on from there."""
    from statekv.core.step.batching import StepBatcher

    with pushed(loaded(checkpoint, "handover"), FRAMES[:3]) as stream:
        step, calls = StepBatcher.step, []

        def stopped_at_the_third(self, requests):
            calls.append(len(requests))
            if len(calls) == 3:
                raise KeyboardInterrupt
            return step(self, requests)

        monkeypatch.setattr(StepBatcher, "step", stopped_at_the_third)
        with pytest.raises(KeyboardInterrupt):
            stream.catch_up()
        monkeypatch.setattr(StepBatcher, "step", step)
        assert stream.successor.seen_tokens == sum(stream.prefill.cache.chunk_lengths[:2])
        assert stream.backlog.spans == stream.prefill.cache.chunk_lengths[2:]
        stream.catch_up()
        assert fingerprint(stream.successor) == fingerprint(references["cache", 3].prefill)


@pytest.mark.parametrize("together", [False, True])
def test_a_push_stopped_in_its_handover_keeps_its_frame_and_goes_on(checkpoint, references, monkeypatch, together):
    """Stopped while its successor replays, the push that passed the range raises the stop; its frame is streamed
    and counted once, and the stream goes on (the replay finished by the next push) as if never stopped."""
    from statekv.core.step.batching import StepBatcher

    qa = loaded(checkpoint, "handover")
    with qa.stream() as stream:
        step, replays = StepBatcher.step, []

        def stopped_in_the_replay(self, requests):
            if requests[0].prefill is stream.successor:
                replays.append(len(requests))
                if len(replays) == 2:
                    raise KeyboardInterrupt
            return step(self, requests)

        monkeypatch.setattr(StepBatcher, "step", stopped_in_the_replay)
        for index, frame in enumerate(FRAMES):
            try:
                if together:
                    qa.push_many([(stream, frame, float(index))])
                else:
                    stream.push(frame, float(index))
            except KeyboardInterrupt:
                assert stream.handover_due and not stream.pending and stream.pushed == stream.frames == index + 1
                if together:  # else the next push finishes the handover
                    stream.catch_up()
                    assert stream.handover == "handed over" and not stream.handover_due
        assert len(replays) > 2 and stream.handover == "handed over"
        assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)


def test_one_engine_refuses_the_handover_layout_in_one_line(checkpoint):
    qa = loaded(checkpoint, "handover")
    with pytest.raises(ConfigurationError, match=r"^bounded_layout='handover' is a stream's \(two engines"):
        StreamingPrefill(qa.adapter.model, StateKV(budget=8), positions="bounded", bounded_layout="handover")


def test_other_positions_and_layouts_make_no_successor(checkpoint):
    with loaded(checkpoint, "handover").stream(horizon_frames=4) as inside:  # stream positions: nothing to hand over
        assert inside.engine.positions == "stream" and inside.successor is None and inside.handover is None
    with loaded(checkpoint, "cache").stream() as other:
        assert other.successor is None and other.handover is None


def test_it_is_a_bounded_streams_default(checkpoint):
    with loaded(checkpoint, None).stream() as stream:
        assert stream.handover == "beside" and stream.engine.bounded_layout is None


@pytest.mark.parametrize("saved_as, count, resumed_as, continues_as, state", [
    ("handover", 30, "own-then-cache", "cache", "handed over"),  # past its handover: the cache layout's engine
    ("cache", 3, None, "cache", None),  # streamed under the cache layout: it never had a successor
    ("own-then-cache", 3, None, "own-then-cache", "alone: the saved stream kept no successor beside it"),
])
def test_a_saved_stream_goes_on_with_the_engine_it_had(checkpoint, tmp_path, references, saved_as, count, resumed_as,
                                                       continues_as, state):
    with pushed(loaded(checkpoint, saved_as), FRAMES[:count]) as stream:
        path = stream.save(tmp_path / "s.safetensors")
    with Stream.load(path, loaded(checkpoint, resumed_as)) as resumed:
        assert resumed.handover == state and resumed.successor is None
        assert resumed.prefill.positions.layout.name == continues_as
        for frame in FRAMES[count:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references[continues_as, 40].prefill)


def test_a_stream_saved_under_another_one_engine_layout_is_refused_in_one_line(checkpoint, tmp_path):
    with pushed(loaded(checkpoint, "grouped"), FRAMES[:3]) as stream:
        path = stream.save(tmp_path / "s.safetensors")
    with pytest.raises(InputError, match="resume it with bounded_layout=grouped$"):
        Stream.load(path, loaded(checkpoint, None))


def test_a_malformed_successor_is_refused_in_one_line_naming_it(checkpoint, tmp_path):
    from statekv.api.stream_file import read_verified, write_verified

    with pushed(loaded(checkpoint, "handover"), FRAMES[:2]) as stream:
        stream.catch_up()
        stream.push(FRAMES[2])  # the successor saved with the steps it replayed and its backlog
        path = stream.save(tmp_path / "s.safetensors")
    metadata, tensors = read_verified(path)
    record, spans = metadata["successor"], metadata["backlog"]["spans"]
    steps = [list(row) for row in zip(*record["positions"]["steps"])]  # read as three columns of runs
    backlog = tensors["backlog.inputs_embeds"]
    broken = {  # each re-signed: its checksums vouch for it, so only the successor's own checks can refuse it
        "no record": ({k: v for k, v in metadata.items() if k != "successor"}, tensors,
                      "the successor's steps (replayed and backlog) is"),
        "a step missing": ({**metadata, "successor": {**record, "positions": {**record["positions"],
                                                                             "steps": steps[:-1]}}}, tensors,
                           "the successor engine's state (successor.*): the saved stream's positions must list"),
        "other evictions": ({**metadata, "successor": {**record, "evicted_steps": [1]}}, tensors,
                            "successor.evicted_steps is [1], inconsistent with the rest"),
        "own layout": ({**metadata, "successor": {**record, "positions": {**record["positions"],
                                                                          "layout": "own-then-cache"}}}, tensors,
                       "the engines' layouts is"),
        "a tensor missing": (metadata, {k: v for k, v in tensors.items() if k != "successor.layers.0.keys"},
                             "the successor engine's state (successor.*): the saved state lacks layers.0.keys"),
        "no backlog": (metadata, {k: v for k, v in tensors.items() if k != "backlog.inputs_embeds"},
                       "holds a backlog record but no backlog.inputs_embeds"),
        "a backlog step missing": ({**metadata, "backlog": {"spans": spans[:-1]}}, tensors,
                                   "the successor's steps (replayed and backlog) is"),
        "a backlog cut short": (metadata, {**tensors, "backlog.inputs_embeds": backlog[:, :-1]},
                                "the successor's backlog (backlog.inputs_embeds) is"),
    }
    caught_up = {k: v for k, v in metadata.items() if k != "backlog"}  # its steps all replayed: a backlog astray
    caught_up["successor"] = {**record, "chunk_lengths": list(record["chunk_lengths"]) + spans}  # read as runs
    broken["a backlog astray"] = (caught_up, tensors, "holds backlog.inputs_embeds but no backlog record")
    for name, (changed, kept, message) in broken.items():
        target = write_verified(tmp_path / f"{name}.safetensors", kept,
                                {k: v for k, v in changed.items() if k != "checksums"})
        with pytest.raises(InputError) as refused:
            Stream.load(target, loaded(checkpoint, None))
        text = str(refused.value)
        assert message in text and str(target) in text and "\n" not in text, (name, text)


def test_no_successor_where_it_could_never_take_over(checkpoint):
    qa = loaded(checkpoint, None, positions="bounded")  # bounded, but its horizon fits the range
    with qa.stream(horizon_frames=4) as bounded:
        assert bounded.successor is None and bounded.handover.startswith("alone: its ")
        assert "tokens fits the model's range: every step stays at its own positions (a step starting past 448 " \
               "of the 512 would be placed elsewhere)" in bounded.handover
    for frames, beside in ((24, False), (30, True)):  # its last step starts below the ceiling, or past it
        with qa.stream(horizon_frames=frames) as stream:
            assert stream.handover == "beside"
            stream.push(FRAMES[0])
            assert (stream.handover == "beside") is beside
    for method, sizes, kept in (("statekv", {"budget": 480}, True), ("statekv", {"budget": 500}, False),
                                ("recency", {"frames": 30}, False)):
        with loaded(checkpoint, None, method, **sizes).stream() as stream:
            stream.push(FRAMES[0])
            assert (stream.successor is not None) is kept, stream.handover
            if not kept:
                assert "do not fit the model's 512 positions in cache order" in stream.handover


def test_one_guide_steers_each_engine_at_its_own_places(checkpoint):
    """A steering watch's guide serves both engines; each gets its queries rotated to right after its own chunk."""
    from statekv.core.rules.steering import QuestionGuide

    with loaded(checkpoint, None).stream() as stream:
        stream.watch("what is shown?", every=1)
        for frame in FRAMES[:12]:
            stream.push(frame)
        stream.catch_up()  # its replay steered by the guide
        guide = stream.prefill.cache.guide
        assert stream.handover == "beside" and guide is stream.successor.cache.guide and guide.active
        assert stream.successor.cache.step_index == stream.prefill.cache.step_index
        heads, scale = 2, 0.25
        placed = [guide.placed(engine.cache, heads, torch.device("cpu"), 4, scale) for engine in stream.engines]
        for engine, got in zip(stream.engines, placed):
            alone = QuestionGuide()
            for question, weight in guide.questions:
                alone.add(question, weight)
            expected = alone.placed(engine.cache, heads, torch.device("cpu"), 4, scale)
            assert all(torch.equal(g[0], e[0]) for g, e in zip(got, expected))
        assert not torch.equal(placed[0][0][0], placed[1][0][0])  # the engines' chunks are placed apart


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_watch_steers_the_stream_past_its_handover_on_either_tier(checkpoint, tmp_path, tier):
    """On the disk tier the handover keeps the watch beside the folder it hands over: killed after it, the folder
    reopens it (before, the watch file went to the stream's own files, which the handover removes)."""
    disk = {"offload": "disk", "offload_dir": str(tmp_path / "disk")} if tier == "disk" else {}
    qa = loaded(checkpoint, None, **disk)
    with qa.stream() as stream:
        stream.watch("what is shown?", every=4)
        for frame in FRAMES:
            stream.push(frame)
        assert stream.handover == "handed over"
        assert stream.prefill.cache.guide is not None and stream.prefill.cache.guide.active
        if tier == "disk":
            shutil.copytree(stream.folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
            with Stream.load(tmp_path / "killed", qa) as killed:
                assert [watch.question for watch in killed.watches] == ["what is shown?"]


def test_streams_pushed_together_hand_over_as_each_alone(checkpoint, references):
    qa = loaded(checkpoint, "handover")
    first, second = qa.stream(), qa.stream()
    with first, second:
        for index, frame in enumerate(FRAMES):
            qa.push_many([(first, frame, float(index)), (second, frame, float(index))])
            if index == 2:
                first.catch_up()
                assert [fingerprint(e) for e in first.engines] == [
                    fingerprint(references["own-then-cache", 3].prefill), fingerprint(references["cache", 3].prefill)]
        for stream in (first, second):
            assert stream.handover == "handed over"
            assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)


def test_streams_caught_up_together_are_each_caught_up_alone(checkpoint, references):
    qa = loaded(checkpoint, "handover")
    with pushed(qa, FRAMES[:3]) as first, pushed(qa, FRAMES[:3]) as second, pushed(qa, FRAMES[:3]) as alone:
        steps = len(first.backlog.steps)
        qa.catch_up_many([first, second], steps=2)
        alone.catch_up(2)
        assert held(first) == held(second) == held(alone) and len(first.backlog.steps) == steps - 2
        qa.catch_up_many([first, second])
        for stream in (first, second):
            assert fingerprint(stream.successor) == fingerprint(references["cache", 3].prefill)
        with pytest.raises(InputError, match="belongs to another VideoQA"):
            loaded(checkpoint, "handover").catch_up_many([first])
        with pytest.raises(InputError, match="takes streams"):
            qa.catch_up_many([first, "second"])
        with pytest.raises(ConfigurationError, match="steps"):
            qa.catch_up_many([first], steps=0)


def test_catching_up_is_due_past_half_the_range_and_refused_for_a_closed_stream(checkpoint):
    qa = loaded(checkpoint, "handover")
    with pushed(qa, FRAMES[:3]) as early:
        assert early.backlog.steps and not early.catch_up_due  # a few frames into the range
    stream = pushed(qa, FRAMES[:15])
    assert stream.prefill.seen_tokens >= RANGE // 2 and stream.catch_up_due
    stream.close()
    assert not stream.catch_up_due and not stream.backlog.steps and stream.backlog.nbytes == 0  # let go
    with pytest.raises(InputError, match="this stream was closed"):
        qa.catch_up_many([stream])
    with pytest.raises(InputError, match="this stream was closed"):
        stream.catch_up()


def test_streams_of_one_layout_pushed_together_after_others_are_placed_as_alone(checkpoint, references):
    """A pooled batch is kept per batch key and reused by the next streams of that key: streams of another layout,
    stepped together past the range first, must not lend it their placement."""
    qa = loaded(checkpoint, "own-then-cache")
    first, second = qa.stream(), qa.stream()
    for index, frame in enumerate(FRAMES[:30]):
        qa.push_many([(first, frame, float(index)), (second, frame, float(index))])
    assert first.prefill.positions.moved
    cached = qa.with_options(bounded_layout="cache")
    streams = [cached.stream(), cached.stream()]
    for index, frame in enumerate(FRAMES[:3]):
        cached.push_many([(stream, frame, float(index)) for stream in streams])
    assert [fingerprint(stream.prefill) for stream in streams] == [fingerprint(references["cache", 3].prefill)] * 2
    for stream in (first, second, *streams):
        stream.close()


def test_a_watch_inside_the_range_reads_and_steers_the_stream_as_under_own_then_cache(checkpoint):
    """The steering guide the successor shares leaves the stream's own engine, and the watch's events, as they are
    without a successor."""
    streams = [loaded(checkpoint, layout).stream() for layout in ("handover", "own-then-cache")]
    watches = [stream.watch(QUESTION, every=1, max_new_tokens=3) for stream in streams]
    try:
        for frame in FRAMES[:12]:
            for stream in streams:
                stream.push(frame)
        assert streams[0].handover == "beside" and streams[1].successor is None
        assert fingerprint(streams[0].prefill) == fingerprint(streams[1].prefill)
        assert [e.to_dict() for e in watches[0].events] == [e.to_dict() for e in watches[1].events]
        assert watches[0].events  # it was evaluated and answered
    finally:
        for stream in streams:
            stream.close()


def test_a_disk_tier_folder_resumes_with_the_layout_it_was_streamed_with(checkpoint, tmp_path, references):
    with pushed(loaded(checkpoint, "cache"), FRAMES[:3]) as stream:
        path = stream.save(tmp_path / "s.safetensors")
    on_disk = loaded(checkpoint, None, offload="disk", offload_dir=str(tmp_path / "disk"))
    with Stream.load(path, on_disk) as loaded_stream:  # the cache layout's engine, now on the disk tier
        assert loaded_stream.prefill.positions.layout.name == "cache"
        for frame in FRAMES[3:6]:
            loaded_stream.push(frame)
        folder = loaded_stream.durability.folder
    with pytest.raises(InputError, match=r"resume it with bounded_layout=cache or the default$"):
        Stream.load(folder, loaded(checkpoint, "own-then-cache", offload="disk", offload_dir=str(tmp_path / "disk")))
    with Stream.load(folder, on_disk) as resumed:
        assert resumed.prefill.positions.layout.name == "cache"
        for frame in FRAMES[6:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_served_stream_replays_its_backlog_in_quiet_moments_and_hands_over_as_ever(checkpoint, references, caplog,
                                                                                     tmp_path, tier):
    """Through the server's model worker, a camera leaving gaps between frames: past half the range the gaps
    replay the backlog, so the push that passes the range replays only the steps since the last gap, and the
    stream past the range is still the cache-layout stream, bit for bit (its detailed cache in memory, or on the
    disk tier)."""
    import asyncio
    import logging
    import re
    import time

    from statekv.serve.worker import ModelWorker

    worker = ModelWorker(gather_seconds=0.0)
    stream = (on_disk(checkpoint, tmp_path) if tier == "disk" else loaded(checkpoint, "handover")).stream()
    push = {"before": lambda: 0, "after": lambda context, kept: kept}

    async def caught_up() -> None:  # the next frame comes once quiet moments replayed the backlog
        deadline = time.monotonic() + 10
        while stream.catch_up_due and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def camera() -> None:
        for frame in FRAMES:
            await worker.push(stream, frame, None, **push)
            await caught_up()

    caplog.set_level(logging.INFO, logger="statekv")
    try:
        asyncio.run(camera())
    finally:
        worker.close()
    with stream:
        replayed = [int(n) for n in re.findall(r"the steps not yet so encoded \((\d+)\)", caplog.text)]
        assert replayed == [1] and worker.quiet_catch_up_steps > 0  # without them, every step of the range
        assert stream.handover == "handed over"
        assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)


# -- on the disk tier ------------------------------------------------------------------------------------------
def on_disk(checkpoint, tmp_path, layout: str | None = None) -> statekv.VideoQA:
    return loaded(checkpoint, layout, offload="disk", offload_dir=str(tmp_path / "disk"))


def files_of(folder) -> set[str]:
    return {path.name for path in folder.iterdir()}


@pytest.mark.parametrize("count, caught_up", [(3, 0), (20, 0), (20, 20), (30, 0)])
def test_on_the_disk_tier_it_hands_over_its_folder_and_resumes_in_either_phase(checkpoint, tmp_path, references,
                                                                              count, caught_up):
    """Closed after ``count`` frames (its successor having replayed ``caught_up`` of them), resumed from its folder
    and pushed on: the cache-layout stream, in the same folder, with nothing of its successor left beside it."""
    qa = on_disk(checkpoint, tmp_path)
    with pushed(qa, FRAMES[:caught_up]) as stream:
        assert stream.handover == "beside" and stream.successor.disk.folder.parent == stream.durability.folder
        stream.catch_up()
        for frame in FRAMES[caught_up:count]:
            stream.push(frame)
        folder, phase = stream.durability.folder, stream.handover
    assert phase == ("handed over" if count == 30 else "beside")
    kept = phase == "beside" and caught_up > 0  # a closed stream keeps a successor that replayed steps, else none
    assert any(path.is_dir() for path in folder.iterdir()) == kept
    with Stream.load(folder, qa) as resumed:
        assert resumed.handover == phase and resumed.frames == count
        if phase == "beside":  # what it had not replayed, from the backlog kept in the folder, read when replayed
            replayed = len(resumed.successor.cache.chunk_lengths)
            assert len(resumed.backlog.steps) == len(resumed.step_frames) - replayed and (replayed > 0) == kept
            assert all(isinstance(step, StoredStep) for step in resumed.backlog.steps)
        for frame in FRAMES[count:]:
            resumed.push(frame)
        assert resumed.handover == "handed over" and resumed.folder == folder
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)
        assert (resumed.ask(QUESTION, max_new_tokens=4, retrieve=2)
                == references["cache", 40].ask(QUESTION, max_new_tokens=4, retrieve=2))
        assert "backlog.bin" not in files_of(folder) and "handover.json" not in files_of(folder)
        assert not any(path.is_dir() for path in folder.iterdir())
    with pytest.raises(InputError, match=r"under handover it handed over to the cache layout past the model's range, "
                                         r"not own-then-cache; resume it with bounded_layout=cache or the default$"):
        Stream.load(folder, on_disk(checkpoint, tmp_path, "own-then-cache"))


def test_on_the_disk_tier_a_kill_before_the_handover_resumes_and_rebuilds_its_successor(checkpoint, tmp_path,
                                                                                         references):
    """The folder as a kill leaves it (copied while the stream lives: its successor's file set in it, nothing
    checkpointed since the first step) resumes at its last checkpoint, rebuilds the successor from the backlog and
    hands over as ever."""
    import shutil

    qa = on_disk(checkpoint, tmp_path)
    with pushed(qa, FRAMES[:20]) as stream:
        stream.catch_up(5)
        killed = tmp_path / "killed"
        shutil.copytree(stream.durability.folder, killed, ignore=shutil.ignore_patterns("lock"))
    assert any(path.is_dir() for path in killed.iterdir())
    with Stream.load(killed, qa) as resumed:
        assert resumed.handover == "beside" and resumed.frames_lost == 20 - resumed.frames
        assert [path for path in killed.iterdir() if path.is_dir()] == [resumed.successor.disk.folder]
        for frame in FRAMES[resumed.frames:]:
            resumed.push(frame)
        assert resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


@pytest.mark.parametrize("moved", [0, 7])
def test_on_the_disk_tier_a_handover_stopped_after_it_was_marked_is_finished_by_resuming(checkpoint, tmp_path,
                                                                                         references, monkeypatch,
                                                                                         moved):
    """The move of the successor's files into the stream's folder fails after ``moved`` files: the push says in one
    line that the stream was closed and how to resume it; resuming finishes the move, and the stream is the one it
    was at the handover."""
    import os

    import statekv.core.disk.successor as successor_files
    from statekv.errors import HandoverError

    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:20])
    folder = stream.durability.folder
    replace, calls = os.replace, []

    def failing(source, target):
        if Path(target).parent != folder or Path(source).parent == folder:  # not a move of the handover
            return replace(source, target)
        calls.append(target)
        if len(calls) > moved:
            raise OSError(28, "No space left on device")
        return replace(source, target)
    monkeypatch.setattr(successor_files.os, "replace", failing)
    with pytest.raises(HandoverError) as raised:
        for frame in FRAMES[20:]:
            stream.push(frame)
    monkeypatch.setattr(successor_files.os, "replace", replace)
    message = str(raised.value)
    assert "\n" not in message and "No space left on device" in message and f"Stream.load({str(folder)!r})" in message
    assert "handover.json" in files_of(folder) and any(path.is_dir() for path in folder.iterdir())
    with pytest.raises(Exception):
        stream.push(FRAMES[-1])
    stream.close()
    with pytest.raises(InputError, match="belongs to no owner"):  # one who may not load it changes nothing
        Stream.load(folder, qa, owner="someone else")
    assert "handover.json" in files_of(folder)
    if moved:  # `statekv reown` finishes it too
        from statekv.api.reown import reown

        reown(folder)
        assert "handover.json" not in files_of(folder)
    with Stream.load(folder, qa) as resumed:
        assert resumed.handover == "handed over" and "handover.json" not in files_of(folder)
        for frame in FRAMES[resumed.frames:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


def test_on_the_disk_tier_every_write_of_a_push_can_fail_and_the_stream_is_as_it_was(checkpoint, tmp_path,
                                                                                     references, monkeypatch):
    """Each write of a push beside a successor (the push's journal record, the step's embeddings in the backlog, the
    layers' files, the step's record) fails in turn: a one-line error, the stream and its backlog as they were;
    then the same frames go on to the handover as ever."""
    import errno
    import os

    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:3])
    real, count = {name: getattr(os, name) for name in ("write", "pwrite")}, [0, None]

    def failing(name):
        def write(*args):
            count[0] += 1
            if count[0] == count[1]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real[name](*args)
        return write
    for name in real:
        monkeypatch.setattr(os, name, failing(name))
    count[:] = [0, None]
    stream.push(FRAMES[3])
    per_push = count[0]
    assert per_push >= 4
    for fail_at in range(1, per_push + 1):
        before = (held(stream), stream.frames, stream.pushed, len(stream.pending), stream.handover)
        count[:] = [0, fail_at]
        with pytest.raises(OutputError) as error:
            stream.push(FRAMES[4])
        message = str(error.value)
        assert "\n" not in message and "No space left on device" in message
        assert "as it was" in message or "as before it" in message, message
        assert (held(stream), stream.frames, stream.pushed, len(stream.pending), stream.handover) == before
    count[:] = [0, None]
    for frame in FRAMES[4:]:
        stream.push(frame)
    with stream:
        assert stream.handover == "handed over"
        assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)


def test_on_the_disk_tier_a_damaged_backlog_leaves_the_successor_behind_and_says_why(checkpoint, tmp_path,
                                                                                     references):
    qa = on_disk(checkpoint, tmp_path)
    with pushed(qa, FRAMES[:6]) as stream:
        folder = stream.durability.folder
    with open(folder / "backlog.bin", "r+b") as backlog:
        backlog.seek(100)
        backlog.write(b"\xff" * 8)
    with Stream.load(folder, qa) as resumed:
        assert resumed.successor is None
        assert resumed.handover == "alone: its backlog (backlog.bin) does not hold step 0's embeddings as journaled"
        for frame in FRAMES[6:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references["own-then-cache", 40].prefill)


@pytest.mark.parametrize("count, caught_up", [(3, 0), (12, 5), (12, 12)])
def test_a_file_loaded_into_the_disk_tier_hands_over_as_if_never_stopped(checkpoint, tmp_path, references, count,
                                                                         caught_up):
    """Saved with its successor's replayed steps and its backlog, loaded into the disk tier: the successor's state
    goes into its file set and the stream hands over to it as the stream that never stopped did; its folder then
    resumes whole."""
    with pushed(loaded(checkpoint, "handover"), FRAMES[:count]) as stream:
        if caught_up:
            stream.catch_up(caught_up)
        path = stream.save(tmp_path / "s.safetensors")
    qa = on_disk(checkpoint, tmp_path)
    with Stream.load(path, qa) as resumed:
        assert resumed.handover == "beside" and len(resumed.backlog.steps) == len(resumed.step_frames) - caught_up
        folder = resumed.folder
        for frame in FRAMES[count:]:
            resumed.push(frame)
        assert resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)
        assert "backlog.bin" not in files_of(folder) and not any(path.is_dir() for path in folder.iterdir())
    with Stream.load(folder, qa) as again:
        assert again.handover == "handed over" and again.frames == 40
        assert fingerprint(again.prefill) == fingerprint(references["cache", 40].prefill)
        assert (again.ask(QUESTION, max_new_tokens=4, retrieve=2)
                == references["cache", 40].ask(QUESTION, max_new_tokens=4, retrieve=2))


def test_a_file_saved_with_its_handover_due_loaded_into_the_disk_tier_hands_over_at_catch_up_and_resumes(
        checkpoint, tmp_path, references, monkeypatch):
    """Saved at the step that passed the range, before its handover (stopped by a signal): loaded into the disk
    tier, `catch_up` alone replays the backlog and hands over, and the folder's last journal record still holds
    the stream's state: the folder resumes as the stream that never stopped."""
    import shutil

    import statekv.steps.jobs as jobs

    def stopped(videos, batcher):
        if videos:
            raise KeyboardInterrupt
        return {}
    stream = loaded(checkpoint, "handover").stream()
    with monkeypatch.context() as patched:
        patched.setattr(jobs, "hand_over", stopped)
        with pytest.raises(KeyboardInterrupt):
            for frame in FRAMES:
                stream.push(frame)
    with stream:
        assert stream.handover_due and stream.backlog.steps
        count = stream.frames
        path = stream.save(tmp_path / "s.safetensors")
    qa = on_disk(checkpoint, tmp_path)
    with Stream.load(path, qa) as resumed:
        assert resumed.handover_due
        resumed.catch_up()
        assert resumed.handover == "handed over"
        resumed.prefill.sync()
        killed = tmp_path / "killed"
        shutil.copytree(resumed.folder, killed, ignore=shutil.ignore_patterns("lock"))
    with Stream.load(killed, qa) as again:
        assert again.handover == "handed over" and again.frames == count and again.frames_lost == 0
        for frame in FRAMES[count:]:
            again.push(frame)
        assert fingerprint(again.prefill) == fingerprint(references["cache", 40].prefill)


def test_a_file_saved_alone_loaded_into_the_disk_tier_resumes_alone_without_a_warning(checkpoint, tmp_path,
                                                                                        references, caplog):
    """Saved with no successor beside it, loaded into the disk tier under the handover layout: its folder resumes
    alone, as it was, and says nothing of a successor it never had."""
    import shutil

    with pushed(loaded(checkpoint, "own-then-cache"), FRAMES[:3]) as stream:
        path = stream.save(tmp_path / "s.safetensors")
    qa = on_disk(checkpoint, tmp_path)
    with Stream.load(path, qa) as resumed:
        assert resumed.successor is None
        resumed.prefill.sync()
        killed = tmp_path / "killed"
        shutil.copytree(resumed.folder, killed, ignore=shutil.ignore_patterns("lock"))
    with caplog.at_level("WARNING", logger="statekv"), Stream.load(killed, qa) as again:
        assert again.handover == "alone: it had no successor when it stopped" and not caplog.text
        for frame in FRAMES[3:]:
            again.push(frame)
        assert fingerprint(again.prefill) == fingerprint(references["own-then-cache", 40].prefill)


@pytest.mark.parametrize("streamed", [0, 4])
def test_a_file_loaded_into_the_disk_tier_then_killed_before_its_handover_goes_on_alone_and_says_why(
        checkpoint, tmp_path, references, streamed, caplog):
    """Its folder keeps the embeddings of the steps streamed since the load only: resumed before the handover, the
    stream cannot rebuild its successor and says so, then streams on whole as own-then-cache."""
    import shutil

    with pushed(loaded(checkpoint, "handover"), FRAMES[:6]) as stream:
        stream.catch_up(2)
        path = stream.save(tmp_path / "s.safetensors")
    qa = on_disk(checkpoint, tmp_path)
    with Stream.load(path, qa) as resumed:
        for frame in FRAMES[6:6 + streamed]:
            resumed.push(frame)
        resumed.prefill.sync()
        killed = tmp_path / "killed"
        shutil.copytree(resumed.folder, killed, ignore=shutil.ignore_patterns("lock"))
    with caplog.at_level("WARNING", logger="statekv"), Stream.load(killed, qa) as again:
        assert again.successor is None and again.frames == 6 + streamed
        why = ("it was loaded from a saved file" if not streamed
               else "its step 0 was journaled without its embeddings (its successor was dropped or not made then, "
                    "or the stream was loaded from a saved file since)")
        assert again.handover.startswith(f"alone: {why}")
        assert "streams on without its successor engine" in caplog.text
        for frame in FRAMES[6 + streamed:]:
            again.push(frame)
        assert fingerprint(again.prefill) == fingerprint(references["own-then-cache", 40].prefill)


def test_a_disk_tier_stream_saved_to_a_file_goes_on_in_memory_as_if_never_stopped(checkpoint, tmp_path, references):
    with pushed(on_disk(checkpoint, tmp_path), FRAMES[:20]) as stream:
        stream.catch_up(8)  # its successor saved with the steps it replayed, the rest of the backlog read back
        path = stream.save(tmp_path / "s.safetensors")
    with Stream.load(path, loaded(checkpoint, None)) as resumed:
        assert resumed.handover == "beside" and resumed.successor.seen_tokens and resumed.backlog.steps
        for frame in FRAMES[20:]:
            resumed.push(frame)
        assert resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


def test_on_the_disk_tier_a_successor_whose_writes_fail_is_kept_and_replays_once_the_disk_takes_them(
        checkpoint, tmp_path, references, monkeypatch):
    """Before: a step its disk tier refused (a full disk, for a moment) dropped the successor for good, and the
    stream went on past the range as own-then-cache. Now the replay stops there with a one-line error, the successor
    and its backlog as they were, and goes on once the disk takes it: the stream hands over as ever."""
    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:12])
    stream.catch_up(2)  # a refused first step closes its engine (nothing to go back to): refuse a later one
    backlog = list(stream.backlog.spans)

    def full(*args, **kwargs):
        raise OutputError("cannot write the disk cache: No space left on device")
    monkeypatch.setattr(stream.successor.disk, "commit_step", full)
    with pytest.raises(OutputError) as error:
        stream.catch_up(3)
    assert str(error.value) == (f"{stream.name}: its successor's replay stopped {len(backlog)} steps short of the "
                                "handover, the successor and the stream as they were, to go on at a later push (tried "
                                "again after 1, 2, 4, ... steps, 6 times at most) or catch_up: cannot write the disk "
                                "cache: No space left on device")
    assert stream.successor is not None and stream.handover == "beside" and stream.backlog.spans == backlog
    monkeypatch.undo()
    for frame in FRAMES[12:20]:
        stream.push(frame)
    stream.close()
    folder = stream.durability.folder
    with Stream.load(folder, qa) as resumed:
        assert resumed.frames == 20 and resumed.frames_lost == 0 and resumed.handover == "beside"
        for frame in FRAMES[20:]:
            resumed.push(frame)
        assert resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


def test_streams_caught_up_together_replay_on_when_one_successors_disk_refuses(checkpoint, tmp_path, monkeypatch):
    """`VideoQA.catch_up_many` (a server's quiet moment): one successor's refused step puts its replay off alone; the
    error names it and counts the steps the others replayed."""
    from statekv.steps.jobs import ReplayPutOff

    qa = on_disk(checkpoint, tmp_path)
    streams = [qa.stream(name=name) for name in ("first", "second")]
    for stream in streams:
        for frame in FRAMES[:8]:
            stream.push(frame)
    for stream in streams:
        stream.catch_up(1)
    before = [len(stream.backlog.steps) for stream in streams]

    def full(*args, **kwargs):
        raise OutputError("cannot write the disk cache: No space left on device")
    monkeypatch.setattr(streams[0].successor.disk, "commit_step", full)
    with pytest.raises(ReplayPutOff) as error:
        qa.catch_up_many(streams, 3)
    assert error.value.put_off == {id(streams[0])} and error.value.replayed == 3 and not error.value.said
    assert [len(stream.backlog.steps) for stream in streams] == [before[0], before[1] - 3]
    with pytest.raises(ReplayPutOff) as again:  # said already: a server's log takes it once
        qa.catch_up_many(streams, 1)
    assert again.value.said and again.value.replayed == 1
    monkeypatch.setattr(streams[1].successor.disk, "commit_step", full)
    with pytest.raises(ReplayPutOff) as newly:  # another one put off: the line names it, not the one said before
        qa.catch_up_many(streams, 1)
    assert not newly.value.said and str(newly.value).startswith("second: ")
    with pytest.raises(ReplayPutOff) as both:
        qa.catch_up_many(streams, 1)
    assert both.value.said and both.value.put_off == {id(stream) for stream in streams}
    assert streams[0].successor is not None and streams[0].handover == "beside"
    for stream in streams:
        stream.close()


def test_on_the_disk_tier_a_handover_whose_replay_the_disk_refused_goes_on_at_the_next_push(
        checkpoint, tmp_path, references, monkeypatch, caplog):
    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:3])
    commit, calls = stream.successor.disk.commit_step, []

    def full_once(*args, **kwargs):
        calls.append(len(stream.backlog.steps))
        if len(calls) == 3:
            raise OutputError("cannot write the disk cache: No space left on device")
        return commit(*args, **kwargs)
    monkeypatch.setattr(stream.successor.disk, "commit_step", full_once)
    put_off = None
    for index, frame in enumerate(FRAMES[3:], 3):
        stream.push(frame)
        if len(calls) == 3 and put_off is None:  # the push that passed the range, its replay refused
            put_off = index
            assert stream.handover_due and stream.handover == "beside" and stream.backlog.steps
            assert f"its successor's replay stopped {calls[2]} steps short of the handover" in caplog.text
    assert put_off is not None and stream.handover == "handed over"
    assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)
    stream.close()
    with Stream.load(stream.durability.folder, qa) as resumed:
        assert resumed.frames == 40 and resumed.frames_lost == 0 and resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


def test_a_replay_the_disk_refuses_push_after_push_is_said_once(checkpoint, tmp_path, references, monkeypatch, caplog):
    """Before: every push of a stream whose disk stayed full logged the put-off replay again."""
    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:3])
    commit, calls = stream.successor.disk.commit_step, []

    def full_for_a_while(*args, **kwargs):
        calls.append(len(stream.backlog.steps))
        if 3 <= len(calls) <= 6:
            raise OutputError("cannot write the disk cache: No space left on device")
        return commit(*args, **kwargs)
    monkeypatch.setattr(stream.successor.disk, "commit_step", full_for_a_while)
    with caplog.at_level(logging.INFO, logger="statekv"):
        for frame in FRAMES[3:]:
            stream.push(frame)
    assert len(calls) > 6 and stream.handover == "handed over"
    assert caplog.text.count("its successor's replay stopped") == 1
    assert caplog.text.count("encoding again in cache order") == 1
    assert fingerprint(stream.prefill) == fingerprint(references["cache", 40].prefill)
    stream.close()


def test_on_the_disk_tier_a_successor_closed_by_its_refused_first_step_is_dropped_and_the_stream_resumes_whole(
        checkpoint, tmp_path, references, monkeypatch):
    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:12])
    real = os.write

    def full(fd, data):  # the successor's first step journaled: refused, and nothing earlier to go back to
        if "successor" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(os, "write", full)
    stream.catch_up(3)
    monkeypatch.undo()
    assert stream.successor is None and stream.handover.startswith("alone: the successor's step failed")
    folder = stream.durability.folder
    assert not any(path.is_dir() for path in folder.iterdir())  # its file set discarded, unwritten
    for frame in FRAMES[12:20]:
        stream.push(frame)
    stream.close()  # its last step checkpointed: nothing lost
    with Stream.load(folder, qa) as resumed:
        assert resumed.frames == 20 and resumed.frames_lost == 0
        assert resumed.handover == "alone: it had no successor when it stopped"
        assert "backlog.bin" not in files_of(folder)  # what was kept for it goes once the stream resumed
        for frame in FRAMES[20:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references["own-then-cache", 40].prefill)


@pytest.mark.parametrize("vision_batch", [3, 4])
def test_on_the_disk_tier_a_kill_just_after_a_handover_inside_a_vision_call_resumes_as_the_stream_that_never_stopped(
        checkpoint, tmp_path, monkeypatch, vision_batch):
    """The handover comes at the step that passed the range, which may fall inside a vision-tower call: a stream
    killed just after it resumes where a call began (a checkpoint waits for its call's end, the successor's
    replayed steps' too), so it encodes the frames after it in the calls the stream that never stopped did, bit for
    bit. Before: the handover checkpointed the successor at its step, inside the call."""
    import shutil

    import statekv.steps.jobs as jobs

    qa = on_disk(checkpoint, tmp_path)
    whole = qa.stream(vision_batch=vision_batch)
    for frame in FRAMES:
        whole.push(frame)
    assert whole.handover == "handed over"
    hand_over, killed = jobs.hand_over, tmp_path / "killed"

    def copied(videos, batcher):
        stopped = hand_over(videos, batcher)
        if videos and not killed.exists():
            shutil.copytree(videos[0].folder, killed, ignore=shutil.ignore_patterns("lock"))
        return stopped
    monkeypatch.setattr(jobs, "hand_over", copied)
    with qa.stream(vision_batch=vision_batch) as stopped:
        for frame in FRAMES:
            stopped.push(frame)
    monkeypatch.undo()
    with Stream.load(killed, qa) as resumed:
        assert resumed.frames % vision_batch == 0  # a call begins with the next frame
        for frame in FRAMES[resumed.frames:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(whole.prefill)
    whole.close()


@pytest.mark.parametrize("vision_batch", [2, 3])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_cap_that_holds_the_handover_at_its_step_holds_it_whatever_the_vision_batch(checkpoint, tmp_path, tier,
                                                                                     vision_batch):
    """Before: once the handover waited for the end of its vision-tower call everywhere, the steps left in that
    call were held by both engines with the backlog, and a cap that holds the handover at its step dropped the
    successor there. Off the disk tier it hands over at its step; on it, it waits only while the cap holds both."""
    where = {"offload": "disk", "offload_dir": str(tmp_path / "disk")} if tier == "disk" else {"offload": True}
    qa = loaded(checkpoint, "handover", max_cache_bytes=1_250_000 if tier == "disk" else 1_200_000,
                cache_limit="evict-oldest", **where)
    with qa.stream(vision_batch=vision_batch) as stream:
        for frame in FRAMES:
            stream.push(frame)
        assert stream.handover == "handed over"


def test_on_the_disk_tier_a_kill_just_after_the_handover_was_marked_still_counts_the_waiting_frames(
        checkpoint, tmp_path, monkeypatch):
    """Frames waiting for their batch while the folder is handed over (the handover stopped by a signal, then
    finished by `catch_up` between pushes): the folder as a kill leaves it then resumes at the handover and counts
    them lost."""
    import shutil

    import statekv.api.durability as durability
    import statekv.steps.jobs as jobs

    def stopped(videos, batcher):
        if videos:
            raise KeyboardInterrupt
        return {}
    qa = on_disk(checkpoint, tmp_path)
    stream = qa.stream(vision_batch=4)
    with monkeypatch.context() as patched:
        patched.setattr(jobs, "hand_over", stopped)
        with pytest.raises(KeyboardInterrupt):
            for frame in FRAMES:
                stream.push(frame)
    finish, seen = durability.finish_handover, {}

    def killed_first(folder):
        if not seen:
            shutil.copytree(folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
            seen["journaled"] = stream.pushed
        return finish(folder)
    monkeypatch.setattr(durability, "finish_handover", killed_first)
    with stream:
        assert stream.handover_due
        for frame in FRAMES[stream.pushed:stream.pushed + 2]:
            stream.push(frame)
        assert len(stream.pending) == 2
        stream.catch_up()
        assert stream.handover == "handed over"
    with Stream.load(tmp_path / "killed", qa) as resumed:
        assert resumed.handover == "handed over"
        assert resumed.frames_lost == seen["journaled"] - resumed.frames == 2


def test_on_the_disk_tier_a_handover_stopped_in_a_batch_closes_that_stream_alone(checkpoint, tmp_path, references,
                                                                                 monkeypatch):
    import statekv.api.durability as durability
    from statekv.errors import HandoverError

    qa = on_disk(checkpoint, tmp_path)
    first, second = qa.stream(name="first"), qa.stream(name="second")
    finish = durability.finish_handover

    def failing_first(folder):
        if folder == first.durability.folder:
            raise OutputError(f"cannot finish the handover of the disk cache in {folder}: Input/output error")
        return finish(folder)
    monkeypatch.setattr(durability, "finish_handover", failing_first)
    errors = []
    for frame in FRAMES:
        items = [(stream, frame, None) for stream in (first, second) if not stream.prefill.closed]
        errors += [item for item in qa.push_many(items, return_exceptions=True) if isinstance(item, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], HandoverError) and first.prefill.closed
    with second:
        assert second.handover == "handed over"
        assert fingerprint(second.prefill) == fingerprint(references["cache", 40].prefill)
    first.close()
    monkeypatch.setattr(durability, "finish_handover", finish)
    with Stream.load(first.durability.folder, qa) as resumed:
        assert resumed.handover == "handed over"
        for frame in FRAMES[resumed.frames:]:
            resumed.push(frame)
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)


def test_a_stream_whose_folder_was_replaced_leaves_the_folder_now_there_alone(checkpoint, tmp_path, references):
    """The folder moved away and a copy put in its place, resumed by another stream: the first, closing, removes
    nothing of what the path now names (its successor's files, the backlog), and the copy hands over as ever."""
    import shutil

    qa = on_disk(checkpoint, tmp_path)
    first = pushed(qa, FRAMES[:12])
    first.catch_up(3)
    folder = first.durability.folder
    moved = folder.rename(folder.with_name("moved"))
    shutil.copytree(moved, folder, ignore=shutil.ignore_patterns("lock"))
    with Stream.load(folder, qa) as copy:
        first.drop_successor("dropped while another stream lives in what its path names")
        first.close()
        assert "backlog.bin" in files_of(folder) and [path for path in folder.iterdir() if path.is_dir()] == [
            copy.successor.disk.folder]
        for frame in FRAMES[copy.frames:]:
            copy.push(frame)
        assert copy.handover == "handed over"
        assert fingerprint(copy.prefill) == fingerprint(references["cache", 40].prefill)


def test_on_the_disk_tier_it_evicts_as_the_cache_layout_stream(checkpoint, tmp_path):
    """Past its handover the adopted engine's file set has no checkpoint slot open and another journal than the
    cache-layout stream's, but the cap counts them from the steps alone. Before: the handover stream evicted 18
    frames where the cache-layout stream evicted 17, and held another state."""
    cap = {"max_cache_bytes": 1_400_000, "cache_limit": "evict-oldest", "offload": "disk"}
    frames = random_frames(80, seed=3, height=32, width=32)
    with loaded(checkpoint, "handover", offload_dir=tmp_path / "handover", **cap).stream() as stream, \
            loaded(checkpoint, "cache", offload_dir=tmp_path / "cache", **cap).stream() as reference:
        for frame in frames:
            stream.push(frame)
            reference.push(frame)
            if stream.handover == "handed over":
                assert stream.prefill.stats.held_bytes == reference.prefill.stats.held_bytes
        assert stream.handover == "handed over" and stream.stats.evicted_frames > 0
        assert stream.stats.evicted_frames == reference.stats.evicted_frames
        assert stream.prefill.cache.evicted_steps == reference.prefill.cache.evicted_steps
        assert fingerprint(stream.prefill) == fingerprint(reference.prefill)


@pytest.mark.parametrize("moved", [False, True])
def test_on_the_disk_tier_a_steered_stream_caught_up_resumes_its_successor_as_it_was(checkpoint, tmp_path, moved):
    """Caught up under a steering watch, closed and resumed from its folder: its successor goes on from the steps it
    replayed, as steered then, so past the range it is the stream that never stopped (rebuilt from the backlog, its
    replay would be steered by the watches open at the resume). ``moved``: the folder resumed elsewhere."""
    qa = on_disk(checkpoint, tmp_path)
    with qa.stream() as alone:
        alone.watch("what is shown?", every=4)
        for frame in FRAMES[:20]:
            alone.push(frame)
        alone.catch_up()
        for frame in FRAMES[20:]:
            alone.push(frame)
        assert alone.handover == "handed over"
        expected = fingerprint(alone.prefill)
    with qa.stream() as stream:
        stream.watch("what is shown?", every=4)
        for frame in FRAMES[:20]:
            stream.push(frame)
        stream.catch_up()
        folder = stream.durability.folder
    if moved:
        folder = Path(shutil.move(str(folder), str(tmp_path / "moved")))
    with Stream.load(folder, qa) as resumed:
        assert resumed.handover == "beside" and not resumed.backlog.steps
        assert [watch.question for watch in resumed.watches] == ["what is shown?"]
        for frame in FRAMES[20:]:
            resumed.push(frame)
        assert resumed.handover == "handed over" and not any(path.is_dir() for path in folder.iterdir())
        assert fingerprint(resumed.prefill) == expected


@pytest.mark.parametrize("damage", ["journal", "gone"])
def test_on_the_disk_tier_a_kept_successor_that_does_not_resume_is_rebuilt_from_the_backlog(checkpoint, tmp_path,
                                                                                         references, damage, caplog):
    qa = on_disk(checkpoint, tmp_path)
    with pushed(qa, FRAMES[:20]) as stream:
        stream.catch_up(5)
        folder = stream.durability.folder
    [kept] = [path for path in folder.iterdir() if path.is_dir()]
    if damage == "gone":
        shutil.rmtree(kept)
    else:
        journal = next(path for path in kept.iterdir() if path.name.startswith("journal"))
        journal.write_bytes(journal.read_bytes()[:-40])
    with Stream.load(folder, qa) as resumed:
        assert resumed.handover == "beside" and len(resumed.backlog.steps) == len(resumed.step_frames)
        assert "it replays its backlog again" in caplog.text
        assert [path for path in folder.iterdir() if path.is_dir()] == [resumed.successor.disk.folder] != [kept]
        for frame in FRAMES[20:]:
            resumed.push(frame)
        assert resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == fingerprint(references["cache", 40].prefill)
