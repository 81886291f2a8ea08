"""Sinks and recency in one rule whose kept set is not contiguous (the attention-sink recipe of streaming LLMs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...settings.values import check_int
from .base import CarryPolicy
from .candidates import Candidates


@dataclass(frozen=True)
class SinksAndRecency(CarryPolicy):
    """Carry the first ``sinks`` tokens of the sequence plus the tokens of the ``frames`` latest steps.

    The attention-sink recipe of streaming LLMs, applied per step; shown here as an example of a rule
    whose kept set is not contiguous.
    """

    sinks: int
    frames: int

    def __post_init__(self) -> None:
        check_int(self.sinks, "SinksAndRecency: sinks")
        check_int(self.frames, "SinksAndRecency: frames")

    def select(self, candidates: Candidates) -> torch.Tensor:
        first_recent_step = candidates.step - self.frames + 1
        # The rule ignores heads, so one row decides for all of them.
        keep = (candidates.positions[0, 0] < self.sinks) | (candidates.steps[0, 0] >= first_recent_step)
        return keep.nonzero().squeeze(-1).expand(*candidates.positions.shape[:2], -1)
