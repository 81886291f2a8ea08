"""Streaming accumulation of the attention statistics: fold one (layer, step) of scores at a time.

:class:`AttentionStatistics` receives each layer's scores as the full-attention stream produces them,
turns them into that step's statistics (:mod:`statekv.analysis.statistics`) and adds those to running
sums. What it keeps between steps does not grow with the video: the running sums, and per layer the oracle
ranking of the previous step (at most ``max(budgets)`` indices per row), which is all the next step's
oracle comparison needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from statekv.errors import ConfigurationError
from statekv.settings.values import check_int

from . import statistics as st

PAPER_BUDGETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
PAPER_WINDOWS = (1, 4, 16, 64)
TRANSITIONS = ("recall", "weighted_recall", "retention", "churn")


def positive_integers(name: str, values) -> tuple[int, ...]:
    """``values`` sorted and deduplicated; a one-line error unless every one is a positive integer."""
    values = tuple(values)
    for value in values:
        check_int(value, f"every one of {name} {list(values)}")
    return tuple(sorted(set(values)))


@dataclass
class AnalysisSettings:
    """What to measure.

    budgets: token budgets ``B`` for concentration and the oracle states.
    windows: recency windows ``R`` in steps (frames).
    max_distance: step distances kept apart in the distance profile; further ones share one bucket.
    per_head: also compute every statistic per KV head (rows of ``[H_kv, N]``), besides per layer.
    """

    budgets: tuple[int, ...] = PAPER_BUDGETS
    windows: tuple[int, ...] = PAPER_WINDOWS
    max_distance: int = 128
    per_head: bool = False

    def __post_init__(self) -> None:
        for name in ("budgets", "windows"):
            setattr(self, name, positive_integers(name, getattr(self, name)))
            if not getattr(self, name):
                raise ConfigurationError(f"{name}: give at least one")
        check_int(self.max_distance, "max_distance")


@dataclass
class _Mean:
    """A running sum and count of ``[..., K]`` values (count per column)."""

    total: torch.Tensor | None = None
    count: torch.Tensor | None = None

    def add(self, values: torch.Tensor, present: torch.Tensor | None = None) -> None:
        values = values.double()
        if present is None:
            present = torch.ones(values.shape[-1], dtype=torch.bool, device=values.device)
        present = present.to(values.device)
        values = values * present
        if self.total is None:
            self.total, self.count = torch.zeros_like(values), torch.zeros_like(present, dtype=torch.float64)
        self.total += values
        self.count += present

    def mean(self) -> torch.Tensor | None:
        if self.total is None:
            return None
        return (self.total / self.count.clamp(min=1)).cpu().where(self.count.cpu() > 0, torch.nan)


@dataclass
class _Grouping:
    """Running statistics of one way of forming rows (``layer``: one row per layer; ``head``: one per KV head)."""

    concentration: _Mean = field(default_factory=_Mean)
    historical_share: _Mean = field(default_factory=_Mean)
    recent: _Mean = field(default_factory=_Mean)
    selected: _Mean = field(default_factory=_Mean)
    window_tokens: _Mean = field(default_factory=_Mean)
    distance: _Mean = field(default_factory=_Mean)
    transitions: dict[str, _Mean] = field(default_factory=lambda: {name: _Mean() for name in TRANSITIONS})
    previous: torch.Tensor | None = None  # oracle ranking [G, <= max(budgets)] after the previous step


class AttentionStatistics:
    """Running statistics of one or more full-attention streams, per layer.

    Call :meth:`start_stream` before each video and :meth:`fold` for every (layer, step) in stream order;
    :meth:`result` averages over streams and steps.
    """

    def __init__(self, num_layers: int, settings: AnalysisSettings | None = None):
        self.settings = settings or AnalysisSettings()
        self.num_layers = num_layers
        groupings = ("layer", "head") if self.settings.per_head else ("layer",)
        self._layers = [{name: _Grouping() for name in groupings} for _ in range(num_layers)]
        self.streams = 0
        self.steps = 0  # steps folded at layer 0 (every layer sees the same steps)

    def start_stream(self) -> None:
        """Forget the previous stream's oracle states (the running sums carry on)."""
        for layer in self._layers:
            for grouping in layer.values():
                grouping.previous = None
        self.streams += 1

    def fold(self, layer: int, scores: torch.Tensor, lengths: tuple[int, ...]) -> None:
        """Add one step of one layer: ``scores [H_kv, N]`` (mass per KV head) of a stream of steps ``lengths``."""
        if self.streams == 0:
            self.start_stream()
        if layer == 0:
            self.steps += 1
        for name, grouping in self._layers[layer].items():
            rows = scores.sum(dim=0, keepdim=True) if name == "layer" else scores
            self._fold_rows(grouping, rows.float(), lengths)

    def _fold_rows(self, g: _Grouping, rows: torch.Tensor, lengths: tuple[int, ...]) -> None:
        s = self.settings
        order = st.oracle_order(rows, max(s.budgets))
        if g.previous is not None:
            moved = st.oracle_transition(rows, lengths, g.previous, order, list(s.budgets))
            for name in TRANSITIONS:
                g.transitions[name].add(getattr(moved, name))
        g.previous = order
        history = st.split_history(rows, lengths)
        if history.shape[1] == 0:
            return
        cumulative = st.top_mass(history)
        g.concentration.add(st.concentration(cumulative, list(s.budgets)))
        g.historical_share.add((cumulative[:, -1] / rows.double().sum(dim=-1))[:, None])
        recent, selected, tokens = st.recency_comparison(history, cumulative, lengths, list(s.windows))
        g.recent.add(recent)
        g.selected.add(selected)
        g.window_tokens.add(torch.tensor(tokens, dtype=torch.float64, device=rows.device)[None])
        share, present = st.distance_profile(history, lengths, s.max_distance)
        g.distance.add(share, present)

    def state_numel(self) -> int:
        """Elements held in tensors between steps (constant once ``max(budgets)`` tokens have streamed)."""
        total = 0
        for layer in self._layers:
            for g in layer.values():
                means = [g.concentration, g.historical_share, g.recent, g.selected, g.window_tokens, g.distance,
                         *g.transitions.values()]
                total += sum(m.total.numel() + m.count.numel() for m in means if m.total is not None)
                total += 0 if g.previous is None else g.previous.numel()
        return total

    def result(self) -> dict:
        """Every statistic as plain lists (JSON-ready); see ``docs/analysis.md`` for the fields."""
        s = self.settings
        out = {"budgets": list(s.budgets), "windows": list(s.windows), "max_distance": s.max_distance,
               "layers": self.num_layers, "streams": self.streams, "steps": self.steps,
               "distance_labels": [str(d) for d in range(1, s.max_distance + 1)] + [f">{s.max_distance}"]}
        for name in self._layers[0] if self._layers else ():
            out[name] = self._grouping_result(name)
        return out

    def _grouping_result(self, name: str) -> dict:
        def stacked(get) -> torch.Tensor:  # [L, G, K] over layers
            return torch.stack([get(layer[name]).mean() for layer in self._layers])

        def summary(values: torch.Tensor) -> dict:  # values [L, G, K]
            out = {"mean": _listed(values.nanmean(dim=(0, 1))), "per_layer": _listed(values.nanmean(dim=1))}
            if name == "head":
                out["per_head"] = _listed(values)
            return out

        if self._layers[0][name].concentration.total is None:
            return {}
        recent, selected = stacked(lambda g: g.recent), stacked(lambda g: g.selected)
        result = {
            "concentration": summary(stacked(lambda g: g.concentration)),
            "historical_share": summary(stacked(lambda g: g.historical_share)),
            "recency": {
                "window_tokens": _listed(self._layers[0][name].window_tokens.mean()[0]),
                "recent_mass": summary(recent),
                "selected_mass": summary(selected),
                "gap": summary(selected - recent),
            },
            "distance": summary(stacked(lambda g: g.distance)),
        }
        if self._layers[0][name].transitions["recall"].total is not None:
            result["oracle"] = {t: summary(stacked(lambda g, t=t: g.transitions[t])) for t in TRANSITIONS}
        return result


def _listed(values: torch.Tensor) -> list:
    """Nested lists of floats, NaN (a statistic no step had) as None so the result is valid JSON."""
    if values.dim() == 0:
        return None if values.isnan() else values.item()
    return [_listed(v) for v in values]
