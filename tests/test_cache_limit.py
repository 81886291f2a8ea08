"""A hard cap on the detailed cache (max_cache_bytes): refuse (nothing lost, the stream still answers), evict the
oldest or the least attended frames (counted, never read again, positions unchanged), on every offloaded tier."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

import statekv
from statekv import Stream
from statekv.core.storage.limits import CacheLimit
from statekv.core.stream.prefill import cache_geometry
from statekv.core.answering.retrieval import LayerQuestion, MostRecent, Retrieval, segment_bounds
from statekv.errors import CacheLimitError, ConfigurationError, InputError
from statekv.settings.values import format_bytes
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _steps(adapter, frames: int) -> tuple[list[int], int, int]:
    """(each step's tokens for ``frames`` frames, the prompt prefix's step first; bytes per token; the bytes each
    step adds besides its tokens: its retrieval summaries)."""
    probe = tiny_qa(adapter, "recency").stream(horizon_frames=frames)
    for frame in random_frames(frames):
        probe.push(frame)
    assert probe.prefix_tokens and probe.prefill.cache.chunk_lengths[0] == probe.prefix_tokens
    return (list(probe.prefill.cache.chunk_lengths), cache_geometry(adapter.model).bytes_per_token,
            probe.prefill.bytes_per_step)


def _oldest_evicted(lengths: list[int], cap: int, per_token: int, per_step: int) -> list[int]:
    """The steps evict-oldest gives up under ``cap`` bytes (each step: its tokens and its summaries), simulated:
    before each step, the oldest frames go until it fits (the prefix stays; a 2-frame recency window carries only
    the newest frames)."""
    held, evicted = [0], []
    cost = lambda step: lengths[step] * per_token + per_step  # noqa: E731
    for step in range(1, len(lengths)):
        while sum(cost(s) for s in held) + cost(step) > cap:
            evicted.append(held.pop(1))
        held.append(step)
    return evicted


def test_refuse_keeps_everything_and_the_stream_still_answers(adapter):
    lengths, per_token, per_step = _steps(adapter, 4)
    cap = sum(lengths[:4]) * per_token + 4 * per_step  # the prefix and 3 frames, with their summaries
    stream = tiny_qa(adapter, "recency", max_cache_bytes=cap).stream(horizon_frames=6)
    for frame in random_frames(3):
        stream.push(frame)
    before = (stream.frames, stream.tokens, stream.ask_tokens(QUESTION, max_new_tokens=4))
    with pytest.raises(CacheLimitError) as error:
        stream.push(random_frames(4)[3])
    message = str(error.value)
    assert "\n" not in message and "the detailed cache is full (max_cache_bytes=" in message
    assert "was refused; everything streamed before it is kept and can be asked about" in message
    assert (stream.frames, stream.tokens) == before[:2] and not stream.pending
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=4), before[2])
    assert stream.stats.evicted_frames == 0 and stream.prefill.stats.evicted_steps == 0
    held = stream.prefill.stats
    assert held.held_bytes == sum(lengths[:4]) * per_token + 4 * per_step <= cap
    assert held.summary_bytes >= 4 * per_step and held.journal_bytes == held.scale_bytes == 0


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int4"}, {"offload": True}], ids=["model", "int4", "host"])
def test_a_stream_without_a_cap_counts_what_a_cap_would(adapter, options):
    """Before: without a cap, held_bytes was the detailed cache as allocated, a whole horizon's from the first
    frame, so it could not be compared with a cap or with another stream's."""
    capped = tiny_qa(adapter, "recency", max_cache_bytes="1G", **options).stream(horizon_frames=6)
    free = tiny_qa(adapter, "recency", **options).stream(horizon_frames=6)
    assert free.prefill.stats.held_bytes == capped.prefill.stats.held_bytes > 0  # the prompt prefix
    for frame in random_frames(3):
        capped.push(frame)
        free.push(frame)
        assert free.prefill.stats.held_bytes == capped.prefill.stats.held_bytes > 0
    stats = free.prefill.stats  # buffers for six frames, three held
    assert stats.held_bytes < stats.detailed_bytes + stats.summary_bytes + stats.journal_bytes


