"""Writing still-per-second videos with PyAV, losslessly, so every decoded frame equals the picture drawn."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import av
import numpy as np

FRAMES_PER_STILL = 4  # one still per second at 4 fps: sampling at 1 fps by any rule lands on each still once


def write_stills_video(path: Path | str, stills: Iterable[np.ndarray], *, fps: int = FRAMES_PER_STILL) -> Path:
    """Write ``stills`` (RGB uint8 ``[H, W, 3]``, all one size, even sides) as a video that shows each for one
    second at ``fps`` frames per second: lossless H.264 in RGB (``libx264rgb``, qp 0). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = None
        index = 0
        for image in stills:
            if stream is None:
                stream = container.add_stream("libx264rgb", rate=fps)
                stream.height, stream.width = image.shape[:2]
                stream.pix_fmt = "rgb24"
                stream.options = {"qp": "0", "preset": "ultrafast"}
            image = np.ascontiguousarray(image)
            for _ in range(fps):  # a fresh frame each time: the encoder may still hold the previous one
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                frame.pts = index
                container.mux(stream.encode(frame))
                index += 1
        if stream is None:
            raise ValueError(f"{path}: no stills to write")
        container.mux(stream.encode(None))
    return path
