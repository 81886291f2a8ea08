"""What a power loss leaves of a disk tier's file set, and what of it a resume may drop (see
`statekv.core.disk.tier`).

A kill loses nothing written (the kernel keeps it); a power loss loses what was not yet forced to the device, in
any order between files, and within a file between its pages. A checkpoint forces the layers' files, its slot and
the journal's lines before it to the device, then appends its ``carry`` record (marked `SYNCED`) and forces the
journal again (`DiskTier.checkpoint`): a marked record that a power loss left vouches for durable data, and so
does every journal line before it. What follows the last one may never have reached the device: journal lines
there that do not read (torn, zero-filled, a later page written before an earlier one) are dropped with the steps
after the checkpoint, which a resume never reads (`statekv.core.disk.files.read_file_set`). A line that does not
read before a checkpoint's record is damage, refused as before, whether it is marked or not (an earlier statekv's:
dropping it would cut a long stream back to a checkpoint before it for one damaged line). A record not marked
(written by an earlier statekv, which forced nothing before a sync) whose carried state does not match its checksum
gives way to the checkpoint before it, whose slot it did not overwrite.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

SYNCED = "synced"  # a checkpoint's record: written once what it vouches for was forced to the device

Layout = list[list[tuple[torch.dtype, list[int]] | None]]


def checkpointed(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` is a checkpoint's (marked `SYNCED` or not): every journal line before it was written
    before it, so one that does not read is damage, not a write a power loss took."""
    return record is not None and "carry" in record


def synced(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` is a checkpoint's, written once what it vouches for was on the device."""
    return record is not None and "carry" in record and record.get(SYNCED) is True


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
