"""Frame preprocessing for the supported model families, without torchvision.

Resizing uses PIL (bicubic), as the transformers image processors' PIL backend does, so the results can be
checked against transformers' own processors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
QWEN_MEAN = (0.5, 0.5, 0.5)
QWEN_STD = (0.5, 0.5, 0.5)

ItemT = TypeVar("ItemT")


def _to_pil(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise ValueError(f"expected an RGB uint8 image [H, W, 3], got {array.dtype} {list(array.shape)}")
    return Image.fromarray(array)


def _resize_normalize(image: Any, height: int, width: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """RGB image -> float32 tensor [3, height, width]: bicubic resize, scale to [0, 1], normalise per channel."""
    resized = _to_pil(image).resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return (pixels - mean_t) / std_t


def internvl_pixel_values(
    image: Any,
    size: int | tuple[int, int] = 448,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> torch.Tensor:
    """One frame for InternVL3 / Eagle: resize to ``size`` ignoring aspect ratio, normalise.

    image: PIL image or RGB uint8 array [H, W, 3]. size: side (or (height, width)) from the checkpoint's config.
    Returns float32 [3, height, width].
    """
    height, width = (size, size) if isinstance(size, int) else size
    return _resize_normalize(image, height, width, mean, std)


def qwen_frame_size(height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int = 32) -> tuple[int, int]:
    """The (height, width) every frame of a video is resized to for Qwen-VL ("smart resize").

    Keeps the aspect ratio as closely as possible, makes both sides multiples of ``factor``
    (patch_size * merge_size) and brings ``height * width`` into ``[min_pixels, max_pixels]``. Choose it once
    per video: the model expects every temporal patch of a video at one resolution.
    """
    if height < 1 or width < 1:
        raise ValueError(f"frame size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be at most 200, got {height}x{width}")
    if min(height, width) < factor:  # bring the short side up to one factor before rounding
        scale = factor / min(height, width)
        height, width = int(height * scale), int(width * scale)
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    if resized_h * resized_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        resized_h = max(factor, math.floor(height / shrink / factor) * factor)
        resized_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * grow / factor) * factor
        resized_w = math.ceil(width * grow / factor) * factor
    return resized_h, resized_w


def qwen_pixel_values(
    frames: Sequence[Any],
    size: tuple[int, int],
    *,
    patch_size: int = 16,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    mean: Sequence[float] = QWEN_MEAN,
    std: Sequence[float] = QWEN_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames -> the flattened patches the Qwen2/3-VL vision tower takes as video input.

    frames: consecutive frames (PIL or RGB uint8 [H, W, 3]); if their count is not a multiple of
        ``temporal_patch_size`` the last frame is repeated (a lone last frame fills a temporal patch).
    size: (height, width), multiples of ``patch_size * merge_size`` (see `qwen_frame_size`).
    Returns ``pixel_values`` float32 [t * gh * gw, 3 * temporal_patch_size * patch_size**2] and
    ``grid_thw`` int64 [1, 3] = [[t, gh, gw]] with gh = height / patch_size, gw = width / patch_size.
    Patches are ordered as in transformers: by temporal patch, then by merge_size x merge_size block
    (row-major), then row-major inside the block; each patch is flattened as (channel, time, row, column).
    """
    height, width = size
    factor = patch_size * merge_size
    if height % factor or width % factor:
        raise ValueError(f"size {height}x{width} must be a multiple of patch_size * merge_size = {factor}")
    if not frames:
        raise ValueError("qwen_pixel_values needs at least one frame")
    pixels = torch.stack([_resize_normalize(frame, height, width, mean, std) for frame in frames])
    if remainder := -len(frames) % temporal_patch_size:
        pixels = torch.cat([pixels, pixels[-1:].expand(remainder, -1, -1, -1)])
    grid_t, grid_h, grid_w = pixels.shape[0] // temporal_patch_size, height // patch_size, width // patch_size
    patches = pixels.view(
        grid_t, temporal_patch_size, 3,
        grid_h // merge_size, merge_size, patch_size,
        grid_w // merge_size, merge_size, patch_size,
    )  # fmt: skip
    # -> (t, block row, block col, row in block, col in block, channel, time, pixel row, pixel col)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = patches.reshape(grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size * patch_size)
    return pixel_values, torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.long)


def temporal_groups(frames: Iterable[ItemT], size: int = 2) -> Iterator[tuple[ItemT, ...]]:
    """Consecutive groups of ``size`` items, lazily; a short last group is padded by repeating its last item.

    Used to pair sampled frames into Qwen-VL temporal patches (one chunk = one group).
    """
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    group: list[ItemT] = []
    for frame in frames:
        group.append(frame)
        if len(group) == size:
            yield tuple(group)
            group = []
    if group:
        yield tuple(group + [group[-1]] * (size - len(group)))
