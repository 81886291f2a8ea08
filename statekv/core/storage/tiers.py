"""Which storage a layer's detailed cache gets (:mod:`statekv.core.storage.layer_storage`): with the model, offloaded to
another device, quantized (:mod:`statekv.core.storage.quantized`) on either, or built by a tier of its own (the disk
tier, :class:`statekv.core.disk.tier.DiskTier`). A stream's engine decides it once, from its settings
(`StorageTier`), and every layer's storage is made from that."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .quantized import QuantizedStorage
from .layer_storage import LayerStorage, OffloadedStorage, memory_buffers


@dataclass(frozen=True)
class StorageTier:
    """Where and how every layer of a stream keeps its detailed cache.

    device: where it lives, if not with the model (offloaded, e.g. CPU memory). kv_cache_dtype: ``"int8"`` or
    ``"int4"`` to store it quantized; None: in the model's dtype. make_storage: a tier's own factory, ``(index,
    capacity_hint, on_replace, kv_cache_dtype) -> storage`` (the disk tier's), which then decides everything.
    evicts: the stream evicts under a cap: its host memory is never pinned (pinned pages cannot go back to the OS,
    and its host memory would grow with its age) and its rows per token are kept in blocks
    (`statekv.core.storage.blocks`); else, offloaded from a GPU, host memory is pinned (asynchronous copies).
    """

    device: torch.device | None = None
    kv_cache_dtype: str | None = None
    make_storage: Callable[..., LayerStorage] | None = None
    evicts: bool = False

    def storage(self, index: int, capacity_hint: int | None, on_replace: Callable[[], None]) -> LayerStorage:
        """Layer ``index``'s storage (``capacity_hint`` tokens preallocated; ``on_replace`` called when a buffer a
        captured step reads is replaced)."""
        if self.make_storage is not None:
            return self.make_storage(index, capacity_hint, on_replace, self.kv_cache_dtype)
        buffers = memory_buffers(self.device, on_replace, evicts=self.evicts)
        if self.kv_cache_dtype is not None:
            return QuantizedStorage(self.kv_cache_dtype, capacity_hint, self.device, on_replace, buffers)
        kind = LayerStorage if self.device is None else OffloadedStorage
        return kind(capacity_hint, self.device, on_replace, buffers)
