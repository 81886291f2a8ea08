"""A test pattern: frames that carry their own index, readable back after lossy coding.

Used to fabricate small benchmarks (`statekv.eval.fabricate`) and by the tests' videos (`statekv.testing`).
"""

from __future__ import annotations

import numpy as np

FRAME_INDEX_BITS = 12  # frame indices up to 4095 are drawn as black/white stripes in the top half


def draw_test_frame(index: int, size: tuple[int, int]) -> np.ndarray:
    """A distinguishable RGB uint8 frame [h, w, 3] for ``size = (w, h)``.

    The top half shows ``index`` in binary as `FRAME_INDEX_BITS` vertical stripes (white = 1, most significant
    bit first), readable back after lossy coding (the tests' ``read_frame_index``) when w >= 48 and h >= 8; the bottom
    half is a colour that changes with ``index`` and a square that moves with it.
    """
    width, height = size
    frame = np.zeros((height, width, 3), np.uint8)
    top = height // 2
    stripe = width // FRAME_INDEX_BITS
    for bit in range(FRAME_INDEX_BITS):
        if stripe and (index >> (FRAME_INDEX_BITS - 1 - bit)) & 1:
            frame[:top, bit * stripe : (bit + 1) * stripe] = 255
    frame[top:] = ((37 * index) % 256, (101 * index + 64) % 256, 160)
    side = max(1, min(width, height - top) // 3)
    x = (5 * index) % max(1, width - side)
    frame[top : top + side, x : x + side] = (255, 255, 0)
    return frame
