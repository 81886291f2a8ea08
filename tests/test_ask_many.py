"""Questions asked together (`VideoQA.ask_many`, `statekv.core.answering.together`): several streams' questions as
the rows of one batch, each answered exactly as it is alone (the same tokens, its logits within float rounding), on
the built-in model and on tiny random checkpoints loaded through from_pretrained (InternVL; Qwen3-VL's M-RoPE):
prompts of different lengths, streams of different lengths, stream and bounded positions, the whole cache and
retrieved frames in one batch; questions whose shapes do not allow it answered alone; errors one question's own."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import statekv
import statekv.core.answering.together as together_module
from statekv.core.answering.retrieval import RETRIEVAL_RULES, RetrievalRule
from statekv.errors import InputError
from statekv.models import load_adapter
from statekv.synthetic.plans import plan_video
from statekv.synthetic.prompts import question_prompt
from statekv.synthetic.scenes import render
from statekv.synthetic.seeds import video_rng

from conftest import random_frames, tiny_qa

COUNT = question_prompt("How many times did the video show red?", ["1", "2", "3", "4"])
COLOUR = question_prompt("What colour was the circle?", ["red", "green", "blue", "yellow"])


class Logits:
    """Records the logits of the last position of every call of a model's output head: ``[rows, V]`` per call."""

    def __init__(self, head: torch.nn.Module):
        self.calls: list[torch.Tensor] = []
        self.handle = head.register_forward_hook(lambda module, args, output: self.calls.append(
            output.detach().reshape(-1, *output.shape[-2:])[:, -1].clone() if output.dim() == 3
            else output.detach().clone()))

    def take(self) -> list[torch.Tensor]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        self.handle.remove()


def streams_of(qa, frames, layout):
    """One stream per ``(frames pushed, horizon_frames)`` of ``layout`` (horizon None: bounded positions)."""
    made = []
    for count, horizon in layout:
        stream = qa.stream(horizon, max_fps=None)
        for index in range(count):
            stream.push(frames[index], float(index))
        made.append(stream)
    return made


def assert_as_alone(qa, items, head):
    """Ask ``items`` together, then each alone: the same tokens, and the head's logits for every answer token
    allclose (fp32); the questions that could share one batch did (one forward for all their prompts)."""
    logits = Logits(head)
    try:
        together = qa.ask_tokens_many(items)
        batched = logits.take()
        for row, ((stream, question, kwargs), tokens) in enumerate(zip(items, together)):
            alone = stream.ask_tokens(question, **kwargs)
            assert torch.equal(tokens, alone), (row, tokens, alone)
            steps = logits.take()
            assert len(steps) == alone.shape[1]
            for step, expected in enumerate(steps):
                torch.testing.assert_close(batched[step][row], expected[0], rtol=1e-4, atol=1e-4)
    finally:
        logits.close()
    assert batched[0].shape[0] == len(items)  # every prompt in the first forward
    return together


@pytest.fixture(scope="module")
def builtin():
    return statekv.VideoQA.from_pretrained("builtin")


@pytest.fixture(scope="module")
def scenes():
    return [render(still) for still in plan_video(video_rng(4141, 0), 24).stills]


def test_builtin_questions_of_streams_of_different_lengths_and_positions_answer_as_alone(builtin, scenes):
    streams = streams_of(builtin, scenes, [(5, 30), (11, None), (17, None), (8, 30)])
    items = [(streams[0], COLOUR, {"max_new_tokens": 4}),
             (streams[1], COUNT, {"max_new_tokens": 6}),
             (streams[2], "Why?", {"max_new_tokens": 3}),
             (streams[3], COUNT + " Be brief.", {"max_new_tokens": 5, "retrieve": 2}),
             (streams[1], COLOUR, {"max_new_tokens": 2, "retrieve": 3}),  # a stream asked twice, retrieving once
             (streams[2], COLOUR, {"max_new_tokens": 2})]  # two rows reading one stream's whole cache: one context
    before = builtin.question_batch_sizes.copy()
    answers = assert_as_alone(builtin, items, builtin.adapter.model.get_output_embeddings())
    assert builtin.question_batch_sizes - before == {6: 1}
    assert len({answer.shape[1] for answer in answers}) > 1  # rows that finished at different forwards
    assert streams[3].answer_info.context == "retrieved"  # each stream's answer_info is its last question's
    assert builtin.ask_many(items[:2]) == [streams[0].ask(COLOUR, max_new_tokens=4),
                                           streams[1].ask(COUNT, max_new_tokens=6)]
    for stream in streams:
        stream.close()


