"""Which storage a layer's detailed cache gets (:mod:`statekv.core.storage.layer_storage`): with the model, offloaded to
another device, quantized (:mod:`statekv.core.storage.quantized`) on either, or built by a tier of its own (the disk
tier, :class:`statekv.core.disk.tier.DiskTier`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .quantized import QuantizedStorage
from .layer_storage import LayerStorage, OffloadedStorage


def layer_storage(index: int, capacity_hint: int | None, storage_device: torch.device | str | None,
                  kv_cache_dtype: str | None, on_replace: Callable[[], None], make_storage=None) -> LayerStorage:
    """Layer ``index``'s storage. make_storage: ``(index, capacity_hint, on_replace, kv_cache_dtype) ->
    storage``, a tier's own (it then decides everything)."""
    if make_storage is not None:
        return make_storage(index, capacity_hint, on_replace, kv_cache_dtype)
    if kv_cache_dtype is not None:
        return QuantizedStorage(kv_cache_dtype, capacity_hint, storage_device, on_replace)
    kind = LayerStorage if storage_device is None else OffloadedStorage
    return kind(capacity_hint, storage_device, on_replace)
