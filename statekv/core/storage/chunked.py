"""A per-token buffer in host memory whose memory follows what is held, not what was ever streamed
(:class:`ChunkedTokenBuffer`): the buffers of an offloaded detailed cache under an evicting cache limit
(:mod:`statekv.core.storage.limits`).

A :class:`~statekv.core.storage.buffers.TokenBuffer` grows by moving everything to a buffer twice as large, and an
evicted row only gives back the whole pages it covers until the next move copies it again: a stream that never
ends, evicting as it goes, would hold every row it ever streamed. Here the slots are cut into chunks of
`CHUNK_SLOTS`, allocated as they are first written; growing adds chunks (nothing moves, so pages given back stay
given back), and a chunk every slot of which was released is given back whole (a slot of it is then read as
zeros). Slots keep their indices, so a stream's positions never move. Reads across chunks are copies.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch

from .buffers import TokenBuffer
from .limits import release_host_rows

CHUNK_SLOTS = 4096  # slots per chunk: what is allocated, and given back, at once


class ChunkedTokenBuffer(TokenBuffer):
    """`TokenBuffer`'s interface over chunks of ``chunk`` slots (default `CHUNK_SLOTS`), each ``parts`` tensors
    ``[B, H_kv, chunk, D]`` in ``device`` memory (see the module). ``release(start, end)`` gives slots back;
    ``nbytes`` counts the chunks allocated (a chunk stays while a slot of it is held, e.g. a token still carried,
    its released pages given back all the same)."""

    def __init__(self, parts: int = 2, device: torch.device | str | None = None,
                 on_replace: Callable[[], None] | None = None, chunk: int | None = None):
        super().__init__(parts, None, device, on_replace)
        self.chunk = CHUNK_SLOTS if chunk is None else chunk
        self.chunks: list[list[torch.Tensor] | None] = []  # each chunk's parts; None: not allocated, or given back
        # each chunk's released slots (None: none yet; given back: every slot, and the mask is dropped)
        self.released: list[torch.Tensor | None] = []
        self.given_back: set[int] = set()
        self.like: torch.Tensor | None = None  # ``[B, H_kv, 0, D]``: the slots' shape, dtype and device
        self.pinned = False

    @property
    def keys(self) -> torch.Tensor | None:
        raise TypeError("a chunked buffer has no single tensor: read it with view or gather")

    values = keys

    @property
    def capacity(self) -> int:
        return len(self.chunks) * self.chunk

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.chunks if parts is not None for t in parts)

    @property
    def where(self) -> torch.device | None:
        return None if self.like is None else self.like.device

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        """Room for ``needed`` slots: chunks are added, none moves (``expected`` is not allocated ahead)."""
        if self.like is None:
            device = self.device or like.device
            self.like = torch.empty(*like.shape[:2], 0, like.shape[3], dtype=like.dtype, device=device)
            self.pinned = device.type == "cpu" and like.is_cuda  # asynchronous copies from a GPU need it
        while self.capacity < needed:
            self.chunks.append(None)
            self.released.append(None)
        return False

    def _chunk(self, number: int) -> list[torch.Tensor]:
        """Chunk ``number``'s parts, allocated at its first write."""
        parts = self.chunks[number]
        if parts is None:
            b, h, _, d = self.like.shape
            parts = [torch.empty(b, h, self.chunk, d, dtype=self.like.dtype, device=self.like.device,
                                 pin_memory=self.pinned) for _ in range(self.parts)]
            self.chunks[number] = parts
        return parts

    def _spans(self, start: int, end: int):
        """``(chunk, first slot in it, end in it, offset from start)`` over slots ``[start, end)``."""
        slot = start
        while slot < end:
            number, inside = divmod(slot, self.chunk)
            stop = min(end - slot, self.chunk - inside)
            yield number, inside, inside + stop, slot - start
            slot += stop

    def write(self, start: int, *parts: torch.Tensor) -> None:
        end = start + parts[0].shape[2]
        self.reserve(parts[0], end)
        for number, first, last, offset in self._spans(start, end):
            for tensor, part in zip(self._chunk(number), parts):
                tensor[:, :, first:last].copy_(part[:, :, offset: offset + last - first],
                                               non_blocking=tensor.is_pinned())

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        index = index.to("cpu")
        for slot, column in zip(index.tolist(), range(index.numel())):
            self.write(slot, *(part[:, :, column: column + 1] for part in parts))

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Slots ``[start, end)``: views inside one chunk, copies across chunks (released slots read as zeros)."""
        pieces = [self._read(number, first, last) for number, first, last, _ in self._spans(start, end)]
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return tuple(self.like for _ in range(self.parts))
        return tuple(torch.cat(part, dim=2) for part in zip(*pieces))

    def _read(self, number: int, first: int, last: int) -> tuple[torch.Tensor, ...]:
        parts = self.chunks[number]
        if parts is None:
            b, h, _, d = self.like.shape
            return tuple(self.like.new_zeros(b, h, last - first, d) for _ in range(self.parts))
        return tuple(tensor[:, :, first:last] for tensor in parts)

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        index = index.to("cpu")
        b, h, _, d = self.like.shape
        out = [self.like.new_zeros(b, h, index.numel(), d) for _ in range(self.parts)]
        chunks = index // self.chunk
        for number in chunks.unique().tolist():
            parts = self.chunks[number]
            if parts is None:
                continue
            columns = (chunks == number).nonzero().squeeze(1)
            inside = (index[columns] - number * self.chunk).to(self.like.device)
            columns = columns.to(self.like.device)
            for target, tensor in zip(out, parts):
                target.index_copy_(2, columns, tensor.index_select(2, inside))
        return tuple(out)

    def load(self, *parts: torch.Tensor) -> None:
        self.chunks, self.released, self.given_back, self.length = [], [], set(), 0
        self.like = None
        if parts[0].shape[2]:
            self.write(0, *parts)
            self.length = parts[0].shape[2]
        else:
            self.reserve(parts[0], 0)

    def release(self, start: int, end: int) -> None:
        """Slots ``[start, end)`` are never read again: the whole pages they cover go back to the OS (pinned memory
        excepted), and a chunk all of whose slots are released is given back whole."""
        for number, first, last, _ in self._spans(start, end):
            if number in self.given_back:
                continue
            mask = self.released[number]
            if mask is None:
                mask = self.released[number] = torch.zeros(self.chunk, dtype=torch.bool)
            mask[first:last] = True
            if bool(mask.all()):
                self.chunks[number], self.released[number] = None, None
                self.given_back.add(number)
            elif self.chunks[number] is not None:
                self._give_pages_back(number, mask, first, last)

    def _give_pages_back(self, number: int, mask: torch.Tensor, first: int, last: int) -> None:
        """Give back the pages that releasing slots ``[first, last)`` of chunk ``number`` left wholly released: a
        step's rows may be smaller than a page, so a page goes back once the released run around it covers it."""
        parts = self.chunks[number]
        row = max(t.shape[3] * t.element_size() for t in parts)
        near = -(-mmap.PAGESIZE // row) + 1  # rows a page touches, at most
        start, end = max(first - near, 0), min(last + near, self.chunk)
        held = (~mask[start:end]).nonzero().squeeze(1) + start
        start = int(held[held < first].max()) + 1 if bool((held < first).any()) else start
        end = int(held[held >= last].min()) if bool((held >= last).any()) else end
        release_host_rows(parts, start, end)

    def synchronize(self) -> None:
        if self.pinned and torch.cuda.is_available():
            torch.cuda.synchronize()
