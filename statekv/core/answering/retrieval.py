"""Question-time retrieval: which steps (frames) of the detailed cache a question is answered from.

A rule scores every step of the stream at one layer from what any model gives: the question's queries at that
layer, each step's summaries (its mean key and a few of its keys, kept beside the detailed cache in the model's
dtype, :class:`statekv.core.storage.layer_storage.StepSummaries`) and the step boundaries; scoring never reads the detailed
cache itself. :class:`Retrieval` keeps the
first ``keep_tokens`` tokens and the ``steps`` best-scored steps (top-k taken once, here), in time order.

Rules (registered here in `statekv.settings.methods.RETRIEVAL_RULES`, chosen by name with ``retrieval=``):

``attention`` (:class:`AttentionShare`, the default)
    The share of each query head's attention that a step would get if the question attended to the whole cache
    (softmax over every key, RoPE applied as in attention), the largest over the question's tokens, summed over
    heads and accumulated over the layers answered so far: a step an earlier layer looked up stays in at later
    layers, whose tokens carry what that look-up found.
``rekv`` (:class:`MeanKeyMatch`, ReKV's)
    Mean key of the step . mean query of the question, summed over heads (Di et al., ICLR 2025).
``recent`` (:class:`MostRecent`)
    The last steps only: SimpleStream's baseline (answer from the last N frames).

Hierarchical retrieval: a question's cost must not grow with the stream's age, so once a stream holds more
segments (``SEGMENT_STEPS`` steps each, :attr:`statekv.core.storage.layer_storage.LayerStorage.segments`) than twice the steps
asked for, a rule that allows it (``hierarchical``) scores only the steps of a few segments: the ``2 x steps``
segments whose keys could match the question best (Quest's bound, Tang et al., ICML 2024: per channel, the query
times the segment's smallest or largest key, whichever is larger, summed: no key of the segment scores above it;
normalised over the segments per query head and token, the largest over the question's tokens, summed over
heads; ``rekv`` ranks segments by its own score of their mean key), the segments of the steps earlier layers chose,
and the open segment (the latest steps). ``attention`` then shares the question's attention among those steps'
keys and the kept ones', the other segments each standing in its softmax for its sampled keys that are not kept
by the mean key of its steps that are not kept (weighted by their count), every key once: one question costs
``O(segments + steps x SEGMENT_STEPS)`` per layer instead of ``O(steps of the stream)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, ClassVar, NamedTuple

import torch

from ...errors import ConfigurationError, InputError
from ...settings.methods import RETRIEVAL_RULES
from ...settings.values import check_int
from ..cache.step_runs import StepRuns
from ..positions.rotation import rotate
from .segments import (evicted_segments, partly_evicted, segment_tokens, segments_to_choose,
                       segments_without_choices)

# Query rows x keys of one block of scores: bounds the scratch memory of AttentionShare on long streams.
SCORE_BLOCK = 1 << 22
SEGMENTS_PER_STEP = 2  # segments a hierarchical question scores the steps of, per step it retrieves


class Held(NamedTuple):
    """Which of a stream's steps a `LayerQuestion` holds, when not every step it streamed: ``steps`` LongTensor
    ``[S]`` (host, ascending), the stream's step each of its steps is; ``firsts`` ``[S]`` the stream's token each
    begins at; ``complete``: the complete segments of the stream the question covers (its own ``segments`` are
    those of them it holds)."""

    steps: torch.Tensor
    firsts: torch.Tensor
    complete: int


@dataclass(frozen=True)
class LayerQuestion:
    """What a rule sees at one layer when a question's queries reach it.

    layer: the layer's index. queries: ``[1, Hq, Q, D]`` the prompt's queries (RoPE applied). keys:
    ``[1, H_kv, T, D]`` the stream's detailed keys (RoPE applied), or None when answering (rules score from the
    summaries; :meth:`detailed_keys` reads the keys if a rule needs them). step_means: ``[1, H_kv, S, D]`` each
    step's mean key. steps: the token count of each of the ``S`` steps. scale: the attention's softmax scale.
    memory: scratch shared by the layers of one question (rules that look across layers keep their running
    state there, under their own name). samples: ``[1, H_kv, S, N, D]`` keys of each step, evenly spaced
    (the first ``min(tokens, N)`` of a step are real; see :func:`statekv.core.storage.layer_storage.sample_index`), or None.
    read_keys: reads the detailed keys of tokens ``[M]`` -> ``[1, H_kv, M, D]`` (when ``keys`` is None).
    evicted: steps given up under a cache limit (never chosen). segments: ``[1, H_kv, G, 3 D]`` the index of the
    complete segments of ``segment_steps`` steps (minimum, maximum and sum of their keys), or None. candidates:
    LongTensor ``[C]`` (ascending) of the only steps a rule scores (None: every step); others: for the softmax of
    ``attention``, what stands for the keys outside them: ``(keys [1, H_kv, E, D], log weights [E])``. turns:
    LongTensor ``[S]`` (host), the positions each step's keys are rotated by before they are scored, so that they
    are compared with the question where it reads them rather than where they were encoded (bounded positions
    past the range, `statekv.core.positions.placing.StreamPositions.scoring_turns`), or None: as stored;
    segment_turns: ``[G]`` the same for each complete segment (its queries turned the other way); frequencies: the
    rotary frequencies ``[R / 2]`` the turns rotate with. held: None, or which of the stream's steps these are.
    segment_tokens: ``[G]`` (float, host) the tokens each segment's sum is over, when not every token of its steps
    (`segments_to_choose`), or None.

    A stream that evicts (a cache limit) gives its wholly evicted segments back, and a question over it sees only
    the steps it holds (the kvpress way: a rule scores what it is given): ``steps``, ``starts``, ``step_means``,
    ``samples``, ``segments``, ``turns`` and ``segment_turns`` are those of the held steps and segments, numbered
    from 0 as if nothing else had been streamed (a segment evicted in part is held whole, its evicted steps in
    ``evicted``, their summaries zeros), token indices (``read_keys``, ``keys``) counted over them alone, and
    ``held`` says which steps of the stream they are (`Retrieval` maps its choice back). A rule never needs it.
    A rule ranks segments over ``segments_to_choose(seen, first)``: a segment evicted in part indexed over its held
    steps alone (``segment_tokens`` their tokens).
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
    evicted: StepRuns = field(default_factory=StepRuns, compare=False)
    segments: torch.Tensor | None = field(default=None, compare=False)
    segment_steps: int = 0
    candidates: torch.Tensor | None = field(default=None, compare=False)
    others: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)
    starts: torch.Tensor | None = field(default=None, compare=False)
    turns: torch.Tensor | None = field(default=None, compare=False)
    segment_turns: torch.Tensor | None = field(default=None, compare=False)
    frequencies: torch.Tensor | None = field(default=None, compare=False)
    held: Held | None = field(default=None, compare=False)
    segment_tokens: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.evicted, StepRuns):  # any set of steps
            object.__setattr__(self, "evicted", StepRuns(self.evicted))

    def turned(self, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[..., H_kv, M, D]`` of the steps ``steps`` (LongTensor ``[M]``) rotated by their turns (as they
        are when there are none)."""
        if self.turns is None:
            return keys
        flat = keys.reshape(-1, *keys.shape[-3:]) if keys.dim() > 3 else keys[None]
        delta = self.turns[steps.cpu()].to(keys.device).expand(*flat.shape[:2], -1)
        return rotate(flat, delta, self.frequencies).reshape(keys.shape)

    @property
    def step_starts(self) -> torch.Tensor:
        """LongTensor ``[S + 1]`` on the host: each step's first token, then the end (given, or from ``steps``)."""
        if self.starts is not None:
            return self.starts
        cached = self.memory.get("starts")
        if cached is None or cached.shape[0] != len(self.steps) + 1:
            cached = self.memory["starts"] = torch.tensor([0, *accumulate(self.steps)], dtype=torch.long)
        return cached

    @property
    def scored(self) -> int:
        """How many steps a rule scores: the candidates, or every step."""
        return len(self.steps) if self.candidates is None else self.candidates.shape[0]

    @property
    def step_of_token(self) -> torch.Tensor:
        """``[T]`` the step each token of the detailed cache belongs to."""
        return torch.repeat_interleave(torch.arange(len(self.steps), device=self.device),
                                       torch.tensor(self.steps, device=self.device))


@dataclass(frozen=True)
class RetrievalRule:
    """A way to score steps; subclasses set ``name`` and return one score per step (higher: keep)."""

    name: ClassVar[str] = ""
    hierarchical: ClassVar[bool] = True  # may score only the steps of the best segments

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        """One score per step of the stream, or per candidate when ``seen.candidates`` is set (float, on any
        device)."""
        raise NotImplementedError

    def segment_scores(self, seen: LayerQuestion) -> torch.Tensor:
        """``[G]`` one score per complete segment of ``seen.segments`` (default: `segment_bounds`)."""
        return segment_bounds(seen)


@dataclass(frozen=True)
class MeanKeyMatch(RetrievalRule):
    """ReKV's rule: each step's mean key . the question's mean query, summed over heads."""

    name: ClassVar[str] = "rekv"

    def scores(self, seen: LayerQuestion) -> torch.Tensor:
        means = seen.step_means
        if seen.candidates is not None:
            means = means.index_select(2, seen.candidates.to(means.device))
        scored = torch.arange(len(seen.steps)) if seen.candidates is None else seen.candidates
        means = seen.turned(means.float(), scored)
        hkv, dim = means.shape[1], means.shape[-1]
        mean_query = seen.queries.float().reshape(1, hkv, -1, dim).mean(dim=2).to(means.device)
        return torch.einsum("bhsd,bhd->bs", means, mean_query)[0]

    def segment_scores(self, seen: LayerQuestion) -> torch.Tensor:
        """The same score of each segment's mean key (its keys' sum over its tokens)."""
        index = seen.segments.float()
        hkv, dim = index.shape[1], index.shape[-1] // 3
        tokens = segment_tokens(seen, torch.arange(index.shape[2])).to(index.device)
        means = segment_means(index, tokens[None, None, :, None])
        if seen.segment_turns is not None:
            means = rotate(means, seen.segment_turns.to(means.device).expand(*means.shape[:2], -1), seen.frequencies)
        mean_query = seen.queries.float().reshape(1, hkv, -1, dim).mean(dim=2).to(means.device)
        return torch.einsum("bhsd,bhd->bs", means, mean_query)[0]


@dataclass(frozen=True)
class MostRecent(RetrievalRule):
    """The latest steps first (SimpleStream: answer from the last frames only)."""

    name: ClassVar[str] = "recent"
    hierarchical: ClassVar[bool] = False  # the latest steps need no index

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
        if seen.turns is not None:
            scored = torch.arange(len(seen.steps)) if seen.candidates is None else seen.candidates.cpu()
            keys = seen.turned(keys, scored.repeat_interleave(torch.tensor(steps, dtype=torch.long)))
        hkv, tokens, dim = keys.shape
        queries = seen.queries[0].float().to(keys.device)
        group, prompt = queries.shape[0] // hkv, queries.shape[1]
        queries = queries.reshape(hkv, group * prompt, dim)  # rows: (query head in the group, prompt token)
        ends = torch.tensor(list(accumulate(steps)), device=keys.device) - 1
        others = None
        if seen.others is not None:  # what stands for the keys outside the candidates, in the softmax
            other_keys, weights = seen.others
            others = (other_keys[0].float().to(keys.device), weights.float().to(keys.device))
        gone = None
        if seen.candidates is None and seen.evicted:  # their summaries were given back: out of the softmax
            owners = torch.arange(len(steps)).repeat_interleave(torch.tensor(steps, dtype=torch.long))
            gone = seen.evicted.mask(len(seen.steps))[owners].to(keys.device)
        rows = max(1, SCORE_BLOCK // max(hkv * (tokens + (0 if others is None else others[1].shape[0])), 1))
        shares = []
        for start in range(0, group * prompt, rows):
            block = queries[:, start:start + rows]
            logits = torch.baddbmm(keys.new_zeros(()), block, keys.transpose(1, 2), beta=0, alpha=seen.scale)
            if gone is not None:
                logits = logits.masked_fill(gone, -math.inf)
            if others is not None:
                extra = torch.baddbmm(keys.new_zeros(()), block, others[0].transpose(1, 2), beta=0,
                                      alpha=seen.scale) + others[1]
                logits = torch.cat([logits, extra], -1)
            weights = logits.softmax(-1)[..., :tokens]  # [H_kv, r, T]
            at_ends = weights.cumsum(-1, dtype=torch.float64)[..., ends]  # share of the tokens up to each step's end
            shares.append(torch.diff(at_ends, dim=-1, prepend=at_ends.new_zeros(*at_ends.shape[:2], 1)))
        layer = torch.cat(shares, 1).reshape(hkv, group, prompt, -1).amax(2).sum((0, 1)).float()  # [scored]
        layer = layer / layer.sum().clamp_min(torch.finfo(layer.dtype).tiny)
        total = seen.memory.get(self.name)
        if total is None:
            total = torch.zeros(len(seen.steps), dtype=layer.dtype, device=layer.device)
            seen.memory[self.name] = total
        total = total.to(layer.device)
        seen.memory[self.name] = total
        if seen.candidates is None:
            total += layer
            return total.clone()
        index = seen.candidates.to(layer.device)
        total.index_add_(0, index, layer)
        return total[index]

    def sampled_keys(self, seen: LayerQuestion) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``([H_kv, T', D] float keys, the token count of each scored step among them)``: every key of a step of
        at most ``keys_per_step`` tokens, else ``keys_per_step`` of them evenly spaced (from the steps' summaries
        when they hold these keys, else from the detailed keys), for the candidates when there are some."""
        most = self.keys_per_step
        chosen = range(len(seen.steps)) if seen.candidates is None else seen.candidates.tolist()
        lengths = [seen.steps[s] for s in chosen]
        counts = tuple(min(length, most) for length in lengths)
        samples = seen.samples
        if samples is not None and samples.shape[3] == most:
            if seen.candidates is not None:
                samples = samples.index_select(2, seen.candidates.to(samples.device))
            slots = torch.arange(len(counts) * most).view(-1, most)
            index = slots[torch.arange(most) < torch.tensor(counts, dtype=torch.long).view(-1, 1)]  # real keys only
            flat = samples[0].flatten(1, 2)  # [H_kv, scored * most, D]
            return flat.index_select(1, index.to(flat.device)).float(), counts
        if seen.candidates is None and seen.keys is not None and max(seen.steps, default=0) <= most:
            return seen.keys[0].float(), seen.steps
        starts = [0, *accumulate(seen.steps)]
        picks = [starts[step] + torch.arange(count) * length // count
                 for step, length, count in zip(chosen, lengths, counts)]
        index = torch.cat(picks or [torch.zeros(0, dtype=torch.long)]).to(seen.device)
        return seen.detailed_keys(index)[0].float(), counts


RETRIEVAL_RULES.update((rule.name, rule) for rule in (AttentionShare(), MeanKeyMatch(), MostRecent()))


@dataclass(frozen=True)
class Retrieval:
    """Answer from the ``steps`` steps per layer that ``rule`` scores highest, plus the first ``keep_tokens``
    tokens of the stream, which are always kept. Past ``steps`` segments, a hierarchical rule scores only the
    steps of the best segments (module docstring)."""

    steps: int
    keep_tokens: int = 0
    rule: RetrievalRule = AttentionShare()

    def __post_init__(self) -> None:
        check_int(self.steps, "Retrieval: steps")
        check_int(self.keep_tokens, "Retrieval: keep_tokens", minimum=0)
        if not isinstance(self.rule, RetrievalRule):
            raise ConfigurationError(f"Retrieval: rule must be a RetrievalRule, got {type(self.rule).__name__}")

    def choose(self, seen: LayerQuestion) -> list[int]:
        """The steps (ascending, the stream's) answered from at ``seen``'s layer, besides the kept tokens."""
        chosen = self._choose_among(seen)
        return chosen if seen.held is None else seen.held.steps[chosen].tolist()

    def _choose_among(self, seen: LayerQuestion) -> list[int]:
        """The steps (ascending) of ``seen`` answered from at its layer (`choose`, numbered as ``seen`` numbers
        them; private, so a subclass's fields never shadow it)."""
        count = len(seen.steps)
        first = int(torch.searchsorted(seen.step_starts[1:], self.keep_tokens, right=True))  # before: wholly kept
        held = count - first - seen.evicted.count_from(first)
        if held <= self.steps:
            return [s for s in range(first, count) if s not in seen.evicted]
        candidates = self.candidates(seen, first)
        if candidates is None:  # every step scored
            outside = [s for s in range(first, count) if s not in seen.evicted]
            scores = self.scored(seen, count, "step of the stream")
            best = scores[torch.tensor(outside, device=scores.device)].topk(self.steps).indices.tolist()
            return sorted(outside[i] for i in best)
        if seen.evicted:
            candidates = candidates[~seen.evicted.mask(count)[candidates]]
        seen = replace(seen, candidates=candidates, others=self._others(seen, candidates, first))
        scores = self.scored(seen, candidates.shape[0], "candidate step (seen.candidates)")
        best = scores.topk(min(self.steps, candidates.shape[0])).indices.cpu()
        return sorted(candidates[best].tolist())

    def scored(self, seen: LayerQuestion, count: int, what: str) -> torch.Tensor:
        """The rule's scores as floats, refused (one-line `InputError`) unless ``[count]``, one per ``what``."""
        scores = self.rule.scores(seen)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (count,):
            got = f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise InputError(f"{type(self.rule).__name__}.scores must return one score per {what}, a tensor of "
                             f"shape ({count},); got {got}")
        return scores.float()

    def candidates(self, seen: LayerQuestion, first: int) -> torch.Tensor | None:
        """The steps scored at this layer when the stream holds more complete segments than `SEGMENTS_PER_STEP` x
        ``steps`` (None: every step): those of that many best segments, of the segments earlier layers' best steps
        lie in, and of the open segment, from step ``first`` on (LongTensor ``[C]``, ascending, on the host)."""
        index, per_segment = seen.segments, seen.segment_steps
        expanded = SEGMENTS_PER_STEP * self.steps
        if not self.rule.hierarchical or index is None or per_segment < 1:
            return None
        if (index.shape[2] if seen.held is None else seen.held.complete) <= expanded:  # the stream's, held or not
            return None
        complete = index.shape[2]
        empty = segments_without_choices(seen, complete, first)
        if complete - int(empty.sum()) <= expanded:  # every segment left with a step to choose
            best = set((~empty).nonzero().squeeze(1).tolist())
        else:
            # never ranked: a segment with no step to choose (kept whole, evicted) would take the place of one that
            # has some, and a layer could read fewer than ``steps`` steps while more are held
            scores = self.rule.segment_scores(segments_to_choose(seen, first, split=True))
            scores = scores.masked_fill(empty.to(scores.device), -math.inf)
            best = set(scores.topk(expanded).indices.tolist())
        total = seen.memory.get(self.rule.name)
        if isinstance(total, torch.Tensor) and total.shape[0] == len(seen.steps):
            earlier = total.topk(min(self.steps, total.shape[0])).indices.tolist()
            best.update(s // per_segment for s in earlier
                        if s // per_segment < complete and not empty[s // per_segment])
        ranges = [torch.arange(g * per_segment, (g + 1) * per_segment) for g in sorted(best)]
        ranges.append(torch.arange(complete * per_segment, len(seen.steps)))
        steps = torch.cat(ranges)
        return steps[steps >= first]

    def _others(self, seen: LayerQuestion, candidates: torch.Tensor, first: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What stands in the ``attention`` rule's softmax for the keys outside ``candidates``, each once: the kept
        steps' sampled keys (weight 1 each) and every other complete segment's mean key over its steps that are
        not kept, weighted by their sampled keys (log weights; a segment kept whole is its kept steps' keys alone)."""
        if not isinstance(self.rule, AttentionShare) or seen.segments is None:
            return None
        per_segment, most = seen.segment_steps, self.rule.keys_per_step
        index = seen.segments[0]  # [H_kv, G, 3 D]
        expanded = torch.zeros(index.shape[1], dtype=torch.bool)
        expanded[candidates[candidates < index.shape[1] * per_segment] // per_segment] = True
        gone = evicted_segments(seen, index.shape[1])
        split, end = first // per_segment, (first // per_segment + 1) * per_segment
        # a segment whose first steps are kept: they stand for themselves below, its mean key for the others
        straddles = bool(first % per_segment) and seen.samples is not None and split < index.shape[1]
        if first and seen.samples is not None:
            expanded[:split] = True
        if straddles and gone is not None and (
                seen.evicted.count_from(first) - seen.evicted.count_from(end) == end - first):
            gone = gone.clone()  # its steps not kept were all evicted: nothing of it left to stand for
            gone[split] = True
        rest = (~expanded if gone is None else ~expanded & ~gone).nonzero().squeeze(1)
        parts = partly_evicted(seen, first, index.shape[1])  # stand for their steps held alone
        straddles = straddles and split not in parts
        keys, weights = [], []
        if rest.numel():
            starts, choosing = seen.step_starts, segments_to_choose(seen, first)
            tokens = segment_tokens(choosing, rest).to(index.device)
            means = segment_means(choosing.segments[0][:, rest.to(index.device)].float(), tokens[None, :, None])
            if straddles:
                means = _without_kept(seen, index, rest, means, first)
            if seen.segment_turns is not None:
                means = rotate(means[None], seen.segment_turns[rest].to(means.device).expand(1, means.shape[0], -1),
                               seen.frequencies)[0]
            keys.append(means)
            counts = _sampled_per_segment(seen, index.shape[1], most)[rest]
            if straddles:
                held = torch.diff(starts[first:end + 1]).double().clamp(max=most).sum()
                counts = torch.where(rest == split, held, counts)
            for at in (torch.isin(rest, torch.tensor(list(parts), dtype=torch.long))).nonzero().squeeze(1).tolist():
                counts[at] = torch.diff(starts)[parts[int(rest[at])]].double().clamp(max=most).sum()
            weights.append(counts.log().float())
        kept = range(first)  # the prompt prefix and sinks: never candidates
        if kept and seen.samples is not None:
            samples = seen.samples.index_select(2, torch.tensor(kept, device=seen.samples.device))[0]
            counts = [min(seen.steps[s], samples.shape[2]) for s in kept]
            owners = torch.tensor(kept, dtype=torch.long).repeat_interleave(torch.tensor(counts, dtype=torch.long))
            keys.append(seen.turned(torch.cat([samples[:, i, :count] for i, count in enumerate(counts)], 1).float(),
                                    owners))
            weights.append(torch.zeros(sum(counts)))
        if not keys:
            return None
        return (torch.cat([k.to(keys[0].device) for k in keys], 1)[None],
                torch.cat([w.to(keys[0].device) for w in weights]))

    def tokens(self, seen: LayerQuestion) -> torch.Tensor:
        """Token indices ``[M]`` (ascending, on the keys' device) of the context at ``seen``'s layer."""
        starts = seen.step_starts
        keep = min(self.keep_tokens, int(starts[-1]))
        parts = [torch.arange(keep)]
        chosen = torch.tensor(self.choose(seen), dtype=torch.long)  # the stream's steps
        held = chosen if seen.held is None else torch.searchsorted(seen.held.steps, chosen)  # numbered as seen's
        firsts = starts[held] if seen.held is None else seen.held.firsts[held]  # the stream's tokens
        for first, length in zip(firsts.tolist(), (starts[held + 1] - starts[held]).tolist()):
            parts.append(torch.arange(max(first, keep), first + length))
        return torch.cat(parts).to(seen.device)


def _sampled_per_segment(seen: LayerQuestion, segments: int, most: int) -> torch.Tensor:
    """``[G]`` the sampled keys of each complete segment (float64), computed once per question."""
    key = ("sampled per segment", most)
    counts = seen.memory.get(key)
    if counts is None or counts.shape[0] < segments:
        lengths = torch.diff(seen.step_starts[: segments * seen.segment_steps + 1]).double().clamp(max=most)
        counts = seen.memory[key] = lengths.reshape(segments, seen.segment_steps).sum(1)
    return counts[:segments]


def segment_means(index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[..., G, D]`` each segment's mean key from its index rows ``[..., G, 3 D]`` (float32) and token counts
    ``tokens`` (broadcast as ``[..., G, 1]``): the sum of its keys over them, or, in a channel where that sum
    overflowed the model's dtype (float16: 4,096 tokens of keys above 16, as a key bias gives), the middle of the
    segment's smallest and largest keys there."""
    dim = index.shape[-1] // 3
    means = index[..., 2 * dim:] / tokens
    return torch.where(means.isfinite(), means, (index[..., :dim].float() + index[..., dim:2 * dim].float()) / 2)


def _without_kept(seen: LayerQuestion, index: torch.Tensor, rest: torch.Tensor, means: torch.Tensor,
                  first: int) -> torch.Tensor:
    """``means`` ``[H_kv, len(rest), D]`` (the mean keys of segments ``rest`` from their rows of ``index``
    ``[H_kv, G, 3 D]``) with the segment that step ``first`` lies in, if among them, standing for its steps from
    ``first`` on alone: its keys' sum less its kept steps' (their mean keys times their lengths), over their tokens
    (where that sum overflowed the model's dtype, the mean `segment_means` gave)."""
    per_segment, dim = seen.segment_steps, index.shape[-1] // 3
    split = first // per_segment
    at = (rest == split).nonzero().squeeze(1)
    if not at.numel():
        return means
    starts, device = seen.step_starts, index.device
    lengths = torch.diff(starts[split * per_segment:first + 1]).float().to(device)  # the kept steps' tokens
    kept = seen.step_means[0, :, split * per_segment:first].float().to(device) * lengths[None, :, None]
    held = (index[:, split, 2 * dim:].float() - kept.sum(1)) / float(starts[(split + 1) * per_segment] - starts[first])
    means = means.clone()
    means[:, int(at)] = torch.where(held.isfinite(), held, means[:, int(at)])
    return means


def segment_bounds(seen: LayerQuestion) -> torch.Tensor:
    """``[G]`` how well each complete segment could match the question: per query head and prompt token, the
    bound no key of the segment can score above (Quest's: ``sum_d max(q_d min_d, q_d max_d)``), softmaxed over the
    segments; the largest over the prompt's tokens, summed over heads. With ``segment_turns``, a segment's bound
    is taken with the queries turned back by its turn (``q . R(t) k = R(-t) q . k``), so it holds for its keys
    turned by it: one rotation of the queries per distinct turn."""
    index = seen.segments[0].float()  # [H_kv, G, 3 D]
    hkv, dim = index.shape[0], index.shape[-1] // 3
    queries = seen.queries[0].float().to(index.device)
    queries = queries.reshape(hkv, -1, dim)  # [H_kv, rows, D]
    lowest, highest = index[..., :dim], index[..., dim:2 * dim]
    if seen.segment_turns is None:
        bound = queries.clamp(min=0) @ highest.transpose(1, 2) + queries.clamp(max=0) @ lowest.transpose(1, 2)
    else:
        bound = queries.new_empty(hkv, queries.shape[1], index.shape[1])
        turns = seen.segment_turns.cpu()
        for turn in turns.unique().tolist():
            group = (turns == turn).nonzero().squeeze(1).to(index.device)
            back = rotate(queries[None], torch.full((1, *queries.shape[:2]), -turn, device=queries.device),
                          seen.frequencies)[0]
            bound[:, :, group] = (back.clamp(min=0) @ highest[:, group].transpose(1, 2)
                                  + back.clamp(max=0) @ lowest[:, group].transpose(1, 2))
    gone = evicted_segments(seen, index.shape[1])
    if gone is not None:  # given back: out of the softmax too
        bound = bound.masked_fill(gone.to(bound.device), -math.inf)
    return (bound * seen.scale).softmax(-1).amax(1).sum(0)
