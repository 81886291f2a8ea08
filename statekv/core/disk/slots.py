"""What a disk tier's checkpoint writes into its slot (``carry.0.bin`` or ``carry.1.bin``, written in turn) and how
its bytes are laid out: per layer the carried positions ``[B, H_kv, K]`` (int64), keys and values
``[B, H_kv, K, D]``, under bounded positions the placements ``[2, B, H_kv, K]`` (int64) and the open segment's
accumulators ``[B, H_kv, 1, 3 D]``, then evict-least-attended's tally (steps ``[L]`` int64, totals ``[L]``
float64); the ``carry`` record names their shapes, dtype and CRC-32 (`statekv.core.disk.tier.DiskTier.checkpoint`,
read back by `statekv.core.disk.resume`)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

Layout = list[list[tuple[torch.dtype, list[int]] | None]]


def carried_parts(layer: Any) -> tuple[torch.Tensor | None, ...]:
    """What a checkpoint writes of a layer: its carried positions, keys, values, placements (None unless bounded)
    and open segment (None before the first step)."""
    placements = layer.slots.head_placements() if layer.slots is not None else None
    return (layer.positions(), *layer.carried(), placements, layer.storage.saved_segment())


def tally_parts(cache: Any) -> tuple[torch.Tensor, ...]:
    """What a checkpoint writes after the layers' carried state: under evict-least-attended the steps ``[L]``
    (int64) it may still evict with a total, and their totals ``[L]`` (float64); else nothing."""
    return () if cache.tally is None else cache.tally.export(cache.evicted_steps)


def slot_bytes(carried: list[tuple[torch.Tensor | None, ...]], tally: tuple[torch.Tensor, ...]) -> bytes:
    """The bytes of a slot: every layer's `carried_parts` in order, then the `tally_parts`."""
    return b"".join(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in [*(t for parts in carried for t in parts), *tally] if t is not None)


def carried_layout(carry: dict[str, Any]) -> Layout | None:
    """Per layer, the parts of the carried state the checkpoint ``carry`` wrote, each ``(dtype, shape)`` or None
    (positions ``[B, H_kv, K]``, keys, values ``[B, H_kv, K, D]``, placements ``[2, B, H_kv, K]``, open segment);
    None when the record does not say."""
    dtype = getattr(torch, str(carry.get("carried_dtype")), None)
    shapes, placed, segment = carry.get("carried"), bool(carry.get("placed")), carry.get("segment")
    if (not isinstance(dtype, torch.dtype) or not isinstance(shapes, list)
            or not all(isinstance(shape, list) and len(shape) == 4 for shape in shapes)):
        return None
    layout = []
    for shape in shapes:
        parts = [(torch.int64, shape[:3]), (dtype, shape), (dtype, shape)]
        parts.append((torch.int64, [2, *shape[:3]]) if placed else None)
        parts.append((dtype, segment) if isinstance(segment, list) else None)
        layout.append(parts)
    return layout


def layout_bytes(layout: Layout) -> int:
    """Bytes the parts of ``layout`` (`carried_layout`) take."""
    return sum(math.prod(s) * kind.itemsize for parts in layout for part in parts if part for kind, s in [part])


def slot_matches(folder: Path, carry: dict[str, Any]) -> bool:
    """Whether the slot the checkpoint ``carry`` names holds the carried state its checksum vouches for."""
    layout, tallied = carried_layout(carry), carry.get("tally") or 0
    if layout is None or type(tallied) is not int or tallied < 0 or not isinstance(carry.get("slot"), int):
        return False
    try:
        data = (folder / f"carry.{carry['slot']}.bin").read_bytes()[:layout_bytes(layout) + 16 * tallied]
    except (OSError, ValueError, OverflowError):
        return False
    return zlib.crc32(data) == carry.get("carry_crc")
