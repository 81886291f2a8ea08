"""The two-state cache: a small carried state per layer and KV head, and a detailed cache of every token.

During a step the model's attention modules call :meth:`StreamingLayer.update` with the chunk's keys and
values, which returns ``[carried; chunk]``; the registered attention function then scores those keys and
asks the policy what to carry (:meth:`TwoStateCache.attend`). Nothing becomes visible until the whole forward
succeeded: :meth:`TwoStateCache.commit_device` installs the new carried state and :meth:`TwoStateCache.commit_host`
advances the committed lengths; :meth:`TwoStateCache.rollback` forgets the step. Writes a step makes before
its commit land only in scratch space (past the committed end of the detailed cache, in the chunk slots of the
carried buffer), so a failed step leaves the cache exactly as it was.

A layer keeps its carried state in one of three forms:

* **window**: the suffix ``detailed[window_start : length]`` of its own detailed cache (full attention,
  recency, and scored rules until their budget first overflows). Carrying costs no copy, but the view moves
  every step.
* **slots**: one buffer ``[carried K; chunk T]`` (:class:`CarriedSlots`). The chunk is written into the last
  T slots, attention reads the whole buffer, and the selection is gathered back into the first K. Once K and
  T stop changing (a scored rule at its budget), every step touches the same memory with the same shapes.
* **ring**: for recency (and ReKV) once its window holds R steps of equal length T: the slots buffer holds
  the sink tokens, then the window as a ring of R steps (step ``s`` in ring slot ``s mod R``), and each commit
  overwrites the oldest step with the chunk (:class:`Ring`).

In the slots and ring forms, everything that changes from step to step (where the chunk goes in the detailed
cache, its positions, the ring slot, the step's index) lives in device tensors that the step itself advances,
so a steady step is static and can be captured as a CUDA graph.

Every step also leaves the mean of its keys per layer and KV head (``block_keys``): what question-time
retrieval ranks steps by (:mod:`statekv.core.answering`).

With ``storage_device`` set (offload), the detailed cache and the step means live there (e.g. CPU memory)
while the carried state stays with the model, so accelerator memory does not grow with the stream; such
layers never use the window form, and their chunk is copied to storage after the device part of each step.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from . import persistence
from .attention import ChunkMask, chunk_attention, scored_attention
from .buffers import CarriedSlots, Ring, TokenBuffer
from ..errors import InputError
from .persistence import check_state_dict  # noqa: F401  (its historical home)
from .policies import Candidates, CarryPolicy


class StreamingLayer(CacheLayerMixin):
    """One decoder layer's two states (see the module docstring for the window, slots and ring forms).

    ``detailed``: every token's keys and values (a :class:`TokenBuffer` of 2 parts, length = tokens);
    ``block_keys``: every step's mean key ``[B, H_kv, steps, D]`` (1 part, length = steps).
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "TwoStateCache", index: int, capacity_hint: int | None = None,
                 storage_device: torch.device | str | None = None):
        super().__init__()
        self.cache, self.index = cache, index
        self.detailed = TokenBuffer(2, capacity_hint, storage_device, on_replace=cache.buffers_replaced)
        self.block_keys = TokenBuffer(1, None, storage_device, on_replace=cache.buffers_replaced)
        self.offloaded = storage_device is not None
        self.window_start: int | None = None if self.offloaded else 0
        self._slots: CarriedSlots | None = None
        self.pending_selection: slice | torch.Tensor | None = None
        self.staged: torch.Tensor | None = None  # offloaded: the chunk [2, B, H_kv, T, D] to copy to storage
        self.staged_mean: torch.Tensor | None = None  # offloaded: the step's mean key [B, H_kv, 1, D]

    @property
    def slots(self) -> CarriedSlots | None:
        return self._slots

    @slots.setter
    def slots(self, slots: CarriedSlots | None) -> None:
        replaced, self._slots = slots is not self._slots, slots
        if replaced:
            self.cache.buffers_replaced()

    # transformers' CacheLayerMixin interface ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        b, h, t, d = key_states.shape
        if self.window_start is None and self.slots is None:  # offloaded: start with an empty carried state
            positions = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)
            self.slots = CarriedSlots.holding(key_states.new_empty(2, b, h, 0, d), positions, t)
        if self.offloaded and self.staged_mean is None:
            self.staged_mean = key_states.new_empty(b, h, 1, d)
        self.block_keys.reserve(key_states, self.block_keys.length + 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stage the chunk ``[B, H_kv, T, D]`` and return ``[carried; chunk]`` keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        mean = key_states.mean(dim=2, keepdim=True)
        if self.offloaded:
            self.staged_mean.copy_(mean)
        else:  # room was made by prepare()
            self.block_keys.write_at(self.cache.step_device, mean)
        if self.window_start is not None:
            self.detailed.write(self.detailed.length, key_states, value_states)
            return self.detailed.view(self.window_start, self.detailed.length + key_states.shape[2])
        self.slots.stage(key_states, value_states, self.cache.write_index)
        if not self.offloaded:
            self.detailed.write_at(self.cache.write_index, key_states, value_states)
        return self.slots.keys, self.slots.values

    def get_seq_length(self) -> int:
        """Logical tokens committed (what the model's positions count), as transformers' sliding layers."""
        return self.detailed.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(carried + query_length, offset)``: the keys handed to attention and the logical position the
        first of them would have if they were contiguous (so the chunk is causal at the end)."""
        return self.carried_length + query_length, self.detailed.length - self.carried_length

    def get_max_length(self) -> int:
        return -1

    # two-state bookkeeping -------------------------------------------------------------------------------
    @property
    def form(self) -> str:
        if self.window_start is not None:
            return "window"
        return "ring" if self.cache.ring is not None else "slots"

    @property
    def carried_length(self) -> int:
        if self.window_start is not None:
            return self.detailed.length - self.window_start
        return 0 if self.slots is None else self.slots.carried

    @property
    def device_nbytes(self) -> int:
        """Bytes of this layer's cache on the model's device."""
        total = (0 if self.slots is None else self.slots.nbytes) + (
            0 if self.staged_mean is None else self.staged_mean.numel() * self.staged_mean.element_size())
        return total if self.offloaded else total + self.detailed.nbytes + self.block_keys.nbytes

    def carried(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The carried keys and values, ``[B, H_kv, K, D]`` each, in time order."""
        if self.window_start is not None:
            return self.detailed.view(self.window_start, self.detailed.length)
        kv, _ = self.slots.head()
        if self.cache.ring is not None:
            kv = kv.index_select(3, self.cache.ring.time_order(self.cache.step_index))
        return kv[0], kv[1]

    def positions(self) -> torch.Tensor:
        """Logical positions of the carried tokens, ``[B, H_kv, K]`` (``[1, 1, 0]`` before the first step)."""
        reference = self.detailed.keys if self.window_start is not None else getattr(self.slots, "keys", None)
        if reference is None:
            return torch.empty(1, 1, 0, dtype=torch.long)
        shape = reference.shape[:2]
        if self.window_start is not None:
            return torch.arange(self.window_start, self.detailed.length, device=reference.device).expand(*shape, -1)
        if self.cache.ring is not None:
            return self.cache.ring.positions(self.detailed.length, reference.device).expand(*shape, -1)
        return self.slots.head()[1]

    def candidate_positions(self) -> torch.Tensor:
        """Positions ``[B, H_kv, K + T]`` of the tokens handed to attention this step."""
        if self.window_start is None:
            return self.slots.positions
        b, h = self.detailed.keys.shape[:2]
        end = self.detailed.length + self.cache.chunk_len
        return torch.arange(self.window_start, end, device=self.detailed.keys.device).expand(b, h, -1)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[carried; chunk]`` keys and values ``[B, H_kv, K + T, D]`` as handed to attention this step."""
        if self.window_start is None:
            return self.slots.keys, self.slots.values
        return self.detailed.view(self.window_start, self.detailed.length + self.cache.chunk_len)

    def prepare(self, chunk_len: int) -> None:
        """Host-side preparation of a step (before the forward): buffers sized for a chunk of ``chunk_len``."""
        if not self.is_initialized:
            return
        horizon = self.detailed.capacity_hint  # steps of this length until the horizon: room for all of them
        expected = 0 if horizon is None else self.block_keys.length + math.ceil(
            max(horizon - self.detailed.length, 0) / chunk_len) + 1
        self.block_keys.reserve(self.block_keys.keys, self.block_keys.length + 1, expected)
        if self.slots is None or self.window_start is not None:
            return
        self.slots = self.slots.with_chunk_len(chunk_len)
        if not self.offloaded:
            self.detailed.reserve(self.slots.keys, self.detailed.length + chunk_len)

    def enter_ring(self, ring: Ring) -> None:
        """Hold the carried state (the sinks and the last ``ring.steps`` steps, in time order) as ``ring``."""
        kv = torch.stack(self.carried())
        order = ring.time_order(self.cache.step_index)
        self.slots = CarriedSlots.holding(kv.new_empty(kv.shape).index_copy_(3, order, kv), None, ring.chunk_len)
        self.window_start = None

    def leave_ring(self) -> None:
        """Back to the window form (or, offloaded or with sinks, to slots in time order with positions)."""
        keys, values = self.carried()
        positions = self.positions()
        if self.offloaded or self.cache.ring.sinks:
            self.slots = CarriedSlots.holding(torch.stack([keys, values]), positions, self.cache.chunk_len)
        else:
            self.window_start, self.slots = self.detailed.length - keys.shape[2], None

    def commit_device(self, ring_target: torch.Tensor | None) -> None:
        """Install the carried state the policy selected, or in a ring put the chunk in ``ring_target`` (its
        token slots). Device work; host state changes only outside steady steps (window form, a carried size
        that changes)."""
        selection, self.pending_selection = self.pending_selection, None
        if self.offloaded:
            self.staged = self.slots.tail()
        if ring_target is not None:
            self.slots.kv.index_copy_(3, ring_target, self.slots.tail())
            return
        size = self.carried_length + self.cache.chunk_len
        if isinstance(selection, slice):
            start, stop, _ = selection.indices(size)
            if stop == size and self.window_start is not None:
                self.window_start += start
                return
            if stop == size:
                self.slots = self.slots.suffix(start)
                return
            keys = self.candidates()[0]
            selection = torch.arange(start, stop, device=keys.device).expand(*keys.shape[:2], -1)
        if self.window_start is not None:
            keys, values = self.candidates()
            self.slots = CarriedSlots(torch.stack([keys, values]), self.candidate_positions().contiguous(),
                                      size - self.cache.chunk_len)
            self.window_start = None
        self.slots = self.slots.keep(selection)

    def commit_host(self, chunk_len: int) -> None:
        """Advance the committed lengths (host work, after the device part; also after a graph replay)."""
        if self.offloaded:
            self.detailed.write(self.detailed.length, self.staged[0], self.staged[1])
            self.block_keys.write(self.block_keys.length, self.staged_mean)
        self.detailed.length += chunk_len
        self.block_keys.length += 1

    def export(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The committed state as tensors and the window start (see :func:`persistence.export_layer`)."""
        return persistence.export_layer(self)

    def restore(self, tensors: dict[str, torch.Tensor], window_start: int | None, steps: list[int],
                device: torch.device) -> None:
        """Install a state saved by :meth:`export` (see :func:`persistence.restore_layer`)."""
        persistence.restore_layer(self, tensors, window_start, steps, device)


class TwoStateCache(Cache):
    """A transformers ``Cache`` of :class:`StreamingLayer` s, driven one step at a time by a carry policy.

    Args:
        num_layers: decoder layers of the model.
        policy: the carry rule.
        backend: attention backend for policies that need scores (see :func:`scored_attention`).
        capacity_hint: tokens to preallocate in each detailed buffer (the planned horizon), if known.
        storage_device: where the detailed cache lives, if not with the model (offload, e.g. ``"cpu"``).

    A step is ``begin`` (host) -> ``begin_device`` -> the model's forward (``update``/``attend`` per layer)
    -> ``commit_device`` -> ``commit_host``; the device part may be a CUDA graph replay.
    """

    def __init__(self, num_layers: int, policy: CarryPolicy, backend: str = "auto",
                 capacity_hint: int | None = None, storage_device: torch.device | str | None = None):
        super().__init__(layers=[])
        self.layout_version = 0  # bumped whenever a buffer that a captured step reads is replaced
        self.peak_device_bytes = 0  # most bytes of cache this stream held on the model's device at once
        self.layers = [StreamingLayer(self, i, capacity_hint, storage_device) for i in range(num_layers)]
        self.policy = policy
        self.backend = backend
        self.chunk_lengths: list[int] = []
        self.seen_tokens = 0
        self.chunk_len = 0
        self.ring: Ring | None = None
        self.seen_device: torch.Tensor | None = None  # seen_tokens, kept on the model's device by the step
        self.step_device: torch.Tensor | None = None  # LongTensor [1]: the step's index, likewise
        self.write_index: torch.Tensor | None = None  # LongTensor [T]: the current chunk's logical positions
        self.read_host_state = False  # a policy read per-step host values during the current step
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._attended: list[bool] = []

    @property
    def step_index(self) -> int:
        """Index of the step being run (or about to run)."""
        return len(self.chunk_lengths)

    # one step ----------------------------------------------------------------------------------------------
    def begin(self, chunk_len: int, device: torch.device) -> None:
        """Host-side preparation of a step of ``chunk_len`` tokens on ``device``: buffers sized for it, the ring
        entered or left. Nothing the stream has committed changes."""
        self.chunk_len = chunk_len
        self.read_host_state = False
        self._attended = [False] * len(self.layers)
        if self.seen_device is None or self.seen_device.device != device:
            self.seen_device = torch.tensor(self.seen_tokens, device=device)
            self.step_device = torch.tensor([self.step_index], device=device)
            self.buffers_replaced()
        if (chunk_len, device) not in self._aranges:
            self._aranges[chunk_len, device] = torch.arange(chunk_len, device=device)
        self._update_ring(chunk_len, device)
        for layer in self.layers:
            layer.prepare(chunk_len)

    def buffers_replaced(self) -> None:
        """Some buffer a captured step reads moved: recorded steps are no longer valid."""
        self.layout_version += 1
        self.note_device_bytes()

    def device_bytes(self) -> int:
        """Bytes of cache held on the model's device now (carried state, and the detailed cache unless it is
        offloaded)."""
        return sum(layer.device_nbytes for layer in self.layers)

    def note_device_bytes(self, extra: int = 0) -> None:
        """Record the device cache in use now, plus ``extra`` bytes held for answering, in the peak."""
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes() + extra)

    def _update_ring(self, chunk_len: int, device: torch.device) -> None:
        steps, sinks = self.policy.recent_steps, self.policy.sink_tokens
        history = self.chunk_lengths[-steps:] if steps else []
        wanted = (bool(steps) and len(history) == steps and all(length == chunk_len for length in history)
                  and self.seen_tokens - steps * chunk_len >= sinks
                  and all(layer.carried_length == sinks + steps * chunk_len for layer in self.layers))
        if wanted == (self.ring is not None):
            return
        if wanted:
            ring = Ring.starting_at(self.step_index, steps, chunk_len, sinks, device)
            for layer in self.layers:
                layer.enter_ring(ring)
            self.ring = ring
        else:
            for layer in self.layers:
                layer.leave_ring()
            self.ring = None

    def is_steady(self) -> bool:
        """Whether the step just begun has the static form a CUDA graph can replay: every layer in a ring, or
        in slots holding a scored rule's full budget."""
        if self.ring is not None:
            return True
        budget = getattr(self.policy, "budget", None)
        return budget is not None and all(layer.window_start is None and layer.slots is not None
                                          and layer.slots.carried == budget for layer in self.layers)

    def begin_device(self) -> torch.Tensor:
        """Device-side start of the step: the chunk's logical positions ``[T]`` (also where it goes in the
        detailed cache), computed from the device copy of ``seen_tokens``."""
        self.write_index = torch.add(self._aranges[self.chunk_len, self.seen_device.device], self.seen_device)
        return self.write_index

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the chunk's queries ``q [B, Hq, T, D]`` over ``[carried; chunk]`` keys ``k``/``v``;
        stages the policy's selection for this layer and returns ``[B, T, Hq, D]``."""
        layer = self.layers[layer_idx]
        self._attended[layer_idx] = True
        mask = ChunkMask.of(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
        if self.ring is not None:
            return chunk_attention(q, k, v, scale=scale, mask=mask)
        if self.policy.scores_needed(k.shape[2]):
            out, scores = scored_attention(q, k, v, scale=scale, backend=self.backend, mask=mask)
        else:
            out, scores = chunk_attention(q, k, v, scale=scale, mask=mask), None
        candidates = Candidates(layer=layer_idx, scores=scores, keys=k, values=v,
                                positions=layer.candidate_positions, history=self._history, queries=q)
        layer.pending_selection = _checked(self.policy.select(candidates), candidates)
        self.read_host_state |= candidates.read_host_state
        return out

    def _history(self) -> tuple[int, ...]:
        return (*self.chunk_lengths, self.chunk_len)

    def missing_layers(self) -> list[int]:
        """Layers whose attention did not run through :meth:`attend` during the current step."""
        return [i for i, attended in enumerate(self._attended) if not attended]

    def commit_device(self) -> None:
        ring_target = None if self.ring is None else self.ring.target()
        for layer in self.layers:
            layer.commit_device(ring_target)
        if self.ring is not None:
            self.ring.advance()
        self.seen_device.add_(self.chunk_len)
        self.step_device.add_(1)

    def commit_host(self) -> None:
        for layer in self.layers:
            layer.commit_host(self.chunk_len)
        self.chunk_lengths.append(self.chunk_len)
        self.seen_tokens += self.chunk_len

    def rollback(self) -> None:
        for layer in self.layers:
            layer.pending_selection = None

    # saving and resuming (see persistence) -----------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resumed stream needs: tensors named ``layers.{i}.{name}`` and JSON-able metadata."""
        return persistence.state_dict(self)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], metadata: dict, device: torch.device) -> None:
        """Install a state from :meth:`state_dict` (checked first with `check_state_dict`); carried tensors go
        to ``device``."""
        persistence.load_state_dict(self, tensors, metadata, device)

    def to_dynamic_cache(self, device: torch.device | None = None) -> DynamicCache:
        """Every token's keys/values as a ``DynamicCache`` of views (no copy), or copies on ``device`` when the
        detailed cache is stored elsewhere (offload).

        ``DynamicCache.update`` concatenates into new tensors, so decoding from it never writes into the
        detailed buffers.
        """
        cache = DynamicCache()
        for layer in self.layers:
            exported = DynamicLayer()
            cache.layers.append(exported)
            if layer.detailed.keys is None:
                continue  # nothing streamed yet: an empty layer
            keys, values = layer.detailed.view(0, layer.detailed.length)
            if device is not None:
                keys, values = keys.to(device), values.to(device)
            exported.lazy_initialization(keys, values)
            exported.keys, exported.values = keys, values
        return cache


def _checked(selection: slice | torch.Tensor, candidates: Candidates) -> slice | torch.Tensor:
    """A policy's selection, refused (one line, before anything is committed) if it is malformed."""
    if isinstance(selection, slice):
        if selection.indices(candidates.size)[2] != 1:
            raise InputError("a carry policy returned a strided slice; return indices instead")
        return selection
    expected = (*candidates.keys.shape[:2], "K")
    if (not isinstance(selection, torch.Tensor) or selection.dtype != torch.long or selection.dim() != 3
            or tuple(selection.shape[:2]) != tuple(candidates.keys.shape[:2])
            or selection.shape[2] > candidates.size):
        got = tuple(selection.shape) if isinstance(selection, torch.Tensor) else type(selection).__name__
        raise InputError(f"a carry policy must return a slice or a LongTensor of indices {expected} with "
                         f"K <= {candidates.size}; got {got}")
    return selection
