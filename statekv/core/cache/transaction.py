"""One streaming step as a transaction over a cache's layers: stage, attend, check the selection, commit or
roll back.

The model's attention modules stage the chunk in each layer (:meth:`StreamingLayer.update`) and attend through the
cache (:func:`statekv.core.cache.two_state.attend`), which asks the policy what to carry;
:meth:`StepTransaction.keep` keeps that selection pending, checked (:func:`checked`). Nothing becomes visible
until the whole forward succeeded: :meth:`commit_device` installs every layer's new carried state (device work:
a CUDA graph replays it) and :meth:`commit_host` advances the committed lengths; :meth:`rollback` forgets the
step. A step's writes before its commit land only in scratch space, so a failed step leaves the cache exactly as
it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InputError
from ..rules.candidates import Candidates


@dataclass
class StepContext:
    """What a layer needs to know about the step being run (handed to each layer when the step begins).

    ``step_device`` (LongTensor ``[1]``, the step's index) and ``write_index`` (LongTensor ``[T]``, the chunk's
    logical positions, also where it goes in the detailed cache; set by the device part of the step) live on
    the model's device and are advanced by the step itself, so a steady step reads no host value;
    ``ring_target`` (``[T]``) is where the chunk goes in a ring, if the layers hold one. Under bounded positions
    (:mod:`statekv.core.positions.placing`), ``position_rows`` holds the chunk's positions, anchors and rotations
    (``[3, T]``) and ``positions`` the stream's `StreamPositions`; once the stream is placed away from its own
    positions, ``placed_keys`` holds each layer's keys for attention, its carried ones rotated to this step's places
    (`statekv.core.positions.rotation.place_carried`), the chunk's left for the layer to write.
    """

    chunk_len: int
    step_index: int
    step_device: torch.Tensor
    write_index: torch.Tensor | None = None
    ring_target: torch.Tensor | None = None
    position_rows: torch.Tensor | None = None
    positions: object = None
    placed_keys: list[torch.Tensor | None] | None = None


class NotBatchable(Exception):
    """Raised inside a batched forward when it turns out the rows cannot share it (the batch then runs alone)."""


class StepTransaction:
    """The pending part of one step over ``layers`` (objects with ``carry`` and ``storage``, see
    :mod:`statekv.core.cache.forms`)."""

    def __init__(self, context: StepContext, layers: list):
        self.context, self.layers = context, layers
        self.pending: list[slice | torch.Tensor | None] = [None] * len(layers)
        self.attended = [False] * len(layers)
        self.read_host_state = False  # the policy read per-step host values: the step cannot be captured

    def keep(self, layer_idx: int, selection: slice | torch.Tensor, read_host_state: bool) -> None:
        """Keep ``selection`` (checked) pending for this layer; ``read_host_state``: the policy read per-step host
        values to make it (the step cannot be captured)."""
        self.pending[layer_idx] = selection
        self.read_host_state |= read_host_state

    def missing_layers(self) -> list[int]:
        """Layers whose attention did not run through :meth:`attend`."""
        return [i for i, attended in enumerate(self.attended) if not attended]

    def commit_device(self) -> None:
        """Every layer's form commits its pending selection (a form may hand it on to the next form), and its
        storage the step's part of the open segment."""
        for index, layer in enumerate(self.layers):
            layer.storage.commit_device()
            selection, self.pending[index] = self.pending[index], None
            while True:
                layer.carry, selection = layer.carry.commit(layer.storage, selection, self.context)
                if selection is None:
                    break
        self.context.placed_keys = None  # every layer's placed keys: held for the step only

    def commit_host(self) -> None:
        for layer in self.layers:
            layer.storage.commit_host(self.context.chunk_len)
            layer.carry.commit_host()

    def rollback(self) -> None:
        self.pending = [None] * len(self.layers)
        self.context.placed_keys = None


def checked(selection: slice | torch.Tensor, candidates: Candidates) -> slice | torch.Tensor:
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
