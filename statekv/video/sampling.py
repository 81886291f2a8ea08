"""Which frames to keep: for a user's stored video every frame at most once, the last one near the end
(`source_frame_indices`); the benchmarks' published uniform rule (`uniform_frame_indices`) where their protocol
uses it; a fixed rate for live streams (`sample_at_rate`, on the ticks of `tick`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

from ..errors import InputError
from ..settings.values import HIGHEST_FPS


class _Timed(Protocol):
    timestamp: float


TimedT = TypeVar("TimedT", bound=_Timed)


def num_sampled_frames(total_frames: int, avg_fps: float, *, max_fps: float = 1.0, max_frames: int = 512) -> int:
    """How many frames the paper's protocol keeps from a video.

    ``n = min(max(1, floor(total_frames / avg_fps * max_fps)), max_frames)``: the FPS cap first, then the
    frame cap.
    """
    if total_frames < 1:
        raise InputError(f"total_frames must be >= 1, got {total_frames}")
    if not (avg_fps > 0 and max_fps > 0 and max_frames >= 1):  # a NaN fails each comparison
        raise InputError(f"avg_fps and max_fps must be > 0 and max_frames >= 1, got {avg_fps}, {max_fps}, {max_frames}")
    wanted = total_frames / avg_fps * max_fps  # past any number for a max_fps near the largest float: no FPS cap
    return min(max(1, math.floor(wanted)) if math.isfinite(wanted) else max_frames, max_frames)


def uniform_frame_indices(
    total_frames: int, avg_fps: float, *, max_fps: float = 1.0, max_frames: int = 512
) -> list[int]:
    """Frame indices at the centres of ``n`` equal segments of the video (``n`` from `num_sampled_frames`).

    With ``seg = (total_frames - 1) / n`` the k-th index is ``int(seg / 2 + round(seg * k))``, within
    ``[0, total_frames - 1]``. Indices strictly increase while ``n < total_frames``; when ``max_fps`` reaches
    the video's own rate some repeat (the rule is kept as published, so the model sees ``n`` frames).
    """
    n = num_sampled_frames(total_frames, avg_fps, max_fps=max_fps, max_frames=max_frames)
    segment = (total_frames - 1) / n
    return [int(segment / 2 + round(segment * k)) for k in range(n)]


def source_frame_indices(
    total_frames: int, avg_fps: float, *, max_fps: float = 1.0, max_frames: int = 512
) -> list[int]:
    """The frames statekv keeps from a user's video: ``n`` (from `num_sampled_frames`) frames at the centres of
    ``n`` equal parts of the whole video, ``floor((k + 1/2) * total_frames / n)``.

    Each frame is kept at most once; at or above the video's own rate (``n == total_frames``) every frame is
    kept, the last one included; the last kept frame lies within half a part of the end. The benchmarks'
    published rule (`uniform_frame_indices`) differs only in where the parts start and end and repeats frames
    at or above the source's rate (see docs/evaluation.md).
    """
    n = num_sampled_frames(total_frames, avg_fps, max_fps=max_fps, max_frames=max_frames)
    if max_fps >= avg_fps:  # at or above the source's rate: all of it (T / fps * fps can round below T)
        n = min(total_frames, max_frames)
    n = min(n, total_frames)
    return [(2 * k + 1) * total_frames // (2 * n) for k in range(n)]


def tick(seconds: float, rate: float) -> int:
    """The last tick of ``rate`` a second (ticks at ``k / rate`` seconds) that ``seconds`` reaches. A timestamp of
    exactly ``k / rate`` as a float is on tick ``k`` however large it is (an epoch's: 1.7e9 s), the slack growing
    with the product's rounding."""
    product = seconds * rate
    return math.floor(product + 1e-9 + 4 * math.ulp(product))


def slack(*times: float) -> float:
    """How far apart times as large as ``times`` may lie from rounding alone, and 1e-9 s at least (two epoch
    timestamps 0.1 s apart differ by 0.1 only to within 2.4e-7)."""
    return 1e-9 + 4 * math.ulp(max(abs(time) for time in times))


def reaches(seconds: float, moment: float) -> bool:
    """Whether ``seconds`` is at or past ``moment``, up to their rounding (`slack`)."""
    return seconds >= moment - slack(seconds, moment)


def sample_at_rate(frames: Iterable[TimedT], fps: float) -> Iterator[TimedT]:
    """Keep, from a stream of timestamped frames, each frame that reaches the next ``1 / fps`` tick.

    Ticks lie at ``k / fps`` seconds. A frame is kept when its timestamp is at or past the next pending
    tick; the pending tick then moves to the first tick after that frame, so a gap in the stream yields
    one frame, not a burst. Works lazily on any iterable (a live stream never ends).
    """
    if not 0 < fps <= HIGHEST_FPS:
        raise InputError(f"fps must be a number above 0 and at most {HIGHEST_FPS:g}, got {fps}")
    next_tick = 0
    for frame in frames:
        last_tick_reached = tick(frame.timestamp, fps)
        if last_tick_reached >= next_tick:
            yield frame
            next_tick = last_tick_reached + 1
