"""Watches on a stream past its model's positional range (`positions="bounded"`, `statekv.core.watching.fitting`):
an evaluation's retrieval picks the steps `ask` picks for its question, its new frames never take it past the
range however long it waited, and a question that cannot fit is refused when the watch opens.

A one-layer tiny InternVL of 128 positions through the real from_pretrained path: with one layer, a watch's
prompt queries at the layer retrieval scores with are the ones `ask` scores with (deeper layers read different
contexts)."""

from __future__ import annotations

import numpy as np
import pytest

import statekv
import statekv.core.answering.rows as rows_module
from statekv.errors import HorizonError
from statekv.testing import make_tiny_checkpoint

LIMIT = 128


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    short = {"max_position_embeddings": LIMIT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
             "num_hidden_layers": 1}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("short") / "ckpt", text_config=short,
                                      vision_config={"image_size": 112})
    return statekv.VideoQA.from_pretrained(checkpoint, method="statekv", reserve_tokens=24, budget=24)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)


@pytest.mark.parametrize("question", ["Why?", "What is in the picture?"])
def test_past_the_range_a_watch_retrieves_the_frames_ask_retrieves(qa, images, question):
    stream = qa.stream()
    for image in images:
        stream.push(image)
    assert stream.prefill.positions.bounded and stream.tokens > 4 * LIMIT
    for frames in (1, 3):
        stream.ask(question, retrieve=frames, max_new_tokens=2)
        asked = stream.answer_info.read_frames
        watch = stream.watch(question, retrieve=frames, max_new_tokens=2, steer=False)  # evaluated now
        assert watch.error is None and stream.frames_of(tuple(sorted(watch.read_steps))) == asked
        watch.close()
    stream.close()


def spy_on_evaluations(stream, monkeypatch, request) -> tuple[list[int], list[int]]:
    """The highest RoPE position of every forward of ``stream``'s decoder (its steps' and its evaluations'; the
    hook goes when the test ends), and the most keys a query of each evaluation forward reads at a layer."""
    positions: list[int] = []
    read: list[int] = []
    attention = rows_module.masked_attention

    def note(module, args, kwargs):
        positions.append(int(kwargs["position_ids"].max()))

    def spied(q, keys, values, valid, scale, **kwargs):
        read.append(int(valid.sum(-1).max()))
        return attention(q, keys, values, valid, scale, **kwargs)

    hook = stream.prefill.decoder.register_forward_pre_hook(note, with_kwargs=True)
    request.addfinalizer(hook.remove)
    monkeypatch.setattr(rows_module, "masked_attention", spied)
    return positions, read


@pytest.mark.parametrize("cadence", [{"every": 20}, {}])
def test_an_evaluation_long_after_the_last_reads_the_newest_frames_that_fit(qa, images, cadence, monkeypatch,
                                                                           request):
    """Twenty frames between evaluations (or an evaluation asked for after them) are about three times the range:
    the evaluation reads the carried state and the newest frames that fit with the question, every key inside
    the range, as many as a step could read, however long the wait."""
    stream = qa.stream()
    stream.push(images[0])
    watch = stream.watch("Why?", max_new_tokens=2, steer=False, **cadence)
    positions, read = spy_on_evaluations(stream, monkeypatch, request)
    for image in images[1:21]:
        stream.push(image)
    if not cadence:
        watch.evaluate()
    assert stream.tokens - 19 > 2 * LIMIT and watch.evaluations == 2 and watch.error is None
    assert read and max(read) <= LIMIT and max(positions) < LIMIT
    stream.close()


@pytest.mark.parametrize("frames", [0, 8])
def test_a_watch_whose_question_cannot_fit_the_range_is_refused(qa, images, frames):
    """Refused when it opens, before any frame (no evaluation runs then) or after some."""
    stream = qa.stream()
    for image in images[:frames]:
        stream.push(image)
    with pytest.raises(HorizonError, match=r"do not fit in the \d+ positions an evaluation has") as refused:
        stream.watch("Why?", max_new_tokens=LIMIT)
    assert "\n" not in str(refused.value) and stream.watches == []
    stream.close()


def test_a_watch_that_would_not_fit_once_a_horizons_frames_are_in_is_refused_when_it_opens(qa, images):
    """Stream positions: a watch is evaluated until the declared frames are all in, so its question must fit the
    room the horizon keeps after them, not only the room left now. Before: accepted on an empty stream, then every
    evaluation from the second frame on failed."""
    from statekv.errors import QuestionTooLong

    stream = qa.with_options(positions="stream").stream(horizon_frames=3, max_fps=None)
    stream.start()
    room_now = stream.prefill.horizon - stream.prefill.seen_tokens
    question = "Why " * 5  # its tokens and answer: within the room now, more than the 24 kept after the frames
    with pytest.raises(QuestionTooLong, match=r"do not fit in the 24 tokens left before the stream's horizon"):
        stream.watch(question, every=1, max_new_tokens=4)
    assert stream.watches == [] and room_now > 39 + 4
    fitting = stream.watch("Why?", every=1, max_new_tokens=1)  # 23 tokens and 1: exactly the room kept
    for image in images[:3]:
        stream.push(image)
    stream.flush()
    assert fitting.evaluations == 3 and fitting.error is None
    stream.close()


