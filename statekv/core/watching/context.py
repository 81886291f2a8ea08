"""What a standing question's evaluation attends to, per layer: the keys and values it reads, placed in RoPE.

An evaluation of a standing question (:mod:`statekv.core.watching.standing`) reads, at each layer:

1. the carried state (per KV head, the tokens the carry rule keeps; those of the new frames are left out here,
   they come next), with the tokens retrieval picks for the question when it retrieves (`Retrieval`, scored with
   the prompt's queries at that layer, as a question asked is);
2. the new frames: every token streamed since the question's last evaluation (``since``), read from the
   detailed cache through its storage;

and the question's prompt runs after them, then its answer.

Positions: under ``stream`` positions every token is read at the rotation it was stored with. Under ``bounded``
positions the evaluation is placed as a step would be whose chunk is the new frames and the question: its first
token at the layout's base for that span, the carried (and retrieved) tokens where the layout puts a step's
carried state (`BoundedLayout.place`), each key rotated from its stored rotation to there (`rotate`), as a
step's own keys are.

Rows: the evaluations of several questions (of one stream or of several) run as rows of one batch; each row's
context has its own length, so the batch pads them and attends under a mask (`statekv.core.answering.rows`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..answering.held import held_question
from ..answering.retrieval import Retrieval
from ..answering.rows import LayerContext
from ..cache.step_runs import StepRuns
from ..storage.step_values import StepValues
from ..positions.rotation import rotate
from .fitting import Scoring


@dataclass(frozen=True)
class Placement:
    """Where one evaluation of a stream sits in RoPE.

    ``shift``: the tail (new frames, question, answer) goes from its positions in the stream to ``position -
    shift`` (0 under ``stream`` positions). ``first``, ``base``: the tail's first position in the stream and the
    rotary position it is placed at (bounded only). ``carried``: tokens placed before the tail (bounded only).
    ``span``: positions the tail takes. ``question_first``: the question's first position in the stream.
    """

    shift: int = 0
    first: int = 0
    base: int = 0
    span: int = 0
    question_first: int = 0
    bounded: bool = False
    flat: bool = True


def placement(prefill, since: int, question_first: int, question_positions: int, carried: int,
              flat: bool = True) -> Placement:
    """The placement of an evaluation of ``prefill``'s stream reading the steps from token ``since`` on, its
    question starting at position ``question_first`` and taking ``question_positions`` positions (the question and
    its answer), after ``carried`` carried tokens; ``flat``: 1-D RoPE (False: M-RoPE)."""
    positions = prefill.positions
    if not positions.bounded:
        return Placement(question_first=question_first)
    first = _first_position(prefill, since, question_first)
    span = question_first + question_positions - first
    base = positions.layout.base(first, span, carried, positions.limit, flat)
    return Placement(shift=first - base, first=first, base=base, span=span, question_first=question_first,
                     bounded=True, flat=flat)


def _first_position(prefill, since: int, question_first: int) -> int:
    """The stream position of token ``since`` (the first of the new frames), or the question's when none is new."""
    positions, cache = prefill.positions, prefill.cache
    if since >= cache.seen_tokens:
        return question_first
    step, start = cache.step_of(since)
    return positions.firsts[step] + (since - start)


def tail_deltas(prefill, tokens: torch.Tensor, place: Placement) -> torch.Tensor:
    """The rotation ``[M]`` that moves the stored keys of ``tokens`` (LongTensor ``[M]``, host) into the tail: each
    step's tokens from where the step was placed (its base) to its position in the stream minus ``shift``, together
    (zero under ``stream`` positions, and for an unshifted tail while every step is stored at its own position)."""
    if not place.bounded or tokens.numel() == 0 or (not place.shift and not prefill.positions.moved):
        return torch.zeros(tokens.shape[0], dtype=torch.long)
    positions = prefill.positions
    steps = prefill.cache.starts.searched(tokens) - 1
    return positions.firsts.gathered(steps) - place.shift - positions.bases.gathered(steps)


def stored_rotations(prefill, tokens: torch.Tensor, starts: StepValues | None = None) -> torch.Tensor:
    """``[M]`` the rotary position each of ``tokens`` (host, 1-D RoPE under bounded positions) was stored at: its
    step's base plus its offset in the step. ``starts``: the cache's `starts`, where the caller read them."""
    starts = prefill.cache.starts if starts is None else starts
    steps = starts.searched(tokens) - 1
    return prefill.positions.bases.gathered(steps) + (tokens - starts.gathered(steps))


def held_tokens(starts: Sequence[int], evicted: StepRuns, since: int) -> torch.Tensor:
    """Token indices ``[M]`` from ``since`` on of the steps (first tokens ``starts``, ``S + 1`` of them: the
    cache's `StepValues`, then the end) not evicted, ascending (only the steps from ``since`` on are walked)."""
    end = int(starts[-1])
    if not evicted:
        return torch.arange(since, end)
    first = bisect.bisect_right(starts, since) - 1
    index = [torch.arange(max(int(starts[s]), since), int(starts[s + 1]))
             for s in range(max(first, 0), len(starts) - 1) if s not in evicted]
    return torch.cat(index) if index else torch.empty(0, dtype=torch.long)


