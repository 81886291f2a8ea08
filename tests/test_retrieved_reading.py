"""Training questions that read a few frames of a whole dense video, placed as a question past the range reads the
frames it retrieved (`LongRange.dense_read`, `statekv.builtin.long_range.read_frames`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statekv
from statekv.builtin.batches import BatchMaker, FrameBank, Reading, forward_targets, turned
from statekv.builtin.long_range import DENSE_FAMILIES, LongRange, dense_batch, read_frames
from statekv.core.positions.rotation import rotate
from statekv.settings.engine import DEFAULT_QUESTION_SPAN


@pytest.fixture(scope="module")
def adapter():
    adapter = statekv.VideoQA.from_pretrained("builtin", method="full").adapter
    adapter.model.set_attn_implementation("eager")
    return adapter


def reading_batch(adapter, frames: int = 30, read: int = 5, seed: int = 3):
    phase = LongRange(dense_share=1.0, dense_frames=(frames,), dense_videos=2, dense_whole=True, dense_read=read)
    return dense_batch(phase, BatchMaker(adapter), np.random.default_rng(seed))


def test_each_question_reads_its_evidence_among_a_few_frames_spread_before_its_prompt(adapter):
    batch = reading_batch(adapter)
    reading = batch.reading
    assert batch.families == list(DENSE_FAMILIES * 2) * 2 and reading.tokens.shape[0] == len(batch.families)
    prefix = int(batch.frame_positions[0, 0]) - 2  # the first frame's text: a line, its visual token, </img>
    ends = batch.frame_positions[:, 1] + 1
    for row, evidence in enumerate(batch.evidence_frames):
        tokens, places = reading.tokens[row][reading.valid[row]], reading.places[row][reading.valid[row]]
        assert torch.equal(tokens[:prefix], torch.arange(prefix)) and torch.equal(places[:prefix], tokens[:prefix])
        frames = torch.searchsorted(ends, tokens[prefix:], right=True).unique()
        assert len(frames) == 5 and set(evidence) <= set(frames.tolist())  # whole frames, the evidence among them
        assert bool(batch.evidence[row, tokens].sum() == batch.evidence[row].sum())
        assert bool((places.diff() > 0).all()) and int(places[-1]) < int(reading.start[row])  # in order, apart
        assert int(reading.start[row]) == prefix + DEFAULT_QUESTION_SPAN  # five short frames: the default span
        moved = places[prefix:] - tokens[prefix:]
        assert bool((moved != 0).any())  # read where a question past the range reads them, not where written


def test_a_question_reading_its_whole_video_in_place_is_the_whole_video_pass(adapter):
    """The reading path (each row's own cache, its keys turned, padding masked) over every token at its own place
    gives the ordinary pass's outputs and gradients."""
    model = adapter.model
    bank = FrameBank(adapter)
    batch = reading_batch(adapter, frames=12, read=3)
    rows, length = batch.question_ids.shape[0], batch.video_ids.shape[1]
    whole = torch.arange(length).expand(rows, -1)
    padded = torch.cat([torch.zeros(rows, 2, dtype=torch.long), whole], 1)  # two padding tokens a row, masked
    in_place = Reading(padded, padded.new_ones(padded.shape, dtype=torch.bool), padded, torch.full((rows,), length))
    in_place.valid[:, :2] = False

    def forward(reading):
        batch.reading = reading
        model.zero_grad()
        outputs = forward_targets(model, bank, batch)
        sum(output.float().sum() for output in outputs).backward()
        grads = [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]
        return [output.detach() for output in outputs], grads

    (expected, expected_grads), (got, grads) = forward(None), forward(in_place)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
    for want, have in zip(expected_grads, grads, strict=True):
        assert float((have - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-9
    model.zero_grad()


def test_a_few_frames_read_answer_from_what_the_whole_video_wrote(adapter):
    """The question's gradient reaches frames it does not read: theirs is in what the frames it reads wrote."""
    model = adapter.model
    batch = reading_batch(adapter, frames=12, read=2)
    inputs = []

    def keep(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None:  # the video pass
            kwargs["inputs_embeds"].retain_grad()
            inputs.append(kwargs["inputs_embeds"])

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        logits = forward_targets(model, bank=FrameBank(adapter), batch=batch)[0]
        logits[0, 0].logsumexp(-1).backward()  # the first question's answer alone
    finally:
        hook.remove()
        model.zero_grad()
    reading = batch.reading.tokens[0][batch.reading.valid[0]]
    visual = batch.frame_positions[:, 0]
    read = torch.searchsorted(batch.frame_positions[:, 1] + 1, reading, right=True).unique().tolist()
    per_frame = inputs[0].grad[0, visual].abs().sum(-1)  # [N]: the first video's visual tokens
    unread = [frame for frame in range(12) if frame not in read and frame < max(read)]
    assert unread and all(float(per_frame[frame]) > 0 for frame in unread)
    assert all(float(per_frame[frame]) == 0 for frame in range(max(read) + 1, 12))  # after it: causal, unread


def test_keys_turned_for_training_are_the_engines_rotation():
    keys, delta = torch.randn(3, 2, 7, 16), torch.randint(-4000, 4000, (3, 2, 7))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(turned(keys, delta, inv_freq), rotate(keys, delta, inv_freq), rtol=0, atol=1e-5)
    keys.requires_grad_(True)
    turned(keys, delta, inv_freq).sum().backward()
    assert keys.grad is not None and bool(keys.grad.abs().sum() > 0)


def test_a_recipe_without_the_reading_field_loads_as_reading_whole_videos():
    data = LongRange(dense_read=16).to_dict()
    assert LongRange.from_dict(data).dense_read == 16
    del data["dense_read"], data["dense_asked"]
    assert LongRange.from_dict(data) == LongRange()



def test_frames_read_sit_where_their_time_in_the_whole_stream_puts_them(adapter):
    """Read as a window of a longer stream: early in it, the frames sit near the prefix; late, near the prompt."""
    maker = BatchMaker(adapter)
    batch = reading_batch(adapter, frames=30, read=5)
    prefix = int(batch.frame_positions[0, 0]) - 2  # the first frame's text: a line, its visual token, </img>
    video = int(batch.frame_positions[-1, 1]) + 1 - prefix  # the video's tokens after the prefix
    early = read_frames(batch, maker, np.random.default_rng(1), 5, before=0, stream=20 * video)
    late = read_frames(batch, maker, np.random.default_rng(1), 5, before=19 * video, stream=20 * video)
    assert torch.equal(early.tokens, late.tokens)  # the same frames drawn
    span = DEFAULT_QUESTION_SPAN
    for row in range(early.tokens.shape[0]):
        valid = early.valid[row]
        read = early.places[row][valid][prefix:], late.places[row][valid][prefix:]
        assert int(read[0].max()) < prefix + span // 4  # a twentieth of the span, and packed after it
        assert int(read[1].min()) > prefix + span // 2 and int(read[1].max()) < int(late.start[row])


def test_a_window_of_a_stream_is_read_as_its_questions_read_it_past_the_range(adapter):
    maker = BatchMaker(adapter)
    phase = LongRange(dense_share=1.0, dense_frames=(30,), dense_videos=2, dense_whole=True, window_share=1.0,
                      dense_read=5, stream_frames=3000)
    batch = dense_batch(phase, maker, np.random.default_rng(11))
    assert batch.video_positions is not None and batch.reading is not None  # a window, placed past the range
    assert batch.families == list(DENSE_FAMILIES * 2) * 2
    for row, evidence in enumerate(batch.evidence_frames):
        tokens = batch.reading.tokens[row][batch.reading.valid[row]]
        assert bool(batch.evidence[row, tokens].sum() == batch.evidence[row].sum()) and evidence
    whole = dense_batch(LongRange(dense_share=1.0, dense_frames=(30,), dense_videos=2, dense_whole=True,
                                  dense_read=5), maker, np.random.default_rng(11))
    assert whole.video_positions is None  # no window share: whole videos, as before