@pytest.fixture(scope="module")
def static_adapter(tmp_path_factory):
    """RoPE that does not depend on the horizon: a video cut short answers as those frames encoded alone."""
    rope = {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("static") / "ckpt", text_config=rope)
    return load_adapter(checkpoint, layout="chat")


def test_encode_stops_at_the_cap_and_answers_from_the_frames_that_fit(static_adapter):
    lengths, per_token, per_step = _steps(static_adapter, 6)
    cap = sum(lengths[:4]) * per_token + 4 * per_step  # the prefix and 3 frames, with their summaries
    video = random_frames(6)
    with pytest.raises(CacheLimitError) as error:
        tiny_qa(static_adapter, "recency", max_cache_bytes=cap).encode(video, max_frames=6)
    message = str(error.value)
    assert message == (f"array[6]: the detailed cache is full at frame 4 of 6 (max_cache_bytes={format_bytes(cap)}): "
                       "encoding stopped; the first 3 frames are encoded and can be asked about")
    encoded = error.value.encoded
    assert isinstance(encoded, statekv.EncodedVideo)
    assert encoded.frames == encoded.stats.frames == 3 and encoded.tokens == sum(lengths[:4])
    assert encoded.prefill.stats.held_bytes <= cap
    alone = tiny_qa(static_adapter, "recency").encode(video[:3], max_frames=6)  # only the frames that fit, no cap
    for retrieve in (None, 2):
        assert torch.equal(encoded.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve),
                           alone.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve))
    assert encoded.answer_info.frames == 3
    # exactly at the cap: not stopped
    with tiny_qa(static_adapter, "recency", max_cache_bytes=cap).encode(video[:3]) as fits:
        assert fits.frames == 3 and fits.prefill.stats.held_bytes == cap


def test_encode_says_when_nothing_fits(static_adapter):
    lengths, per_token, per_step = _steps(static_adapter, 1)
    video = random_frames(4)
    with pytest.raises(CacheLimitError) as error:  # the prompt prefix fits, the first frame does not
        tiny_qa(static_adapter, "recency", max_cache_bytes=lengths[0] * per_token + per_step).encode(video)
    assert str(error.value).endswith("the detailed cache is full at frame 1 of 4 (max_cache_bytes="
                                     f"{format_bytes(lengths[0] * per_token + per_step)}): no frame fit under it, so "
                                     "there is nothing to ask about")
    assert error.value.encoded.frames == 0
    with pytest.raises(InputError, match="no frame has been encoded"):
        error.value.encoded.ask(QUESTION)
    with pytest.raises(CacheLimitError, match="cannot hold even the prompt") as error:
        tiny_qa(static_adapter, "recency", max_cache_bytes=per_token).encode(video)
    assert error.value.encoded is None
    evicting = tiny_qa(static_adapter, "recency", offload=True, max_cache_bytes=lengths[0] * per_token + per_step,
                       cache_limit="evict-oldest")
    with pytest.raises(CacheLimitError) as error:  # a frame too large even with every other one evicted
        evicting.encode(video)
    assert "even after evicting" in str(error.value) and "encoding stopped at frame 1 of 4" in str(error.value)
    assert error.value.encoded.frames == 0


def test_a_stream_still_answers_when_its_pending_batch_does_not_fit(static_adapter):
    lengths, per_token, per_step = _steps(static_adapter, 4)
    cap = sum(lengths[:3]) * per_token + 3 * per_step  # the prefix and 2 frames
    stream = tiny_qa(static_adapter, "recency", max_cache_bytes=cap).stream(horizon_frames=6, vision_batch=3)
    frames = random_frames(3)
    stream.push(frames[0])
    stream.push(frames[1])
    with pytest.raises(CacheLimitError):  # the batch of 3: the first 2 steps fit, the third is refused
        stream.push(frames[2])
    assert stream.frames == 2 and not stream.pending
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=6),
                       tiny_qa(static_adapter, "recency").encode(frames[:2], max_frames=6).ask_tokens(
                           QUESTION, max_new_tokens=6))
    small = tiny_qa(static_adapter, "recency", max_cache_bytes=cap).stream(horizon_frames=6, vision_batch=4)
    for frame in frames:  # pending, waiting for a batch of 4: asking encodes them, and the cap stops the third
        small.push(frame)
    assert small.frames == 0 and len(small.pending) == 3
    answer = small.ask_tokens(QUESTION, max_new_tokens=6)
    assert small.frames == 2 and len(small.pending) == 1 and small.answer_info.frames == 2
    assert torch.equal(answer, stream.ask_tokens(QUESTION, max_new_tokens=6))


