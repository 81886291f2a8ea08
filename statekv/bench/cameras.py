"""What the simulated cameras show: JPEG frames, synthetic (the numbered test pattern) or sampled from video files.

Frames are encoded once, before a run, so the load generator only sends bytes: camera ``i`` shows its own frames,
looping when it has shown them all.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

SYNTHETIC_FRAMES = 16  # distinct frames each synthetic camera loops over


def jpeg(image: np.ndarray, quality: int = 85) -> bytes:
    """An RGB uint8 image ``[H, W, 3]`` as JPEG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


class Cameras:
    """The frames each camera pushes: ``frames(camera)`` is a list of JPEG bodies it loops over."""

    def __init__(self, videos: Sequence[str] = (), *, size: int = 224, fps: float = 1.0, limit: int = 1):
        self.videos, self.size, self.fps, self.limit = list(videos), size, fps, max(1, limit)
        self._decoded: dict[int, list[bytes]] = {}
        self._synthetic: dict[int, list[bytes]] = {}

    def check(self) -> None:
        """Open every video file (a one-line error names one that is not a readable video)."""
        for index in range(len(self.videos)):
            self._video_frames(index)

    def frames(self, camera: int) -> list[bytes]:
        if self.videos:
            return self._video_frames(camera % len(self.videos))
        if camera not in self._synthetic:
            from ..video.patterns import draw_test_frame

            first = 1000 * camera
            self._synthetic[camera] = [jpeg(draw_test_frame(first + index, (self.size, self.size)))
                                       for index in range(SYNTHETIC_FRAMES)]
        return self._synthetic[camera]

    def _video_frames(self, index: int) -> list[bytes]:
        """The first ``limit`` frames of video ``index`` sampled at ``fps`` (fewer if it is shorter)."""
        if index not in self._decoded:
            from ..errors import InputError
            from ..video import open_video

            video = open_video(self.videos[index])
            frames = []
            for frame in video.sample_at_rate(self.fps):
                frames.append(jpeg(frame.image))
                if len(frames) >= self.limit:
                    break
            if not frames:
                raise InputError(f"--video {self.videos[index]}: no frame could be read at {self.fps:g} fps")
            self._decoded[index] = frames
        return self._decoded[index]
