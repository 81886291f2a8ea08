"""An evicting stream's step summaries and segment index hold the rows of what it keeps, not of every step it
streamed, and a question over it sees the steps it holds alone: it chooses the same steps and answers the same
tokens as a question over every step streamed (evicted ones masked) did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import statekv.core.answering.held as held
import statekv.core.storage.layer_storage as layer_storage
from statekv import Stream
from statekv.core.answering.retrieval import AttentionShare, LayerQuestion
from statekv.models import load_adapter
from statekv.settings.methods import RETRIEVAL_RULES

from conftest import random_frames, tiny_qa

QUESTION = "What happened?"
EVICTING = dict(offload=True, max_cache_bytes=60_000, cache_limit="evict-oldest")
HOLDING_MORE = dict(EVICTING, max_cache_bytes=300_000)  # about ten steps held besides the prompt prefix


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def evicted_stream(adapter, monkeypatch, **settings):
    """A stream of 150 frames under `EVICTING` (segments of 2 steps), its steps and the steps it holds."""
    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", 2)
    stream = tiny_qa(adapter, "recency", **{**EVICTING, **settings}).stream()
    for frame in random_frames(150):
        stream.push(frame)
    cache = stream.prefill.cache
    steps = len(cache.chunk_lengths)
    held_steps = steps - len(cache.evicted_steps)
    assert steps > 100 and held_steps < 16
    return stream, steps, held_steps


def test_an_evicting_streams_summaries_and_segment_index_take_rows_for_what_it_holds(adapter, monkeypatch):
    """Before: one allocation each, addressed by every step (segment) streamed and doubled as they came (256 rows
    of step summaries for 150 steps holding a few)."""
    stream, steps, held_steps = evicted_stream(adapter, monkeypatch)
    cache = stream.prefill.cache
    for layer in cache.layers:
        storage = layer.storage
        for buffer in (storage.block_keys, storage.step_samples):  # packed when half are released: a few times
            assert buffer.length == steps and buffer.capacity <= 4 * held_steps + 4, buffer.capacity
        assert storage.segment_index.length == steps // 2
        assert storage.segment_index.capacity <= 4 * held_steps + 4, storage.segment_index.capacity
    assert stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2).numel()


@dataclass(frozen=True)
class Recording(AttentionShare):
    """The attention rule, noting how many steps each layer's question held."""

    name: ClassVar[str] = "recording"
    seen: list = None

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        self.seen.append((len(seen.steps), seen.step_means.shape[2], seen.held is not None))
        return super().scores(seen)


def _streams(adapter, monkeypatch, frames, **settings):
    """The same frames streamed with the summaries compacted and questions over the held steps, then as before."""
    made = []
    for compact in (True, False):
        monkeypatch.setattr(layer_storage, "COMPACTED", layer_storage.COMPACTED if compact else ())
        stream = tiny_qa(adapter, "statekv", **{**EVICTING, **settings}).stream()
        for frame in frames:
            stream.push(frame)
        made.append(stream)
    return made


@pytest.mark.parametrize("per_segment, when_full, kv_cache_dtype", [
    (2, "evict-oldest", None), (16, "evict-oldest", "int8"), (4, "evict-least-attended", "int8")])
def test_a_question_over_the_held_steps_chooses_and_answers_as_over_every_step(adapter, monkeypatch, per_segment,
                                                                               when_full, kv_cache_dtype):
    """Hierarchical (small segments) or not (16 steps a segment, 3 retrieved), a segment evicted in part among
    those held; past the tiny model's range (bounded positions: steps scored turned)."""
    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", per_segment)
    settings = dict(HOLDING_MORE, cache_limit=when_full, kv_cache_dtype=kv_cache_dtype)
    frames = random_frames(100, seed=per_segment)
    compacted, whole = _streams(adapter, monkeypatch, frames, **settings)
    assert compacted.prefill.cache.evicted_steps == whole.prefill.cache.evicted_steps
    assert len(compacted.prefill.cache.evicted_steps) > 2 * per_segment
    for rule in ("attention", "rekv", "recent"):
        for retrieve in (1, 2, 3):
            answers = []
            for stream, compact in ((compacted, True), (whole, False)):
                monkeypatch.setattr(held, "COMPACT", compact)
                tokens = stream.ask_tokens(QUESTION, max_new_tokens=3, retrieve=retrieve, retrieval=rule)
                answers.append((tokens.tolist(), stream.answer_info.read_frames))
            assert answers[0] == answers[1], (rule, retrieve)


