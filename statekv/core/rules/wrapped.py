"""A rule around another rule (`WrappedPolicy`): what every wrapper shares, as kvpress's wrapper presses do."""

from __future__ import annotations

from dataclasses import dataclass

from .base import CarryPolicy


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

    @property
    def carries_everything(self) -> bool:
        return self.rule.carries_everything

    def steady_budget(self, layer: int) -> int | None:
        return self.rule.steady_budget(layer)

    def check_layers(self, layers: int) -> None:
        self.rule.check_layers(layers)
