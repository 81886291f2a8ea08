"""Frames turned upright, the way a player shows them.

A phone stores a portrait video as landscape frames plus a display matrix saying how to turn them, and a portrait
photo as a landscape image plus an EXIF orientation. A model shown the stored pixels sees the scene on its side, so
files are read as FFmpeg's tools and browsers show them: a video file's display matrix applied in quarter turns and
a mirror (`display_turn`, `statekv.video.sources.FileVideo`), an image file's (or pushed image's) EXIF orientation
applied by Pillow (`statekv.video.images.decode_image`). PIL images and arrays given in memory are read as given.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np
from av.sidedata.sidedata import Type


class Turn(NamedTuple):
    """How to show a stored frame: mirrored left to right first, then turned ``quarters`` quarter turns
    counterclockwise."""

    mirrored: bool
    quarters: int

    @property
    def sideways(self) -> bool:
        """Whether the shown frame's width is the stored frame's height."""
        return self.quarters % 2 == 1

    def apply(self, image: np.ndarray) -> np.ndarray:
        """``image`` ``[H, W, C]`` as shown (a new contiguous array when it moves: views with negative strides are
        not tensors)."""
        if not self.mirrored and not self.quarters:
            return image
        if self.mirrored:
            image = image[:, ::-1]
        return np.ascontiguousarray(np.rot90(image, self.quarters))


AS_STORED = Turn(False, 0)


def display_turn(frame: Any) -> Turn:
    """The `Turn` a decoded PyAV ``frame``'s display matrix asks for (`AS_STORED` without one, or for a matrix
    that turns by other than quarter turns, which is left as stored)."""
    data = frame.side_data.get(Type.DISPLAYMATRIX)
    if data is None:
        return AS_STORED
    a, b, _, c, d = struct.unpack("=5i", bytes(data)[:20])  # the 2x2 part of a 16.16 fixed-point 3x3 matrix
    mirrored = a * d - b * c < 0
    if mirrored:  # a mirrored matrix is a rotation after the stored frame's x is negated
        a, b = -a, -b
    if a == b == 0:
        return AS_STORED
    angle = math.degrees(math.atan2(-b, a))
    quarters = round(angle / 90)
    if abs(angle - 90 * quarters) > 1:
        return AS_STORED
    return Turn(mirrored, quarters % 4)

