"""StateKV: the candidates that received the most attention mass from the step's queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .candidates import Candidates
from .scored import ScoredPolicy


@dataclass(frozen=True)
class StateKV(ScoredPolicy):
    """Carry the top-``budget`` candidates by the attention mass they received from the step's queries."""

    needs_scores: ClassVar[bool] = True

    def score(self, candidates: Candidates) -> torch.Tensor:
        return candidates.scores