@pytest.mark.parametrize("offload", [True, "disk"])
def test_evict_oldest_answers_from_the_frames_it_kept(adapter, offload, tmp_path, caplog):
    lengths, per_token, per_step = _steps(adapter, 7)
    cap = (lengths[0] + max(lengths[1:]) * 3) * per_token + 4 * per_step
    disk = {"offload_dir": tmp_path} if offload == "disk" else {}
    if disk:  # the journal is counted too (a share per step held): room for it, and to spare
        probe = tiny_qa(adapter, "recency", offload="disk", offload_dir=tmp_path / "probe").stream(horizon_frames=7)
        for frame in random_frames(7):
            probe.push(frame)
        cap += probe.prefill.stats.journal_bytes
    settings = dict(offload=offload, max_cache_bytes=cap, cache_limit="evict-oldest", **disk)
    capped = tiny_qa(adapter, "recency", **settings).stream(horizon_frames=7)
    whole = tiny_qa(adapter, "recency").stream(horizon_frames=7)
    with caplog.at_level(logging.WARNING, logger="statekv"):
        for frame in random_frames(7):
            capped.push(frame)
            whole.push(frame)
    said = [r.getMessage() for r in caplog.records if "max_cache_bytes" in r.getMessage()]
    assert len(said) == 1 and "evicting the oldest frames" in said[0]  # stated once, when it first happened
    evicted = sorted(capped.prefill.cache.evicted_steps)
    kept_frames = 7 - len(evicted)
    assert evicted == list(range(1, len(evicted) + 1))  # the oldest frames; the prompt prefix is protected
    journal = capped.prefill.stats.journal_bytes
    assert (journal > 0) == (offload == "disk")
    simulated = _oldest_evicted(lengths, cap - (probe.prefill.stats.journal_bytes if disk else 0), per_token, per_step)
    if disk:  # its journal also holds the evictions and the room kept for the next step's line: perhaps one more
        assert len(simulated) <= len(evicted) <= len(simulated) + 1
    else:
        assert evicted == simulated
    assert capped.prefill.stats.held_bytes <= cap
    assert capped.stats.evicted_frames == capped.prefill.stats.evicted_steps == len(evicted)
    assert capped.prefill.stats.evicted_tokens == sum(lengths[s] for s in evicted)
    # positions never move: the kept frames answer exactly as the same frames retrieved from the whole cache
    kept = whole.ask_tokens(QUESTION, max_new_tokens=6, retrieve=kept_frames, retrieval="recent")
    assert torch.equal(capped.ask_tokens(QUESTION, max_new_tokens=6, retrieve=None), kept)
    info = capped.answer_info
    assert (info.frames, info.evicted_frames, info.unseen_fraction) == (7, len(evicted), len(evicted) / 7)
    assert torch.equal(capped.ask_tokens(QUESTION, max_new_tokens=6, retrieve=7, retrieval="recent"), kept)
    # given back (to the file system, or host memory's pages to the OS): the evicted rows read as zeros
    starts = np.cumsum([0, *lengths])
    for layer in capped.prefill.cache.layers:
        retained = set(capped.prefill.keeper.retained.get(layer.index, torch.zeros(0)).tolist())
        for s in evicted:
            if retained & set(range(int(starts[s]), int(starts[s + 1]))):
                continue  # carried when it was evicted: given back at a later eviction
            keys, values = layer.detailed.view(int(starts[s]), int(starts[s + 1]))
            assert not keys.any() and not values.any()
    if offload == "disk":
        capped.close()  # one owner at a time (closing checkpoints it: it resumes where it is)
        resumed = Stream.load(capped.prefill.disk.folder, tiny_qa(adapter, "recency", **settings))
        assert resumed.stats.evicted_frames == len(evicted) and resumed.prefill.cache.evicted_steps == set(evicted)
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=None), kept)


