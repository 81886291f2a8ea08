"""Past the range a question's retrieved steps are spread over the last ``question_span`` positions before the
prompt by their time in the stream (`StreamPositions.question`, `StreamPositions.spread`); inside the range, and
with ``question_span=0``, nothing changes."""

from __future__ import annotations

import pytest
import torch

from statekv.core import Retrieval, StateKV, StreamingPrefill
from statekv.core.cache.step_runs import StepRuns
from statekv.core.positions.placing import QuestionPlan, StepPlan, StreamPositions
from statekv.errors import ConfigurationError
from statekv.settings import EngineSettings, ModelOptions

from conftest import split

LIMIT = 64  # the tiny model's trained range


@pytest.fixture
def model(tiny_lm):
    return tiny_lm("qwen2", max_position_embeddings=LIMIT)


def tokens(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (1, count), generator=torch.Generator().manual_seed(seed))


def long_stream(span: int) -> StreamPositions:
    """A prompt prefix of 3 positions, then 2,000 five-token steps, past a 4,096-position range from step 819."""
    positions = StreamPositions("bounded", 4096, inv_freq=torch.ones(1), question_span=span)
    positions.append(StepPlan(0, 3, 0))
    for step in range(2000):
        positions.append(StepPlan(3 + 5 * step, 5, min(3 + 5 * step, 70)))
    return positions


def placed(positions: StreamPositions, steps: list[int], plan: QuestionPlan) -> list[int]:
    return [positions.bases[s] + int(d) for s, d in zip(steps, positions.context_deltas(steps, plan))]


def answer(model, prefill: StreamingPrefill, retrieve: Retrieval) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The answer's tokens, the logits of its first token and the positions RoPE was asked for while answering."""
    logits, seen = [], []
    hooks = [model.lm_head.register_forward_hook(lambda m, args, out: logits.append(out[:, -1].clone())),
             model.model.rotary_emb.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))]
    try:
        sequences = prefill.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, retrieve=retrieve)
    finally:
        for hook in hooks:
            hook.remove()
    return sequences, logits[0], seen