def test_a_watch_retrieving_too_many_frames_is_refused_in_frames_with_a_hint_that_is_taken(qa, images):
    """Before: a watch's refusal counted steps ("40 retrieved steps ... retrieve at most N steps") where its
    ``retrieve``, and every other refusal, counts frames. Now it reads as a question's, and its hint is taken."""
    import re

    stream = qa.stream()
    for image in images:
        stream.push(image)
    with pytest.raises(HorizonError) as refused:
        stream.watch("Why?", retrieve=100, max_new_tokens=2, steer=False)
    message = str(refused.value)
    assert message.startswith(f"{stream.frames} retrieved frames ("), message
    hint = re.fullmatch(r".*; retrieve at most (\d+) frames", message)
    assert hint, message
    with pytest.raises(HorizonError, match=f"^{int(hint[1]) + 1} retrieved frames .* at most {hint[1]} frames$"):
        stream.watch("Why?", retrieve=int(hint[1]) + 1, max_new_tokens=2, steer=False)
    watch = stream.watch("Why?", retrieve=int(hint[1]), max_new_tokens=2, steer=False)
    assert watch.error is None and watch.evaluations == 1 and stream.watches == [watch]
    stream.close()


def test_a_failing_watch_is_logged_as_its_error_starts_changes_and_ends_not_at_each_evaluation(qa, images, caplog):
    """Before: a warning at every failed evaluation, for as long as the stream ran (every 2 frames here, for
    weeks); its growing frame count did not make the error another one. Its ``error`` still says each failure."""
    import logging
    import re

    stream = qa.stream()
    watch = stream.watch("Why?", every=2, retrieve=1, max_new_tokens=2, steer=False)
    watch.retrieve = 100  # refused as it opens: too wide once past the range
    caplog.set_level(logging.WARNING, logger="statekv")
    errors = set()
    for image in images:
        stream.push(image)
        errors.add(watch.error)
    logged = [record.getMessage() for record in caplog.records if watch.id in record.getMessage()]
    failed = [message for message in errors if message is not None]
    assert len(failed) > 3 and len(logged) == 1 and "could not be evaluated" in logged[0], logged
    assert re.sub(r"\d+", "N", watch.error) in re.sub(r"\d+", "N", logged[0]), logged  # its numbers aside
    hint = re.fullmatch(r".*; retrieve at most (\d+) frames", watch.error)
    watch.retrieve = int(hint[1])
    for image in images[:4]:
        stream.push(image)
    assert watch.error is None
    logged = [record.getMessage() for record in caplog.records if watch.id in record.getMessage()]
    assert len(logged) == 2 and "evaluated again" in logged[1], logged
    watch.retrieve = 100
    stream.push(images[0])
    stream.push(images[1])
    assert watch.error is not None
    logged = [record.getMessage() for record in caplog.records if watch.id in record.getMessage()]
    assert len(logged) == 3 and watch.error in logged[2], logged
    stream.close()


def test_a_capped_stream_refuses_a_watch_whose_retrieval_would_not_fit_past_the_range(qa, images):
    """Before: under a cache cap the check was skipped, so a watch retrieving 30 frames opened inside the range
    and failed at every evaluation past it. Now it is refused when it opens unless the cap holds too few steps for
    that (a retrieval of more than is held reads every held step, and fits)."""
    capped = qa.with_options(max_cache_bytes=100_000, cache_limit="evict-oldest", offload=True).stream()
    capped.push(images[0])
    with pytest.raises(HorizonError, match=r"^30 retrieved frames .*; retrieve at most 5 frames$"):
        capped.watch("Why?", retrieve=30, max_new_tokens=2, steer=False, every=1)
    capped.close()
    small = qa.with_options(max_cache_bytes=40_000, cache_limit="evict-oldest", offload=True).stream()
    small.push(images[0])
    watch = small.watch("Why?", retrieve=30, max_new_tokens=2, steer=False, every=1)
    for image in images[1:]:
        small.push(image)
    small.flush()
    assert watch.error is None and watch.evaluations == len(images) and small.prefill.positions.moved
    small.close()


def test_a_capped_stream_opens_a_watch_whose_retrieval_reads_every_held_step_and_fits(qa, images):
    """Before: the cap's steps were counted at the visual tokens of a frame alone, not the text labelling it in each
    step, so a cap holding as many steps as fit past the range counted one more and refused a watch whose every
    evaluation reads every held step and fits."""
    capped = qa.with_options(max_cache_bytes=41_000, cache_limit="evict-oldest", offload=True).stream()
    capped.push(images[0])
    capped.push(images[1])
    watch = capped.watch("Why?", retrieve=30, max_new_tokens=2, steer=False, every=1)
    for image in images[2:]:
        capped.push(image)
    capped.flush()
    assert watch.error is None and watch.evaluations == len(images) - 1 and capped.prefill.positions.moved
    capped.close()
