"""A video file fed into a served stream: its progress (`Feed`), how many frames it gives at the stream's rate
(`frames_at_rate`) and where a feed that skips the frames a cut one pushed places the rest (`resumed_shift`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Feed:
    """A video file being fed into a stream: how far it got (``total``: the frames it should give at the
    stream's rate, estimated from its length) and, once it stopped early, why."""

    source: str
    total: int | None
    offered: int = 0
    kept: int = 0
    skipped: int = 0
    running: bool = True
    error: str | None = None
    resumable: bool = True  # False: the page's (its file is gone once it stops; its record names a cut feed)
    # a page's feed, to tell what the stream holds of its file once it is cut (None: a record written before):
    skip: int = 0  # the file's first frames it skipped
    held_before: int | None = None  # the stream's frames before the file's first (those it skipped included)
    size: int | None = None  # the file's bytes

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "total": self.total, "offered": self.offered, "kept": self.kept,
                "running": self.running, "error": self.error}

    def recorded(self) -> dict[str, Any]:
        return {**self.describe(), "skip": self.skip, "held_before": self.held_before, "size": self.size}

    def rest_of(self, name: str, size: int, frames: int) -> int:
        """The frames to skip of the file ``name`` of ``size`` bytes, fed again into the stream this feed was cut
        in, which holds ``frames``: those the stream holds of it (0 for another file, or a feed not cut short)."""
        if self.running or not self.error or (name, size) != (self.source, self.size) or self.held_before is None:
            return 0
        return max(0, frames - self.held_before)


def frames_at_rate(video: Any, max_fps: float | None) -> int:
    """About how many frames a video file gives at ``max_fps`` (None: all), from its length: one per tick."""
    if max_fps is None:
        return video.num_frames
    return max(1, min(video.num_frames, math.ceil(video.duration * max_fps - 1e-9)))


def resumed_shift(last: float | None, start: float | None, first: float, last_skipped: float | None) -> float:
    """What a feed adds to its file's timestamps: ``start`` (given) places its first frame pushed (file time
    ``first``) there; else a feed that skipped frames goes on as the feed cut short after ``last_skipped`` placed
    them (the stream's ``last`` frame being that one; on a stream holding no frame, at the file's own times, where
    a feed from its first frame puts them)."""
    if start is not None:
        return start - first if last_skipped is not None else start
    if last is not None:
        return last - last_skipped
    return 0.0