def test_retrieved_steps_are_spread_by_their_time_over_the_span():
    positions = long_stream(384)
    plan = positions.question(positions.held_span(StepRuns()), positions.keep_end(1), 20, 16)
    assert plan.start == 3 + 384 and not plan.whole and plan.packed
    plan = QuestionPlan(plan.whole, plan.start, plan.retrieve, keep_steps=1)
    chosen = [0, 1, 2, 3, 500, 501, 1200, 1999, 2000]  # the prefix, neighbours, far apart, the last
    where = placed(positions, chosen, plan)
    assert where[0] == 0  # the prefix at its own position
    later = where[1:]
    assert all(b >= a + 5 for a, b in zip(later, later[1:]))  # in time order, never overlapping
    assert later[0] == 3 and later[-1] + 5 == plan.start  # the first step at the prefix's end, the last at the prompt
    assert abs(where[chosen.index(1200)] - (3 + 1199 * (384 - 5) // 2000)) <= 10  # where its time scales to


def test_without_a_span_or_when_the_steps_fill_it_they_are_packed():
    packed = long_stream(0)
    plan = packed.question(packed.held_span(StepRuns()), packed.keep_end(1), 20, 16)
    assert plan.start == 3 + 16 * 5
    plan = QuestionPlan(plan.whole, plan.start, plan.retrieve, keep_steps=1)
    chosen = [0, *range(1, 2001, 125)]
    assert placed(packed, chosen, plan)[1:] == list(range(3, 3 + 16 * 5, 5))
    filled = long_stream(16 * 5)  # sixteen steps take the whole span: packed as well
    assert filled.question(filled.held_span(StepRuns()), filled.keep_end(1), 20, 16) == QuestionPlan(False, 83, 16)
    assert placed(filled, chosen, plan) == placed(packed, chosen, plan)
    narrow = long_stream(8)  # a span narrower than the steps: packed
    assert narrow.question(narrow.held_span(StepRuns()), narrow.keep_end(1), 20, 16).start == 83


def test_the_span_stays_inside_the_range():
    positions = long_stream(4000)
    plan = positions.question(positions.held_span(StepRuns()), positions.keep_end(1), 200, 16)
    assert plan.start == 4096 - 200


def test_inside_the_range_a_question_reads_the_same_whatever_the_span(model):
    """While the stream fits the range every step is read at its own position: the answer and its scores are the
    same bit for bit with and without a span."""
    outputs = []
    for span in (0, 40):
        prefill = StreamingPrefill(model, StateKV(16), positions="bounded", protect_tokens=9, question_span=span)
        for chunk in split(tokens(40), (9, 10, 10, 11)):
            prefill.step(input_ids=chunk)
        plan = prefill.question_plan(7, Retrieval(2, keep_tokens=9))
        sequences, logits, _ = answer(model, prefill, Retrieval(2, keep_tokens=9))
        outputs.append((plan, sequences, logits))
    (plan, sequences, scores), (plan_spread, sequences_spread, scores_spread) = outputs
    assert plan == plan_spread and not plan.packed
    assert torch.equal(sequences, sequences_spread) and torch.equal(scores, scores_spread)


def test_past_the_range_the_prompt_follows_the_span(model):
    """Past the range the prompt starts ``question_span`` positions after the kept prefix (two retrieved steps
    would otherwise end right before it), every position inside the range, and the answer reads them there."""
    starts, scores = {}, {}
    for span in (0, 40):
        prefill = StreamingPrefill(model, StateKV(16), positions="bounded", protect_tokens=9, question_span=span)
        for chunk in split(tokens(100)) * 3:
            prefill.step(input_ids=chunk)
        _, logits, seen = answer(model, prefill, Retrieval(2, keep_tokens=9))
        plan = prefill.question_plan(7, Retrieval(2, keep_tokens=9))
        assert prefill.last_context == "retrieved" and max(int(p.max()) for p in seen) < LIMIT
        starts[span] = (plan.start, prefill.positions.keep_end(plan.keep_steps), int(seen[0][0, 0]))
        scores[span] = logits
    start, keep_end, prompt_at = starts[40]
    assert start == keep_end + 40 and prompt_at == start
    start, keep_end, prompt_at = starts[0]
    assert start < keep_end + 40 and prompt_at == start
    assert not torch.equal(scores[0], scores[40])


def test_the_span_is_a_checked_setting_from_the_front_door():
    assert EngineSettings().question_span == 384 and ModelOptions(model="builtin").question_span == 384
    assert ModelOptions(model="builtin", question_span=0).engine.question_span == 0
    for bad in (-1, "wide", 1.5, True):
        with pytest.raises(ConfigurationError, match="^question_span must be a non-negative integer, got"):
            EngineSettings(question_span=bad)
        with pytest.raises(ConfigurationError, match="^question_span must be a non-negative integer"):
            ModelOptions(model="builtin", question_span=bad)


def test_qa_stream_and_eval_take_the_span(tmp_path, capsys):
    import statekv
    from statekv.cli import main
    from statekv.testing import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "tiny", vision_config={"image_size": 112})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, question_span=96)
    assert qa.stream().prefill.positions.question_span == 96
    assert qa.with_options(question_span=0).stream().prefill.positions.question_span == 0
    with pytest.raises(SystemExit) as stopped:
        main(["eval", "synthetic", "--model", "builtin", "--data-root", str(tmp_path), "--out", str(tmp_path / "o"),
              "--question-span", "-3"])
    assert stopped.value.code == 2
    assert "argument --question-span: expected a non-negative integer, got '-3'" in capsys.readouterr().err


def test_the_bounded_layout_is_a_checked_setting_a_stream_is_made_with(tmp_path):
    import statekv
    from statekv.core.positions.layouts import BOUNDED_LAYOUTS, CacheOrder, OwnThenCache
    from statekv.settings.engine import BOUNDED_LAYOUTS as NAMES
    from statekv.testing import make_tiny_checkpoint

    assert NAMES == tuple(BOUNDED_LAYOUTS)
    with pytest.raises(ConfigurationError,
                       match="^unknown bounded_layout 'wide'; choose one of own-then-cache, grouped, cache, handover$"):
        EngineSettings(bounded_layout="wide")
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "tiny", vision_config={"image_size": 112})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24)
    assert qa.stream().prefill.positions.layout == OwnThenCache()
    assert qa.with_options(bounded_layout="cache").stream().prefill.positions.layout == CacheOrder()


def test_a_stream_saved_under_one_bounded_layout_is_resumed_under_it_only(tmp_path):
    import numpy as np

    import statekv
    from statekv import Stream
    from statekv.errors import InputError
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=short,
                                      vision_config={"image_size": 112})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                         bounded_layout="cache")
    stream = qa.stream()
    for frame in np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8):
        stream.push(frame)
    saved = stream.save(tmp_path / "s.safetensors")
    stream.close()
    with pytest.raises(InputError, match="resume it with bounded_layout=cache$"):
        Stream.load(saved, qa.with_options(bounded_layout="grouped"))
    assert Stream.load(saved, qa).tokens == stream.tokens


def test_the_settings_name_every_bounded_layout_the_engine_has():
    from statekv.core.positions import layouts
    from statekv.settings import engine

    assert set(engine.BOUNDED_LAYOUTS) == set(layouts.BOUNDED_LAYOUTS)
    assert layouts.DEFAULT_LAYOUT in engine.BOUNDED_LAYOUTS
