"""Carry rules: which tokens a layer keeps in its carried state after each step.

A policy sees the candidates of one layer after one step (the tokens it carried into the step, then the
step's own tokens, in time order) and returns which of them to carry into the next step. Everything else
about streaming (the detailed cache, positions, attention) is shared, so a new rule is one small class:

    @dataclass(frozen=True)
    class FirstTokens(CarryPolicy):
        count: int
        def select(self, c):
            return slice(0, min(self.count, c.size))   # slices are fine when the kept set is contiguous

`select` returns either a ``slice`` over the candidate axis (the same for every head: cheap, and lets the
cache keep the carried state as a view of the detailed cache) or a LongTensor ``[B, H_kv, K]`` of
candidate indices per (batch, KV head), sorted ascending so the carried state stays in time order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch

from .errors import ConfigurationError

KEEP_ALL = slice(0, None)


class Candidates:
    """The tokens a layer may carry after one step: what it carried into the step, then the step's tokens.

    Attributes:
        size: number of candidates N.
        scores: float32 ``[B, H_kv, N]``: attention mass each candidate received from the step's queries,
            summed over those queries and the query heads of its KV group (each row sums to ``T * G``);
            ``None`` unless the policy sets ``needs_scores``.
        step: index of the current step (0 for the first chunk).
        chunk_lengths: host-side token count of every step so far, the current one last.
        layer: decoder layer index.
        positions: LongTensor ``[B, H_kv, N]``: logical sequence position of each candidate, ascending.
        steps: LongTensor ``[B, H_kv, N]``: index of the step that produced each candidate.

    ``positions`` and ``steps`` are computed on first access, so rules that do not read them cost nothing.
    """

    def __init__(self, *, size: int, scores: torch.Tensor | None, step: int,
                 chunk_lengths: tuple[int, ...], layer: int,
                 locate: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        self.size, self.scores, self.step = size, scores, step
        self.chunk_lengths, self.layer = chunk_lengths, layer
        self._locate = locate

    @classmethod
    def from_tensors(cls, positions: torch.Tensor, steps: torch.Tensor, scores: torch.Tensor | None,
                     step: int, chunk_lengths: tuple[int, ...], layer: int = 0) -> "Candidates":
        return cls(size=positions.shape[-1], scores=scores, step=step, chunk_lengths=chunk_lengths,
                   layer=layer, locate=lambda: (positions, steps))

    @cached_property
    def _located(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._locate()

    @property
    def positions(self) -> torch.Tensor:
        return self._located[0]

    @property
    def steps(self) -> torch.Tensor:
        return self._located[1]

    def last_steps(self, count: int) -> slice:
        """The candidates produced by the ``count`` most recent steps, as a slice.

        Valid when the carried state already holds every token of the previous ``count - 1`` steps (true for
        any rule that never drops a recent token before an older one, such as recency).
        """
        recent = sum(self.chunk_lengths[-count:])
        return slice(max(self.size - recent, 0), None)


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CarryPolicy:
    """Base class of carry rules. Subclasses override :meth:`select`."""

    needs_scores: ClassVar[bool] = False

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        """Which candidates to carry: a slice over the candidate axis, or indices ``[B, H_kv, K]``."""
        raise NotImplementedError

    def scores_needed(self, size: int) -> bool:
        """Whether :meth:`select` will read scores for ``size`` candidates (lets attention skip scoring)."""
        return self.needs_scores

    @property
    def name(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class FullAttention(CarryPolicy):
    """Carry everything: every step attends to the whole history. Exact, and quadratic in length."""

    def select(self, candidates: Candidates) -> slice:
        return KEEP_ALL


@dataclass(frozen=True)
class Recency(CarryPolicy):
    """Carry the tokens of the ``frames`` most recent steps (sliding window; the ReKV baseline)."""

    frames: int

    def __post_init__(self) -> None:
        _positive_int("Recency", "frames", self.frames)

    def select(self, candidates: Candidates) -> slice:
        return candidates.last_steps(self.frames)


@dataclass(frozen=True)
class StateKV(CarryPolicy):
    """Carry the top-``budget`` candidates by attention mass, per layer and per KV head, in time order."""

    budget: int
    needs_scores: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _positive_int("StateKV", "budget", self.budget)

    def scores_needed(self, size: int) -> bool:
        return size > self.budget

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        if candidates.size <= self.budget:
            return KEEP_ALL
        top = candidates.scores.topk(self.budget, dim=-1, sorted=False).indices
        return top.sort(dim=-1).values


@dataclass(frozen=True)
class SinksAndRecency(CarryPolicy):
    """Carry the first ``sinks`` tokens of the sequence plus the tokens of the ``frames`` latest steps.

    The attention-sink recipe of streaming LLMs, applied per step; shown here as an example of a rule
    whose kept set is not contiguous.
    """

    sinks: int
    frames: int

    def __post_init__(self) -> None:
        _positive_int("SinksAndRecency", "sinks", self.sinks)
        _positive_int("SinksAndRecency", "frames", self.frames)

    def select(self, candidates: Candidates) -> torch.Tensor:
        first_recent_step = candidates.step - self.frames + 1
        # The rule ignores heads, so one row decides for all of them.
        keep = (candidates.positions[0, 0] < self.sinks) | (candidates.steps[0, 0] >= first_recent_step)
        return keep.nonzero().squeeze(-1).expand(*candidates.positions.shape[:2], -1)
