"""What a power loss leaves of a disk tier's file set (see `statekv.core.disk.tier`).

A kill loses nothing written (the kernel keeps it); a power loss loses what was not yet forced to the device, in
any order between files, and within a file between its pages. A checkpoint forces the layers' files, its slot and
the journal's lines before it to the device, then appends its ``carry`` record (marked `SYNCED`) and forces the
journal again (`DiskTier.checkpoint`): a marked record that a power loss left vouches for durable data, and so
does every journal line before it, and the slot of the checkpoint before is overwritten only once it is durable.
"""

from __future__ import annotations

SYNCED = "synced"  # a checkpoint's record: written once what it vouches for was forced to the device
