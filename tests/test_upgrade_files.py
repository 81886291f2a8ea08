"""Files an earlier statekv wrote, read by this one: each goes on as it was saved, or is refused in one line that
says what to do."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import statekv
import statekv.api.watch
from statekv.testing import make_tiny_checkpoint

QUESTION = "Red?"


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    """The tiny InternVL (128 positions): a bounded stream carrying up to 4096 tokens leaves 16 for a watch."""
    return statekv.VideoQA.from_pretrained(make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("up") / "m"))


def test_a_saved_watch_that_no_longer_fits_reopens_and_the_stream_loads(qa, tmp_path, monkeypatch, caplog):
    """Before: a stream saved before watches were refused as they open for a question that cannot fit beside the
    most the stream will carry (its watch open, failing at each evaluation) was refused by `Stream.load` with a bare
    QuestionTooLong ('ask a shorter question'), so the stream could not be loaded at all. Now it loads, the watch
    reopened as it was saved (evaluated while it fits, its error recorded once it does not) with a warning saying to
    close it."""
    frames = np.random.default_rng(1).integers(0, 256, (4, 24, 32, 3), dtype=np.uint8)
    stream = qa.stream()
    with pytest.raises(statekv.errors.QuestionTooLong):
        stream.watch(QUESTION, every=2)
    monkeypatch.setattr(statekv.api.watch, "check_question_fits", lambda *args, **kwargs: None)  # as it was
    watch = stream.watch(QUESTION, every=2)
    monkeypatch.undo()
    for index, frame in enumerate(frames[:2]):
        stream.push(frame, float(index))
    asked = stream.ask_tokens("What?", max_new_tokens=3).tolist()
    stream.save(tmp_path / "old.safetensors")
    stream.close()
    with caplog.at_level(logging.WARNING):
        loaded = statekv.Stream.load(tmp_path / "old.safetensors", qa)
    assert [one.id for one in loaded.watches] == [watch.id]
    assert f"watch {watch.id} is reopened" in caplog.text and "close it" in caplog.text
    assert loaded.ask_tokens("What?", max_new_tokens=3).tolist() == asked
    for index, frame in enumerate(frames[2:], start=2):
        loaded.push(frame, float(index))
    assert loaded.frames == 4 and loaded.watches[0].evaluations > watch.evaluations  # evaluated while it fits
    loaded.watches[0].close()
    loaded.close()