@pytest.mark.parametrize("family", ["internvl", "qwen3_vl"])
def test_tiny_random_checkpoints_answer_together_as_alone(tiny_checkpoint, family):
    """Random weights: answers run to their lengths, so rows finish at different forwards; Qwen3-VL places its
    prompts by explicit M-RoPE positions. These checkpoints scale RoPE by the horizon, so streams of other
    horizons rotate otherwise and are answered in batches of their own."""
    qa = statekv.VideoQA.from_pretrained(str(tiny_checkpoint(family)), budget=12, attention="eager",
                                         reserve_tokens=40, dtype="float32")
    frames = random_frames(12, seed=3)
    questions = [("What happens?", {"max_new_tokens": 5}),
                 ("Which colours do the frames show, from first to last?", {"max_new_tokens": 7}),
                 ("Why?", {"max_new_tokens": 4, "retrieve": 2})]
    head = qa.adapter.model.get_output_embeddings()
    made = []
    for layout in ([(3, 16), (8, 16), (6, 16)], [(6, None), (12, None), (2, None)]):  # stream, then bounded
        streams = streams_of(qa, frames, layout)
        answers = assert_as_alone(qa, [(stream, *question) for stream, question in zip(streams, questions)], head)
        assert len({answer.shape[1] for answer in answers}) > 1
        made += streams
    assert qa.question_batch_sizes == {3: 2}
    mixed = [(stream, *questions[index % 3]) for index, stream in enumerate(made)]
    for (stream, question, kwargs), answer in zip(mixed, qa.ask_tokens_many(mixed)):
        assert torch.equal(answer, stream.ask_tokens(question, **kwargs))
    # InternVL's scaled RoPE: a batch per horizon; Qwen3-VL's is not scaled: stream and bounded rows in one batch
    assert qa.question_batch_sizes - Counter({3: 2}) == ({3: 2} if family == "internvl" else {6: 1})
    for stream in made:
        stream.close()


def test_bounded_streams_past_the_range_answer_together_as_alone(tmp_path):
    """Past a short model's range a question reads retrieved steps packed before its prompt (`QuestionPlan`):
    such rows, a stream still inside the range and one asked with retrieval share one batch."""
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=short,
                                      vision_config={"image_size": 112})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                         dtype="float32")
    frames = random_frames(20, seed=5, height=32, width=32)
    streams = streams_of(qa, frames, [(14, None), (20, None), (3, None)])
    assert all(stream.tokens > 128 for stream in streams[:2])
    plan = streams[0].prefill.fit_question(8, 4)
    assert not plan.whole and plan.packed
    items = [(streams[0], "Why?", {"max_new_tokens": 4}),
             (streams[1], "What happens in the end?", {"max_new_tokens": 5, "retrieve": 1}),
             (streams[2], "What happens?", {"max_new_tokens": 3})]
    assert_as_alone(qa, items, qa.adapter.model.get_output_embeddings())
    assert qa.question_batch_sizes == {3: 1} and streams[0].answer_info.context == "retrieved"
    for stream in streams:
        stream.close()


def test_offloaded_streams_and_one_that_evicted_frames_answer_together_as_alone(checkpoint):
    """The detailed cache kept off the model's device, and a stream that gave up its oldest frames under
    ``max_cache_bytes``: each row reads what it reads alone (the held steps only)."""
    adapter = load_adapter(checkpoint, layout="chat")
    probe = tiny_qa(adapter, "recency", offload=True).stream(horizon_frames=8)
    for frame in random_frames(4):
        probe.push(frame)
    qa = tiny_qa(adapter, "recency", offload=True, max_cache_bytes=probe.prefill.stats.held_bytes,
                 cache_limit="evict-oldest")
    streams = streams_of(qa, random_frames(8, seed=6), [(8, 8), (3, 8)])
    assert streams[0].prefill.cache.evicted_steps and not streams[1].prefill.cache.evicted_steps
    items = [(streams[0], "Why?", {"max_new_tokens": 5}), (streams[1], "What happens next?", {"max_new_tokens": 4})]
    assert_as_alone(qa, items, adapter.model.get_output_embeddings())
    assert qa.question_batch_sizes == {2: 1}