def test_a_rule_scores_only_the_steps_held(adapter, monkeypatch):
    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", 2)
    stream = tiny_qa(adapter, "statekv", **HOLDING_MORE).stream()
    for frame in random_frames(100):
        stream.push(frame)
    cache = stream.prefill.cache
    held_steps = len(cache.chunk_lengths) - len(cache.evicted_steps)
    rule = Recording(seen=[])
    monkeypatch.setitem(RETRIEVAL_RULES, rule.name, rule)
    stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=1, retrieval=rule.name)
    assert rule.seen and all(flag for _, _, flag in rule.seen)
    # the segments it holds whole or in part, and the open one: at most a segment more per held step
    assert all(steps == rows <= 2 * held_steps + 2 < len(cache.chunk_lengths) // 2 for steps, rows, _ in rule.seen)


def test_an_evicting_stream_saved_and_loaded_answers_as_before(adapter, monkeypatch, tmp_path):
    """The file keeps every step's row (released runs left out, as before); a load holds the kept rows alone."""
    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", 2)
    compacted, whole = _streams(adapter, monkeypatch, random_frames(60, seed=3))
    first, second = compacted.prefill.state_dict(), whole.prefill.state_dict()
    assert first[1] == second[1] and sorted(first[0]) == sorted(second[0])
    assert all(torch.equal(first[0][name], second[0][name]) for name in first[0])
    saved = whole.save(tmp_path / "whole.safetensors")
    monkeypatch.setattr(layer_storage, "COMPACTED", ("step_means", "step_samples", "segment_index"))
    loaded = Stream.load(saved, tiny_qa(adapter, "statekv", **EVICTING))
    storage = loaded.prefill.cache.layers[0].storage
    held_steps = len(loaded.prefill.cache.chunk_lengths) - len(loaded.prefill.cache.evicted_steps)
    assert storage.block_keys.capacity <= held_steps + 1
    for frame in random_frames(10, seed=4):
        loaded.push(frame)
        compacted.push(frame)
    for retrieve in (None, 1, 3):
        assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=3, retrieve=retrieve),
                           compacted.ask_tokens(QUESTION, max_new_tokens=3, retrieve=retrieve))
        assert loaded.answer_info.read_frames == compacted.answer_info.read_frames


def test_a_watch_over_the_held_steps_retrieves_and_answers_as_over_every_step(adapter, monkeypatch):
    monkeypatch.setattr(layer_storage, "SEGMENT_STEPS", 2)
    frames = random_frames(60, seed=5)
    answers = []
    for compact in (True, False):
        monkeypatch.setattr(layer_storage, "COMPACTED", ("step_means", "step_samples", "segment_index")
                            if compact else ())
        monkeypatch.setattr(held, "COMPACT", compact)
        stream = tiny_qa(adapter, "statekv", **HOLDING_MORE).stream()
        watch = stream.watch(QUESTION, retrieve=2, steer=False, max_new_tokens=3)
        evaluated = []
        for at in range(0, len(frames), 10):
            for frame in frames[at:at + 10]:
                stream.push(frame)
            evaluated.append(watch.evaluate())
        answers.append(evaluated)
    assert len(stream.prefill.cache.evicted_steps) > 20
    assert answers[0] == answers[1]


