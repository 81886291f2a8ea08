"""Steps of several streams on one model in one forward of its decoder.

A steady StateKV step (slots holding the full budget) or recency step (a ring) has the same shapes every time,
whichever stream takes it. :class:`StepBatcher` runs such steps of S streams as one batch of S rows: inputs
``[S, T, D]``, positions ``[S, T]`` (``[3, S, T]`` for M-RoPE), and a :class:`BatchCache` whose layers hand each
row to its own stream's :class:`~statekv.core.cache.StreamingLayer` (its carried state, detailed cache and
step transaction), so every stream keeps its own positions, state and horizon; the attention (and the
attention mass a scored rule reads, and the rule's top-k) runs once for all rows, and every stream's
transaction keeps its own row of the selection.

Steps are batched only when their shapes and everything the forward computes with agree (see
:func:`batch_key`); the others run alone (:func:`step_alone`, which is also :meth:`StreamingPrefill.step`): a
batch of one row through the same code (:func:`run_rows`, :func:`device_step`), its cache the stream's own
:class:`~statekv.core.cache.TwoStateCache`. Both caches attend through one function
(:func:`statekv.core.cache.attend`). docs/engine.md says which steps batch.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import OutputError, UnsupportedModelError
from .cache import attend
from .graphs import StepGraphs
from .model_attention import share_language_attention
from .transaction import NotBatchable
from .untraced import engine_call

# A stream (`statekv.core.prefill.StreamingPrefill`) is named in annotations only: its step runs through this module.

# Forward arguments with one row per stream: how S streams' values become one batch's.
ROW_ARGUMENTS = ("visual_pos_masks", "deepstack_visual_embeds")


@dataclass
class StepRequest:
    """One stream's next step, as :meth:`StreamingPrefill.step` takes it (``B == 1``)."""

    prefill: StreamingPrefill
    inputs_embeds: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    durable_record: dict | None = None  # what the disk tier journals with the step (see StreamingPrefill.step)

    @classmethod
    def of(cls, prefill: "StreamingPrefill", inputs: dict, durable_record: dict | None = None) -> "StepRequest":
        """The request of ``prefill``'s step whose checked inputs (`StreamingPrefill.checked_inputs`) are
        ``inputs``."""
        rest = dict(inputs)
        return cls(prefill, rest.pop("inputs_embeds"), rest.pop("position_ids"), rest.pop("input_ids"), rest,
                   durable_record)


def chunk_of(inputs: dict) -> torch.Tensor:
    """The chunk of a step's checked inputs: ``inputs_embeds [B, T, D]`` or ``input_ids [B, T]``."""
    return inputs["inputs_embeds"] if inputs["input_ids"] is None else inputs["input_ids"]


