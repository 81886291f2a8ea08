"""KeyNorm: the candidates whose keys have the smallest norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .candidates import Candidates
from .scored import ScoredPolicy


@dataclass(frozen=True)
class KeyNorm(ScoredPolicy):
    """Carry the ``budget`` candidates whose keys have the smallest L2 norm (low-norm keys tend to draw
    attention; the KNorm baseline of the KV-compression literature)."""

    def score(self, candidates: Candidates) -> torch.Tensor:
        return -candidates.keys.float().norm(dim=-1)
