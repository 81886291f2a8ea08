"""One decoder layer of the two-state cache: its detailed cache (``storage``) and the form of its carried state
(``carry``), staged by each step and committed by its transaction (`statekv.core.cache.two_state` drives it)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import forms, persistence
from ..attention.untraced import engine_call
from ..storage.tiers import StorageTier
from .engine_layer import EngineLayer
from .transaction import StepContext


class StreamingLayer(EngineLayer):
    """One decoder layer's two states: ``storage`` (every token, see :mod:`statekv.core.storage.layer_storage`) and
    ``carry`` (the carried state's form, see :mod:`statekv.core.cache.forms`).

    ``detailed``: every token's keys and values (a :class:`TokenBuffer` of 2 parts, length = tokens);
    ``block_keys``: every step's mean key ``[B, H_kv, steps, D]`` (1 part, length = steps).
    """

    def __init__(self, on_replace: Callable[[], None], index: int, capacity_hint: int | None = None,
                 tier: StorageTier = StorageTier()):
        super().__init__()
        self.index, self._on_replace = index, on_replace  # called when a buffer a captured step reads is replaced
        self.storage = tier.storage(index, capacity_hint, on_replace)
        self._carry = forms.initial(self.storage)
        self.step: StepContext | None = None  # the step being run, handed in by begin()

    @property
    def carry(self):
        """The carried state's form (:class:`forms.Window`, :class:`forms.Slots` or :class:`forms.RingForm`)."""
        return self._carry

    @carry.setter
    def carry(self, form) -> None:
        replaced, self._carry = form.buffer is not self._carry.buffer, form
        if replaced:
            self._on_replace()

    detailed = property(lambda self: self.storage.detailed)
    block_keys = property(lambda self: self.storage.block_keys)
    offloaded = property(lambda self: self.storage.offloaded)
    form = property(lambda self: self.carry.name, doc="The carried form's name: window, slots or ring.")
    slots = property(lambda self: self.carry.buffer, doc="The slots buffer (None in the window form).")
    window_start = property(lambda self: self.carry.start, doc="Where a window form starts (else None).")

    # transformers' CacheLayerMixin interface ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Initialized once all of it is done: a step whose storage could not start (the disk refused a file)
        starts again at the next step."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.carry = self.carry.begin(self.storage, key_states, placed=self.step.position_rows is not None)
        self.storage.start(key_states)
        self.carry.reserve(self.storage, key_states.shape[2])  # slots over a storage the step writes in place
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' call: :meth:`stage` (untraced in a compiled step, `statekv.core.attention.untraced`)."""
        return engine_call(self.stage, key_states, value_states)

    def stage(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the chunk ``[B, H_kv, T, D]`` and return ``[carried; chunk]`` keys and values (under bounded
        positions, the keys rotated to where this step places them; what is stored keeps its own rotation)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.storage.stage_summaries(key_states, self.step.step_device)
        keys, values = self.carry.stage(self.storage, key_states, value_states, self.step)
        placed = self.step.placed_keys[self.index] if self.step.placed_keys else None
        if placed is not None:  # its chunk's rows are the last: [B, H_kv, K + T, D]
            chunk_len = key_states.shape[2]
            placed.narrow(2, placed.shape[2] - chunk_len, chunk_len).copy_(key_states)
            return placed, values
        return keys, values

    def get_seq_length(self) -> int:
        """Logical tokens committed (what the model's positions count), as transformers' sliding layers."""
        return self.storage.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(carried + query_length, offset)``: the keys handed to attention and the logical position the
        first of them would have if they were contiguous (so the chunk is causal at the end)."""
        return self.carried_length + query_length, self.storage.length - self.carried_length

    # two-state bookkeeping -------------------------------------------------------------------------------
    @property
    def carried_length(self) -> int:
        return self.carry.carried_length(self.storage)

    @property
    def device_nbytes(self) -> int:
        """Bytes of this layer's cache on the model's device."""
        return self.carry.nbytes + self.storage.device_nbytes()

    def carried(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The carried keys and values, ``[B, H_kv, K, D]`` each, in time order."""
        return self.carry.carried(self.storage)

    def carried_for_placing(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Under bounded positions, the carried keys ``[B, H_kv, K, D]`` at their stored rotations and their
        placements ``[2, B, H_kv, K]`` (anchors, rotations); None where nothing is carried or placed."""
        slots = self.carry.buffer
        return None if slots is None else slots.carried_placing()

    def positions(self) -> torch.Tensor:
        """Logical positions of the carried tokens, ``[B, H_kv, K]`` (``[1, 1, 0]`` before the first step)."""
        return self.carry.positions(self.storage)

    def candidate_positions(self) -> torch.Tensor:
        """Positions ``[B, H_kv, K + T]`` of the tokens handed to attention this step."""
        return self.carry.candidate_positions(self.storage, self.step)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[carried; chunk]`` keys and values ``[B, H_kv, K + T, D]`` as handed to attention this step."""
        return self.carry.candidates(self.storage, self.step)

    def prepare(self, step: StepContext) -> None:
        """Host-side preparation of ``step`` (before the forward): buffers sized for its chunk."""
        self.step = step
        if not self.is_initialized:
            return
        self.storage.prepare(step.chunk_len)
        self.carry = self.carry.prepare(self.storage, step.chunk_len)
        self.carry.reserve(self.storage, step.chunk_len)

    def export(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The committed state as tensors and the window start (see :func:`persistence.export_layer`)."""
        return persistence.export_layer(self)

    def restore(self, tensors: dict[str, torch.Tensor], window_start: int | None, steps: list[int],
                device: torch.device) -> None:
        """Install a state saved by :meth:`export` (see :func:`persistence.restore_layer`)."""
        persistence.restore_layer(self, tensors, window_start, steps, device)