class BatchLayer(CacheLayerMixin):
    """Layer ``index`` of a :class:`BatchCache`: row ``s`` of a step is stream ``s``'s own layer's step."""

    is_compileable = False
    is_sliding = False

    def __init__(self, batch: "BatchCache", index: int):
        super().__init__()
        self.batch, self.index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' call: :meth:`stage` (untraced in a compiled step, `statekv.core.untraced`)."""
        return engine_call(self.stage, key_states, value_states)

    def stage(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage row ``s`` of the chunk ``[S, H_kv, T, D]`` in stream ``s``'s layer; return every stream's
        ``[carried; chunk]`` keys and values stacked, ``[S, H_kv, K + T, D]``."""
        keys, values = [], []
        for row, cache in enumerate(self.batch.caches):
            k, v = cache.layers[self.index].stage(key_states[row:row + 1], value_states[row:row + 1])
            keys.append(k)
            values.append(v)
        return torch.cat(keys), torch.cat(values)

    def get_seq_length(self) -> int:
        return self.batch.caches[0].layers[self.index].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.caches[0].layers[self.index].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """A transformers ``Cache`` over the :class:`~statekv.core.cache.TwoStateCache` s of S streams whose steps
    have equal shapes (row ``s`` is stream ``s``); each stream's step was begun (``TwoStateCache.begin``)."""

    def __init__(self, caches: Sequence):
        super().__init__(layers=[])
        self.caches = list(caches)
        self.layers = [BatchLayer(self, index) for index in range(len(self.caches[0].layers))]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of every row's chunk ``q [S, Hq, T, D]`` over its ``[carried; chunk]`` ``k``/``v``, computed
        once; the policy selects once for all rows and each stream's transaction keeps its row."""
        return attend(self.caches, layer_idx, q, k, v, scale)


_rope_keys: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def rope_key(prefill: "StreamingPrefill") -> tuple:
    """What a stream's rotation is, comparable across streams: streams with equal keys rotate a position the
    same way (static RoPE types: all; ``dynamic``/``longrope``: equal frozen frequencies). Read once per stream."""
    rope = prefill.rope
    if rope is None:
        return ("unfrozen", id(prefill))  # recomputed per call: never shared
    key = _rope_keys.get(rope)
    if key is None:
        key = tuple((id(module), tuple(inv_freq.tolist())) for module, inv_freq in zip(rope.modules, rope.frozen))
        _rope_keys[rope] = key
    return key


def _argument_key(name: str, value: Any) -> Any:
    """How a forward argument enters the batch key (raises NotBatchable for what cannot be stacked)."""
    if name in ("input_ids", "inputs_embeds"):
        return None if value is None else (tuple(value.shape), value.dtype)
    if name == "position_ids":
        return None if value is None else (tuple(value.shape), value.dtype)
    if name == "visual_pos_masks":
        return None if value is None else tuple(value.shape)
    if name == "deepstack_visual_embeds":
        return None if value is None else tuple((t.shape[1:], t.dtype) for t in value)
    if isinstance(value, torch.Tensor):
        raise NotBatchable(f"forward argument {name} has no known batch layout")
    try:
        hash(value)
    except TypeError:
        raise NotBatchable(f"forward argument {name} cannot be compared") from None
    return value


def batch_key(prefill: "StreamingPrefill", inputs: dict) -> tuple | None:
    """What must be equal for steps to share a forward (None: this step runs alone). Read after the step was
    begun. A step is batched when it is steady (every layer in a ring, or in slots holding a scored rule's full
    budget: the carried length is the same at every step) under a capturable rule (one that reads no per-step
    host values), its chunk has one row, and it is neither tracking overlap nor tallying attention per frame
    for ``evict-least-attended`` (host reads per step)."""
    cache = prefill.cache
    chunk = chunk_of(inputs)
    if (prefill.track_overlap or cache.tally is not None or chunk.shape[0] != 1
            or not prefill.policy.capturable or not cache.is_steady()
            or (cache.positions.bounded and inputs["position_ids"] is not None)):  # M-RoPE moved: on its own
        return None
    try:
        arguments = tuple((name, _argument_key(name, value)) for name, value in sorted(inputs.items()))
        hash(prefill.policy)
    except (NotBatchable, TypeError):
        return None
    layers = tuple((layer.form, layer.carried_length, layer.offloaded) for layer in cache.layers)
    return (id(prefill.decoder), prefill.dtype, prefill.device, prefill.attention, prefill.policy, layers,
            rope_key(prefill), cache.positions.mode, cache.placed, prefill.compiled_decoder is not None, arguments)


def stack_inputs(inputs: Sequence[dict]) -> dict:
    """S streams' decoder inputs (one row each, equal :func:`batch_key`) as one batch's."""
    first, stacked = inputs[0], {}
    for name, value in first.items():
        values = [each[name] for each in inputs]
        if value is None:
            stacked[name] = None
        elif name == "position_ids":
            stacked[name] = torch.cat(values, dim=-2)  # [S, T] or [3, S, T]
        elif name in ("input_ids", "inputs_embeds", "visual_pos_masks"):
            stacked[name] = torch.cat(values)
        elif name == "deepstack_visual_embeds":  # per layer, the visual tokens of every row in row order
            stacked[name] = [torch.cat(layer) for layer in zip(*values)]
        else:
            stacked[name] = value
    return stacked


class StepBatcher:
    """Steps streams of one model together (see the module doc); keeps the CUDA graphs of the batches it ran
    (``keep`` of them, by the streams they hold). ``batch_sizes``: its forwards counted by the stream steps each
    took (1: a step alone).

    ``step(requests)`` -> one outcome per request, in order: the step's hidden states ``[1, T, D]``, or the
    exception that step raised (the others went on). A stream given twice takes its steps in order.
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.batched_steps = 0  # forwards that stepped more than one stream
        self.batched_rows = 0  # stream steps taken in them
        self.batch_sizes: Counter[int] = Counter()  # forwards by the stream steps they took
        self._graphs: OrderedDict[tuple, tuple[BatchCache, StepGraphs]] = OrderedDict()
        self._graphs_lock = threading.Lock()  # forget() may come from another thread (a stream closing)

    @torch.no_grad()
    def step(self, requests: Sequence[StepRequest]) -> list[torch.Tensor | Exception]:
        outcomes: list[torch.Tensor | Exception | None] = [None] * len(requests)
        remaining = list(range(len(requests)))
        while remaining:  # waves: each stream's first remaining step
            wave, seen, later = [], set(), []
            for index in remaining:
                prefill = requests[index].prefill
                (later if id(prefill) in seen else wave).append(index)
                seen.add(id(prefill))
            self._wave(requests, wave, outcomes)
            remaining = later
        return outcomes

    def _wave(self, requests, indices, outcomes) -> None:
        if len(indices) == 1:  # nothing to batch with: the stream's own step
            try:
                outcomes[indices[0]] = step_alone(requests[indices[0]])
                self.batch_sizes[1] += 1
            except Exception as error:
                outcomes[indices[0]] = error
            return
        groups: dict[tuple, list[tuple[int, dict]]] = {}
        alone: list[tuple[int, dict]] = []
        for index in indices:
            request = requests[index]
            prefill = request.prefill
            try:
                inputs = prefill.checked_inputs(request.inputs_embeds, request.position_ids,
                                                input_ids=request.input_ids, **request.forward_kwargs)
                prefill.make_room(chunk_of(inputs).shape[1], chunk_of(inputs).shape[0])
                prefill.cache.begin(chunk_of(inputs).shape[1], chunk_of(inputs).device, inputs["position_ids"])
            except Exception as error:
                prefill.cache.rollback()
                outcomes[index] = error
                continue
            key = batch_key(prefill, inputs)
            if key is None:
                alone.append((index, inputs))
            else:
                groups.setdefault(key, []).append((index, inputs))
        for members in groups.values():
            if len(members) == 1:
                alone.extend(members)
                continue
            prefills = [requests[index].prefill for index, _ in members]
            try:
                inputs = stack_inputs([each for _, each in members])
                batch, graphs = self._graphs_for(prefills)
                hidden = run_rows(prefills, batch, graphs, inputs,
                                  [requests[index].durable_record for index, _ in members],
                                  replay=all(prefill.cuda_graph for prefill in prefills))
            except RowsFailed as partly:  # the device step ran for all: each row took it or is as it was
                self.batched_steps += 1
                self.batched_rows += len(prefills)
                self.batch_sizes[len(prefills)] += 1
                for row, (index, _) in enumerate(members):
                    outcomes[index] = partly.errors.get(row, partly.hidden[row:row + 1])
                continue
            except Exception:
                for prefill in prefills:  # every stream as it was; each retried on its own below
                    prefill.cache.rollback()
                alone.extend(members)
                continue
            self.batched_steps += 1
            self.batched_rows += len(prefills)
            self.batch_sizes[len(prefills)] += 1
            for row, (index, _) in enumerate(members):
                outcomes[index] = hidden[row:row + 1]
        for index, inputs in sorted(alone):
            prefill = requests[index].prefill
            prefill.cache.rollback()
            try:
                outcomes[index] = step_alone(StepRequest.of(prefill, inputs, requests[index].durable_record))
                self.batch_sizes[1] += 1
            except Exception as error:
                outcomes[index] = error

    def _graphs_for(self, prefills: list["StreamingPrefill"]) -> tuple[BatchCache, StepGraphs]:
        """The device step of these streams over one batch cache, with, on CUDA, the graphs recorded for it (kept
        for the next step of the same streams in the same rows)."""
        if not all(prefill.cuda_graph for prefill in prefills):
            return batch_graphs(prefills)
        key = tuple(id(prefill) for prefill in prefills)
        with self._graphs_lock:
            held = self._graphs.get(key)
            if held is None or any(a is not b for a, b in zip(held[0].caches, (p.cache for p in prefills))):
                held = self._graphs[key] = batch_graphs(prefills)
                while len(self._graphs) > self.keep:
                    self._graphs.popitem(last=False)[1][1].clear()
            self._graphs.move_to_end(key)
            return held

    def forget(self, prefill: "StreamingPrefill") -> None:
        """Drop the recorded batches that hold ``prefill`` (it closed or left)."""
        with self._graphs_lock:
            for key in [key for key, (batch, _) in self._graphs.items() if prefill.cache in batch.caches]:
                self._graphs.pop(key)[1].clear()


@torch.no_grad()
def step_alone(request: StepRequest) -> torch.Tensor:
    """One stream's step, a batch of one row (what :meth:`StreamingPrefill.step` runs): its inputs checked, room
    made under a cache limit, the step begun, then :func:`run_rows` with the stream's own graphs (its own cache;
    replayed once steady on CUDA); any failure rolls the stream back."""
    prefill = request.prefill
    inputs = prefill.checked_inputs(request.inputs_embeds, request.position_ids, input_ids=request.input_ids,
                                    **request.forward_kwargs)
    chunk = chunk_of(inputs)
    prefill.make_room(chunk.shape[1], chunk.shape[0])
    started = time.perf_counter()
    carried_before = prefill.positions_snapshot() if prefill.track_overlap else None
    prefill.cache.begin(chunk.shape[1], chunk.device, inputs["position_ids"])
    try:
        return run_rows([prefill], prefill.cache, prefill.graphs, inputs, [request.durable_record],
                        replay=prefill.cuda_graph and prefill.cache.is_steady(), started=started,
                        carried_before=carried_before)
    except BaseException:
        prefill.cache.rollback()
        raise


def run_rows(prefills: Sequence["StreamingPrefill"], cache: Cache, graphs: StepGraphs, inputs: dict,
             durable_records: Sequence[dict | None], *, replay: bool, started: float | None = None,
             carried_before: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The steps of ``prefills`` (each begun; one row each of ``inputs``, stacked) through ``cache`` (one stream's
    own cache, or a `BatchCache`): inside the streams' call (their attention through ``cache``, their RoPE), the
    device part (``graphs.device_step``, :func:`device_step`) replayed from ``graphs`` when ``replay`` and it
    holds it, else run eagerly; then each stream's host end (`StreamingPrefill.finish_step`). Returns the hidden
    states ``[S, T, D]``."""
    started = time.perf_counter() if started is None else started
    first = prefills[0]
    share_language_attention(first.model)  # a no-op unless someone switched the model's attention since
    with first.streaming(cache):
        hidden = graphs.run(inputs, tuple(prefill.cache.layout_version for prefill in prefills)) if replay else None
        if hidden is None:
            hidden = graphs.device_step(inputs)
    chunk_len = chunk_of(inputs).shape[1]
    failed: dict[int, OutputError] = {}
    for row, (prefill, record) in enumerate(zip(prefills, durable_records)):
        try:
            prefill.finish_step(chunk_len, started, carried_before, durable_record=record)
        except OutputError as error:  # its disk tier could not take the step: it alone is back as it was
            failed[row] = error
    if failed:
        if len(prefills) == 1:
            raise failed[0]
        raise RowsFailed(failed, hidden)
    return hidden


