"""Decoding one image (a pushed frame's bytes, a file in a folder of frames) whole, or refusing it in one line.

PIL decodes a PNG whose header promises more rows than its image data holds without a word: the missing rows
come out black. `decode_image` checks a PNG's data against its header first (`png_rows`), and refuses a
truncated image of any format, one in a format not asked for and one over a pixel limit, each with a one-line
`VideoError` (its ``reason`` says which: ``"format"``, ``"size"`` or ``"data"``).
"""

from __future__ import annotations

import io
import re
import struct
import warnings
import zlib
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InputError, VideoError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIGNATURES = {"PNG": PNG_SIGNATURE, "JPEG": b"\xff\xd8\xff"}  # how each format's files begin
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples per pixel
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


class ImageError(VideoError):
    """An image that cannot be used; ``reason``: ``"format"`` (not one asked for), ``"size"`` (over the pixel
    limit) or ``"data"`` (unreadable, truncated, or holding less than its header promises)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def decode_image(data: bytes, *, formats: tuple[str, ...] | None = None, max_pixels: int | None = None,
                 name: str = "the image") -> np.ndarray:
    """``data`` (a whole image file's bytes) as RGB uint8 ``[H, W, 3]``, turned as its EXIF orientation asks.

    formats: PIL format names accepted (``("JPEG", "PNG")``; None: any). max_pixels: the most pixels accepted,
    checked from the header before decoding. name: what messages call it. Raises `ImageError`."""
    if not data:
        raise ImageError(f"{name}: not a readable image (empty)", "data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                if formats is not None and image.format not in formats:
                    raise ImageError(f"{name} is {image.format or 'not an image'}, not {' or '.join(formats)}",
                                     "format")
                width, height = image.size
                if max_pixels is not None and width * height > max_pixels:
                    raise ImageError(f"{name} is {width}x{height} pixels, over the limit of {max_pixels}", "size")
                if image.format == "PNG":
                    promised, held = png_rows(data)
                    if held < promised:
                        raise ImageError(f"{name}: not a readable image (truncated: its PNG header promises {promised} "
                                         f"rows of {width} pixels, its image data holds {held})", "data")
                image.load()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a damaged EXIF block: the image is read as stored
                    ImageOps.exif_transpose(image, in_place=True)  # a phone's portrait photo, shown upright
                return rgb_image(image)
    except ImageError:
        raise
    except UnidentifiedImageError:
        if formats is not None and all(kind in SIGNATURES and not data.startswith(SIGNATURES[kind])
                                       for kind in formats):  # it does not begin as any format it may be
            raise ImageError(f"{name} is not {' or '.join(formats)} (no image format recognised)", "format") from None
        raise ImageError(f"{name}: not a readable image (no image format recognised)", "data") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        # Pillow refuses before the size can be read, naming its own limit rather than the one asked for
        counted = re.search(r"\((\d+) pixels\)", str(error))
        pixels = f" of {int(counted[1]):,} pixels" if counted else ""
        limit = (f"over the limit of {max_pixels}" if max_pixels is not None
                 else f"over Pillow's limit of {Image.MAX_IMAGE_PIXELS}")
        raise ImageError(f"{name} is too large to decode (an image{pixels}, {limit} pixels)", "size") from None
    except (OSError, ValueError, SyntaxError, struct.error, zlib.error) as error:
        raise ImageError(f"{name}: not a readable image ({str(error).strip() or type(error).__name__})", "data") from None


def rgb_image(image: Image.Image) -> np.ndarray:
    """A PIL image in any mode as RGB uint8 ``[H, W, 3]``. Grey of more than 8 bits is scaled to 8 (PIL's own
    conversion clips it: mid-grey came out white): 16-bit (``I;16``) by ``1/257``; 32-bit integers (``I``) as 16-bit
    data when they lie in its range (PIL stores 16-bit PNG and TIFF data so on some paths; an 8-bit picture converted
    to ``I`` so comes out dark), else stretched from their least to their greatest; floats (``F``) as ``0..1``."""
    if image.mode.startswith("I;16"):
        return _grey(np.asarray(image, dtype=np.float64) / 257)
    if image.mode == "I":
        values = np.asarray(image, dtype=np.float64)
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if 0 <= low and high <= 65535:
            return _grey(values / 257)
        return _grey((values - low) * (255 / (high - low)))  # (out of 16-bit range: high > low)
    if image.mode == "F":
        return _grey(np.nan_to_num(np.asarray(image, dtype=np.float64)) * 255)
    return np.asarray(image.convert("RGB"))


def readable_rgb_image(image: Image.Image, error: type[InputError] | type[VideoError]) -> np.ndarray:
    """`rgb_image`, or ``error`` in one line where its pixels cannot be read: PIL reads an opened image's file only
    when it is first used, and the file may be closed by then, or cut short."""
    try:
        return rgb_image(image)
    except (OSError, ValueError, SyntaxError) as reason:
        raise error(f"a PIL image whose pixels cannot be read: {reason} (PIL reads an opened image's file when it "
                    "is first used)") from None


def _grey(values: np.ndarray) -> np.ndarray:
    """Grey ``values`` (0..255, any number type) as RGB uint8 ``[H, W, 3]``, rounded and clipped."""
    levels = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return np.repeat(levels[..., None], 3, axis=-1)


def png_rows(data: bytes) -> tuple[int, int]:
    """``(rows its header promises, rows its image data holds)`` of a PNG file's bytes (for an interlaced one, the
    rows of the full image the data would fill in order); a `ValueError` when it is no PNG."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG")
    header, chunks, position = None, [], len(PNG_SIGNATURE)
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            chunks.append(body)
        elif kind == b"IEND":
            break
        position += 12 + length
    if header is None or header[3] not in _CHANNELS:
        raise ValueError("a PNG without a valid IHDR chunk")
    width, height, depth, colour, _, _, interlaced = header
    bits = depth * _CHANNELS[colour]
    if interlaced:
        passes = [((width - x + dx - 1) // dx, (height - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7]
    else:
        passes = [(width, height)]
    strides = [(1 + (w * bits + 7) // 8, h) for w, h in passes if w and h]
    expected = sum(stride * rows for stride, rows in strides)
    raw = zlib.decompressobj().decompress(b"".join(chunks), expected + 1)  # never more than the header promises
    if len(raw) >= expected:
        return height, height
    return height, int(height * len(raw) / expected) if interlaced else len(raw) // strides[0][0]


def rgb_frame(image: Any, *, copy: bool = False) -> np.ndarray:
    """A frame handed to a stream (an RGB uint8 array ``[H, W, 3]``, or a PIL image in any mode) as an RGB uint8
    array ``[H, W, 3]``, a copy of it when ``copy``. Anything else is an `InputError` that says what it was."""
    wanted = "a frame must be an RGB uint8 array [H, W, 3] or a PIL image"
    if isinstance(image, Image.Image):
        image = readable_rgb_image(image, InputError)
    kind = type(image).__name__
    named = f"{wanted}, got {'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"
    try:
        array = np.array(image, copy=True) if copy else np.asarray(image)
    except (ValueError, TypeError, RuntimeError):  # ragged nesting, a tensor on a GPU or one that needs grad
        raise InputError(f"{named} that is no array on the CPU") from None
    if array.ndim == 0 or array.dtype.kind in "OUS":  # not an array of numbers: say what it was
        raise InputError(named)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8 or 0 in array.shape:
        raise InputError(f"{wanted}, got {array.dtype} values of shape {list(array.shape)}")
    return array
