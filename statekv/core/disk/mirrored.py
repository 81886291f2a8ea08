"""The disk tier's segment index: kept in RAM (what retrieval ranks segments by), its writes mirrored to files
(what a resumed stream reads back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..storage.buffers import TokenBuffer
from ..storage.compact import CompactBuffer
from ..storage.host_pages import kept_in
from .buffers import MappedTokenBuffer


class MirroredTokenBuffer:
    """A buffer in RAM (what is read) whose writes are also appended to a `MappedTokenBuffer` (what a resumed
    stream reads back): the segment index. For a stream that ``evicts`` the RAM half is a `CompactBuffer` (only
    the rows it keeps, so its address space follows them, not the stream's age; its views are copies), else a
    `TokenBuffer` (views). Everything but writing, releasing and loading is the RAM half's."""

    def __init__(self, parts: int, prefix: Path, on_replace: Callable[[], None] | None = None,
                 described: dict | None = None, evicts: bool = False,
                 mapped: type[MappedTokenBuffer] = MappedTokenBuffer):
        """mapped: the files' buffer's class (a disk tier's gives rows back late, `statekv.core.disk.deferred`)."""
        self.mirror = mapped(parts, None, prefix, described=described)
        self._ram_only = False  # while loading: the file has the rows already
        # never pinned: its rows are copied to the file synchronously anyway, and pinned rows a stream evicts could
        # not go back to the OS (nor would the slots ahead of its length go uncounted, `nbytes`)
        self.ram = (CompactBuffer(parts, on_replace) if evicts
                    else TokenBuffer(parts, None, "cpu", on_replace=on_replace, pin=False))

    def __getattr__(self, name: str):
        if name == "ram":  # not set yet
            raise AttributeError(name)
        return getattr(self.ram, name)

    @property
    def length(self) -> int:
        return self.ram.length

    @length.setter
    def length(self, value: int) -> None:
        self.ram.length = value
        if not self._ram_only:
            self.mirror.length = value

    def write(self, start: int, *parts: torch.Tensor) -> None:
        self.ram.write(start, *parts)
        if not self._ram_only:
            self.mirror.write(start, *parts)

    def release(self, start: int, end: int) -> None:
        self.ram.release(start, end)
        self.mirror.release(start, end)

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """As `MappedTokenBuffer.load`; resuming (``parts`` the views of the rows its files hold), the RAM half reads
        only the rows of the blocks still there (given back whole, the others read as zeros): a stream that evicted
        for weeks never copies its whole index in to give it back again."""
        mirror = self.mirror
        if mirror.adopted and parts[0].shape[2] == mirror.length and not released:
            gone = mirror.released.within(mirror.length)
            kept = [torch.arange(start, end) for (start, end), _ in kept_in(gone, mirror.length)]
            copies = mirror.gather(torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long))
        else:
            gone, copies = released, tuple(part.clone() for part in parts)
        mirror.load(*parts, released=released)
        self._ram_only = True
        try:
            self.ram.load(*copies, released=gone)
        finally:
            self._ram_only = False

    @property
    def crc(self) -> int:
        return self.mirror.crc

    @crc.setter
    def crc(self, value: int) -> None:
        self.mirror.crc = value
