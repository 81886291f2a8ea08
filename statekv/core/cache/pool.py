"""Streams of one model whose steady state lives in tensors they share, so that a batch of their steps is a set of
rows (`statekv.core.step.pooled` runs it).

A stream takes a seat in its model's :class:`StreamPool` when its steady step is first batched, and keeps it until
it closes. Its seat is a row ``row`` of:

* ``counters`` LongTensor ``[3, R]``: its tokens seen, its step index and its ring slot, as the step advances them
  on the device (the stream's ``seen_device``, ``step_device`` and ring ``slot`` are views of its column);
* per layer, ``segments[layer]`` ``[3, R, H_kv, 1, D]``: its open segment's minimum, maximum and sum (its storage's
  ``segment_open`` is a view of its row);
* the page tables of the pools ``tokens`` (keys and values, in the model's dtype) and ``steps`` (each step's mean
  and sampled keys): its layers' storage becomes a :class:`~statekv.core.storage.paged.PagedStorage`, its detailed
  cache and summaries copied there once.

Its carried state (slots or a ring: the same size at every steady step) is a row ``slot`` of the :class:`SlotRows`
of its shape, per layer ``kv`` ``[2, R', H_kv, K + T, D]`` and ``positions`` ``[R', H_kv, K + T]`` (and under bounded
positions each slot's placements; its form's buffer is a view of that row). A stream stepping alone reads and writes
the same memory through those views, so its state is in one place whichever way it steps. Row 0 of every table is
scratch: a batch padded to its bucket reads and writes there. When a stream's shape changes (a new chunk length,
leaving its ring), its form makes buffers of its own and its slot row is given back at its next batched step.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from ..storage.layer_storage import SAMPLES_PER_STEP, LayerStorage
from ..storage.paged import PagedStorage, PagePool, PageRow
from ...weak import weakly

COUNTERS = 3  # per seat: tokens seen, step index, ring slot
KEPT_IDLE_SHAPES = 4  # slot rows of shapes no stream holds, kept (their steps recorded) for the next of that shape


@dataclass(frozen=True)
class SlotShape:
    """The shape of a steady carried state: ``chunk_len`` T, per layer ``carried`` K, ``ring`` (its steps and
    sinks) when the layers hold a ring, and whether each slot has its placements (bounded positions)."""

    chunk_len: int
    carried: tuple[int, ...]
    ring: tuple[int, int] | None
    placed: bool = False

    @classmethod
    def of(cls, cache) -> "SlotShape | None":
        """``cache``'s shape after its step was begun, or None when it is not one slot rows can hold (a window,
        nothing carried yet)."""
        buffers = [layer.carry.buffer for layer in cache.layers]
        if any(buffer is None for buffer in buffers):
            return None
        placed = {buffer.placements is not None for buffer in buffers}
        if len(placed) != 1:
            return None
        ring = cache.ring
        if ring is None and any(layer.carry.name != "slots" for layer in cache.layers):
            return None
        lengths = {buffer.chunk_len for buffer in buffers}
        if len(lengths) != 1:
            return None
        return cls(lengths.pop(), tuple(buffer.carried for buffer in buffers),
                   None if ring is None else (ring.steps, ring.sinks), placed.pop())


class SlotRows:
    """The carried slots of every seat whose steady state has ``shape``: per layer ``kv`` ``[2, R, H_kv, K + T, D]``
    and ``positions`` ``[R, H_kv, K + T]`` (None for a ring, whose positions follow from the step count), and under
    bounded positions ``placements`` ``[2, R, H_kv, K + T]`` (anchors, rotations), both then views of
    ``position_rows`` ``[3, R, H_kv, K + T]`` (as a stream's own `CarriedSlots` holds them); a ring's ``ring_index``
    ``[steps, T]`` maps a ring slot to its token slots. Row 0 is scratch."""

    def __init__(self, shape: SlotShape, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 on_change, rows: int = 4):
        self.shape, self.on_change = shape, on_change
        self.selects = shape.ring is None
        sizes = [carried + shape.chunk_len for carried in shape.carried]
        self.kv = [torch.zeros(2, rows, heads, size, head_dim, dtype=dtype, device=device) for size in sizes]
        self.position_rows: list[torch.Tensor] | None = None  # bounded positions (never a ring)
        self.positions = self.placements = None
        if shape.placed:
            self.position_rows = [torch.zeros(3, rows, heads, size, dtype=torch.long, device=device)
                                  for size in sizes]
            self._views()
        elif shape.ring is None:
            self.positions = [torch.zeros(rows, heads, size, dtype=torch.long, device=device) for size in sizes]
        self.ring_index = None
        if shape.ring is not None:
            steps, sinks = shape.ring
            self.ring_index = sinks + torch.arange(steps * shape.chunk_len, device=device).view(steps, -1)
        self.free = list(range(rows - 1, 0, -1))

    def take(self) -> int:
        if not self.free:
            rows = self.kv[0].shape[1]
            self.kv = [_grown(kv, 1, 2 * rows) for kv in self.kv]
            if self.position_rows is not None:
                self.position_rows = [_grown(marks, 1, 2 * rows) for marks in self.position_rows]
                self._views()
            elif self.positions is not None:
                self.positions = [_grown(positions, 0, 2 * rows) for positions in self.positions]
            self.free = list(range(2 * rows - 1, rows - 1, -1))
            self.on_change()
        return self.free.pop()

    def give(self, row: int) -> None:
        self.free.append(row)

    @property
    def idle(self) -> bool:
        """Whether no stream holds a slot here."""
        return len(self.free) == self.kv[0].shape[1] - 1  # all but the scratch row

    def _views(self) -> None:
        """``positions`` ``[R', H_kv, K + T]`` and ``placements`` ``[2, R', H_kv, K + T]`` as views of
        ``position_rows``."""
        self.positions = [marks[0] for marks in self.position_rows]
        self.placements = [marks[1:] for marks in self.position_rows]


def _grown(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with ``dim`` grown to ``size`` (zeros after its rows)."""
    shape = list(tensor.shape)
    shape[dim] = size
    grown = tensor.new_zeros(shape)
    grown.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return grown


class Seat:
    """A stream's place in a :class:`StreamPool` (see the module doc). ``views``: the views its own objects were
    given, by what they are (compared by identity to see what the stream replaced since)."""

    def __init__(self, row: int, cache, tokens: PageRow, steps: PageRow):
        self.row, self.cache = row, weakref.ref(cache)
        self.tokens, self.steps = tokens, steps
        self.slots: SlotRows | None = None
        self.slot = 0
        self.version = -1  # the cache's layout_version when its views were last settled
        self.views: dict = {}


class StreamPool:
    """The shared state of the streams of one model (decoder, device and dtype) with ``layers`` layers of ``heads`` KV
    heads of ``head_dim``: see the module doc. ``version`` changes whenever a shared tensor moved to new memory
    (recorded steps over it are then stale); ``lock`` is held while its rows are taken, settled or stepped."""

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 rows: int = 8):
        self.layers, self.heads, self.head_dim, self.dtype, self.device = layers, heads, head_dim, dtype, device
        self.lock = threading.RLock()
        self.version = 0
        self.tokens = PagePool({"keys": head_dim, "values": head_dim}, layers, heads, dtype, device, self.changed)
        self.steps = PagePool({"means": head_dim, "samples": SAMPLES_PER_STEP * head_dim}, layers, heads, dtype,
                              device, self.changed)
        self.counters = torch.zeros(COUNTERS, rows, dtype=torch.long, device=device)
        self.segments = [torch.zeros(3, rows, heads, 1, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.free = list(range(rows - 1, 0, -1))  # row 0 is scratch
        self.seats: dict[int, Seat] = {}
        self.slot_rows: dict[SlotShape, SlotRows] = {}
        self._idle: dict[SlotShape, SlotRows] = {}  # slot rows no stream holds, the longest idle first
        self.batches: dict = {}  # what `statekv.core.step.pooled` keeps per batch key and bucket
        self._by_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._aranges: dict[int, torch.Tensor] = {}

    def arange(self, length: int) -> torch.Tensor:
        """``[0, length)`` on the pool's device, kept (a recorded step reads it)."""
        if length not in self._aranges:
            self._aranges[length] = torch.arange(length, device=self.device)
        return self._aranges[length]

    # seats --------------------------------------------------------------------------------------------------
    def seat(self, cache) -> Seat:
        """``cache``'s seat (taken now if it has none), its views settled on the stream's current state. Called
        between steps, after the stream's step was begun (its shape is the step's)."""
        with self.lock:
            seat = self._by_cache.get(cache)
            if seat is None:
                seat = self._take(cache)
            if seat.version != cache.layout_version:
                self._settle(seat, cache)
            return seat

    def seated(self, cache) -> Seat | None:
        return self._by_cache.get(cache)

    def _take(self, cache) -> Seat:
        if not self.free:
            self._grow_rows()
        row = self.free.pop()
        seat = Seat(row, cache, self.tokens.open(row), self.steps.open(row))
        self.seats[row] = seat
        self._by_cache[cache] = seat
        weakref.finalize(cache, self.release, seat)
        for index, layer in enumerate(cache.layers):  # the detailed cache and summaries move into pages, once
            old = layer.storage
            old.synchronize()
            paged = PagedStorage(seat.tokens, seat.steps, index, old.detailed.capacity_hint,
                                 weakly(cache, lambda owner: owner.buffers_replaced()))
            paged.segment_steps = old.segment_steps
            paged.load(old.export(), list(cache.chunk_lengths), self.device)
            LayerStorage.prepare(paged, cache.chunk_len)  # room for every summary and index row to the horizon
            layer.storage = paged
        return seat

    def _settle(self, seat: Seat, cache) -> None:
        """Make every view of ``cache``'s state one of the seat's rows, copying in what the stream holds elsewhere
        (new counters after a load, a new ring, a new carried form...)."""
        row, views = seat.row, seat.views
        if cache.seen_device is None or cache.seen_device is not views.get("seen"):
            self.counters[0, row] = cache.seen_tokens
            self.counters[1, row] = cache.step_index
        ring = cache.ring
        if ring is not None and ring.slot is not views.get("ring"):
            self.counters[2, row:row + 1].copy_(ring.slot)
        for index, layer in enumerate(cache.layers):
            storage = layer.storage
            if not isinstance(storage, PagedStorage) or storage.rows[0] is not seat.tokens:
                raise RuntimeError("a pooled stream's storage was replaced")  # never: the stream keeps its pages
            if storage.segment_open is not views.get(("segment", index)):
                self.segments[index][:, row:row + 1].copy_(storage.segment_open)
        shape = SlotShape.of(cache)
        rows = self.slot_rows.get(shape)
        if rows is None:
            rows = self.slot_rows[shape] = SlotRows(shape, self.heads, self.head_dim, self.dtype, self.device,
                                                    self.changed)
        if seat.slots is not rows:
            self._idle.pop(shape, None)  # first: the rows given back below must not free the ones taken here
            if seat.slots is not None:
                self._give_slot(seat)
            seat.slots, seat.slot = rows, rows.take()
        for index, layer in enumerate(cache.layers):
            buffer = layer.carry.buffer
            if buffer.kv is not views.get(("kv", index)):
                rows.kv[index][:, seat.slot:seat.slot + 1].copy_(buffer.kv)
                if rows.position_rows is not None:
                    rows.position_rows[index][:, seat.slot:seat.slot + 1].copy_(buffer.position_rows)
                elif rows.positions is not None:
                    rows.positions[index][seat.slot:seat.slot + 1].copy_(buffer.positions)
        self._point(seat, cache)
        cache.buffers_replaced()
        seat.version = cache.layout_version

    def _point(self, seat: Seat, cache, held_only: bool = False) -> None:
        """Point ``cache``'s views at the seat's rows of the current tensors, whose values are already there
        (``held_only``: only the views the stream still holds, after a shared tensor moved)."""
        row, slot, views = seat.row, seat.slot, seat.views

        def holds(name, current) -> bool:
            return not held_only or current is views.get(name)

        if holds("seen", cache.seen_device):
            cache.seen_device = views["seen"] = self.counters[0, row]
            cache.step_device = views["step"] = self.counters[1, row:row + 1]
        if cache.ring is not None and holds("ring", cache.ring.slot):
            cache.ring.slot = views["ring"] = self.counters[2, row:row + 1]
        for index, layer in enumerate(cache.layers):
            if holds(("segment", index), layer.storage.segment_open):
                layer.storage.segment_open = views["segment", index] = self.segments[index][:, row:row + 1]
            buffer = layer.carry.buffer
            if seat.slots is not None and buffer is not None and holds(("kv", index), buffer.kv):
                buffer.kv = views["kv", index] = seat.slots.kv[index][:, slot:slot + 1]
                if seat.slots.position_rows is not None:
                    buffer.point_rows(None, seat.slots.position_rows[index][:, slot:slot + 1])
                elif seat.slots.positions is not None:
                    buffer.point_rows(seat.slots.positions[index][slot:slot + 1], None)

    def changed(self) -> None:
        """A shared tensor moved: every seated stream's views follow it, and recorded steps over it are stale."""
        self.version += 1
        for seat in list(self.seats.values()):
            cache = seat.cache()
            if cache is None or not seat.views:
                continue
            settled = seat.version == cache.layout_version
            self._point(seat, cache, held_only=True)
            cache.buffers_replaced()
            if settled:
                seat.version = cache.layout_version

    def _grow_rows(self) -> None:
        rows = self.counters.shape[1]
        self.counters = _grown(self.counters, 1, 2 * rows)
        self.segments = [_grown(segment, 1, 2 * rows) for segment in self.segments]
        self.free = list(range(2 * rows - 1, rows - 1, -1)) + self.free
        self.changed()

    def release(self, seat: Seat) -> None:
        """Give back everything ``seat`` holds (its stream closed or is gone); host bookkeeping only."""
        with self.lock:
            if self.seats.get(seat.row) is not seat:
                return
            del self.seats[seat.row]
            seat.views.clear()  # a closed stream still referenced keeps no view of the rows it held
            seat.tokens.close()
            seat.steps.close()
            if seat.slots is not None:
                self._give_slot(seat)
            self.free.append(seat.row)
            cache = seat.cache()
            if cache is not None:
                self._by_cache.pop(cache, None)

    def _give_slot(self, seat: Seat) -> None:
        """Give back ``seat``'s slot row. Slot rows no stream holds any more are kept for the next stream of their
        shape, the `KEPT_IDLE_SHAPES` last; older ones are freed, with the batches recorded over them (a client
        that creates streams of ever new budgets would otherwise keep every shape's memory for good)."""
        rows = seat.slots
        rows.give(seat.slot)
        seat.slots = None
        if not rows.idle:
            return
        self._idle.pop(rows.shape, None)
        self._idle[rows.shape] = rows
        while len(self._idle) > KEPT_IDLE_SHAPES:
            shape = next(iter(self._idle))
            oldest = self._idle.pop(shape)
            del self.slot_rows[shape]
            for key in [key for key, batch in self.batches.items() if batch.slots is oldest]:
                dropped = self.batches.pop(key)
                dropped.graphs.clear()
                dropped.slots = None  # freed now, not when the collector breaks the batch's cycles


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> {(device, dtype): StreamPool}
_pools_lock = threading.Lock()


def pool_of(decoder: torch.nn.Module, geometry, device: torch.device) -> StreamPool:
    """The pool of the streams of ``decoder`` (its cache's ``geometry``, a `CacheGeometry`) on ``device``."""
    with _pools_lock:
        pools = _pools.setdefault(decoder, {})
        key = (device, geometry.dtype)
        if key not in pools:
            pools[key] = StreamPool(geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.dtype, device)
        return pools[key]


def holding(cache) -> StreamPool | None:
    """The pool ``cache`` has a seat in (its detailed cache in that pool's pages), if any."""
    for pools in list(_pools.values()):
        for pool in list(pools.values()):
            if pool.seated(cache) is not None:
                return pool
    return None


def release(cache) -> None:
    """Give back the seat ``cache`` holds in any pool (its stream closed)."""
    for pools in list(_pools.values()):
        for pool in pools.values():
            seat = pool.seated(cache)
            if seat is not None:
                pool.release(seat)
