"""Attention sinks around any rule: the protected prefix is always carried, the wrapped rule chooses the rest."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...errors import ConfigurationError
from ...settings.values import check_int
from .base import KEEP_ALL, CarryPolicy
from .candidates import Candidates
from .wrapped import WrappedPolicy


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
            raise ConfigurationError(f"WithSinks: rule must be a CarryPolicy, got {type(self.rule).__name__}")
        for name in ("sinks", "prefix_tokens"):
            check_int(getattr(self, name), f"{type(self).__name__}: {name}", minimum=0)
        check_int(self.sink_tokens, f"{type(self).__name__}: sinks with the prompt's prefix ({self.prefix_tokens:,} "
                  "tokens)", minimum=0)

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