def test_questions_whose_shapes_do_not_allow_a_batch_are_answered_alone(builtin, scenes, monkeypatch):
    """A repetition penalty changes what greedy decoding picks: that question goes to ``generate`` alone, the
    others still share a batch, and every answer is the one asked alone."""
    rows = []
    original = together_module.answer_together
    monkeypatch.setattr("statekv.api.asking.answer_together", lambda asked: rows.append(len(asked)) or original(asked))
    streams = streams_of(builtin, scenes, [(6, 30), (9, 30), (4, 30)])
    items = [(streams[0], COLOUR, {"max_new_tokens": 3}),
             (streams[1], COUNT, {"max_new_tokens": 3, "repetition_penalty": 1.5}),
             (streams[2], COUNT, {"max_new_tokens": 3})]
    before = builtin.question_batch_sizes.copy()
    answers = builtin.ask_tokens_many(items)
    assert rows == [2] and builtin.question_batch_sizes - before == {2: 1, 1: 1}
    for (stream, question, kwargs), answer in zip(items, answers):
        assert torch.equal(answer, stream.ask_tokens(question, **kwargs))
    for stream in streams:
        stream.close()


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


class StopAfter(StoppingCriteria):
    def __init__(self, tokens: int, prompt: int):
        self.tokens, self.prompt = tokens, prompt

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.prompt >= self.tokens, dtype=torch.bool)


class Lengths(StoppingCriteria):
    """Never stops; records the length of the ids it is called with, a call per token."""

    def __init__(self):
        self.seen: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_streamer_and_stopping_criteria_are_served_as_generate_serves_them(tiny_checkpoint):
    qa = statekv.VideoQA.from_pretrained(str(tiny_checkpoint("internvl")), budget=12, attention="eager",
                                         reserve_tokens=40, dtype="float32")
    streams = streams_of(qa, random_frames(6, seed=4), [(4, 16), (6, 16)])
    prompt = streams[1].adapter.question_ids("Why?", streams[1].state).shape[1]
    together, alone = (Recorder(), Recorder(), Lengths()), (Recorder(), Recorder(), Lengths())

    def items(streamers):  # a criterion is called at every token, the last (at max_new_tokens) included
        return [(streams[0], "What happens?", {"max_new_tokens": 5, "streamer": streamers[0],
                                               "stopping_criteria": StoppingCriteriaList([streamers[2]])}),
                (streams[1], "Why?", {"max_new_tokens": 6, "streamer": streamers[1],
                                      "stopping_criteria": StoppingCriteriaList([StopAfter(2, prompt)])})]

    answers = qa.ask_tokens_many(items(together))
    assert qa.question_batch_sizes == {2: 1} and answers[1].shape[1] == 2
    for (stream, question, kwargs), answer in zip(items(alone), answers):
        assert torch.equal(answer, stream.ask_tokens(question, **kwargs))
    for mine, theirs in zip(together[:2], alone[:2]):
        assert mine.puts == theirs.puts and mine.ended == theirs.ended == 1  # the prompt, then token by token
    assert together[2].seen == alone[2].seen and len(alone[2].seen) == answers[0].shape[1]


