"""The memory a streaming layer writes into: a growing per-token buffer, the carried slots, the recency ring.

Each is written in place, so a steady stream touches the same memory step after step (what lets a CUDA graph
replay it), and each tells its owner when it had to move to new memory (which invalidates recorded steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .host_pages import ReleasedRuns, free_rows, returnable, write_kept


class TokenBuffer:
    """Tensors ``[B, H_kv, capacity, D]`` that grow geometrically along the token axis (e.g. keys and values).

    The first ``length`` slots are committed; writes past them are scratch until the owner advances
    ``length``. Appends write in place, so N chunks copy O(N) bytes in total (amortised), not O(N^2).
    Released slots (`release`: never read again) read as zeros and, in host memory, give their pages back;
    growing copies only the slots not released.

    Args:
        parts: how many tensors (2: keys and values; 1: one mean key per step).
        capacity_hint: slots to allocate at once (the planned horizon), if known.
        device: where the tensors live; None: where the first write comes from.
        on_replace: told whenever the tensors move to new memory.
        pin: in host memory, written from a GPU, pin it (asynchronous copies); False for a buffer that gives rows
            back (`release`), since pinned pages cannot go back to the OS.
    """

    GROWTH = 2.0

    def __init__(self, parts: int = 2, capacity_hint: int | None = None, device: torch.device | str | None = None,
                 on_replace: Callable[[], None] | None = None, pin: bool = True):
        self.parts, self.capacity_hint, self.pin = parts, capacity_hint, pin
        self.device = torch.device(device) if device is not None else None
        self.on_replace = on_replace
        self.tensors: list[torch.Tensor] | None = None
        self.length = 0
        self.released = ReleasedRuns()

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.tensors is None else self.tensors[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.tensors is None else self.tensors[1]

    @property
    def capacity(self) -> int:
        return 0 if self.tensors is None else self.tensors[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors as allocated, less the rows given back to the OS (`release`: in host memory that is
        not pinned; pinned or GPU rows are only zeroed, and still take their memory). A buffer that gives rows back
        (``pin`` False) in host memory counts the rows below ``length`` only: the pages of the slots ahead hold no
        memory until they are written (`reserve` gives them back)."""
        total = 0
        for tensor in self.tensors or ():
            rows = tensor.shape[2]
            if rows and returnable(tensor):
                rows = (rows if self.pin else min(self.length, rows)) - self.released.rows
            if rows:
                total += rows * (tensor.numel() // tensor.shape[2]) * tensor.element_size()
        return total

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        """Make room for ``needed`` slots shaped like ``like`` ``[B, H_kv, *, D]`` (for ``expected`` if it has to
        grow anyway); True if it reallocated."""
        if needed <= self.capacity:
            return False
        capacity = max(needed, expected, math.ceil(self.capacity * self.GROWTH), self.capacity_hint or 0)
        b, h, _, d = like.shape
        device = self.device or like.device
        pin = self.pin and device.type == "cpu" and like.is_cuda  # from a GPU: asynchronous copies need pinned memory
        grown = [torch.empty(b, h, capacity, d, dtype=like.dtype, device=device, pin_memory=pin)
                 for _ in range(self.parts)]
        for new, old in zip(grown, self.tensors or ()):
            for start, end in self.released.kept(self.length):
                new[:, :, start:end] = old[:, :, start:end]
            for start, end in self.released.within(self.length):
                free_rows(new, start, end)
        for new in grown:
            if self.released.starts or not self.pin:  # reused memory may hold its pages: the slots not written yet
                free_rows(new, self.length, capacity, zero=False)
        self.tensors = grown
        if self.on_replace is not None:
            self.on_replace()
        return True

    def write(self, start: int, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, D]`` tensors to slots ``[start, start + T)`` (from any device)."""
        end = start + parts[0].shape[2]
        self.reserve(parts[0], end)
        for tensor, part in zip(self.tensors, parts):
            tensor[:, :, start:end].copy_(part, non_blocking=tensor.is_pinned())

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        """Copy ``[B, H_kv, T, D]`` tensors to the slots ``index`` (LongTensor ``[T]`` on this buffer's device, so
        the offset never passes through the host)."""
        for tensor, part in zip(self.tensors, parts):
            tensor.index_copy_(2, index, part)

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, :, start:end] for t in self.tensors)

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Slots ``index`` (LongTensor ``[N]``, any device), ``[B, H_kv, N, D]`` each (copies)."""
        return tuple(t.index_select(2, index.to(t.device)) for t in self.tensors)

    def release(self, start: int, end: int) -> None:
        """Slots ``[start, end)`` are never read again: they read as zeros, and in host memory the whole pages that
        they and the slots released before them cover go back to the OS."""
        run = self.released.add(start, end)
        for tensor in self.tensors or ():
            free_rows(tensor, start, end, run)

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents with committed slots: tensors ``[B, H_kv, length, D]``, or with ``released``
        (ascending ``[start, end)`` runs, as a saved state lists them) the slots outside those runs, in order; the
        released slots read as zeros and, in host memory, are never written."""
        self.tensors, self.length, self.released = None, 0, ReleasedRuns()
        length = write_kept(self, parts, released)
        for start, end in released:
            self.release(start, end)
        self.length = length

    def synchronize(self) -> None:
        """Wait for asynchronous copies into this (pinned) buffer before the host reads it."""
        if self.tensors is not None and self.tensors[0].is_pinned() and torch.cuda.is_available():
            torch.cuda.synchronize()


class CarriedSlots:
    """The carried state and the current chunk in one buffer, so attention reads them without concatenating.

    ``kv`` ``[2, B, H_kv, K + T, D]`` holds keys then values; the first ``carried`` (K) slots are the carried
    state, the last T the chunk being streamed. ``positions`` LongTensor ``[B, H_kv, K + T]`` (None in a
    ring, whose positions follow from the step count) gives each slot's logical position. Under bounded
    positions (:mod:`statekv.core.positions.placing`) ``placements`` holds two more rows ``[2, B, H_kv, K + T]``:
    each slot's position in the stream as RoPE counts it (its anchor) and the rotation its key was computed at;
    the three are then views of one tensor, ``position_rows`` ``[3, B, H_kv, K + T]`` (positions, anchors,
    rotations), so a step writes, gathers and keeps them as one.
    """

    def __init__(self, kv: torch.Tensor, positions: torch.Tensor | None, carried: int,
                 position_rows: torch.Tensor | None = None):
        self.kv, self.carried = kv, carried
        self.point_rows(positions, position_rows)

    @property
    def kv(self) -> torch.Tensor:
        return self._kv

    @kv.setter
    def kv(self, kv: torch.Tensor) -> None:  # a pool points a seated stream's buffer at its rows
        self._kv = kv
        self._carried_placing: tuple[torch.Tensor, torch.Tensor] | None = None  # `carried_placing`'s views

    def point_rows(self, positions: torch.Tensor | None, position_rows: torch.Tensor | None) -> None:
        """Hold ``positions`` ``[B, H_kv, K + T]``, or under bounded positions ``position_rows`` ``[3, B, H_kv,
        K + T]`` (its first row the positions, the others the placements)."""
        self.position_rows = position_rows
        self._carried_placing = None
        self.positions = positions if position_rows is None else position_rows[0]
        self.placements = None if position_rows is None else position_rows[1:]  # [2, B, H_kv, K + T]

    @classmethod
    def holding(cls, kv: torch.Tensor, positions: torch.Tensor | None, chunk_len: int,
                placements: torch.Tensor | None = None) -> "CarriedSlots":
        """A new buffer whose carried part is ``kv`` ``[2, B, H_kv, K, D]`` (and ``positions [B, H_kv, K]``,
        ``placements [2, B, H_kv, K]``: then positions too), with room for a chunk of ``chunk_len`` tokens."""
        two, b, h, k, d = kv.shape
        size = k + chunk_len
        rows = None if placements is None else positions.new_empty(3, b, h, size)
        slots = cls(kv.new_empty(two, b, h, size, d),
                    None if positions is None or rows is not None else positions.new_empty(b, h, size), k, rows)
        slots.kv[:, :, :, :k] = kv
        if rows is not None:
            rows[0, ..., :k] = positions
            rows[1:, ..., :k] = placements
        elif positions is not None:
            slots.positions[..., :k] = positions
        return slots

    @property
    def size(self) -> int:
        return self.kv.shape[3]

    @property
    def chunk_len(self) -> int:
        return self.size - self.carried

    @property
    def keys(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[1]

    @property
    def nbytes(self) -> int:
        rows = self.positions if self.position_rows is None else self.position_rows
        return sum(t.numel() * t.element_size() for t in (self.kv, rows) if t is not None)

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The carried part: ``kv [2, B, H_kv, K, D]`` and positions ``[B, H_kv, K]`` (views)."""
        positions = None if self.positions is None else self.positions[..., : self.carried]
        return self.kv[:, :, :, : self.carried], positions

    def carried_placing(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The carried keys ``[B, H_kv, K, D]`` and their placements ``[2, B, H_kv, K]`` (views, made once for the
        tensors held, which a buffer kept in place keeps; pointing it at others forgets them); None unless
        bounded."""
        if self.placements is None:
            return None
        if self._carried_placing is None:
            self._carried_placing = self.kv[0, :, :, : self.carried], self.placements[..., : self.carried]
        return self._carried_placing

    def head_placements(self) -> torch.Tensor | None:
        """The carried part's placements ``[2, B, H_kv, K]`` (a view; None unless bounded)."""
        return None if self.placements is None else self.placements[..., : self.carried]

    def tail(self) -> torch.Tensor:
        """The chunk part, ``[2, B, H_kv, T, D]`` (a view)."""
        return self.kv[:, :, :, self.carried:]

    def with_chunk_len(self, chunk_len: int) -> "CarriedSlots":
        """This buffer, or a new one holding the same carried state, with room for ``chunk_len`` tokens."""
        return self if chunk_len == self.chunk_len else CarriedSlots.holding(*self.head(), chunk_len,
                                                                            self.head_placements())

    def stage(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              position_rows: torch.Tensor | None = None) -> None:
        """Write the chunk ``[B, H_kv, T, D]`` and its positions ``[T]`` into the last T slots; under bounded
        positions ``position_rows`` ``[3, T]``: its positions, anchors and rotations, one write."""
        self.kv[0, :, :, self.carried:] = keys
        self.kv[1, :, :, self.carried:] = values
        if self.position_rows is not None:
            self.position_rows[..., self.carried:] = position_rows[:, None, None]
        elif self.positions is not None:
            self.positions[..., self.carried:] = positions

    def suffix(self, start: int) -> "CarriedSlots":
        """A new buffer carrying slots ``start:`` (e.g. everything, or a recency window), with room for a chunk
        as long as this one."""
        positions = None if self.positions is None else self.positions[..., start:]
        placements = None if self.placements is None else self.placements[..., start:]
        return CarriedSlots.holding(self.kv[:, :, :, start:], positions, self.chunk_len, placements)

    def keep(self, selection: torch.Tensor) -> "CarriedSlots":
        """Carry the slots ``selection`` (LongTensor ``[B, H_kv, K']``, ascending) into the next step: in place
        when K' equals the carried size, else into a new buffer with room for a chunk as long as this one."""
        kv = self.kv.gather(3, selection[None, ..., None].expand(2, -1, -1, -1, self.kv.shape[-1]))
        held = self.positions if self.position_rows is None else self.position_rows  # [(3,) B, H_kv, K + T]
        kept = None if held is None else held.gather(-1, selection.expand(*held.shape[:-3], -1, -1, -1))
        if selection.shape[-1] != self.carried:
            if self.position_rows is None:
                return CarriedSlots.holding(kv, kept, self.chunk_len)
            return CarriedSlots.holding(kv, kept[0], self.chunk_len, kept[1:])
        self.kv[:, :, :, : self.carried] = kv
        if held is not None:
            held[..., : self.carried] = kept
        return self


@dataclass
class Ring:
    """A recency window of ``steps`` equal-length steps of ``chunk_len`` tokens held as a ring, after ``sinks``
    leading tokens that stay put.

    ``slot`` (a device LongTensor ``[1]``) is the ring slot the current step's chunk will overwrite: that of
    the oldest step, ``step_index mod steps``, so the layout depends only on the step count. ``index``
    ``[steps, chunk_len]`` maps a ring slot to its token slots.
    """

    steps: int
    chunk_len: int
    sinks: int
    slot: torch.Tensor
    index: torch.Tensor

    @classmethod
    def starting_at(cls, step_index: int, steps: int, chunk_len: int, sinks: int, device: torch.device) -> "Ring":
        slot = torch.tensor([step_index % steps], device=device)
        index = sinks + torch.arange(steps * chunk_len, device=device).view(steps, chunk_len)
        return cls(steps, chunk_len, sinks, slot, index)

    @property
    def size(self) -> int:
        """Carried tokens: the sinks and the window."""
        return self.sinks + self.steps * self.chunk_len

    def target(self) -> torch.Tensor:
        """Token slots ``[chunk_len]`` the current chunk goes to (read on the device: no host sync)."""
        return self.index.index_select(0, self.slot).view(-1)

    def advance(self) -> None:
        self.slot.add_(1).remainder_(self.steps)

    def time_order(self, step_index: int) -> torch.Tensor:
        """Token slots of the carried state in time order (sinks, then oldest step first), before step
        ``step_index`` runs."""
        first = step_index % self.steps
        window = torch.cat([self.index[first:], self.index[:first]]).flatten()
        return torch.cat([torch.arange(self.sinks, device=window.device), window])

    def positions(self, seen: int, device: torch.device) -> torch.Tensor:
        """Logical positions ``[K]`` of the carried tokens in time order, after ``seen`` tokens."""
        return torch.cat([torch.arange(self.sinks, device=device),
                          torch.arange(seen - self.steps * self.chunk_len, seen, device=device)])
