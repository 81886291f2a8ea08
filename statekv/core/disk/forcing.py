"""A disk tier's files forced to the storage device (`DiskTier.checkpoint`, `DiskTier.sync`, a close), and what a
force that failed leaves (see `statekv.flushing`: a failed flush is never retried nor passed over).

Once ``os.fsync`` failed (EIO, ENOSPC, EDQUOT), the kernel may have dropped the pages it could not write and marked
them clean, so a later fsync of the same file succeeds without them: a checkpoint forced after it would be marked
`statekv.core.disk.power_loss.SYNCED` vouching for steps (journal lines, layers' rows) that may never reach the
device, and a power loss then left a stream refused as damaged. So a tier whose force failed vouches for nothing
more: it keeps the reason (`DiskTier.force_failed`) and refuses every checkpoint, sync and closing record after it
(`refuse_unforced`, a one-line `OutputError`). Its journal's last checkpoint stays the last one whose data a force
put on the device, and `Stream.load` resumes there (the steps after it counted lost).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import OutputError, os_reason
from ...flushing import flush_folder


def refuse_unforced(tier: Any) -> None:
    """A one-line `OutputError` if a force of ``tier``'s files (a `DiskTier`, taken as any: this module is below it)
    failed before: nothing it writes is vouched for."""
    if tier.force_failed is not None:
        raise OutputError(f"cannot force the disk cache in {tier.folder} to the device: an earlier force failed "
                          f"({tier.force_failed}), so what was written since its last checkpoint may never reach it; "
                          "it is not checkpointed again: close the stream, and Stream.load resumes it from that "
                          "checkpoint")


def force(tier: Any, fds: dict[int, str], *, layers: bool, folder: bool) -> None:
    """Force ``fds`` (each named, ``{fd: file name}``), and the layers' files written since the last time
    (``layers``; `MappedTokenBuffer.sync`, and the tier's `forced`) or the folder's names (``folder``), to the storage
    device. A one-line `OutputError` naming the file and why when the device fails it, and from then on
    (`refuse_unforced`)."""
    refuse_unforced(tier)
    what = "the files beside the journal"
    try:
        if layers:
            tier.forced()
            for layer in range(len(tier.buffers)):
                for name, buffer in tier.layer_files(layer):
                    what = f"layer {layer}'s {name}"
                    buffer.sync()
        for fd, name in fds.items():
            what = name
            os.fsync(fd)
        if folder:  # its files' names, and its own in the offload folder
            what = "the folder's entries"
            flush_folder(tier.folder, strict=True)
            flush_folder(tier.folder.parent)
    except OutputError as error:  # the backlog's own (`statekv.core.disk.successor.BacklogFile.sync`)
        tier.force_failed = str(error)
        raise
    except OSError as error:
        tier.force_failed = f"{what}: {os_reason(error)}"
        raise OutputError(f"cannot force the disk cache in {tier.folder} to the device: {tier.force_failed}") from None