def carried_targets(prefill, anchors: torch.Tensor, place: Placement) -> torch.Tensor:
    """Rotary positions ``[B, H, K]`` the bounded layout gives carried tokens at stream positions ``anchors``
    ``[B, H, K]`` (time order) before a tail placed by ``place``."""
    positions = prefill.positions
    first = torch.tensor([place.first], device=anchors.device)
    base = torch.tensor([place.base], device=anchors.device)
    return positions.layout.place(first, base, max(place.span, 1), positions.limit, place.flat)(anchors)


def layer_context(prefill, layer: int, since: int, place: Placement, *, device: torch.device, dtype: torch.dtype,
                  frequencies: torch.Tensor, queries: torch.Tensor | None = None, retrieval: Retrieval | None = None,
                  scale: float = 1.0, memory: dict | None = None, scoring: Scoring | None = None,
                  reads: dict | None = None) -> LayerContext:
    """The context of one evaluation at ``layer`` (module docstring): the carried state and retrieved tokens
    before token ``since``, then the tokens from ``since`` on, placed by ``place``. ``queries`` ``[1, Hq, Q, D]``
    (the prompt's, placed where it is read) score the retrieval, past the range as ``scoring`` says.
    ``frequencies``: the rotary frequencies ``[R / 2]`` the stream's keys are rotated with. ``memory``: scratch
    shared by the layers of one evaluation (its retrieval rule's). ``reads``: scratch shared by the evaluations
    of one stream run together (what they read alike before it is placed: the carried state, the new frames;
    ``reads["rows"]`` the number of them, see `shared`)."""
    cache = prefill.cache
    storage = cache.layers[layer].storage
    seen = cache.seen_tokens
    reads = {} if reads is None else reads
    parts_k, parts_v, parts_valid = [], [], []
    retrieved: tuple[int, ...] = ()
    group = _carried_group(prefill, layer, since, place, device, dtype, frequencies, queries, retrieval, scale,
                           memory, scoring, reads)
    if group is not None:
        keys, values, valid, retrieved = group
        parts_k.append(keys)
        parts_v.append(values)
        parts_valid.append(valid)
    if since < seen:
        tail = reads.get(("new frames", since, place))  # the same at every layer
        if tail is None:
            tail = reads["new frames", since, place] = _new_frames(prefill, since, place, device, reads)
        index, delta, read = tail
        keys, values = shared(reads, ("new frames read", layer, since),
                              lambda: storage.read_tokens(index, device, dtype))
        if delta is not None:
            keys = rotate(keys, delta.to(device).expand(*keys.shape[:2], -1), frequencies)
        parts_k.append(keys)
        parts_v.append(values)
        parts_valid.append(read.expand(*keys.shape[:3]))
    if not parts_k:
        heads, dim = prefill.geometry.kv_heads, prefill.geometry.head_dim
        empty = torch.empty(1, heads, 0, dim, device=device, dtype=dtype)
        return LayerContext(empty, empty, torch.empty(1, heads, 0, dtype=torch.bool, device=device))
    return LayerContext(torch.cat(parts_k, 2), torch.cat(parts_v, 2), torch.cat(parts_valid, 2), retrieved)


def shared(reads: dict, key: tuple, make):
    """``reads[key]``, made by ``make()`` when absent; one layer's keys and values are kept for the other rows only
    when ``reads["rows"]`` (the rows of the stream in the forward) is more than one, else they would be held for
    every layer until the forward ends."""
    value = reads.get(key)
    if value is None:
        value = make()
        if reads.get("rows", 1) > 1:
            reads[key] = value
    return value


def _new_frames(prefill, since: int, place: Placement, device: torch.device, reads: dict) -> tuple:
    """What `layer_context` reads of the tokens from ``since`` on, the same at every layer: their indices ``[M]``,
    the rotation moving them into the tail (None: none turns) and their validity ``[1, 1, M]`` (all read)."""
    cache = prefill.cache
    index = reads.get(("new tokens", since))
    if index is None:
        index = reads["new tokens", since] = held_tokens(cache.starts, cache.evicted_steps, since)
    delta = None
    if place.bounded and index.numel() and (place.shift or prefill.positions.moved):  # else none turns
        delta = tail_deltas(prefill, index, place)
        delta = delta if bool(delta.any()) else None
    return index, delta, torch.ones(1, 1, index.shape[0], dtype=torch.bool, device=device)


