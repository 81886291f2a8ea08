"""The three forms a layer's carried state takes, each owning its storage and its part of a step.

* :class:`Window`: the suffix ``detailed[start : length]`` of the layer's own detailed cache (full attention,
  recency, and scored rules until their budget first overflows). Carrying costs no copy, but the view moves
  every step.
* :class:`Slots`: one buffer ``[carried K; chunk T]`` (:class:`CarriedSlots`). The chunk is written into the
  last T slots, attention reads the whole buffer, and the selection is gathered back into the first K. Once K
  and T stop changing (a scored rule at its budget), every step touches the same memory with the same shapes.
* :class:`RingForm`: recency once its window holds R steps of equal length T: a slots buffer holding the sink
  tokens, then the window as a ring of R steps (:class:`Ring`); each commit overwrites the oldest step.

Transitions are explicit and return the next form: :meth:`Window.commit` becomes :class:`Slots` when a
selection is not a suffix (a scored rule's budget first overflows); :class:`SharedRing` moves every layer of a
cache between window (or slots) and ring. Each form's ``stage`` is the write of a step's chunk, ``commit`` the
device part of installing what carries on (host-side changes only outside steady steps).
"""

from __future__ import annotations

import torch

from ..storage.buffers import CarriedSlots, Ring
from ..storage.layer_storage import LayerStorage
from .transaction import StepContext


def _as_indices(selection: slice | torch.Tensor, size: int, like) -> slice | torch.Tensor:
    """A slice that does not reach the end of the ``size`` candidates, as indices ``[B, H_kv, K']`` (shaped
    as the keys ``like()`` returns, ``[B, H_kv, ...]``); a slice to the end, or indices, unchanged."""
    if not isinstance(selection, slice):
        return selection
    start, stop, _ = selection.indices(size)
    if stop == size:
        return slice(start, stop)
    keys = like()
    return torch.arange(start, stop, device=keys.device).expand(*keys.shape[:2], -1)


