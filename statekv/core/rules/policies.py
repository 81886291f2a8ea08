"""Carry rules: which tokens a layer keeps in its carried state after each step.

A policy sees the candidates of one layer after one step (the tokens it carried into the step, then the
step's own tokens) and returns which of them to carry into the next step. Everything else about streaming
(the detailed cache, positions, attention) is shared, so a new rule is one small class. Most rules score
tokens and keep the best ones; they subclass :class:`ScoredPolicy` and return one score per candidate:

    @dataclass(frozen=True)
    class ValueNorm(ScoredPolicy):
        def score(self, c):
            return c.values.float().norm(dim=-1)      # [B, H_kv, N]: carry the largest values

The base keeps the ``budget`` best per (batch, KV head), in time order, and its steady steps can be captured
as a CUDA graph. Any other rule overrides :meth:`CarryPolicy.select`, returning a ``slice`` over the
candidate axis (the same for every head) or a LongTensor ``[B, H_kv, K]`` of candidate indices sorted
ascending (see :class:`SinksAndRecency`).

Rules compose: :class:`WithSinks` always carries a protected prefix (the prompt prefix and attention sinks) and
lets another rule choose among the rest; :class:`PerLayerBudget` gives a scored rule its own budget in each
layer. ReKV is ``WithSinks(Recency(frames), sinks)``. A rule may read the step's queries
(``candidates.queries``), for example to score keys by the attention of the step's last queries alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar

import torch

from ...settings.values import check_int

KEEP_ALL = slice(0, None)


class Candidates:
    """The tokens a layer may carry after one step: what it carried into the step, then the step's tokens.

    Attributes:
        size: number of candidates N.
        layer: decoder layer index.
        scores: float32 ``[B, H_kv, N]``: attention mass each candidate received from the step's queries,
            summed over those queries and the query heads of its KV group (each row sums to ``T * G``);
            ``None`` unless the policy needs them (:meth:`CarryPolicy.scores_needed`).
        keys, values: ``[B, H_kv, N, D]`` the candidates' keys (post-RoPE) and values.
        queries: ``[B, Hq, T, D]`` the step's queries (post-RoPE), query head ``h`` reading KV head ``h // G``;
            the tensor the attention already used, so reading it costs nothing until a rule computes with it.
        positions: LongTensor ``[B, H_kv, N]``: logical sequence position of each candidate.
        steps: LongTensor ``[B, H_kv, N]``: index of the step that produced each candidate.
        step: index of the current step (0 for the first chunk).
        chunk_lengths: token count of every step so far, the current one last.

    Candidates are in time order, except that a carried state may hold its tokens in any order (positions
    say which is which). ``step``, ``chunk_lengths`` and ``steps`` are host-side facts that change every step:
    a rule that reads them cannot be captured as a CUDA graph, and a step that reads them is never captured.
    """

    def __init__(self, *, layer: int, scores: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 positions: Callable[[], torch.Tensor] | torch.Tensor,
                 history: Callable[[], tuple[int, ...]] | tuple[int, ...],
                 queries: Callable[[], torch.Tensor] | torch.Tensor | None = None):
        self.size, self.layer = keys.shape[2], layer
        self.scores, self.keys, self.values = scores, keys, values
        self._positions, self._history, self._queries = positions, history, queries
        self.read_host_state = False

    @cached_property
    def queries(self) -> torch.Tensor:
        if self._queries is None:
            raise NotImplementedError("these candidates were made without the step's queries")
        return self._queries() if callable(self._queries) else self._queries

    def after(self, count: int) -> "Candidates":
        """The candidates past the first ``count`` (views; indices in the result count from ``count``)."""
        parent = self
        view = Candidates(layer=self.layer, scores=None if self.scores is None else self.scores[..., count:],
                          keys=self.keys[:, :, count:], values=self.values[:, :, count:],
                          positions=lambda: parent.positions[..., count:], history=self._history,
                          queries=lambda: parent.queries)
        return view

    @cached_property
    def positions(self) -> torch.Tensor:
        return self._positions() if callable(self._positions) else self._positions

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        self.read_host_state = True
        return self._history() if callable(self._history) else self._history

    @property
    def step(self) -> int:
        return len(self.chunk_lengths) - 1

    @cached_property
    def steps(self) -> torch.Tensor:
        starts = torch.tensor(self.chunk_lengths, device=self.positions.device).cumsum(0)
        return torch.searchsorted(starts, self.positions, right=True)

    def last_steps(self, count: int) -> slice:
        """The candidates produced by the ``count`` most recent steps, as a slice.

        Valid when the carried state already holds every token of the previous ``count - 1`` steps, in time
        order (true for any rule that never drops a recent token before an older one, such as recency).
        """
        recent = sum(self.chunk_lengths[-count:])
        return slice(max(self.size - recent, 0), None)


@dataclass(frozen=True)
class CarryPolicy:
    """Base class of carry rules. Subclasses override :meth:`select` (or use :class:`ScoredPolicy`).

    Class attributes:
        needs_scores: ``select`` reads ``candidates.scores`` (the attention must then compute them).
        capturable: ``select`` is a function of the candidate tensors alone (no host values that change per
            step), so a steady step may be recorded once as a CUDA graph and replayed.
    """

    needs_scores: ClassVar[bool] = False
    capturable: ClassVar[bool] = False

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        """Which candidates to carry: a slice over the candidate axis, or indices ``[B, H_kv, K]``."""
        raise NotImplementedError

    def scores_needed(self, size: int) -> bool:
        """Whether :meth:`select` will read scores for ``size`` candidates (lets attention skip scoring)."""
        return self.needs_scores

    @property
    def recent_steps(self) -> int | None:
        """If this rule carries exactly the tokens of its last N steps (after its sink tokens), N: the cache
        then keeps them in a ring buffer once steps have equal lengths. Else None."""
        return None

    def steady_budget(self, layer: int) -> int | None:
        """How many tokens ``layer`` carries once this rule's steps stop changing shape (a scored rule at its
        budget: its steps can then be replayed as a CUDA graph and batched with other streams'); None when the
        rule never settles at a fixed count of its own (full attention; recency settles in its ring instead)."""
        return None

    @property
    def sink_tokens(self) -> int:
        """How many leading tokens of the stream this rule always carries (with ``recent_steps``)."""
        return 0

    def for_prefix(self, tokens: int) -> "CarryPolicy":
        """This rule for a stream whose prompt prefix (text before the first frame) has ``tokens`` tokens."""
        return self

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


@dataclass(frozen=True)
class WrappedPolicy(CarryPolicy):
    """A rule around another ``rule``: captured and scored as that rule is; subclasses change what it chooses."""

    rule: CarryPolicy

    @property
    def capturable(self) -> bool:
        return self.rule.capturable

    @property
    def needs_scores(self) -> bool:
        return self.rule.needs_scores

    def steady_budget(self, layer: int) -> int | None:
        return self.rule.steady_budget(layer)


@dataclass(frozen=True)
class WithSinks(WrappedPolicy):
    """Always carry the protected prefix -- the stream's first ``prefix_tokens`` (the prompt before the first
    frame) and the ``sinks`` tokens after them -- and let ``rule`` choose among the other candidates.

    ``prefix_tokens`` is set per stream by :meth:`for_prefix` (the pipeline knows the prompt's prefix). The
    protected tokens are the earliest of the stream, so a carried state that keeps them holds them first.
    """

    sinks: int = 4
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rule, CarryPolicy):
            raise TypeError(f"WithSinks: rule must be a CarryPolicy, got {type(self.rule).__name__}")
        for name in ("sinks", "prefix_tokens"):
            check_int(getattr(self, name), f"{type(self).__name__}: {name}", minimum=0)

    def scores_needed(self, size: int) -> bool:
        return self.rule.scores_needed(max(size - self.sink_tokens, 0))

    @property
    def recent_steps(self) -> int | None:
        return self.rule.recent_steps

    @property
    def sink_tokens(self) -> int:
        return self.prefix_tokens + self.sinks

    def steady_budget(self, layer: int) -> int | None:
        budget = self.rule.steady_budget(layer)
        return None if budget is None else self.sink_tokens + budget

    def for_prefix(self, tokens: int) -> "WithSinks":
        return replace(self, prefix_tokens=tokens)

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        protected = min(self.sink_tokens, candidates.size)
        if protected == 0:
            return self.rule.select(candidates)
        rest = candidates.after(protected)
        chosen = self.rule.select(rest)
        candidates.read_host_state |= rest.read_host_state
        device = candidates.keys.device
        if isinstance(chosen, slice):
            start, stop = chosen.indices(rest.size)[:2]
            if start == 0 and stop == rest.size:
                return KEEP_ALL
            keep = torch.cat([torch.arange(protected, device=device),
                              torch.arange(protected + start, protected + stop, device=device)])
            return keep.expand(*candidates.keys.shape[:2], -1)
        sinks = torch.arange(protected, device=device).expand(*chosen.shape[:2], -1)
        return torch.cat([sinks, chosen + protected], dim=-1)


@dataclass(frozen=True)
class ReKV(Recency):
    """ReKV's prefill (Di et al., ICLR 2025): attention sinks -- the prompt prefix and the first ``sinks``
    tokens after it -- plus the tokens of the ``frames`` most recent steps, that is
    ``WithSinks(Recency(frames), sinks, prefix_tokens)``. Answering from retrieved frames (the other half of
    ReKV) is a question-time option of every method (`Retrieval`).

    ``prefix_tokens`` is set per stream by :meth:`for_prefix` (the pipeline knows the prompt's prefix).
    """

    sinks: int = 4
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("sinks", "prefix_tokens"):
            check_int(getattr(self, name), f"ReKV: {name}", minimum=0)

    @property
    def sink_tokens(self) -> int:
        return self.prefix_tokens + self.sinks

    def for_prefix(self, tokens: int) -> "ReKV":
        return replace(self, prefix_tokens=tokens)

    @cached_property
    def composed(self) -> WithSinks:
        """The rule as a composition: ``WithSinks(Recency(frames), sinks, prefix_tokens)``."""
        return WithSinks(Recency(self.frames), self.sinks, self.prefix_tokens)

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        return self.composed.select(candidates)


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
        top = self.score(candidates).topk(self.budget, dim=-1, sorted=False).indices
        return in_time_order(top, candidates.size)


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


@dataclass(frozen=True)
class StateKV(ScoredPolicy):
    """Carry the top-``budget`` candidates by the attention mass they received from the step's queries."""

    needs_scores: ClassVar[bool] = True

    def score(self, candidates: Candidates) -> torch.Tensor:
        return candidates.scores


@dataclass(frozen=True)
class KeyNorm(ScoredPolicy):
    """Carry the ``budget`` candidates whose keys have the smallest L2 norm (low-norm keys tend to draw
    attention; the KNorm baseline of the KV-compression literature)."""

    def score(self, candidates: Candidates) -> torch.Tensor:
        return -candidates.keys.float().norm(dim=-1)


@dataclass(frozen=True)
class PerLayerBudget(WrappedPolicy):
    """``rule`` (a :class:`ScoredPolicy`) with its own budget in each layer: ``budgets[layer]`` tokens."""

    budgets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rule, ScoredPolicy):
            raise TypeError(f"PerLayerBudget: rule must be a ScoredPolicy, got {type(self.rule).__name__}")
        object.__setattr__(self, "budgets", tuple(self.budgets))
        if not self.budgets:
            raise ValueError("PerLayerBudget: give one budget per layer")
        for budget in self.budgets:
            check_int(budget, "PerLayerBudget: budgets")

    def scores_needed(self, size: int) -> bool:  # the layer is not known here: scores as soon as one layer needs them
        return self.rule.needs_scores and size > min(self.budgets)

    def steady_budget(self, layer: int) -> int | None:
        return self.budgets[layer] if layer < len(self.budgets) else None

    @cached_property
    def rules(self) -> tuple[ScoredPolicy, ...]:
        return tuple(replace(self.rule, budget=budget) for budget in self.budgets)

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        if candidates.layer >= len(self.rules):
            raise ValueError(f"PerLayerBudget has {len(self.rules)} budgets, but layer {candidates.layer} streams")
        return self.rules[candidates.layer].select(candidates)


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
