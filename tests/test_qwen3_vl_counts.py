"""Counts in frames over Qwen3-VL, whose steps pair two frames: an odd frame count ends with a step of one frame,
and what an answer reports and a refusal hints are frames, true of that step too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statekv
from statekv.errors import HorizonError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint


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


def test_past_the_range_too_many_retrieved_frames_are_refused_with_a_hint_in_frames(tmp_path):
    """41 frames past a 256-position range: 12 steps of 2 frames fit beside the question. Before, retrieve=26 was
    refused as "13 retrieved steps ... retrieve at most 12" (retrieve=12 is 6 steps), and retrieve=100 named 50
    steps while 21 were held; now the hint is 24 frames, and retrieve=24 is answered. A question that leaves no room
    for one step is told to be shorter, not to retrieve at most 0."""
    checkpoint = make_tiny_checkpoint("qwen3_vl", tmp_path / "short", text_config={"max_position_embeddings": 256})
    qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24)
    stream = qa.stream()
    for frame in frames(41):
        stream.push(frame)
    stream.flush()
    assert stream.prefill.positions.bounded and stream.frames == 41
    with pytest.raises(HorizonError, match=r"^26 retrieved frames \(13 steps\) .* retrieve at most 24 frames$"):
        stream.ask("Why?", max_new_tokens=2, retrieve=26)
    with pytest.raises(HorizonError, match=r"^41 retrieved frames \(21 steps\) .* retrieve at most 24 frames$"):
        stream.ask("Why?", max_new_tokens=2, retrieve=100)  # every frame held: 21 steps, not 50
    with pytest.raises(HorizonError, match=r"^41 retrieved frames \(21 steps\) "):  # 21 steps asked, 41 frames held
        stream.ask("Why?", max_new_tokens=2, retrieve=42)
    with pytest.raises(HorizonError, match="leave no room for a retrieved step"):  # before: "retrieve at most 0"
        stream.ask("Why?", max_new_tokens=220, retrieve=2)
    stream.ask("Why?", max_new_tokens=2, retrieve=24)
    assert stream.answer_info.retrieved_frames == 24
    stream.close()
