"""Question-time retrieval: which steps (frames) of the detailed cache a question is answered from.

A rule scores every step of the stream at one layer from what any model gives: the question's queries at that
layer, each step's summaries (its mean key and a few of its keys, kept beside the detailed cache in the model's
dtype, :class:`statekv.core.storage.StepSummaries`) and the step boundaries; scoring never reads the detailed
cache itself. :class:`Retrieval` keeps the
first ``keep_tokens`` tokens and the ``steps`` best-scored steps (top-k taken once, here), in time order.

Rules (``RETRIEVAL_RULES``, chosen by name with ``retrieval=``):

``attention`` (:class:`AttentionShare`, the default)
    The share of each query head's attention that a step would get if the question attended to the whole cache
    (softmax over every key, RoPE applied as in attention), the largest over the question's tokens, summed over
    heads and accumulated over the layers answered so far: a step an earlier layer looked up stays in at later
    layers, whose tokens carry what that look-up found.
``rekv`` (:class:`MeanKeyMatch`, ReKV's)
    Mean key of the step . mean query of the question, summed over heads (Di et al., ICLR 2025).
``recent`` (:class:`MostRecent`)
    The last steps only: SimpleStream's baseline (answer from the last N frames).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, ClassVar

import torch

from ..errors import ConfigurationError
from ..values import check_int

# Query rows x keys of one block of scores: bounds the scratch memory of AttentionShare on long streams.
SCORE_BLOCK = 1 << 22


@dataclass(frozen=True)
class LayerQuestion:
    """What a rule sees at one layer when a question's queries reach it.

    layer: the layer's index. queries: ``[1, Hq, Q, D]`` the prompt's queries (RoPE applied). keys:
    ``[1, H_kv, T, D]`` the stream's detailed keys (RoPE applied), or None when answering (rules score from the
    summaries; :meth:`detailed_keys` reads the keys if a rule needs them). step_means: ``[1, H_kv, S, D]`` each
    step's mean key. steps: the token count of each of the ``S`` steps. scale: the attention's softmax scale.
    memory: scratch shared by the layers of one question (rules that look across layers keep their running
    state there, under their own name). samples: ``[1, H_kv, S, N, D]`` keys of each step, evenly spaced
    (the first ``min(tokens, N)`` of a step are real; see :func:`statekv.core.storage.sample_index`), or None.
    read_keys: reads the detailed keys of tokens ``[M]`` -> ``[1, H_kv, M, D]`` (when ``keys`` is None).
    evicted: steps given up under a cache limit (never chosen).
    """

    layer: int
    queries: torch.Tensor
    keys: torch.Tensor | None
    step_means: torch.Tensor
    steps: tuple[int, ...]
    scale: float
    memory: dict[str, Any] = field(default_factory=dict, compare=False)
    samples: torch.Tensor | None = field(default=None, compare=False)
    read_keys: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    @property
    def device(self) -> torch.device:
        """Where the stream's keys (and their summaries) are."""
        return (self.keys if self.keys is not None else self.step_means).device

    def detailed_keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """``[1, H_kv, M, D]`` the detailed keys of tokens ``index`` (LongTensor ``[M]``; None: every token)."""
        if index is None:
            index = torch.arange(sum(self.steps), device=self.device)
        if self.keys is not None:
            return self.keys.index_select(2, index.to(self.keys.device))
        return self.read_keys(index)
    evicted: frozenset[int] = frozenset()

    @property
    def step_of_token(self) -> torch.Tensor:
        """``[T]`` the step each token of the detailed cache belongs to."""
        return torch.repeat_interleave(torch.arange(len(self.steps), device=self.device),
                                       torch.tensor(self.steps, device=self.device))


@dataclass(frozen=True)
class RetrievalRule:
    """A way to score steps; subclasses set ``name`` and return one score per step (higher: keep)."""

    name: ClassVar[str] = ""

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        """``[S]`` one score per step of the stream (float, on any device)."""
        raise NotImplementedError


@dataclass(frozen=True)
class MeanKeyMatch(RetrievalRule):
    """ReKV's rule: each step's mean key . the question's mean query, summed over heads."""

    name: ClassVar[str] = "rekv"

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        means = seen.step_means.float()
        hkv, dim = means.shape[1], means.shape[-1]
        mean_query = seen.queries.float().reshape(1, hkv, -1, dim).mean(dim=2).to(means.device)
        return torch.einsum("bhsd,bhd->bs", means, mean_query)[0]


@dataclass(frozen=True)
class MostRecent(RetrievalRule):
    """The latest steps first (SimpleStream: answer from the last frames only)."""

    name: ClassVar[str] = "recent"

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        return torch.arange(len(seen.steps), dtype=torch.float32)