def _carried_group(prefill, layer: int, since: int, place: Placement, device, dtype, frequencies, queries,
                   retrieval, scale, memory, scoring, reads: dict):
    """The carried tokens before ``since`` and the retrieved ones not carried, in time order, placed: ``(keys,
    values, valid, retrieved steps)``, or None when there are none.

    ``tokens`` are the tokens' indices in the stream (what is read once and what the new frames hold); under
    bounded positions ``anchors`` are their positions in the stream and ``rotations`` where they were stored
    (the carried slots' placements, once the stream was placed: `TwoStateCache.place_slots`)."""
    streaming = prefill.cache.layers[layer]
    storage = streaming.storage
    heads = prefill.geometry.kv_heads
    tokens, keys, values, anchors, rotations, valid = shared(
        reads, ("carried", layer, since, place.bounded),
        lambda: _carried(prefill, layer, since, place.bounded, device, dtype))
    retrieved: tuple[int, ...] = ()
    if retrieval is not None and queries is not None:
        index, retrieved = _retrieved_tokens(prefill, layer, since, queries, retrieval, scale, memory, dtype,
                                             scoring, reads)
        if index.numel():
            more_keys, more_values = storage.read_tokens(index, device, dtype)
            more_tokens = index.to(device).expand(1, heads, -1)
            if tokens.shape[-1]:  # a token the carried state holds too is read once, from there
                held = tokens[0].contiguous()
                at = torch.searchsorted(held, more_tokens[0].contiguous()).clamp(max=held.shape[-1] - 1)
                twice = held.gather(1, at) == more_tokens[0]
            else:
                twice = torch.zeros(more_tokens.shape[1:], dtype=torch.bool, device=device)
            keys = more_keys if keys is None else torch.cat([keys, more_keys], 2)
            values = more_values if values is None else torch.cat([values, more_values], 2)
            valid = torch.cat([valid, ~twice[None]], 2)
            tokens = torch.cat([tokens, more_tokens], 2)
            if place.bounded:  # 1-D RoPE (retrieval under bounded M-RoPE is refused): positions are indices
                starts = reads["steps before", since][0]  # read once by `_retrieved_tokens`
                more_rotations = stored_rotations(prefill, index, starts).to(device).expand(1, heads, -1)
                anchors = more_tokens if anchors is None else torch.cat([anchors, more_tokens], 2)
                rotations = more_rotations if rotations is None else torch.cat([rotations, more_rotations], 2)
            order = tokens.argsort(dim=-1, stable=True)  # time order, as a step's carried state is read
            valid = valid.gather(2, order)
            keys = keys.gather(2, order[..., None].expand_as(keys))
            values = values.gather(2, order[..., None].expand_as(values))
            if anchors is not None:
                anchors, rotations = anchors.gather(2, order), rotations.gather(2, order)
    if keys is None:
        return None
    if anchors is not None and place.shift:  # unshifted, every token is at its own position, as stored
        keys = rotate(keys, carried_targets(prefill, anchors, place) - rotations, frequencies)
    return keys, values, valid, retrieved


def _carried(prefill, layer: int, since: int, bounded: bool, device, dtype) -> tuple:
    """The carried state at ``layer`` as stored, before it is placed: ``(tokens, keys, values, anchors, rotations,
    valid)`` (`_carried_group`; keys None when nothing is carried, anchors and rotations None unless
    ``bounded``)."""
    streaming = prefill.cache.layers[layer]
    tokens = streaming.positions().to(device)
    keys = values = anchors = rotations = None
    if tokens.shape[-1]:
        keys, values = (t.to(device, dtype) for t in streaming.carried())
        if bounded and prefill.cache.placed:
            placed = streaming.carry.placements()
            anchors, rotations = (t[..., :tokens.shape[-1]].to(device) for t in placed)
        elif bounded:  # no step placed away from its own position yet: each token stored at its own
            anchors = rotations = tokens
    else:
        tokens = torch.empty(1, prefill.geometry.kv_heads, 0, dtype=torch.long, device=device)
    return tokens, keys, values, anchors, rotations, tokens < since


def _retrieved_tokens(prefill, layer: int, since: int, queries: torch.Tensor, retrieval: Retrieval, scale: float,
                      memory: dict | None, dtype, scoring: Scoring | None = None, reads: dict | None = None
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Token indices ``[M]`` (host, ascending) of the steps ``retrieval`` picks for ``queries`` among those
    before ``since``, and those steps; past the range scored as ``scoring`` says (as `ask` scores them).
    ``reads``: scratch shared by the layers (see `layer_context`)."""
    cache = prefill.cache
    storage = cache.layers[layer].storage
    reads = {} if reads is None else reads
    key = "steps before", since
    if key not in reads:  # the same at every layer
        starts = StepValues(cache.starts)  # as runs: what an evaluation builds follows the steps it holds
        reads[key] = starts, bisect.bisect_right(starts, since, 1) - 1  # the steps wholly before since
    starts, before = reads[key]
    if before == 0:
        return torch.empty(0, dtype=torch.long), ()
    if scoring is not None and scoring.shift:  # the prompt's queries where `ask` would place them
        queries = rotate(queries, torch.full(queries.shape[:3], scoring.shift, device=queries.device),
                         scoring.turns.frequencies)
    whole = storage.segment_index.length * storage.segment_steps <= before  # every complete segment before since
    seen = held_question(layer, queries, storage, before, starts, cache.evicted_steps.below(before),
                         retrieval.keep_tokens, scale, {} if memory is None else memory, dtype, whole,
                         None if scoring is None else scoring.turns)
    chosen = retrieval.choose(seen)
    parts = [torch.arange(int(starts[s]), int(starts[s + 1])) for s in chosen]
    index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    return index, tuple(chosen)
