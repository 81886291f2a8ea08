"""What a synthetic video shows: one still picture per second, each a coloured shape, a grey shape or nothing.

A `Still` names a picture; `render` draws it as an RGB uint8 array ``[FRAME_SIZE, FRAME_SIZE, 3]``. The set
of stills is finite (`all_stills`), so a model's input for every picture can be computed once (see
`statekv.builtin.batches.FrameBank`), and videos are written losslessly, so the decoded frames equal the rendered
ones pixel for pixel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

FRAME_SIZE = 112  # pixels, square
BACKGROUND = (40, 40, 40)
CLUTTER_GREY = (125, 125, 125)  # grey shapes are scenery: no question is about them
COLOURS: dict[str, tuple[int, int, int]] = {  # the order of a colour question's options
    "red": (225, 45, 45),
    "green": (45, 175, 60),
    "blue": (45, 85, 230),
    "yellow": (240, 220, 40),
}
SHAPES = ("square", "circle", "triangle", "cross")  # the order of a shape question's options
OFFSET_STEP = 10  # pixels; a shape's centre sits at one of 3 x 3 offsets from the frame centre
OFFSETS = tuple((dx, dy) for dy in (-OFFSET_STEP, 0, OFFSET_STEP) for dx in (-OFFSET_STEP, 0, OFFSET_STEP))
_HALF = 28  # half the side of a shape's bounding box (pixels)


@dataclass(frozen=True, order=True)
class Still:
    """One picture: ``colour`` is a `COLOURS` name, ``"grey"`` (clutter) or ``None`` (an empty frame)."""

    colour: str | None = None
    shape: str | None = None
    offset: int = 4  # index into OFFSETS (4: centred)

    @property
    def is_object(self) -> bool:
        return self.colour in COLOURS


EMPTY = Still()


def all_stills() -> tuple[Still, ...]:
    """Every picture a synthetic video can show, in a fixed order (its index is the still's id)."""
    return _all_stills()


@lru_cache(maxsize=1)
def _all_stills() -> tuple[Still, ...]:
    stills = [EMPTY]
    for colour in ("grey", *COLOURS):
        stills += [Still(colour, shape, offset) for shape in SHAPES for offset in range(len(OFFSETS))]
    return tuple(stills)


def still_id(still: Still) -> int:
    """The index of ``still`` in `all_stills`."""
    return _still_ids()[still]


@lru_cache(maxsize=1)
def _still_ids() -> dict[Still, int]:
    return {still: index for index, still in enumerate(_all_stills())}


def render(still: Still) -> np.ndarray:
    """The picture ``still`` as RGB uint8 ``[FRAME_SIZE, FRAME_SIZE, 3]`` (a fresh, writable array)."""
    return _render(still).copy()


@lru_cache(maxsize=512)
def _render(still: Still) -> np.ndarray:
    image = Image.new("RGB", (FRAME_SIZE, FRAME_SIZE), BACKGROUND)
    if still.colour is not None:
        fill = CLUTTER_GREY if still.colour == "grey" else COLOURS[still.colour]
        dx, dy = OFFSETS[still.offset]
        _draw_shape(ImageDraw.Draw(image), still.shape, FRAME_SIZE // 2 + dx, FRAME_SIZE // 2 + dy, fill)
    array = np.asarray(image, dtype=np.uint8)
    array.flags.writeable = False
    return array


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, fill: tuple[int, int, int]) -> None:
    h = _HALF
    if shape == "square":
        draw.rectangle((x - h + 4, y - h + 4, x + h - 4, y + h - 4), fill=fill)
    elif shape == "circle":
        draw.ellipse((x - h, y - h, x + h, y + h), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y - h), (x + h, y + h - 4), (x - h, y + h - 4)], fill=fill)
    elif shape == "cross":
        bar = h // 3
        draw.rectangle((x - h, y - bar, x + h, y + bar), fill=fill)
        draw.rectangle((x - bar, y - h, x + bar, y + h), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