@pytest.mark.parametrize("offload", [True, "disk"])
def test_a_stream_resumed_at_its_cap_says_so_once_and_does_not_warn_again_as_if_new(adapter, offload, tmp_path,
                                                                                    caplog):
    """Before: a stream loaded (or resumed from its disk tier) after its cache reached its cap warned at its next
    eviction that the cap was reached, "from now on", as if for the first time: once more per restart."""
    lengths, per_token, per_step = _steps(adapter, 7)
    cap = (lengths[0] + max(lengths[1:]) * 3) * per_token + 4 * per_step
    disk = {"offload_dir": tmp_path / "tier"} if offload == "disk" else {}
    if disk:
        probe = tiny_qa(adapter, "recency", offload="disk", offload_dir=tmp_path / "probe").stream(horizon_frames=7)
        for frame in random_frames(7):
            probe.push(frame)
        cap += probe.prefill.stats.journal_bytes
    settings = dict(offload=offload, max_cache_bytes=cap, cache_limit="evict-oldest", **disk)
    frames = random_frames(10)
    with caplog.at_level(logging.INFO, logger="statekv"):
        capped = tiny_qa(adapter, "recency", **settings).stream(horizon_frames=12)
        for frame in frames[:7]:
            capped.push(frame)
        assert capped.stats.evicted_frames > 0
        if disk:
            capped.close()
            resumed = Stream.load(capped.prefill.disk.folder, tiny_qa(adapter, "recency", **settings))
        else:
            resumed = Stream.load(capped.save(tmp_path / "s.safetensors"), tiny_qa(adapter, "recency", **settings))
        before = resumed.stats.evicted_frames
        for frame in frames[7:]:
            resumed.push(frame)
        assert resumed.stats.evicted_frames > before  # it went on evicting
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "max_cache_bytes" in
              r.getMessage()]
    assert len(warned) == 1, warned  # when the cap was first reached, not again after the load
    resumed_notes = [r.getMessage() for r in caplog.records if "resumed at its detailed cache's cap" in r.getMessage()]
    assert len(resumed_notes) == 1 and "evicting the oldest frames goes on" in resumed_notes[0], resumed_notes


def test_evict_least_attended_gives_up_the_frames_the_stream_attended_least(adapter, tmp_path):
    lengths, per_token, _ = _steps(adapter, 4)
    stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, max_cache_bytes=sum(lengths) * per_token,
                     cache_limit="evict-least-attended").stream(horizon_frames=8)
    evictions = []
    keeper = stream.prefill.keeper
    original = keeper.evict

    def record(steps):
        cache = stream.prefill.cache
        starts = np.cumsum([0, *cache.chunk_lengths])
        evictable = [s for s in range(len(cache.chunk_lengths))  # not evicted yet, after the protected prefix
                     if s not in cache.evicted_steps and starts[s] >= keeper.protect_tokens]
        tallied = dict(zip(*(t.tolist() for t in cache.tally.export(cache.evicted_steps))))
        evictions.append((steps, evictable, tallied))
        original(steps)

    keeper.evict = record
    for frame in random_frames(8):
        stream.push(frame)
    assert evictions and stream.stats.evicted_frames == sum(len(steps) for steps, _, _ in evictions)
    for steps, evictable, tally in evictions:
        assert steps and set(steps) <= set(evictable)
        others = [s for s in evictable if s not in steps]
        assert max(tally.get(s, 0.0) for s in steps) <= min([tally.get(s, 0.0) for s in others] or [float("inf")])
        assert sum(tally.values()) > 0
    # what a layer still carries of an evicted frame is kept: the carried state stays the detailed cache's own
    for layer in stream.prefill.cache.layers:
        positions = layer.positions()
        index = positions.unsqueeze(-1).expand(*positions.shape, layer.detailed.keys.shape[-1])
        for carried, detailed in zip(layer.carried(), layer.detailed.tensors):
            assert torch.equal(detailed.gather(2, index), carried)
    stream.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)


def test_retrieval_never_chooses_an_evicted_step():
    steps = (4, 2, 2, 2, 2)
    seen = LayerQuestion(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 12, 4), torch.zeros(1, 1, 5, 4), steps, 1.0,
                         evicted=frozenset({3, 4}))
    assert Retrieval(2, keep_tokens=4, rule=MostRecent()).choose(seen) == [1, 2]
    assert Retrieval(9, keep_tokens=4, rule=MostRecent()).choose(seen) == [1, 2]


