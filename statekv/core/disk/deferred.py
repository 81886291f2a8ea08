"""Rows a disk tier evicts, given back to the file system only once the journal record evicting them is on the
device (see `statekv.core.disk.tier`).

A step that evicts journals an ``evict`` record, forced to the device with the next checkpoint; a hole punched, or
a block file removed, is metadata the file system commits on its own within seconds. Given back at once, a power
loss could keep the hole and lose the record: the last forced checkpoint's steps then fail their checksums, and
the folder is refused as damaged. So a tier's buffers (`DeferredTokenBuffer`) count the rows given back at once
(what reads, checks and the cap follow) and leave them in their files until the tier forces its journal
(`give_back`: at each checkpoint, `DiskTier.sync` and a close). The disk holds, beyond what the cap counts, the rows
of the steps evicted since the last checkpoint (in steady state about ``checkpoint_steps`` steps' rows at most).
Rows released as a buffer is reopened (resumed, restored) wait too: the journal's records evicting them may not be on
the device yet (those after the checkpoint are journaled again unforced; a kill may have come before a force).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...errors import OutputError
from ..storage.host_pages import ReleasedRuns
from .buffers import MappedTokenBuffer

log = logging.getLogger("statekv")


class DeferredTokenBuffer(MappedTokenBuffer):
    """A `MappedTokenBuffer` whose `release` counts rows as given back (`released`, `nbytes`; never read again,
    they read as zeros) and leaves them in its files until `give_back`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.waiting = ReleasedRuns()  # rows released, still in the files

    def release(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` given back, left in the files until `give_back`."""
        self.released.add(start, end)
        self.waiting.add(start, end)

    def give_back(self) -> None:
        """Give the rows released since the last call back to the file system (`MappedTokenBuffer.release`): the
        records evicting them are on the device. Raised midway, they all wait for the next call (giving back
        again what was is harmless)."""
        for start, end in zip(list(self.waiting.starts), list(self.waiting.ends)):
            super().release(start, end)
        self.waiting = ReleasedRuns()

    def _mapped_blocks(self, first: int, last: int) -> list[torch.Tensor]:
        """As `MappedTokenBuffer`'s, the rows waiting to be given back zeroed in the copy-on-write mapping (never
        in the files): they read as zeros, as given back."""
        tensors = super()._mapped_blocks(first, last)
        low, high = (0, self.capacity) if self.block_rows is None else (first * self.block_rows,
                                                                         last * self.block_rows)
        for start, end in zip(self.waiting.starts, self.waiting.ends):
            if max(start, low) < min(end, high):
                for rows in tensors:
                    rows[:, :, max(start, low) - low: min(end, high) - low] = 0
        return tensors

    def open(self, *args: Any, **kwargs: Any) -> None:
        """As `MappedTokenBuffer.open`: what it releases from then on waits again (a reopened buffer is released
        anew by its owner, `statekv.core.storage.limits.CacheKeeper.adopt`)."""
        self.waiting = ReleasedRuns()
        super().open(*args, **kwargs)


def give_back(tier: Any) -> None:
    """Give back the rows every buffer of ``tier`` (a `DiskTier`) released, once its journal was forced to the
    device. One the file system refuses (a file it cannot open) waits for the next time, with one line in the log
    the first time: the stream has lost nothing, its folder holds more than it counts. Nothing is given back once
    the tier's folder path no longer names the folder it locked (another stream's files may lie there)."""
    if not tier.owned:
        return
    try:
        for layer in range(len(tier.buffers)):
            for _, buffer in tier.layer_files(layer):
                buffer.give_back()
    except (OutputError, OSError) as error:  # never undoing the checkpoint whose force came before
        if not tier.give_back_failed:
            tier.give_back_failed = True
            log.warning("%s; the rows this stream evicted stay in its files until it can", error)
