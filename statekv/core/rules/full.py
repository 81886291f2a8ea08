"""Full attention: every step attends to the whole history."""

from __future__ import annotations

from dataclasses import dataclass

from .base import KEEP_ALL, CarryPolicy
from .candidates import Candidates


@dataclass(frozen=True)
class FullAttention(CarryPolicy):
    """Carry everything: every step attends to the whole history. Exact, and quadratic in length."""

    carries_everything = True

    def select(self, candidates: Candidates) -> slice:
        return KEEP_ALL