def test_retrieval_never_ranks_a_segment_every_step_of_which_was_evicted():
    from statekv.core.answering.retrieval import MeanKeyMatch

    steps, per_segment = (4,) + (2,) * 32, 4  # the prompt, then 8 complete segments of 4 steps and an open one
    index = torch.zeros(1, 1, 8, 12)
    index[0, 0, :, 8:] = torch.arange(8.0)[:, None]  # each segment's key sum: the later, the better matched
    index[0, 0, 2, 8:] = 100.0  # the best of all, but every step of it was evicted
    seen = LayerQuestion(0, torch.ones(1, 1, 1, 4), None, torch.zeros(1, 1, 33, 4), steps, 1.0,
                         evicted=frozenset(range(8, 12)), segments=index, segment_steps=per_segment)
    chosen = Retrieval(1, keep_tokens=4, rule=MeanKeyMatch()).candidates(seen, 1).tolist()
    assert chosen == [*range(24, 32), 32]  # the two best segments left (6 and 7), then the open one
    means = torch.zeros(1, 1, 33, 4)
    kept = LayerQuestion(0, torch.ones(1, 1, 1, 4), None, means, steps, 1.0,
                         evicted=frozenset(range(8, 11)), segments=index, segment_steps=per_segment)
    # evicted in part: ranked by its held step's keys alone, here matched worse than segments 6 and 7's
    assert Retrieval(1, keep_tokens=4, rule=MeanKeyMatch()).candidates(kept, 1).tolist() == [*range(24, 32), 32]
    means[0, 0, 11] = 100.0  # its held step's keys matched best: the segment ranks first
    assert Retrieval(1, keep_tokens=4, rule=MeanKeyMatch()).candidates(kept, 1).tolist()[:4] == [8, 9, 10, 11]
    few = LayerQuestion(0, torch.ones(1, 1, 1, 4), None, torch.zeros(1, 1, 33, 4), steps, 1.0,
                        evicted=frozenset(range(1, 24)), segments=index, segment_steps=per_segment)
    assert Retrieval(1, keep_tokens=4, rule=MeanKeyMatch()).candidates(few, 1).tolist() == [*range(24, 32), 32]
    queries = torch.randn(1, 1, 2, 4)  # the default rule's bound: a segment given back is out of its softmax
    bounds = segment_bounds(replace(seen, queries=queries))
    live = [g for g in range(8) if g != 2]
    alone = segment_bounds(replace(seen, queries=queries, segments=index[:, :, live], evicted=frozenset()))
    assert bounds[2] == 0 and torch.allclose(bounds[live], alone)


@pytest.mark.parametrize("offload, kv_cache_dtype", [(True, None), ("disk", None), ("disk", "int8")])
def test_a_stream_that_evicts_gives_back_the_index_rows_of_segments_it_evicted_whole(adapter, offload, kv_cache_dtype,
                                                                                    tmp_path):
    lengths, per_token, per_step = _steps(adapter, 3)
    disk = {"offload_dir": tmp_path / "tiers"} if offload == "disk" else {}
    frames = 40 if kv_cache_dtype is None else 12  # the cap's room, in float32 frames (int8 ones take a third)
    cap = (lengths[0] + max(lengths[1:]) * frames) * per_token + 60 * per_step + (60_000 if disk else 0)
    settings = dict(offload=offload, max_cache_bytes=cap, cache_limit="evict-oldest", kv_cache_dtype=kv_cache_dtype,
                    **disk)
    qa = tiny_qa(adapter, "statekv", **settings)
    stream = qa.stream()
    for frame in random_frames(110):
        stream.push(frame)
    keeper, cache = stream.prefill.keeper, stream.prefill.cache
    storage = cache.layers[0].storage
    wholly = [g for g in range(storage.segment_index.length)
              if all(s in cache.evicted_steps for s in range(16 * g, 16 * g + 16))]
    assert len(wholly) == keeper.released_segments >= 2 and stream.prefill.stats.held_bytes <= cap
    for layer in cache.layers:
        index = layer.storage.segment_index.view(0, layer.storage.segment_index.length)[0]
        assert not index[:, :, wholly].any() and index[:, :, wholly[-1] + 1:].any()
    answer = stream.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)
    if offload is True:  # saved and loaded: the same count, rows and answer
        loaded = Stream.load(stream.save(tmp_path / "s.safetensors"), qa)
        assert loaded.prefill.keeper.released_segments == keeper.released_segments
        assert loaded.prefill.stats.held_bytes == stream.prefill.stats.held_bytes
        assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer)
    else:  # closed and resumed from its folder
        stream.close()
        resumed = Stream.load(stream.prefill.disk.folder, tiny_qa(adapter, "statekv", **settings))
        assert resumed.prefill.keeper.released_segments == keeper.released_segments
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer)


def test_a_disk_tier_stream_stays_under_its_cap_at_every_checkpoint(adapter, tmp_path, monkeypatch):
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 16)  # a checkpoint's slot is written every 16 steps
    for cap in (140_000, 220_000, 380_000):  # a few frames to many
        stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path / str(cap), max_cache_bytes=cap,
                         cache_limit="evict-oldest").stream()
        held = []
        for frame in random_frames(34):
            stream.push(frame)
            held.append(stream.prefill.stats.held_bytes)
        assert stream.prefill.cache.evicted_steps and max(held) <= cap, (cap, max(held))
        stream.close()


def test_refused_frames_leave_no_trace_in_a_disk_tier_stream(adapter, tmp_path):
    """Before: each refused push left its journal record, so a camera pushing on into a full stream grew its
    journal (which the cap counts) past the cap, and a resumed stream counted the refused frames lost."""
    stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, max_cache_bytes=60_000).stream()
    frames, refused = random_frames(60), 0
    for frame in frames:
        try:
            stream.push(frame)
        except CacheLimitError:
            refused += 1
            if refused == 1:
                journal = (stream.prefill.disk.folder / "journal").stat().st_size
    assert refused > 20 and (stream.prefill.disk.folder / "journal").stat().st_size == journal
    assert stream.prefill.stats.held_bytes <= 60_000
    folder, kept = stream.prefill.disk.folder, stream.frames
    stream.close()
    resumed = Stream.load(folder, tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path))
    assert (resumed.frames, resumed.frames_lost) == (kept, 0)
    resumed.close()


def test_a_saved_stream_keeps_its_evictions(adapter, tmp_path):
    lengths, per_token, per_step = _steps(adapter, 5)
    cap = (lengths[0] + max(lengths[1:]) * 2) * per_token + 3 * per_step
    qa = tiny_qa(adapter, "recency", offload=True, max_cache_bytes=cap, cache_limit="evict-oldest")
    stream = qa.stream(horizon_frames=5)
    for frame in random_frames(5):
        stream.push(frame)
    evicted = _oldest_evicted(lengths, cap, per_token, per_step)
    loaded = Stream.load(stream.save(tmp_path / "s.safetensors"), qa)
    assert loaded.prefill.cache.evicted_steps == stream.prefill.cache.evicted_steps == set(evicted)
    assert loaded.stats.evicted_frames == len(evicted)
    assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=4), stream.ask_tokens(QUESTION, max_new_tokens=4))
    uncapped = Stream.load(tmp_path / "s.safetensors", tiny_qa(adapter, "recency", offload=True))  # counted too
    assert uncapped.prefill.stats.held_bytes == loaded.prefill.stats.held_bytes == stream.prefill.stats.held_bytes


