"""Properties of the frame samplers over many video lengths and rates: a user's video is seen with every frame
at most once and its last frame near the end; the benchmarks' rule stays exactly as published."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from statekv.video import num_sampled_frames, open_video, sample_at_rate, source_frame_indices, uniform_frame_indices


def _cases(count: int = 3000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        total = rng.choice([1, 2, 3, 5, 10, rng.randint(1, 60), rng.randint(1, 5000)])
        fps = rng.choice([1.0, 2.0, 24.0, 25.0, 29.97, 30.0, 60.0, rng.uniform(0.1, 120)])
        max_fps = rng.choice([0.1, 0.5, 1.0, 2.0, fps, 2 * fps, 1000.0, rng.uniform(0.01, 200)])
        max_frames = rng.choice([1, 2, 16, 512, rng.randint(1, 2000)])
        yield total, fps, max_fps, max_frames


def test_a_users_video_sees_each_frame_at_most_once_and_its_end():
    for total, fps, max_fps, max_frames in _cases():
        indices = source_frame_indices(total, fps, max_fps=max_fps, max_frames=max_frames)
        n = len(indices)
        planned = min(total, max_frames) if max_fps >= fps else num_sampled_frames(total, fps, max_fps=max_fps,
                                                                                   max_frames=max_frames)
        assert n == min(planned, total)
        assert all(0 <= a < b for a, b in zip(indices, indices[1:])) and 0 <= indices[0] and indices[-1] < total
        assert (total - 1) - indices[-1] <= total / n  # the last frame within one sampling interval of the end
        if max_fps >= fps and max_frames >= total:  # at or above the source's own rate: every frame, once
            assert indices == list(range(total))


@pytest.mark.parametrize(("total", "expected"), [(10, list(range(10))), (3, [0, 1, 2]), (1, [0])])
def test_at_the_sources_rate_every_frame_is_seen_the_last_included(total, expected):
    assert source_frame_indices(total, 1.0, max_fps=1.0) == expected
    assert source_frame_indices(total, 1.0, max_fps=5.0) == expected


def test_the_protocols_rule_is_exactly_as_published():
    """min(max(1, floor(T / fps * max_fps)), max_frames) segment centres int(seg / 2 + round(seg * k)), frames
    repeating at or above the source's rate (the published examples below)."""
    for total, fps, max_fps, max_frames in _cases():
        n = min(max(1, math.floor(total / fps * max_fps)), max_frames)
        segment = (total - 1) / n
        assert uniform_frame_indices(total, fps, max_fps=max_fps, max_frames=max_frames) == [
            int(segment / 2 + round(segment * k)) for k in range(n)]
    assert uniform_frame_indices(10, 1.0) == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert uniform_frame_indices(3, 1.0) == [0, 1, 1]
    assert uniform_frame_indices(90, 30) == [14, 44, 73]


class _Stamp:
    def __init__(self, index: int, timestamp: float):
        self.index, self.timestamp = index, timestamp


def test_a_live_rate_keeps_each_frame_at_most_once_and_ends_within_one_interval():
    rng = random.Random(1)
    for _ in range(2000):
        fps, rate, count = rng.uniform(0.5, 60), rng.uniform(0.05, 120), rng.randint(1, 400)
        frames = [_Stamp(i, i / fps) for i in range(count)]
        kept = [frame.index for frame in sample_at_rate(frames, rate)]
        assert kept[0] == 0 and all(a < b for a, b in zip(kept, kept[1:]))
        end = frames[-1].timestamp
        assert end - frames[kept[-1]].timestamp <= 1 / rate + 1e-9
        if rate >= fps:
            assert kept == list(range(count))


@pytest.mark.parametrize("source", ["array", "folder"])
def test_encode_sampling_of_a_small_source_yields_every_frame_once(source, tmp_path):
    from PIL import Image

    images = np.stack([np.full((8, 8, 3), 10 * i, dtype=np.uint8) for i in range(3)])
    if source == "folder":
        for i, image in enumerate(images):
            Image.fromarray(image).save(tmp_path / f"{i}.png")
        video = open_video(tmp_path)
    else:
        video = open_video(images)
    frames = list(video.sample(max_fps=1, max_frames=512))
    assert [frame.index for frame in frames] == [0, 1, 2]
    assert [int(frame.image[0, 0, 0]) for frame in frames] == [0, 10, 20]
    assert [frame.index for frame in video.sample(protocol=True)] == [0, 1, 1]  # the benchmarks' rule, kept