@dataclass(frozen=True)
class AttentionShare(RetrievalRule):
    """Each step's share of the question's whole-cache attention, accumulated over layers (module docstring).

    Per query head ``h`` and prompt token ``i``, ``a[h, i, s]`` is the softmax weight the step's tokens get
    among the detailed cache's keys; a layer scores ``sum_h max_i a[h, i, s]``, normalised to sum to 1, and the
    score returned adds the layers before it. A step longer than ``keys_per_step`` tokens is represented by
    that many of its keys, evenly spaced, so one question costs ``O(prompt x steps x keys_per_step)`` per
    layer: linear in the number of frames whatever a frame's token count.
    """

    name: ClassVar[str] = "attention"
    keys_per_step: int = 16

    def __post_init__(self) -> None:
        check_int(self.keys_per_step, "AttentionShare: keys_per_step")

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        keys, steps = self.sampled_keys(seen)
        hkv, tokens, dim = keys.shape
        queries = seen.queries[0].float().to(keys.device)
        group, prompt = queries.shape[0] // hkv, queries.shape[1]
        queries = queries.reshape(hkv, group * prompt, dim)  # rows: (query head in the group, prompt token)
        ends = torch.tensor(list(accumulate(steps)), device=keys.device) - 1
        rows = max(1, SCORE_BLOCK // max(hkv * tokens, 1))
        shares = []
        for start in range(0, group * prompt, rows):
            weights = torch.baddbmm(keys.new_zeros(()), queries[:, start:start + rows], keys.transpose(1, 2),
                                    beta=0, alpha=seen.scale).softmax(-1)  # [H_kv, r, T]
            at_ends = weights.cumsum(-1, dtype=torch.float64)[..., ends]  # share of the tokens up to each step's end
            shares.append(torch.diff(at_ends, dim=-1, prepend=at_ends.new_zeros(*at_ends.shape[:2], 1)))
        layer = torch.cat(shares, 1).reshape(hkv, group, prompt, -1).amax(2).sum((0, 1)).float()  # [S]
        layer = layer / layer.sum().clamp_min(torch.finfo(layer.dtype).tiny)
        total = seen.memory.get(self.name)
        total = layer if total is None else total.to(layer.device) + layer
        seen.memory[self.name] = total
        return total

    def sampled_keys(self, seen: LayerQuestion) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``([H_kv, T', D] float keys, the token count of each step among them)``: every key of a step of at
        most ``keys_per_step`` tokens, else ``keys_per_step`` of them evenly spaced (from the steps' summaries
        when they hold these keys, else from the detailed keys)."""
        most = self.keys_per_step
        counts = tuple(min(length, most) for length in seen.steps)
        samples = seen.samples
        if samples is not None and samples.shape[3] == most:
            index = torch.cat([step * most + torch.arange(count) for step, count in enumerate(counts)]
                              or [torch.zeros(0, dtype=torch.long)])
            flat = samples[0].flatten(1, 2)  # [H_kv, S * most, D]
            return flat.index_select(1, index.to(flat.device)).float(), counts
        if seen.keys is not None and max(seen.steps, default=0) <= most:
            return seen.keys[0].float(), seen.steps
        picks, start = [], 0
        for length, count in zip(seen.steps, counts):
            picks.append(start + torch.arange(count) * length // count)
            start += length
        index = torch.cat(picks or [torch.zeros(0, dtype=torch.long)]).to(seen.device)
        return seen.detailed_keys(index)[0].float(), counts


RETRIEVAL_RULES: dict[str, RetrievalRule] = {rule.name: rule for rule in (AttentionShare(), MeanKeyMatch(),
                                                                          MostRecent())}
DEFAULT_RETRIEVAL = AttentionShare.name


def retrieval_rule(name: str) -> RetrievalRule:
    """The rule registered as ``name``; a one-line ConfigurationError naming the others if there is none."""
    if not isinstance(name, str) or name not in RETRIEVAL_RULES:
        raise ConfigurationError(f"unknown retrieval rule {name!r}; choose one of {', '.join(RETRIEVAL_RULES)}")
    return RETRIEVAL_RULES[name]


@dataclass(frozen=True)
class Retrieval:
    """Answer from the ``steps`` steps per layer that ``rule`` scores highest, plus the first ``keep_tokens``
    tokens of the stream, which are always kept."""

    steps: int
    keep_tokens: int = 0
    rule: RetrievalRule = AttentionShare()

    def __post_init__(self) -> None:
        check_int(self.steps, "Retrieval: steps")
        check_int(self.keep_tokens, "Retrieval: keep_tokens", minimum=0)
        if not isinstance(self.rule, RetrievalRule):
            raise ConfigurationError(f"Retrieval: rule must be a RetrievalRule, got {type(self.rule).__name__}")

    def choose(self, seen: LayerQuestion) -> list[int]:
        """The steps (ascending) answered from at ``seen``'s layer, besides the kept tokens."""
        ends = list(accumulate(seen.steps))
        outside = [s for s, end in enumerate(ends)  # steps not wholly kept anyway, and still held
                   if end > self.keep_tokens and s not in seen.evicted]
        if len(outside) <= self.steps:
            return outside
        scores = self.rule.scores(seen).float()
        best = scores[torch.tensor(outside, device=scores.device)].topk(self.steps).indices.tolist()
        return sorted(outside[i] for i in best)

    def tokens(self, seen: LayerQuestion) -> torch.Tensor:
        """Token indices ``[M]`` (ascending, on the keys' device) of the context at ``seen``'s layer."""
        ends = list(accumulate(seen.steps))
        keep = torch.zeros(ends[-1] if ends else 0, dtype=torch.bool)
        keep[: self.keep_tokens] = True
        for s in self.choose(seen):
            keep[ends[s] - seen.steps[s]: ends[s]] = True
        return keep.nonzero().squeeze(1).to(seen.device)