def test_bad_cache_limits_are_refused_with_one_line(adapter):
    cases = [(dict(max_cache_bytes=1 << 20, cache_limit="evict-oldest"), "needs the detailed cache offloaded"),
             (dict(offload=True, max_cache_bytes=1 << 20, cache_limit="evict-least-attended"),
              "needs attention scores"),
             (dict(max_cache_bytes=0), "max_cache_bytes"), (dict(max_cache_bytes="20 gigs"), "max_cache_bytes"),
             (dict(cache_limit="evict-oldest"), "needs max_cache_bytes"), (dict(cache_limit="drop"), "cache_limit")]
    for kwargs, needle in cases:
        with pytest.raises(ConfigurationError) as error:
            tiny_qa(adapter, "recency", **kwargs).stream(horizon_frames=2)
        assert "\n" not in str(error.value) and needle in str(error.value), str(error.value)
    for when_full in ("evict-oldest", "evict-least-attended"):  # before: full attention under evict-oldest grew
        with pytest.raises(ConfigurationError) as error:  # past its cap, yet hid the frames it evicted from answers
            tiny_qa(adapter, "full", offload=True, max_cache_bytes=1 << 20, cache_limit=when_full).stream()
        assert str(error.value) == (f"cache_limit={when_full} cannot bound FullAttention(): it carries every token, "
                                    "which eviction never gives back; use cache_limit=refuse, or a method with a "
                                    "budget (statekv, recency)")
    tiny_qa(adapter, "full", offload=True, max_cache_bytes=1 << 20).stream().close()  # refuse: bounded as asked
    with pytest.raises(ConfigurationError, match="cache_limit"):
        CacheLimit(100, "sometimes")
    options = statekv.ModelOptions.from_strings({"max_cache_bytes": "512M", "cache_limit": "evict-oldest"})
    assert options.max_cache_bytes == 512 << 20
    with pytest.raises(ConfigurationError, match="max_cache_bytes must be a size"):
        statekv.ModelOptions.from_strings({"max_cache_bytes": "lots"})


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_an_evicting_stream_saved_loaded_and_saved_again_is_the_same(adapter, kv_cache_dtype, tmp_path):
    lengths, per_token, per_step = _steps(adapter, 7)
    cap = (lengths[0] + max(lengths[1:]) * 3) * per_token + 4 * per_step
    settings = dict(offload=True, max_cache_bytes=cap, cache_limit="evict-oldest", kv_cache_dtype=kv_cache_dtype)
    qa = tiny_qa(adapter, "statekv", **settings)
    stream = qa.stream()
    frames = random_frames(40)
    for frame in frames[:20]:
        stream.push(frame)
    loaded = Stream.load(stream.save(tmp_path / "a.safetensors"), qa)
    assert loaded.prefill.cache.evicted_steps == stream.prefill.cache.evicted_steps
    first, second = stream.prefill.state_dict(), loaded.prefill.state_dict()  # at once: evicted rows given back
    assert all(torch.equal(first[0][name], second[0][name]) for name in first[0])
    for frame in frames[20:]:  # both go on: the loaded one gives back what it evicted before and since
        stream.push(frame)
        loaded.push(frame)
    assert len(stream.prefill.cache.evicted_steps) > 25
    if kv_cache_dtype:  # each evicted step's key scales are given back once no layer carries its tokens
        starts = np.cumsum([0, *stream.prefill.cache.chunk_lengths])
        for layer in stream.prefill.cache.layers:
            retained = stream.prefill.keeper.retained[layer.index].tolist()
            carrying = {int(np.searchsorted(starts, t, side="right")) - 1 for t in retained}
            free = sorted(stream.prefill.cache.evicted_steps - carrying)
            scales = layer.storage.key_scales.view(0, layer.storage.key_scales.length)[0]
            assert free and not scales[:, :, free].any() and scales[:, :, sorted(carrying)].all()
    first, second = stream.prefill.state_dict(), loaded.prefill.state_dict()
    assert first[1] == second[1] and sorted(first[0]) == sorted(second[0])
    assert all(torch.equal(first[0][name], second[0][name]) for name in first[0])
    assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=6), loaded.ask_tokens(QUESTION, max_new_tokens=6))