def test_a_compact_buffer_reads_saves_and_loads_as_a_token_buffer_holding_only_its_kept_rows():
    import random

    from statekv.core.storage.buffers import TokenBuffer
    from statekv.core.storage.compact import CompactBuffer
    from statekv.core.storage.host_pages import saved_rows

    for seed in range(10):
        chance, compact, whole = random.Random(seed), CompactBuffer(1), TokenBuffer(1, None, "cpu", pin=False)
        generator = torch.Generator().manual_seed(seed)
        for row in range(200):
            part = torch.randn(1, 2, 1, 3, generator=generator)
            for buffer in (compact, whole):
                buffer.reserve(part, row + 1)
                buffer.write(row, part)
                buffer.length = row + 1
            if row > 5 and chance.random() < 0.6:
                start = chance.randrange(row - 2)
                end = min(row, start + chance.randrange(1, 6))
                compact.release(start, end)
                whole.release(start, end)
            if row % 37 == 0:
                index = torch.tensor(sorted(chance.sample(range(row + 1), min(row + 1, 10))))
                assert torch.equal(compact.gather(index)[0], whole.gather(index)[0])
        kept = 200 - whole.released.rows
        # packed once released rows outnumber the kept ones, growing by doubling: at most four times the kept rows
        assert torch.equal(compact.view(0, 200)[0], whole.view(0, 200)[0]) and compact.capacity <= 4 * kept + 4
        (saved, *_), released = saved_rows(compact, 200)
        (expected, *_), expected_released = saved_rows(whole, 200)
        assert released == expected_released and torch.equal(saved, expected)
        loaded = CompactBuffer(1)
        loaded.load(saved, released=released)
        assert loaded.length == 200 and loaded.capacity == kept
        assert torch.equal(loaded.view(0, 200)[0], whole.view(0, 200)[0])


def test_a_disk_tier_streams_segment_index_in_ram_takes_rows_for_what_it_holds(adapter, monkeypatch, tmp_path):
    """Before: the RAM half of the disk tier's segment index was addressed by every segment streamed (doubled as
    they came), its evicted pages given back but not its address space."""
    stream, steps, held_steps = evicted_stream(adapter, monkeypatch, offload="disk", offload_dir=str(tmp_path))
    cache = stream.prefill.cache
    for layer in cache.layers:
        assert layer.storage.segment_index.length == steps // 2
        assert layer.storage.segment_index.capacity <= 4 * held_steps + 4, layer.storage.segment_index.capacity
    assert stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2).numel()


def test_an_evicting_int4_stream_reads_its_key_scales_without_a_tensor_of_every_steps_start(adapter, monkeypatch):
    """Before: reading tokens' key scales searched a tensor of every step's first token, made anew after each step
    and kept by each layer (8 B a step per layer, for ever); now the steps the tokens lie in alone."""
    from statekv.core.storage.step_values import StepValues

    stream = tiny_qa(adapter, "recency", **dict(EVICTING, kv_cache_dtype="int4", max_cache_bytes=30_000)).stream()
    for frame in random_frames(120):
        stream.push(frame)
    cache = stream.prefill.cache
    assert len(cache.chunk_lengths) > 100 and len(cache.chunk_lengths) - len(cache.evicted_steps) < 20
    made = []
    tensor = StepValues.tensor
    monkeypatch.setattr(StepValues, "tensor", lambda values: made.append(len(values)) or tensor(values))
    last = cache.seen_tokens - 1
    index = torch.tensor([0, 1, last - 20, last - 1, last])  # the prompt prefix and the last steps
    first = [layer.storage.read_tokens(index) for layer in cache.layers]
    assert made == []
    monkeypatch.setattr(StepValues, "tensor", tensor)
    for layer, read in zip(cache.layers, first):  # what each token reads, whole tensor or not
        expected = layer.storage.read_tokens(index[:1]), layer.storage.read_tokens(index[1:])
        assert all(torch.equal(part, torch.cat([a, b], 2)) for part, a, b in zip(read, *expected))
    assert stream.ask_tokens(QUESTION, max_new_tokens=2, retrieve=2).numel()
