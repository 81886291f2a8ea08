"""Keep-the-best rules (`ScoredPolicy`): a subclass returns one score per candidate; the top-k, in time order,
is taken here, once (`in_time_order`, with the rank tables a recorded CUDA graph may read)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import InputError
from ...settings.values import check_int
from .base import KEEP_ALL, CarryPolicy
from .candidates import Candidates


@dataclass(frozen=True)
class ScoredPolicy(CarryPolicy):
    """Carry the ``budget`` highest-scoring candidates, per layer and per (batch, KV head), in time order.

    Subclasses implement :meth:`score`; top-k and time ordering happen here, once. While every candidate fits
    the budget, everything is carried (and no score is computed).
    """

    budget: int
    capturable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(self.budget, f"{type(self).__name__}: budget")

    def score(self, candidates: Candidates) -> torch.Tensor:
        """One score per candidate, ``[B, H_kv, N]``; higher is kept."""
        raise NotImplementedError

    def scores_needed(self, size: int) -> bool:
        return self.needs_scores and size > self.budget

    def steady_budget(self, layer: int) -> int:
        return self.budget

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        if candidates.size <= self.budget:
            return KEEP_ALL
        top = self.checked_score(candidates).topk(self.budget, dim=-1, sorted=False).indices
        return in_time_order(top, candidates.size)

    def checked_score(self, candidates: Candidates) -> torch.Tensor:
        """:meth:`score`, refused (one-line `InputError`) unless one score per candidate, ``[B, H_kv, N]``: a
        shorter row would never keep the last candidates, and anything else fails inside top-k."""
        scores = self.score(candidates)
        expected = tuple(candidates.keys.shape[:3])
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            got = f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
            hint = ("; a rule that reads candidates.scores declares needs_scores = True"
                    if scores is None and not self.needs_scores else "")
            raise InputError(f"{type(self).__name__}.score must return one score per candidate, a tensor of shape "
                             f"{expected} [B, H_kv, N]; got {got}{hint}")
        return scores


def in_time_order(chosen: torch.Tensor, size: int) -> torch.Tensor:
    """The candidate indices ``chosen`` ``[..., K]`` (distinct, below ``size``, in any order) in ascending order,
    as sorting them would give. Marking them, counting the marks and finding where the count reaches each rank
    takes a few short passes over ``size`` slots, where a GPU sorts each row with a radix sort several times
    longer."""
    marks = torch.zeros(*chosen.shape[:-1], size, dtype=torch.long, device=chosen.device).scatter_(-1, chosen, 1)
    return torch.searchsorted(marks.cumsum(-1), _ranks(chosen.shape, chosen.device))


_ranked: dict[tuple[int, torch.device], torch.Tensor] = {}  # per rank count and device, rows of [1, ..., K]
_outgrown: list[torch.Tensor] = []  # tables a larger one replaced: a recorded CUDA graph may still read them
_ranked_lock = threading.Lock()


def _ranks(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``[1, ..., K]`` along the last axis of ``shape`` ``[..., K]`` on ``device``, contiguous (as searchsorted reads
    it): a view of one table per ``K`` and device, kept for good (a recorded CUDA graph may read it at any replay)
    and doubled when more rows are needed, so the tables of a process stay within twice its largest batch's."""
    rows, count = math.prod(shape[:-1]), shape[-1]
    table = _ranked.get((count, device))
    if table is None or table.shape[0] < rows:
        table = _grown_ranks(rows, count, device)
    return table[:rows].view(shape)


def _grown_ranks(rows: int, count: int, device: torch.device) -> torch.Tensor:
    """The table of `_ranks` for ``count`` on ``device``, with at least ``rows`` rows (streams of several threads
    may need it at once: one of them makes it)."""
    with _ranked_lock:
        table = _ranked.get((count, device))
        if table is None or table.shape[0] < rows:
            if table is not None:
                _outgrown.append(table)
            size = rows if table is None else max(rows, 2 * table.shape[0])
            table = torch.arange(1, count + 1, device=device).expand(size, count).contiguous()
            _ranked[count, device] = table
        return table
