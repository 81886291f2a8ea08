"""Where a layer's detailed cache lives: with the model (:class:`LayerStorage`) or elsewhere, e.g. CPU memory
(:class:`OffloadedStorage`).

The detailed cache holds every token's keys and values (``detailed``, a :class:`TokenBuffer` of 2 parts,
length = tokens) and every step's mean key (``block_keys`` ``[B, H_kv, steps, D]``, 1 part, length = steps:
what question-time retrieval ranks steps by, :mod:`statekv.core.answering`).
Storage is not a carried form: any form (:mod:`statekv.core.forms`) works over either storage, except that an
offloaded layer cannot carry a window of its detailed cache (it is not where attention runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .buffers import CarriedSlots, TokenBuffer
from .limits import release_host_rows, runs


class LayerStorage:
    """The detailed cache and step means of one layer, on the model's device.

    A step writes its chunk and mean key in place, past the committed ends (scratch space until
    :meth:`commit_host` advances the lengths), at indices the step advances on the device.
    """

    offloaded = False
    holds_window = True  # a carried window can be a view of this storage

    def __init__(self, capacity_hint: int | None, device: torch.device | str | None,
                 on_replace: Callable[[], None]):
        self.detailed = TokenBuffer(2, capacity_hint, device, on_replace=on_replace)
        self.block_keys = TokenBuffer(1, None, device, on_replace=on_replace)

    def start(self, key_states: torch.Tensor) -> None:
        """First chunk ``[B, H_kv, T, D]`` seen: room for its mean key."""
        self.block_keys.reserve(key_states, self.block_keys.length + 1)

    def prepare(self, chunk_len: int) -> None:
        """Room for the next step's mean key (and every later one's until the horizon, if it is known)."""
        horizon = self.detailed.capacity_hint
        expected = 0 if horizon is None else self.block_keys.length + math.ceil(
            max(horizon - self.detailed.length, 0) / chunk_len) + 1
        self.block_keys.reserve(self.block_keys.keys, self.block_keys.length + 1, expected)

    def reserve_chunk(self, slots: CarriedSlots, chunk_len: int) -> None:
        """Room in the detailed cache for a chunk of ``chunk_len`` tokens written on the device (alongside the
        carried form's ``slots``)."""
        self.detailed.reserve(slots.keys, self.detailed.length + chunk_len)

    def stage_mean(self, mean: torch.Tensor, step_device: torch.Tensor) -> None:
        """The step's mean key ``[B, H_kv, 1, D]``, written at the step's index ``step_device`` ``[1]``."""
        self.block_keys.write_at(step_device, mean)

    def stage_chunk(self, write_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The chunk ``[B, H_kv, T, D]`` written at its logical positions ``write_index`` ``[T]``."""
        self.detailed.write_at(write_index, keys, values)

    def keep_chunk(self, slots: CarriedSlots) -> None:
        """Device part of the commit: the chunk as the carried form's ``slots`` hold it (already written here
        by :meth:`stage_chunk`)."""

    def commit_host(self, chunk_len: int) -> None:
        self.detailed.length += chunk_len
        self.block_keys.length += 1

    def device_nbytes(self) -> int:
        return self.detailed.nbytes + self.block_keys.nbytes

    def restored(self, dtype: torch.dtype, device: torch.device) -> None:
        """A saved state was loaded; ``device`` is the model's."""

    def release_tokens(self, tokens: torch.Tensor) -> None:
        """Tokens ``tokens`` (ascending positions ``[N]``) were evicted (:mod:`statekv.core.limits`): give back
        what can be. One buffer on the model's device cannot give part of itself back (evicting is refused
        there)."""


class OffloadedStorage(LayerStorage):
    """The detailed cache and step means in ``device`` memory other than the model's: a step stages its chunk
    and mean key on the model's device and copies them here when it commits, so the model's memory does not
    grow with the stream."""

    offloaded = True
    holds_window = False

    def __init__(self, capacity_hint: int | None, device: torch.device | str, on_replace: Callable[[], None]):
        super().__init__(capacity_hint, device, on_replace)
        self.staged: torch.Tensor | None = None  # the chunk [2, B, H_kv, T, D] to copy here
        self.staged_mean: torch.Tensor | None = None  # the step's mean key [B, H_kv, 1, D]

    def start(self, key_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if self.staged_mean is None:
            self.staged_mean = key_states.new_empty(b, h, 1, d)
        super().start(key_states)

    def reserve_chunk(self, slots: CarriedSlots, chunk_len: int) -> None:
        pass  # the detailed cache grows when the chunk is copied in

    def stage_mean(self, mean: torch.Tensor, step_device: torch.Tensor) -> None:
        self.staged_mean.copy_(mean)

    def stage_chunk(self, write_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        pass  # copied from the carried form at commit

    def keep_chunk(self, slots: CarriedSlots) -> None:
        self.staged = slots.tail()

    def commit_host(self, chunk_len: int) -> None:
        self.detailed.write(self.detailed.length, self.staged[0], self.staged[1])
        self.block_keys.write(self.block_keys.length, self.staged_mean)
        super().commit_host(chunk_len)

    def device_nbytes(self) -> int:
        mean = self.staged_mean
        return 0 if mean is None else mean.numel() * mean.element_size()

    def release_tokens(self, tokens: torch.Tensor) -> None:
        tensors = self.detailed.tensors
        for start, end in runs(tokens):
            release_host_rows(tensors, start, end)

    def restored(self, dtype: torch.dtype, device: torch.device) -> None:
        b, h, _, d = self.detailed.keys.shape
        self.staged_mean = torch.empty(b, h, 1, d, dtype=dtype, device=device)
