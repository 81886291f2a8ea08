"""Drive a model through the streaming engine to measure attention structure and approximation error.

Both measurements take the stream as a sequence of steps, each anything with ``inputs_embeds [1, T, D]``,
``position_ids`` and ``forward_kwargs`` (a :class:`statekv.models.Chunk`; :func:`text_steps` makes them from
token ids). Every run over one stream declares the same horizon, the stream's token count, so dynamic RoPE
is frozen exactly as in a one-shot forward over the stream, identically in all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from statekv.core import CarryPolicy, FullAttention, Recency, StateKV, StreamingPrefill
from statekv.errors import InputError

from .accumulator import AnalysisSettings, AttentionStatistics
from .recording import RecordScores


@dataclass
class Step:
    """One streaming step: what :meth:`StreamingPrefill.step` takes (the fields of a ``Chunk`` it reads)."""

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor | None = None
    forward_kwargs: dict[str, Any] = field(default_factory=dict)


def text_steps(model: torch.nn.Module, input_ids: Sequence[torch.Tensor]) -> list[Step]:
    """Steps from token-id chunks ``[1, T]`` (1-D positions continuing from the stream's length)."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        return [Step(embed(ids)) for ids in input_ids]


StepsDone = Callable[[int, int | None], None]  # (steps done, steps planned or None) after each step


def measure_attention(model: torch.nn.Module, steps: Iterable[Any], statistics: AttentionStatistics, *,
                      horizon: int | None = None, attention: str = "auto", on_step: StepsDone | None = None) -> int:
    """Stream ``steps`` under exact full attention, folding every (layer, step)'s scores into ``statistics``.

    ``horizon`` must cover the stream for models with dynamic RoPE (pass a Sequence to have it counted).
    ``on_step`` is told how far the stream is after each step. Returns the number of tokens streamed.
    """
    if horizon is None and isinstance(steps, Sequence):
        horizon = stream_tokens(steps)
    planned = len(steps) if isinstance(steps, Sequence) else None
    statistics.start_stream()
    with StreamingPrefill(model, RecordScores(statistics.fold), attention=attention, horizon=horizon) as run:
        for done, step in enumerate(steps, 1):
            _run_step(run, step)
            if on_step is not None:
                on_step(done, planned)
        return run.seen_tokens


def analyze_attention(model: torch.nn.Module, streams: Iterable[Sequence[Any]],
                      settings: AnalysisSettings | None = None, attention: str = "auto") -> dict:
    """:func:`measure_attention` over several streams (videos); returns the pooled statistics."""
    statistics = AttentionStatistics(_num_layers(model), settings)
    for steps in streams:
        measure_attention(model, steps, statistics, attention=attention)
    return statistics.result()


@dataclass
class _ErrorSums:
    """Squared Frobenius norms of differences and of the reference, accumulated over steps and streams."""

    keys: torch.Tensor           # [2, L]: (error, reference) per layer
    values: torch.Tensor         # [2, L]
    hidden: torch.Tensor         # [2]
    by_step: list[list[list[float]]] = field(default_factory=list)  # per stream, per step: key, value, hidden
    carried_tokens: list[int] = field(default_factory=list)  # per stream: tokens the policy carries at the end

    @classmethod
    def empty(cls, layers: int) -> "_ErrorSums":
        return cls(torch.zeros(2, layers, dtype=torch.float64), torch.zeros(2, layers, dtype=torch.float64),
                   torch.zeros(2, dtype=torch.float64))


def policy_label(policy: CarryPolicy) -> str:
    if isinstance(policy, StateKV):
        return f"statekv B={policy.budget}"
    if isinstance(policy, Recency):
        return f"recency R={policy.frames}"
    return policy.name


class ApproximationErrors:
    """Relative error of carry policies against full attention, measured stream by stream (video by video).

    For every policy: per layer, ``||K - K_full||_F / ||K_full||_F`` over the detailed cache (every token of
    every stream; the same for values), and the same for the last hidden states of every step, pooled over
    the streams and per step. :meth:`measure` keeps only two runs alive at a time: the full-attention
    reference of the stream (its detailed cache and hidden states) and the policy being measured, compared
    step by step.
    """

    def __init__(self, model: torch.nn.Module, policies: Sequence[CarryPolicy], *, attention: str = "auto"):
        self.model, self.policies, self.attention = model, list(policies), attention
        self._sums = {policy_label(p): _ErrorSums.empty(_num_layers(model)) for p in self.policies}

    def measure(self, steps: Sequence[Any], on_step: StepsDone | None = None) -> None:
        """Stream ``steps`` under full attention, then under each policy, and add up the differences. ``on_step``
        is told the steps done of all those runs after each."""
        horizon = stream_tokens(steps)
        planned, done = len(steps) * (1 + len(self.policies)), 0

        def stepped() -> None:
            nonlocal done
            done += 1
            if on_step is not None:
                on_step(done, planned)

        with StreamingPrefill(self.model, FullAttention(), attention=self.attention, horizon=horizon) as reference:
            reference_hidden = []
            for step in steps:
                reference_hidden.append(_run_step(reference, step))
                stepped()
            reference_cache = reference.detailed_cache
        lengths = [_step_tokens(s) for s in steps]
        for policy in self.policies:
            meter = self._sums[policy_label(policy)]
            meter.by_step.append([])
            if isinstance(policy, Recency):
                meter.carried_tokens.append(sum(lengths[-policy.frames - 1 : -1]))
            elif isinstance(policy, StateKV):  # a budget past the history carries the history
                meter.carried_tokens.append(min(policy.budget, sum(lengths[:-1])))
            with StreamingPrefill(self.model, policy, attention=self.attention, horizon=horizon) as run:
                start = 0
                for step, expected in zip(steps, reference_hidden, strict=True):
                    hidden = _run_step(run, step)
                    end = start + hidden.shape[1]
                    _add_step(meter, run.detailed_cache, reference_cache, start, end, hidden, expected)
                    start = end
                    stepped()

    def result(self) -> dict[str, dict]:
        """``{label: errors}`` per policy (see ``docs/analysis.md`` for the fields)."""
        return {policy_label(p): _error_result(p, self._sums[policy_label(p)]) for p in self.policies}


def approximation_errors(model: torch.nn.Module, streams: Iterable[Sequence[Any]], policies: Sequence[CarryPolicy],
                         *, attention: str = "auto") -> dict[str, dict]:
    """:class:`ApproximationErrors` of ``policies`` over ``streams`` (each a sequence of steps)."""
    errors = ApproximationErrors(model, policies, attention=attention)
    for steps in streams:
        errors.measure(steps)
    return errors.result()


def _add_step(sums: _ErrorSums, cache, reference, start: int, end: int, hidden, expected) -> None:
    step = torch.zeros(3, 2, dtype=torch.float64)
    for index, (layer, ref) in enumerate(zip(cache.layers, reference.layers, strict=True)):
        for row, (mine, theirs, total) in enumerate(((layer.keys, ref.keys, sums.keys),
                                                     (layer.values, ref.values, sums.values))):
            pair = _squared(mine[:, :, start:end], theirs[:, :, start:end])
            total[:, index] += pair
            step[row] += pair
    step[2] = _squared(hidden, expected)
    sums.hidden += step[2]
    sums.by_step[-1].append(_relative(step[:, 0], step[:, 1]).tolist())


def _squared(mine: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``(||mine - reference||^2, ||reference||^2)`` as float64 ``[2]``."""
    reference = reference.double()
    return torch.stack([(mine.double() - reference).square().sum(), reference.square().sum()]).cpu()


def _relative(error: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (error / reference.clamp(min=torch.finfo(torch.float64).tiny)).sqrt()


def _error_result(policy: CarryPolicy, sums: _ErrorSums) -> dict:
    if isinstance(policy, StateKV):
        kind, budget = "statekv", policy.budget
        budget_tokens = sum(sums.carried_tokens) / len(sums.carried_tokens)
    elif isinstance(policy, Recency):
        kind, budget = "recency", policy.frames
        budget_tokens = sum(sums.carried_tokens) / len(sums.carried_tokens)
    else:
        kind, budget, budget_tokens = policy.name, None, None
    keys, values = _relative(sums.keys[0], sums.keys[1]), _relative(sums.values[0], sums.values[1])
    return {
        "label": policy_label(policy), "kind": kind, "budget": budget, "budget_tokens": budget_tokens,
        "key_error": {"mean": keys.mean().item(), "per_layer": keys.tolist()},
        "value_error": {"mean": values.mean().item(), "per_layer": values.tolist()},
        "hidden_error": _relative(sums.hidden[0], sums.hidden[1]).item(),
        "by_step": {name: [[row[i] for row in stream] for stream in sums.by_step]
                    for i, name in enumerate(("key_error", "value_error", "hidden_error"))},
    }


def stream_tokens(steps: Sequence[Any]) -> int:
    return sum(_step_tokens(s) for s in steps)


def _step_tokens(step: Any) -> int:
    return step.inputs_embeds.shape[1]


def _run_step(run: StreamingPrefill, step: Any) -> torch.Tensor:
    if step.inputs_embeds.shape[0] != 1:
        raise InputError(f"the analysis streams one video at a time (batch 1), got batch {step.inputs_embeds.shape[0]}")
    return run.step(step.inputs_embeds, step.position_ids, **(step.forward_kwargs or {}))


def _num_layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers
