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
gives way to the checkpoint before it, whose slot it did not overwrite (`statekv.core.disk.slots.slot_matches`).
"""

from __future__ import annotations

from typing import Any

SYNCED = "synced"  # a checkpoint's record: written once what it vouches for was forced to the device


def checkpointed(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` is a checkpoint's (marked `SYNCED` or not): every journal line before it was written
    before it, so one that does not read is damage, not a write a power loss took."""
    return record is not None and "carry" in record


def synced(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` is a checkpoint's, written once what it vouches for was on the device."""
    return record is not None and "carry" in record and record.get(SYNCED) is True
