"""What a stream's cache limit counts (`CacheKeeper`): the bytes its tokens and steps hold as stored, and what
it holds besides them. Host bookkeeping on a `StreamingPrefill`; a closed stream holds nothing."""

from __future__ import annotations

from typing import Any

from ..disk.tier import JOURNAL_STEP_BYTES
from ..storage.limits import released_segments


def counted_bytes(prefill: Any) -> int:
    """What ``max_cache_bytes`` would count now (`CacheKeeper.held_bytes`) for a stream without a cap: the bytes of
    every token and step held as stored (a stream saved under a cap and loaded without one holds none of its
    evicted steps), whatever was allocated ahead of them."""
    cache = prefill.cache
    if not cache.layers:  # closed: its cache was let go
        return 0
    rows = (cache.layers[0].storage.batch_heads or (1, 0))[0]
    tokens = prefill.seen_tokens - cache.evicted_tokens()
    steps = len(cache.chunk_lengths) - len(cache.evicted_steps)
    return (tokens * prefill.bytes_per_token + steps * prefill.bytes_per_step) * rows + other_bytes(prefill)[0]


def other_bytes(prefill: Any) -> tuple[int, int]:
    """What a cache limit counts besides the tokens and steps held (the segment index, the disk tier's journal, as
    `DiskTier.counted_bytes` counts it), and what the next step adds to it (a segment row, a step's share of the
    journal)."""
    cache, disk = prefill.cache, prefill.disk
    storages = [layer.storage for layer in cache.layers if layer.storage.segment_open is not None]
    row = sum(s.segment_open.numel() * s.segment_open.element_size() for s in storages)  # all layers
    index = row * (storages[0].segment_index.length - released_segments(cache, prefill.keeper)) if storages else 0
    completes = (len(cache.chunk_lengths) + 1) % cache.layers[0].storage.segment_steps == 0
    growth = row if completes else 0
    if disk is None:
        return index, growth
    return index + disk.counted_bytes(cache), growth + JOURNAL_STEP_BYTES
