"""Counts in frames over Qwen3-VL, whose steps pair two frames: an odd frame count ends with a step of one frame,
and what an answer reports and a refusal hints are frames, true of that step too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statekv
from statekv.models import load_adapter


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint):
    return load_adapter(tiny_checkpoint("qwen3_vl"), dtype=torch.float32)


def frames(count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (count, 64, 96, 3), dtype=np.uint8)


def test_retrieved_frames_counts_the_frames_a_one_frame_step_holds(adapter):
    """Three frames are a step of two and a step of one; retrieve=2 is one step, and the ``recent`` rule reads the
    last, one frame: before, retrieved_frames said 2. Asked together (a row of a batch), it says the same."""
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=64), attention="eager", reserve_tokens=40)
    stream = qa.stream(horizon_frames=8)
    for frame in frames(3):
        stream.push(frame)
    stream.flush()  # where the video ends: its last frame a step of its own
    stream.ask("Why?", max_new_tokens=2, retrieve=2, retrieval="recent")
    assert stream.answer_info.read_frames == (2,) and stream.answer_info.retrieved_frames == 1
    stream.ask("Why?", max_new_tokens=2, retrieve=2, retrieval="attention")
    assert stream.answer_info.retrieved_frames == len(stream.answer_info.read_frames) == 2
    qa.ask_many([(stream, "Why?", {"max_new_tokens": 2, "retrieve": 2, "retrieval": "recent"})])
    assert qa.question_batch_sizes[1] == 1  # answered as a row of a batch, not alone
    assert stream.answer_info.read_frames == (2,) and stream.answer_info.retrieved_frames == 1
    stream.ask("Why?", max_new_tokens=2, retrieve=4)
    assert stream.answer_info.retrieved_frames == 3  # every frame held, not 2 steps x 2
