"""Recency: the tokens of the most recent steps (a sliding window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...settings.values import check_int
from .base import CarryPolicy
from .candidates import Candidates


@dataclass(frozen=True)
class Recency(CarryPolicy):
    """Carry the tokens of the ``frames`` most recent steps (the sliding-window prefill of ReKV's paper
    baseline): each step attends to its own tokens and those of the ``frames`` steps before it."""

    frames: int
    capturable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(self.frames, "Recency: frames")

    def select(self, candidates: Candidates) -> slice:
        return candidates.last_steps(self.frames)

    @property
    def recent_steps(self) -> int:
        return self.frames
