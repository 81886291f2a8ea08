"""What a stream holds and what its steps cost, as the engine reports it (`StreamingPrefill.stats`).

Everything here is host-side bookkeeping: reading it never waits for the device, except the opt-in selection
overlap, which compares carried positions and so reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class StepRecord:
    """One step: its tokens, the host's wall time for it (on a GPU: until its work was queued, not done), the
    largest carried state after it, and, when tracked, the fraction of the carried state it kept."""

    tokens: int
    seconds: float
    carried_tokens: int
    overlap: float | None = None


@dataclass(frozen=True)
class StreamStats:
    """A stream's cache at one moment.

    steps, tokens: streamed so far. carried_tokens: per layer, tokens carried into the next step (per KV head).
    detailed_bytes: the buffers of the keys and values of every token (or their int8/int4 codes with their
    scales), all layers, wherever they are stored, as allocated (a horizon's, up front), less the rows an evicting
    stream gave back (its disk tier's holes, host pages returned; pinned or GPU memory keeps them; its host buffers
    count the rows written, not the slots grown ahead of them, which hold no pages); scale_bytes:
    the scales and zero points among them. summary_bytes: every step's retrieval summaries and the segment index.
    journal_bytes: the disk tier's journal and carried-state checkpoints, as the files hold them. held_bytes: what
    ``max_cache_bytes`` counts, or would count without a cap (the above for the tokens and steps held, evicted steps
    excepted, not what was allocated ahead of them; of the disk tier's, a fixed share per step held,
    `statekv.core.disk.tier.DiskTier.counted_bytes`).
    device_bytes: cache bytes on the model's device now; peak_device_bytes: the most at once, answering included.
    graph_replays: steps replayed from a CUDA graph. history: a `StepRecord` for each of the last
    ``HISTORY_STEPS`` steps. evicted_steps, evicted_tokens: given up under a cache limit
    (:mod:`statekv.core.storage.limits`; answers no longer see them). forms: per layer, the form
    its carried state is in (``window``, ``slots`` or ``ring``; see :mod:`statekv.core.cache.forms`).
    """

    steps: int
    tokens: int
    carried_tokens: tuple[int, ...]
    detailed_bytes: int
    device_bytes: int
    peak_device_bytes: int
    graph_replays: int
    history: tuple[StepRecord, ...] = field(repr=False)
    evicted_steps: int = 0
    evicted_tokens: int = 0
    summary_bytes: int = 0
    scale_bytes: int = 0
    journal_bytes: int = 0
    held_bytes: int = 0
    forms: tuple[str, ...] = ()

    @property
    def max_carried_tokens(self) -> int:
        return max(self.carried_tokens, default=0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "max_carried_tokens": self.max_carried_tokens}


def kept_fraction(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """Mean over layers of the fraction of the positions carried ``before`` a step that are still carried
    ``after`` it (positions ``[B, H_kv, K]`` per layer); reads the tensors."""
    fractions = []
    for old, new in zip(before, after):
        if old.numel() == 0:
            continue
        kept = (old[..., :, None] == new[..., None, :]).any(dim=-1)
        fractions.append(kept.float().mean().item())
    return sum(fractions) / len(fractions) if fractions else 1.0