class RowsFailed(Exception):
    """Raised by :func:`run_rows` when some streams of a batch could not finish their step (their disk tier could
    not write it: each is restored as it was before the step); the others took it. ``errors`` by row, ``hidden``
    ``[S, T, D]`` every row's hidden states."""

    def __init__(self, errors: dict[int, Exception], hidden: torch.Tensor):
        super().__init__(f"{len(errors)} of {hidden.shape[0]} streams could not finish their step")
        self.errors, self.hidden = errors, hidden


def batch_graphs(prefills: Sequence["StreamingPrefill"]) -> tuple[BatchCache, StepGraphs]:
    """One `BatchCache` over S streams' caches, and the device step of their rows over it as graphs record it."""
    batch = BatchCache([prefill.cache for prefill in prefills])
    return batch, StepGraphs(lambda inputs: device_step(prefills, batch, inputs),
                             lambda: any(prefill.cache.read_host_state for prefill in prefills))


def device_step(prefills: Sequence["StreamingPrefill"], cache: Cache, inputs: dict) -> torch.Tensor:
    """The device part of a step of ``prefills`` through ``cache`` (what a CUDA graph records; run inside the
    streams' call, see :func:`run_rows`): positions, the decoder's forward over every row, every stream's
    commit. Rows continue from each stream's own length."""
    first = prefills[0]
    explicit = inputs["position_ids"]  # bounded streams with explicit positions never batch (see batch_key)
    positions = [prefill.cache.begin_device(explicit if len(prefills) == 1 else None) for prefill in prefills]
    if explicit is None:
        rows = positions[0].expand(chunk_of(inputs).shape[0], -1) if len(prefills) == 1 else torch.stack(positions)
        inputs = dict(inputs, position_ids=rows)
    elif len(prefills) == 1 and positions[0] is not explicit:  # bounded: moved to where the chunk is placed
        inputs = dict(inputs, position_ids=positions[0])
    steady_compiled = first.compiled_decoder is not None and all(prefill.cache.is_steady() for prefill in prefills)
    decoder = first.compiled_decoder if steady_compiled else first.decoder  # `statekv.core.compiled`
    output = decoder(**inputs, attention_mask=first.step_mask, past_key_values=cache, use_cache=True)
    for prefill in prefills:
        missing = prefill.cache.missing_layers()
        if missing:
            raise UnsupportedModelError(
                f"{type(first.decoder).__name__} layers {missing} did not run their attention through "
                "transformers' AttentionInterface, so they cannot be streamed")
    for prefill in prefills:
        prefill.cache.commit_device()
    return output.last_hidden_state


def step_together(requests: Sequence[StepRequest]) -> list[torch.Tensor | Exception]:
    """:meth:`StepBatcher.step` with a batcher of its own (no CUDA graphs kept between calls)."""
    return StepBatcher().step(requests)
