"""A video file's frames' times as statekv reads them, against the times written into it."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import pytest

from frames import read_frame_index
from statekv.testing import draw_test_frame
from statekv.video import open_video


def _written(path: Path, times: list[float], *, b_frames: bool = True,
             time_base: Fraction = Fraction(1, 90000)) -> Path:
    """A video file whose frame ``i`` (`draw_test_frame`) is shown at ``times[i]`` seconds, encoded by libx264 at its
    defaults (B-frames: decoding order is not showing order) unless told."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=None, options={} if b_frames else {"bf": "0"})
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.time_base = stream.codec_context.time_base = time_base
        for index, time in enumerate(times):
            frame = av.VideoFrame.from_ndarray(draw_test_frame(index, (64, 32)), format="rgb24")
            frame.pts, frame.time_base = round(time / time_base), time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.mark.parametrize("b_frames", [True, False])
def test_a_variable_rate_mp4_with_b_frames_is_sampled_to_its_last_frame(tmp_path, b_frames):
    """Six seconds at 4 fps, then one frame a second to 11 s. With B-frames an MP4's header times the stream to its
    last decoding time, 9.5 s. Before: sampling at 1 fps planned 9 frames over 9.5 s and never saw 9 to 11 s."""
    times = [k / 4 for k in range(24)] + [6.0 + k for k in range(6)]
    video = open_video(_written(tmp_path / "recording.mp4", times, b_frames=b_frames))
    frames = list(video.frames())
    assert [(read_frame_index(frame.image), frame.timestamp) for frame in frames] == [
        (index, pytest.approx(time, abs=1e-4)) for index, time in enumerate(times)]
    assert video.variable_rate and video.duration == pytest.approx(11.04, abs=0.01)
    seconds = [int(frame.timestamp) for frame in video.sample(max_fps=1)]
    assert seconds == list(range(11)), seconds