class Window:
    """The carried state as ``detailed[start : length]`` (``start`` is a host int)."""

    name = "window"
    buffer = None  # no buffer of its own: views of the detailed cache
    nbytes = 0
    selects = True

    def __init__(self, start: int = 0):
        self.start = start

    def carried_length(self, storage: LayerStorage) -> int:
        return storage.detailed.length - self.start

    def is_static(self, budget: int | None) -> bool:
        return False  # the view moves every step

    def begin(self, storage: LayerStorage, key_states: torch.Tensor, placed: bool = False) -> "Window":
        return self

    def prepare(self, storage: LayerStorage, chunk_len: int) -> "Window":
        return self

    def reserve(self, storage: LayerStorage, chunk_len: int) -> None:
        pass  # the chunk is written by a host-indexed write that grows the detailed cache

    def stage(self, storage: LayerStorage, keys: torch.Tensor, values: torch.Tensor, step: StepContext):
        storage.detailed.write(storage.detailed.length, keys, values)
        return storage.detailed.view(self.start, storage.detailed.length + keys.shape[2])

    def carried(self, storage: LayerStorage) -> tuple[torch.Tensor, torch.Tensor]:
        return storage.detailed.view(self.start, storage.detailed.length)

    def positions(self, storage: LayerStorage) -> torch.Tensor:
        keys = storage.detailed.keys
        if keys is None:
            return torch.empty(1, 1, 0, dtype=torch.long)
        return torch.arange(self.start, storage.detailed.length, device=keys.device).expand(*keys.shape[:2], -1)

    def candidate_positions(self, storage: LayerStorage, step: StepContext) -> torch.Tensor:
        b, h = storage.detailed.keys.shape[:2]
        end = storage.detailed.length + step.chunk_len
        return torch.arange(self.start, end, device=storage.detailed.keys.device).expand(b, h, -1)

    def candidates(self, storage: LayerStorage, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        return storage.detailed.view(self.start, storage.detailed.length + step.chunk_len)

    def commit(self, storage: LayerStorage, selection, step: StepContext):
        """``(next form, selection left for it)``: a suffix moves the window; other tokens become slots."""
        size = self.carried_length(storage) + step.chunk_len
        selection = _as_indices(selection, size, lambda: self.candidates(storage, step)[0])
        if isinstance(selection, slice):
            return Window(self.start + selection.start), None
        keys, values = self.candidates(storage, step)
        slots = CarriedSlots(torch.stack([keys, values]), self.candidate_positions(storage, step).contiguous(),
                             size - step.chunk_len)
        return Slots(slots), selection

    def commit_host(self) -> None:
        pass

    def saved_start(self, storage: LayerStorage) -> int | None:
        """What :mod:`persistence` saves of this form: the window start (None: carried tensors)."""
        return self.start


class Slots:
    """The carried state in a :class:`CarriedSlots` buffer ``[K; T]`` (None: nothing carried yet)."""

    name = "slots"
    selects = True
    start = None  # not a window

    def __init__(self, slots: CarriedSlots | None):
        self.buffer = slots

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def carried_length(self, storage: LayerStorage) -> int:
        return 0 if self.buffer is None else self.buffer.carried

    def is_static(self, budget: int | None) -> bool:
        return budget is not None and self.buffer is not None and self.buffer.carried == budget

    def begin(self, storage: LayerStorage, key_states: torch.Tensor, placed: bool = False) -> "Slots":
        """First chunk ``[B, H_kv, T, D]`` seen with nothing carried: an empty carried state (with placements
        when ``placed``: bounded positions)."""
        if self.buffer is not None:
            return self
        b, h, t, d = key_states.shape
        positions = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)
        placements = positions.new_empty(2, b, h, 0) if placed else None
        return type(self)(CarriedSlots.holding(key_states.new_empty(2, b, h, 0, d), positions, t, placements))

    def prepare(self, storage: LayerStorage, chunk_len: int) -> "Slots":
        if self.buffer is None:
            return self
        return self._with(self.buffer.with_chunk_len(chunk_len))

    def reserve(self, storage: LayerStorage, chunk_len: int) -> None:
        """Room in the storage for the chunk the step writes at device-held indices."""
        if self.buffer is not None:
            storage.reserve_chunk(self.buffer, chunk_len)

    def _with(self, slots: CarriedSlots) -> "Slots":
        return self if slots is self.buffer else Slots(slots)

    def stage(self, storage: LayerStorage, keys: torch.Tensor, values: torch.Tensor, step: StepContext):
        self.buffer.stage(keys, values, step.write_index, step.position_rows)
        storage.stage_chunk(step.write_index, keys, values)
        return self.buffer.keys, self.buffer.values

    def placements(self) -> torch.Tensor | None:
        """Anchors and rotations ``[2, B, H_kv, K + T]`` of ``[carried; chunk]`` (None unless bounded)."""
        return None if self.buffer is None else self.buffer.placements

    def carried(self, storage: LayerStorage) -> tuple[torch.Tensor, torch.Tensor]:
        kv, _ = self.buffer.head()
        return kv[0], kv[1]

    def positions(self, storage: LayerStorage) -> torch.Tensor:
        if self.buffer is None:
            return torch.empty(1, 1, 0, dtype=torch.long)
        return self.buffer.head()[1]

    def candidate_positions(self, storage: LayerStorage, step: StepContext) -> torch.Tensor:
        return self.buffer.positions

    def candidates(self, storage: LayerStorage, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffer.keys, self.buffer.values

    def commit(self, storage: LayerStorage, selection, step: StepContext):
        """``(next form, None)``: the selected slots carried on (in place when their count is unchanged)."""
        storage.keep_chunk(self.buffer)
        size = self.buffer.carried + step.chunk_len
        selection = _as_indices(selection, size, lambda: self.buffer.keys)
        if isinstance(selection, slice):
            return Slots(self.buffer.suffix(selection.start)), None
        return self._with(self.buffer.keep(selection)), None

    def commit_host(self) -> None:
        pass

    def saved_start(self, storage: LayerStorage) -> int | None:
        return None


class RingForm(Slots):
    """The sinks and the last ``ring.steps`` steps in a slots buffer laid out as ``ring`` (shared by every
    layer of a cache); ``step`` counts the steps committed (host side, for the time order)."""

    name = "ring"
    selects = False  # recency: nothing to score or select

    def __init__(self, slots: CarriedSlots, ring: Ring, step: int):
        super().__init__(slots)
        self.ring, self.step = ring, step

    @classmethod
    def entered(cls, form, storage: LayerStorage, ring: Ring, step_index: int) -> "RingForm":
        """``form``'s carried state (the sinks and the last ``ring.steps`` steps) laid out as ``ring``."""
        kv = torch.stack(form.carried(storage))
        order = ring.time_order(step_index)
        slots = CarriedSlots.holding(kv.new_empty(kv.shape).index_copy_(3, order, kv), None, ring.chunk_len)
        return cls(slots, ring, step_index)

    def left(self, storage: LayerStorage, chunk_len: int):
        """Back to the window form (or, offloaded or with sinks, to slots in time order with positions)."""
        keys, values = self.carried(storage)
        positions = self.positions(storage)
        if not storage.holds_window or self.ring.sinks:
            return Slots(CarriedSlots.holding(torch.stack([keys, values]), positions, chunk_len))
        return Window(storage.length - keys.shape[2])

    def is_static(self, budget: int | None) -> bool:
        return True

    def _with(self, slots: CarriedSlots) -> "RingForm":
        return self if slots is self.buffer else RingForm(slots, self.ring, self.step)

    def carried(self, storage: LayerStorage) -> tuple[torch.Tensor, torch.Tensor]:
        kv, _ = self.buffer.head()
        kv = kv.index_select(3, self.ring.time_order(self.step))
        return kv[0], kv[1]

    def positions(self, storage: LayerStorage) -> torch.Tensor:
        keys = self.buffer.keys
        return self.ring.positions(storage.length, keys.device).expand(*keys.shape[:2], -1)

    def commit(self, storage: LayerStorage, selection, step: StepContext):
        """The chunk over the oldest step, at the token slots ``step.ring_target`` (read on the device)."""
        storage.keep_chunk(self.buffer)
        self.buffer.kv.index_copy_(3, step.ring_target, self.buffer.tail())
        return self, None

    def commit_host(self) -> None:
        self.step += 1

    def saved_start(self, storage: LayerStorage) -> int | None:
        if storage.holds_window and not self.ring.sinks:
            return storage.detailed.length - self.carried_length(storage)
        return None


def placed(form: Window | Slots, storage: LayerStorage) -> Slots:
    """``form``'s carried state as slots with placements (bounded positions; a ring was left first). Slots that
    have none get their logical positions as anchors and rotations: the stream kept every token at its own."""
    if isinstance(form, Window):
        if storage.detailed.keys is None:
            return Slots(None)
        keys, values = form.carried(storage)
        positions = form.positions(storage)
        return Slots(CarriedSlots.holding(torch.stack([keys, values]), positions, 0,
                                          torch.stack([positions, positions])))
    if form.buffer is None or form.buffer.placements is not None:
        return form
    kv, positions = form.buffer.head()
    return Slots(CarriedSlots.holding(kv, positions, form.buffer.chunk_len, torch.stack([positions, positions])))


def initial(storage: LayerStorage) -> Window | Slots:
    """The form of a layer that has carried nothing yet."""
    return Window(0) if storage.holds_window else Slots(None)


class SharedRing:
    """The :class:`Ring` every layer of a cache shares: entered, for all layers together, when every layer holds a
    recency rule's full window of equal steps, and left when the steps stop being equal; the step advances it."""

    def __init__(self):
        self.ring: Ring | None = None
        self.allowed = True  # False under bounded positions: every slot keeps its own position

    def update(self, layers, policy, history: list[int], seen_tokens: int, step: StepContext, device) -> None:
        """Enter or leave the ring before the step ``step`` of ``step.chunk_len`` tokens, as ``policy`` (its
        ``recent_steps`` and ``sink_tokens``) and the stream so far (``history``: every step's tokens) say."""
        steps, sinks, chunk_len = policy.recent_steps, policy.sink_tokens, step.chunk_len
        recent = history[-steps:] if steps else []
        wanted = (self.allowed and bool(steps) and len(recent) == steps
                  and all(length == chunk_len for length in recent)
                  and seen_tokens - steps * chunk_len >= sinks
                  and all(layer.carried_length == sinks + steps * chunk_len for layer in layers))
        if wanted == (self.ring is not None):
            return
        if wanted:
            ring = Ring.starting_at(step.step_index, steps, chunk_len, sinks, device)
            for layer in layers:
                layer.carry = RingForm.entered(layer.carry, layer.storage, ring, step.step_index)
            self.ring = ring
        else:
            for layer in layers:
                layer.carry = layer.carry.left(layer.storage, chunk_len)
            self.ring = None

    def target(self) -> torch.Tensor | None:
        """Token slots ``[T]`` the step's chunk goes to in the ring, if there is one (a device read)."""
        return None if self.ring is None else self.ring.target()

    def advance(self) -> None:
        if self.ring is not None:
            self.ring.advance()

    def reset(self) -> None:
        self.ring = None
