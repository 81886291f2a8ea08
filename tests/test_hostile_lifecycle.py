"""Hostile use of a live stream's life cycle through the public API: found by hunting, each test a defect's
repro (before the fix it failed as its docstring says)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statekv
from statekv.errors import InputError

from hostile import noise_frames


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin")


def test_stream_push_many_takes_numpy_timestamps_as_push_does(qa):
    """Before: a pair whose time was a NumPy scalar (np.arange's times, which `push` takes) was read as one
    image: InputError "a frame must be an RGB uint8 array ..., got a tuple"."""
    images = noise_frames(3)
    with qa.stream() as numpy_times, qa.stream() as float_times:
        assert numpy_times.push_many(zip(images, np.arange(3))) == 3
        assert numpy_times.push_many([(noise_frames(1)[0], np.float32(3.5))]) == 1
        float_times.push_many(zip(images, [0.0, 1.0, 2.0]))
        float_times.push(noise_frames(1)[0], 3.5)
        assert numpy_times.last_timestamp == 3.5 and numpy_times.pushed == 4
        assert torch.equal(numpy_times.ask_tokens("Why?", max_new_tokens=2),
                           float_times.ask_tokens("Why?", max_new_tokens=2))


@pytest.mark.parametrize("frames", [None, 5])
def test_stream_push_many_refuses_what_is_no_list_in_one_line(qa, frames):
    """Before: a raw TypeError "'NoneType' object is not iterable" (`VideoQA.push_many` says it in one line)."""
    with qa.stream() as stream:
        with pytest.raises(InputError, match="push_many takes"):
            stream.push_many(frames)
        assert stream.pushed == 0


@pytest.mark.parametrize("model", [None, "builtin"])
def test_stream_load_refuses_what_is_no_videoqa_in_one_line(qa, model, tmp_path):
    """Before: a raw AttributeError "'NoneType' object has no attribute 'engine'"."""
    path = tmp_path / "s.safetensors"
    with qa.stream() as stream:
        stream.push(noise_frames(1)[0], 0.0)
        stream.save(path)
    with pytest.raises(InputError, match="VideoQA"):
        statekv.Stream.load(path, model)
    statekv.Stream.load(path, qa).close()