class Raising(Recorder):
    """A streamer that raises at its ``at``-th put (the prompt is the first)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def put(self, value):
        super().put(value)
        if len(self.puts) == self.at:
            raise RuntimeError("the client went away")


class RaisingCriterion(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("the criterion broke")


@pytest.mark.parametrize("failing", [{"streamer": Raising(3)}, {"streamer": Raising(1)},
                                     {"stopping_criteria": StoppingCriteriaList([RaisingCriterion()])}],
                         ids=["streamer midway", "streamer at the prompt", "stopping criteria"])
def test_a_question_whose_streamer_or_criteria_raise_fails_alone_and_the_others_stream_once(tiny_checkpoint,
                                                                                              failing):
    qa = statekv.VideoQA.from_pretrained(str(tiny_checkpoint("internvl")), budget=12, attention="eager",
                                         reserve_tokens=40, dtype="float32")
    streams = streams_of(qa, random_frames(6, seed=5), [(4, 16), (6, 16)])
    together, alone = Recorder(), Recorder()
    expected = streams[1].ask_tokens("Why?", max_new_tokens=5, streamer=alone)
    answers = qa.ask_tokens_many([(streams[0], "What happens?", {"max_new_tokens": 5, **failing}),
                                  (streams[1], "Why?", {"max_new_tokens": 5, "streamer": together})],
                                 return_exceptions=True)
    assert isinstance(answers[0], RuntimeError) and torch.equal(answers[1], expected)
    assert together.puts == alone.puts and together.ended == 1  # told each token once, as if asked alone
    for stream in streams:
        stream.close()


@dataclass(frozen=True)
class BrokenAtLayerOne(RetrievalRule):
    """A retrieval rule of a user's that raises at the second layer of a question."""

    name: ClassVar[str] = "broken"

    def scores(self, seen):
        if seen.layer == 1:
            raise RuntimeError("the rule broke")
        return torch.arange(len(seen.steps), dtype=torch.float)


def test_a_question_whose_retrieval_raises_fails_alone_and_a_streamed_one_is_answered(tiny_checkpoint,
                                                                                        monkeypatch):
    """Before: the other question of the batch, streamed, failed with the broken rule's error (its streamer had
    been handed its prompt, so it was not asked again alone)."""
    monkeypatch.setitem(RETRIEVAL_RULES, "broken", BrokenAtLayerOne())
    qa = statekv.VideoQA.from_pretrained(str(tiny_checkpoint("internvl")), budget=12, attention="eager",
                                         reserve_tokens=40, dtype="float32")
    streams = streams_of(qa, random_frames(6, seed=6), [(5, 16), (6, 16)])
    together, alone = Recorder(), Recorder()
    expected = streams[1].ask_tokens("Why?", max_new_tokens=5, streamer=alone)
    answers = qa.ask_tokens_many([(streams[0], "What?", {"max_new_tokens": 5, "retrieve": 2, "retrieval": "broken"}),
                                  (streams[1], "Why?", {"max_new_tokens": 5, "streamer": together})],
                                 return_exceptions=True)
    assert isinstance(answers[0], RuntimeError) and "the rule broke" in str(answers[0])
    assert torch.equal(answers[1], expected) and together.puts == alone.puts and together.ended == 1
    for stream in streams:
        stream.close()


def test_a_bad_question_fails_alone_and_bad_items_are_one_line_errors(builtin, scenes):
    streams = streams_of(builtin, scenes, [(3, 30), (4, 30)])
    answers = builtin.ask_many([(streams[0], "  "), (streams[1], COLOUR, {"max_new_tokens": 2})],
                               return_exceptions=True)
    assert isinstance(answers[0], InputError) and "the question is empty" in str(answers[0])
    assert answers[1] == streams[1].ask(COLOUR, max_new_tokens=2)
    with pytest.raises(InputError, match="the question is empty"):
        builtin.ask_many([(streams[0], ""), (streams[1], COLOUR)])
    with pytest.raises(InputError, match=r"ask_many takes \(stream, question\) .* got tuple of 4"):
        builtin.ask_many([(streams[0], COLOUR, {}, 4)])
    with pytest.raises(InputError, match=r"ask_many asks streams \(from VideoQA.stream\), got str$"):
        builtin.ask_many([("not a stream", COLOUR)])
    with builtin.encode(scenes[:3], max_fps=100) as encoded:  # before: "got tuple", of the very shape asked for
        with pytest.raises(InputError, match="got EncodedVideo: ask it with its own .ask"):
            builtin.ask_many([(encoded, COLOUR)])
    with pytest.raises(InputError, match="ask_many takes a list"):
        builtin.ask_many("What?")
    with pytest.raises(InputError, match="ask_kwargs must be a dict"):
        builtin.ask_many([(streams[0], COLOUR, 4)])
    other = builtin.with_options(method="full").stream(30)
    with pytest.raises(InputError, match="belongs to another VideoQA"):
        builtin.ask_many([(other, COLOUR)])
    for stream in (*streams, other):
        stream.close()
