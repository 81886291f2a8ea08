"""The segment index as a question over a stream that evicts ranks it: which segments were evicted whole, which in
part (`partly_evicted`), which hold no step a question may choose, and each segment indexed over the steps it
still stands for (`segments_to_choose`): a segment ranks for keys a question can still read, never for evicted
ones (docs/engine.md, "Hierarchical retrieval")."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .retrieval import LayerQuestion


def evicted_segments(seen: LayerQuestion, complete: int) -> torch.Tensor | None:
    """``[G]`` bool: which of the ``complete`` segments had every step evicted (their index rows given back, see
    `statekv.core.storage.limits`), or None when no step was; made once per question."""
    if not seen.evicted or seen.segment_steps < 1:
        return None
    key = f"evicted segments of {complete}"
    made = seen.memory.get(key)
    if made is None:
        made = seen.memory[key] = torch.zeros(complete, dtype=torch.bool)
        for start, end in seen.evicted.runs():  # the segments a run covers whole
            made[-(-start // seen.segment_steps):min(end // seen.segment_steps, complete)] = True
    return made


def partly_evicted(seen: LayerQuestion, first: int, complete: int) -> dict[int, torch.Tensor]:
    """The ``complete`` segments some but not all of whose steps were evicted: segment -> the steps it stands for
    (LongTensor, ascending): those held from ``first`` on, or where none is, those held (kept); made once per
    question."""
    per_segment = seen.segment_steps
    if not seen.evicted or per_segment < 1:
        return {}
    key = ("partly evicted", first, complete, len(seen.steps))
    made = seen.memory.get(key)
    if made is None:
        touched = set()
        for start, end in seen.evicted.runs():  # the segments between a run's two ends are evicted whole
            if start < complete * per_segment:
                touched.update((start // per_segment, (min(end, complete * per_segment) - 1) // per_segment))
        made = seen.memory[key] = {}
        for segment in sorted(touched):
            held = [s for s in range(segment * per_segment, (segment + 1) * per_segment) if s not in seen.evicted]
            steps = [s for s in held if s >= first] or held  # none to choose: its kept keys, in the softmax alone
            if steps:
                made[segment] = torch.tensor(steps, dtype=torch.long)
    return made


def segments_to_choose(seen: LayerQuestion, first: int, split: bool = False) -> LayerQuestion:
    """``seen`` with each complete segment evicted in part (`partly_evicted`) indexed over its steps held from
    ``first`` on alone, so that it ranks for keys a question can still read: ``segments`` (float) their keys' sum
    from their mean keys, and their keys' minimum and maximum from their sampled keys where those are every key of
    theirs (else the segment's own, still a bound on them); ``segment_tokens`` their tokens. ``split``: the segment
    step ``first`` lies in too, its sum less its kept steps' (their mean keys times their lengths; its minimum and
    maximum its own, a bound on its other steps). ``seen`` itself when no segment changes."""
    complete = 0 if seen.segments is None else seen.segments.shape[2]
    parts, per_segment = partly_evicted(seen, first, complete), seen.segment_steps
    at = first // per_segment if split and per_segment > 0 and first % per_segment else complete
    kept_out = at < complete and at not in parts and not segments_without_choices(seen, complete, first)[at]
    if not parts and not kept_out:
        return seen
    index = seen.segments.to(torch.float32, copy=True)  # [1, H_kv, G, 3 D]: never the stream's own
    dim, lengths = index.shape[-1] // 3, torch.diff(seen.step_starts)
    tokens = segment_tokens(seen, torch.arange(index.shape[2])).clone()
    if kept_out:
        kept = torch.arange(at * per_segment, first)
        means = seen.step_means[0].index_select(1, kept.to(index.device)).float()
        index[0, :, at, 2 * dim:] -= (means * lengths[kept].float().to(index.device)[None, :, None]).sum(1)
        tokens[at] -= float(lengths[kept].sum())
    for segment, steps in parts.items():
        length = lengths[steps]
        means = seen.step_means[0].index_select(1, steps.to(index.device)).float()  # [H_kv, n, D]
        index[0, :, segment, 2 * dim:] = (means * length.float().to(index.device)[None, :, None]).sum(1)
        tokens[segment] = float(length.sum())
        if seen.samples is not None and int(length.max()) <= seen.samples.shape[3]:
            picked = seen.samples[0].index_select(1, steps.to(seen.samples.device))  # [H_kv, n, N, D]
            held = torch.cat([picked[:, at, :count] for at, count in enumerate(length.tolist())], 1).float()
            index[0, :, segment, :dim], index[0, :, segment, dim:2 * dim] = held.amin(1), held.amax(1)
    return replace(seen, segments=index, segment_tokens=tokens)


def segment_tokens(seen: LayerQuestion, segments: torch.Tensor) -> torch.Tensor:
    """``[len(segments)]`` (float, host) the tokens each of the complete ``segments`` (LongTensor) is indexed over:
    ``seen.segment_tokens``', or every token of its steps."""
    if seen.segment_tokens is not None:
        return seen.segment_tokens[segments]
    starts, per_segment = seen.step_starts, seen.segment_steps
    return (starts[(segments + 1) * per_segment] - starts[segments * per_segment]).float()


def segments_without_choices(seen: LayerQuestion, complete: int, first: int) -> torch.Tensor:
    """``[G]`` bool: which of the ``complete`` segments hold no step a question may choose, every one of their
    steps being before ``first`` (kept whole: the prompt prefix and sinks) or evicted."""
    empty = evicted_segments(seen, complete)
    empty = torch.zeros(complete, dtype=torch.bool) if empty is None else empty.clone()
    per_segment = seen.segment_steps
    split = first // per_segment  # the segment ``first`` lies in: kept before it, held or evicted from it
    empty[:min(split, complete)] = True
    if split < complete and first % per_segment:
        end = (split + 1) * per_segment
        empty[split] = seen.evicted.count_from(first) - seen.evicted.count_from(end) == end - first
    return empty
