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

import bisect
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

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """As `MappedTokenBuffer.view`, the rows waiting to be given back zeroed in the copy-on-write mapping (never
        in the files): they read as zeros, as given back. Only those of ``[start, end)``: a row zeroed there is a
        private page allocated, and after a resume every row the stream ever evicted waits."""
        tensors = super().view(start, end)
        for low, high in self._waiting_within(start, end):
            for rows in tensors:
                rows[:, :, low - start: high - start] = 0
        return tensors

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As `MappedTokenBuffer.gather` (``[B, H_kv, N, X]`` copies), the rows ``index`` (``[N]``) waiting to be
        given back zeroed in the copies, never in the mapping (what a question reads costs its rows alone)."""
        out = super().gather(index)
        if self.waiting.rows and index.numel():
            index = index.to("cpu")
            starts, ends = torch.tensor(self.waiting.starts), torch.tensor(self.waiting.ends)
            run = torch.searchsorted(starts, index, right=True) - 1
            waiting = (run >= 0) & (index < ends[run.clamp(min=0)])
            if bool(waiting.any()):
                for rows in out:
                    rows[:, :, waiting] = 0
        return out

    def _waiting_within(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of rows waiting to be given back, cut to ``[start, end)``."""
        starts, ends = self.waiting.starts, self.waiting.ends
        at, stop = max(bisect.bisect_right(starts, start) - 1, 0), bisect.bisect_left(starts, end)
        return [(max(a, start), min(b, end)) for a, b in zip(starts[at:stop], ends[at:stop]) if b > start]

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
    for layer in range(len(tier.buffers)):
        for _, buffer in tier.layer_files(layer):
            try:  # each buffer alone: one file that keeps refusing holds back its own rows, not every buffer's
                buffer.give_back()
            except (OutputError, OSError) as error:  # never undoing the checkpoint whose force came before
                if not tier.give_back_failed:
                    tier.give_back_failed = True
                    log.warning("%s; the rows this stream evicted stay in its files until it can", error)
