"""Reading back what `statekv.testing.draw_test_frame` drew: which frame a decoded image is."""

from __future__ import annotations

import numpy as np

from statekv.testing import FRAME_INDEX_BITS


def read_frame_index(image: np.ndarray) -> int:
    """The index drawn by `draw_test_frame` into ``image`` (RGB [h, w, 3], w >= 48)."""
    height, width = image.shape[:2]
    stripe = width // FRAME_INDEX_BITS
    if stripe < 4:
        raise ValueError(f"frame index stripes need a width of at least {4 * FRAME_INDEX_BITS}, got {width}")
    top = image[: max(1, height // 2 - 1)].astype(np.float32).mean(axis=2)
    index = 0
    for bit in range(FRAME_INDEX_BITS):
        inner = top[:, bit * stripe + 1 : (bit + 1) * stripe - 1]  # stay clear of blurred stripe edges
        index = (index << 1) | int(inner.mean() > 127.5)
    return index