def test_an_evicting_offloaded_stream_keeps_its_host_memory_unpinned_and_its_tokens_in_blocks(adapter):
    """Pinned host memory cannot give pages back (a model on a GPU, offloaded): an evicting stream's buffers are
    made unpinned, and those read row by row (a row per token, the keys' scales) are kept in blocks (`BlockBuffer`),
    so what it evicts leaves its address space too, and those read whole (the step summaries, the segment index)
    hold the rows it keeps alone (`CompactBuffer`); a stream that keeps everything keeps pinned buffers, one
    allocation each. tests/test_cuda.py checks the memory itself on a GPU."""
    from statekv.core.storage.blocks import BlockBuffer
    from statekv.core.storage.buffers import TokenBuffer
    from statekv.core.storage.compact import CompactBuffer

    for limit, evicts in ((dict(max_cache_bytes=60_000, cache_limit="evict-oldest"), True),
                          (dict(max_cache_bytes=60_000), False), ({}, False)):
        for dtype in (None, "int8"):
            stream = tiny_qa(adapter, "statekv", offload=True, kv_cache_dtype=dtype, **limit).stream()
            assert stream.prefill.tier.evicts is evicts, (limit, dtype)
            storage = stream.prefill.cache.layers[0].storage
            per_token = [storage.detailed] if dtype is None else [storage.key_codes, storage.value_codes,
                                                                   storage.value_scales, storage.key_scales]
            kind = BlockBuffer if evicts else TokenBuffer
            assert all(type(buffer) is kind for buffer in per_token), (limit, dtype)
            per_step = [storage.block_keys, storage.step_samples, storage.segment_index]  # packed, the rows held
            assert all(type(buffer) is CompactBuffer if evicts else type(buffer) is TokenBuffer and buffer.pin
                       for buffer in per_step), (limit, dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_an_evicting_quantized_stream_holds_no_more_than_its_cap(adapter, kv_cache_dtype):
    """Before: a quantized evicting stream's per-step buffers (its keys' scales, its summaries) counted the slots
    they had grown ahead of the stream, so ``detailed_bytes`` passed the cap (the GPU suite's CUDA test caught it).
    Those slots hold no memory until written: they are given back when a buffer grows and no longer counted, so
    what the stream reports holding stays under its cap, as it does unquantized."""
    stream = tiny_qa(adapter, "statekv", offload=True, kv_cache_dtype=kv_cache_dtype, max_cache_bytes=60_000,
                     cache_limit="evict-oldest").stream()
    reported = []
    for frame in random_frames(100):
        stream.push(frame)
        reported.append(stream.prefill.stats.detailed_bytes)
    assert stream.prefill.cache.evicted_steps and max(reported) <= 60_000, max(reported)
    assert max(reported[60:]) <= 1.2 * max(reported[20:40])  # it holds what it keeps, not what it streamed


def test_segments_of_one_step_are_given_back_as_their_step_is_evicted(adapter, monkeypatch):
    """With one step per segment (the retrieval benchmark's ``--segment-steps 1``) each eviction empties its
    segments at once: the stream goes on and questions still retrieve (before: a KeyError at the first eviction)."""
    import statekv.core.storage.layer_storage as layer_storage

    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", 1)
    lengths, per_token, per_step = _steps(adapter, 3)
    cap = (lengths[0] + max(lengths[1:]) * 6) * per_token + 60 * per_step
    stream = tiny_qa(adapter, "statekv", offload=True, max_cache_bytes=cap, cache_limit="evict-oldest").stream()
    for frame in random_frames(30):
        stream.push(frame)
    keeper, cache = stream.prefill.keeper, stream.prefill.cache
    assert keeper.released_segments == len(cache.evicted_steps) > 0
    stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2)
    assert not set(stream.answer_info.read_frames) & set(stream.frames_of(tuple(cache.evicted_steps)))


def test_past_the_range_retrieving_at_least_every_held_frame_answers_as_the_whole_held_cache(tmp_path):
    """Past the model's range, a cap that keeps only a few frames leaves a held cache that fits the range whole: a
    question retrieving at least every held frame reads them all, as the question without retrieval does
    (before: refused whenever k frames of the widest step would not fit, though only the held ones are read)."""
    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "ckpt", text_config=short,
                                      vision_config={"image_size": 112})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24, offload=True,
                                         max_cache_bytes="60K", cache_limit="evict-oldest")
    stream = qa.stream()
    for frame in random_frames(60, height=32, width=32):
        stream.push(frame)
    held = stream.frames - stream.stats.evicted_frames
    assert stream.prefill.positions.moved and 1 < held < 10
    whole = stream.ask_tokens(QUESTION, max_new_tokens=3)
    assert stream.answer_info.context == "whole"
    for frames in (held, held + 1, 50):
        assert torch.equal(stream.ask_tokens(QUESTION, max_new_tokens=3, retrieve=frames), whole), frames
        assert stream.answer_info.read_frames == tuple(range(stream.frames - held, stream.frames))
