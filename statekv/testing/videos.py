"""Synthetic test videos: numbered frames (`draw_test_frame`) written with PyAV at a constant or variable rate."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av

from statekv.video.patterns import FRAME_INDEX_BITS, draw_test_frame

__all__ = ["FRAME_INDEX_BITS", "draw_test_frame", "synthetic_timestamps", "write_test_video"]


def synthetic_timestamps(frames: int, fps: float, vfr: bool = False) -> list[float]:
    """Presentation times (s) that `write_test_video` gives its frames.

    Constant rate: ``i / fps``. Variable rate: gaps alternate between ``0.5 / fps`` and ``1.5 / fps`` (the
    same average rate), rounded to the 90 kHz clock the file is written with.
    """
    if not vfr:
        return [i / fps for i in range(frames)]
    times, t = [], 0.0
    for i in range(frames):
        times.append(round(t * 90_000) / 90_000)
        t += (0.5 if i % 2 == 0 else 1.5) / fps
    return times


def write_test_video(
    path: str | Path,
    frames: int = 30,
    fps: float = 30.0,
    size: tuple[int, int] = (64, 64),
    vfr: bool = False,
    codec: str | None = None,
) -> Path:
    """Write a synthetic video of ``frames`` frames drawn by `draw_test_frame` (yuv420p), return its path.

    size: (width, height), both even (yuv420p). codec: ``"libx264"`` when available, else ``"mpeg4"``.
    With ``vfr=True`` frames get the irregular `synthetic_timestamps`.
    """
    width, height = size
    if width % 2 or height % 2:
        raise ValueError(f"yuv420p needs an even width and height, got {width}x{height}")
    path = Path(path)
    codec = codec or _available_codec()
    rate = Fraction(fps).limit_denominator(100_000)
    time_base = Fraction(1, 90_000) if vfr else 1 / rate
    times = synthetic_timestamps(frames, fps, vfr)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = time_base
        if codec == "libx264":
            stream.options = {"crf": "12", "preset": "ultrafast"}
        else:
            stream.bit_rate = max(200_000, width * height * 30)
        for index, t in enumerate(times):
            frame = av.VideoFrame.from_ndarray(draw_test_frame(index, size), format="rgb24")
            frame.pts, frame.time_base = round(t / time_base), time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def _available_codec() -> str:
    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except av.FFmpegError:
        return "mpeg4"
