"""A scored rule with its own budget in each layer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Iterable
from functools import cached_property

import torch

from ...errors import ConfigurationError
from ...settings.values import check_int
from .candidates import Candidates
from .scored import ScoredPolicy
from .wrapped import WrappedPolicy


@dataclass(frozen=True)
class PerLayerBudget(WrappedPolicy):
    """``rule`` (a :class:`ScoredPolicy`) with its own budget in each layer: ``budgets[layer]`` tokens."""

    budgets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rule, ScoredPolicy):
            raise ConfigurationError(f"PerLayerBudget: rule must be a ScoredPolicy, got {type(self.rule).__name__}")
        if not isinstance(self.budgets, Iterable):
            raise ConfigurationError(f"PerLayerBudget: budgets must be one integer per layer, got "
                                     f"{type(self.budgets).__name__}")
        object.__setattr__(self, "budgets", tuple(self.budgets))
        if not self.budgets:
            raise ConfigurationError("PerLayerBudget: give one budget per layer")
        for budget in self.budgets:
            check_int(budget, "PerLayerBudget: budgets")

    def scores_needed(self, size: int) -> bool:  # the layer is not known here: scores as soon as one layer needs them
        return self.rule.needs_scores and size > min(self.budgets)

    def steady_budget(self, layer: int) -> int | None:
        return self.budgets[layer] if layer < len(self.budgets) else None

    def check_layers(self, layers: int) -> None:
        if len(self.budgets) != layers:
            raise ConfigurationError(f"PerLayerBudget has {len(self.budgets)} budgets, but the model streams {layers} "
                                     "layers: give one budget per layer")

    @cached_property
    def rules(self) -> tuple[ScoredPolicy, ...]:
        return tuple(replace(self.rule, budget=budget) for budget in self.budgets)

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        if candidates.layer >= len(self.rules):
            raise ValueError(f"PerLayerBudget has {len(self.rules)} budgets, but layer {candidates.layer} streams")
        return self.rules[candidates.layer].select(candidates)
