"""A video as the steps of one stream: the adapter's prefix chunk, then one chunk per step of frames."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from statekv.models import Chunk, VideoAdapter
from statekv.video import open_video


def video_steps(adapter: VideoAdapter, source: str | Path | Any, *, max_frames: int = 128,
                max_fps: float = 1.0) -> list[Chunk]:
    """Sample ``source`` as `VideoQA.encode` does (at most ``max_fps`` frames per second, at most ``max_frames``,
    uniformly over the video) and lay it out as the adapter streams it.

    Returns the chunks in stream order (the prefix, if the layout has one, first). Each frame is decoded and
    vision-encoded once, here; the chunks keep only token embeddings (``[1, T, D]`` each), so the same video
    can be streamed again under other policies without encoding it again.
    """
    video = open_video(source)
    num_frames = len(video.sample_indices(max_fps=max_fps, max_frames=max_frames))
    state = adapter.start(num_frames, fps=min(max_fps, video.fps))
    chunks = []
    with torch.no_grad():
        prefix = adapter.prefix(state)
        if prefix is not None:
            chunks.append(prefix)
            state = state.after(prefix)
        frames = iter(video.sample(max_fps=max_fps, max_frames=max_frames))
        while group := list(itertools.islice(frames, adapter.frames_per_step)):
            chunk = adapter.frames_chunk(group, state)
            chunks.append(chunk)
            state = state.after(chunk)
    return chunks
