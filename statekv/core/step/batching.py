"""Steps of several streams on one model in one forward of its decoder.

A steady StateKV step (slots holding the full budget) or recency step (a ring) has the same shapes every time,
whichever stream takes it. :class:`StepBatcher` runs such steps of S streams as one batch of S rows: inputs
``[S, T, D]``, positions ``[S, T]`` (``[3, S, T]`` for M-RoPE), and a :class:`BatchCache` whose layers hand each
row to its own stream's :class:`~statekv.core.cache.layer.StreamingLayer` (its carried state, detailed cache and
step transaction), so every stream keeps its own positions, state and horizon; the attention (and the
attention mass a scored rule reads, and the rule's top-k) runs once for all rows, and every stream's
transaction keeps its own row of the selection.

Every step goes one way, whether it runs alone (:meth:`StreamingPrefill.step` is a batcher's step of one
request) or with others: :func:`begin_step` (its inputs checked, room made, the step begun), then
:func:`run_rows` and its device part :func:`device_step`, through a :class:`BatchCache` or, for a stream
stepping alone, its own :class:`~statekv.core.cache.two_state.TwoStateCache`. Steps are batched only when their
shapes and everything the forward computes with agree (see :func:`batch_key`). Both caches lay out the step's
positions (``step_positions``) and attend through one function (:func:`statekv.core.cache.two_state.attend`).
docs/engine.md says which steps batch.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from ...errors import InputError, OutputError, UnsupportedModelError
from ..cache.engine_layer import EngineLayer
from ..cache.two_state import attend
from . import pooled
from .graphs import StepGraphs
from ..attention.switch import share_language_attention
from ..cache.transaction import NotBatchable
from ..attention.untraced import engine_call

# A stream (`statekv.core.stream.prefill.StreamingPrefill`) is named in annotations only: its step runs through this
# module.

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
    ends_vision_call: bool = True  # the last step of its frames' vision-tower call: a checkpoint may fall here



def chunk_of(inputs: dict) -> torch.Tensor:
    """The chunk of a step's checked inputs: ``inputs_embeds [B, T, D]`` or ``input_ids [B, T]``."""
    return inputs["inputs_embeds"] if inputs["input_ids"] is None else inputs["input_ids"]


class BatchLayer(EngineLayer):
    """Layer ``index`` of a :class:`BatchCache`: row ``s`` of a step is stream ``s``'s own layer's step."""

    def __init__(self, batch: "BatchCache", index: int):
        super().__init__()
        self.batch, self.index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' call: :meth:`stage` (untraced in a compiled step, `statekv.core.attention.untraced`)."""
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


class BatchCache(Cache):
    """A transformers ``Cache`` over the :class:`~statekv.core.cache.two_state.TwoStateCache` s of S streams whose steps
    have equal shapes (row ``s`` is stream ``s``); each stream's step was begun (``TwoStateCache.begin``)."""

    def __init__(self, caches: Sequence):
        super().__init__(layers=[])
        self.caches = list(caches)
        self.layers = [BatchLayer(self, index) for index in range(len(self.caches[0].layers))]

    def step_positions(self, position_ids: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """The decoder's positions for the step of every stream's row (each stream's step begun on the device,
        `TwoStateCache.begin_device`): ``position_ids`` as given (``[S, T]`` or ``[3, S, T]``; streams with explicit
        positions batch only under ``stream`` positions, see `batch_key`), else each stream's own continued from
        its length, ``[S, T]``."""
        positions = [cache.begin_device(None) for cache in self.caches]
        return torch.stack(positions) if position_ids is None else position_ids

    def settled_rotary(self) -> None:
        """None: the rows' positions are stacked anew at every step (`TwoStateCache.settled_rotary`)."""
        return None

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
    for ``evict-least-attended`` (host reads per step), nor probed. Under bounded positions, only streams of one
    layout and range batch together (a pooled batch places its rows as the streams it was made for are placed)."""
    cache = prefill.cache
    chunk = chunk_of(inputs)
    if (prefill.track_overlap or cache.tally is not None or cache.probe is not None or chunk.shape[0] != 1
            or not prefill.policy.capturable or not cache.is_steady()
            or (cache.positions.bounded and inputs["position_ids"] is not None)):  # M-RoPE moved: on its own
        return None
    try:
        arguments = tuple((name, _argument_key(name, value)) for name, value in sorted(inputs.items()))
        hash(prefill.policy)
    except (NotBatchable, TypeError):
        return None
    layers = tuple((layer.form, layer.carried_length, layer.offloaded) for layer in cache.layers)
    placing = (prefill.positions.layout.name, prefill.positions.limit) if cache.positions.bounded else None
    return (id(prefill.decoder), prefill.dtype, prefill.device, prefill.attention, prefill.policy, layers,
            rope_key(prefill), cache.positions.mode, placing, cache.placed, prefill.compiled_decoder is not None,
            arguments)


def stack_inputs(inputs: Sequence[dict]) -> dict:
    """S streams' decoder inputs (one row each, equal :func:`batch_key`) as one batch's; one stream's are the
    forward's as they are."""
    if len(inputs) == 1:
        return inputs[0]
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
        requests = list(requests)
        for request in requests:
            if not isinstance(request, StepRequest):
                raise InputError(f"StepBatcher.step takes StepRequest(prefill, ...) items, got "
                                 f"{type(request).__name__}")
        outcomes: list[torch.Tensor | Exception | None] = [None] * len(requests)
        with stepping([request.prefill for request in requests]) as elsewhere:
            remaining = []
            for index, request in enumerate(requests):
                if id(request.prefill) in elsewhere:
                    outcomes[index] = InputError("this stream is taking a step in another thread; step a stream "
                                                 "from one thread at a time (the step was not taken)")
                else:
                    remaining.append(index)
            while remaining:  # waves: each stream's first remaining step
                wave, seen, later = [], set(), []
                for index in remaining:
                    prefill = requests[index].prefill
                    (later if id(prefill) in seen else wave).append(index)
                    seen.add(id(prefill))
                self._wave(requests, wave, outcomes)
                remaining = later
        return outcomes

    def _wave(self, requests: Sequence[StepRequest], indices: list[int], outcomes: list) -> None:
        """One step of each stream of ``indices``: every step begun (`begin_step`); in a wave of several streams,
        those whose shapes agree (`batch_key`) run as one batch, and each other step is rolled back and taken as a
        wave of its own (as is each step of a batch that failed)."""
        begun: dict[int, BegunStep] = {}
        for index in indices:
            try:
                begun[index] = begin_step(requests[index])
            except Exception as error:
                outcomes[index] = error
        groups: dict[tuple | int, list[int]] = {}
        for index, step in begun.items():  # a wave of one has nothing to batch with: no key to compare
            key = batch_key(step.prefill, step.inputs) if len(indices) > 1 else None
            groups.setdefault(index if key is None else key, []).append(index)
        alone = []
        for key, group in groups.items():
            for start in range(0, len(group), pooled.BUCKETS[-1]):  # a batch holds at most the last bucket's rows
                members = group[start:start + pooled.BUCKETS[-1]]
                if len(indices) > 1 and len(members) == 1:  # begun to be keyed; it steps in a wave of its own
                    begun[members[0]].prefill.cache.rollback()
                    alone.append(members[0])
                elif not self._run([begun[index] for index in members], members, outcomes, key):
                    alone.extend(members)
        for index in sorted(alone):
            self._wave(requests, [index], outcomes)

    def _run(self, steps: list["BegunStep"], indices: list[int], outcomes: list, key: Any) -> bool:
        """Run the begun ``steps`` (of equal batch ``key`` when several) as one forward (`run_rows`) and set their
        outcomes; False when a batch of several failed as a whole (every stream rolled back, to be retried on its
        own). Several streams whose state can be pooled step as rows of their model's pools (`pooled`)."""
        prefills = [step.prefill for step in steps]
        try:
            inputs = None
            if len(steps) > 1 and pooled.poolable(prefills):
                # `device_step` looked up as each step runs: replacing it (op_trace marks steps so) reaches pooled ones
                cache, graphs, rows = pooled.rows(prefills, key, lambda *step: device_step(*step))
                chosen = [step.inputs for step in steps]  # padded to the bucket with the first row's inputs
                inputs = dict(stack_inputs(chosen + chosen[:1] * (rows.shape[1] - len(chosen))), rows=rows)
            else:
                cache, graphs = self._graphs_for(prefills)
            try:
                with nullcontext() if inputs is not None else pooled.pages_held(prefills):
                    hidden = run_rows(steps, cache, graphs, inputs=inputs, replay=all(
                        prefill.cuda_graph and prefill.cache.is_steady() for prefill in prefills))
            finally:
                if inputs is not None:  # a pooled batch holds its streams for this step only
                    cache.members = []
        except RowsFailed as partly:  # the device step ran for all: each row took it or is as it was
            hidden, errors = partly.hidden, partly.errors
        except BaseException as error:
            for prefill in prefills:  # every stream as it was
                prefill.cache.rollback()
            if len(steps) > 1 and isinstance(error, Exception):
                return False
            if not isinstance(error, Exception):
                raise
            outcomes[indices[0]] = (not_taken(error, prefills[0], steps[0].evicted) if isinstance(error, OutputError)
                                    else error)
            return True
        else:
            errors = {}
        self.batch_sizes[len(steps)] += 1
        if len(steps) > 1:
            self.batched_steps += 1
            self.batched_rows += len(steps)
        for row, index in enumerate(indices):
            outcomes[index] = errors.get(row, hidden[row:row + 1] if len(steps) > 1 else hidden)
        return True

    def _graphs_for(self, prefills: list["StreamingPrefill"]) -> tuple[Cache, StepGraphs]:
        """The cache the device step of these streams runs through, and the graphs that record it: one stream's
        own cache and graphs, or a batch cache over several with, on CUDA, the graphs recorded for it (kept for the
        next step of the same streams in the same rows)."""
        if len(prefills) == 1:
            return prefills[0].cache, prefills[0].graphs
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


@contextmanager
def stepping(prefills: Sequence["StreamingPrefill"]):
    """Hold each stream's step lock (`StreamingPrefill.stepping`) while its steps run; yields the ids of the
    streams another thread is stepping now, which are not held (a step of a stream from two threads at once would
    interleave their writes to its cache)."""
    held, elsewhere = [], set()
    try:
        for prefill in {id(prefill): prefill for prefill in prefills}.values():
            if prefill.stepping.acquire(blocking=False):
                held.append(prefill)
            else:
                elsewhere.add(id(prefill))
        yield elsewhere
    finally:
        for prefill in held:
            prefill.stepping.release()


@dataclass
class BegunStep:
    """A stream's step begun by `begin_step`: its ``request``, its checked decoder ``inputs``, when it ``started``
    and, when the stream tracks overlap, the carried positions before it (``carried_before``); ``evicted``: frames
    were evicted to make room for it (a rolled-back step does not bring them back)."""

    request: StepRequest
    inputs: dict
    started: float
    carried_before: list[torch.Tensor] | None = None
    evicted: bool = False

    @property
    def prefill(self) -> "StreamingPrefill":
        return self.request.prefill


def begin_step(request: StepRequest) -> BegunStep:
    """The prologue of every step, alone or batched: its inputs checked (`StreamingPrefill.checked_inputs`), room
    made under a cache limit (`StreamingPrefill.make_room`), the step begun (`TwoStateCache.begin`). A failure
    leaves the stream as it was, but for the frames evicted to make room."""
    prefill = request.prefill
    evictions = len(prefill.evictions)
    try:
        inputs = prefill.checked_inputs(request.inputs_embeds, request.position_ids, input_ids=request.input_ids,
                                        **request.forward_kwargs)
        chunk = chunk_of(inputs)
        prefill.make_room(chunk.shape[1], chunk.shape[0])
        started = time.perf_counter()
        carried_before = prefill.positions_snapshot() if prefill.track_overlap else None
        prefill.cache.begin(chunk.shape[1], chunk.device, inputs["position_ids"])
    except OutputError as error:  # the disk tier could not journal an eviction, or open its files
        prefill.cache.rollback()
        raise not_taken(error, prefill, len(prefill.evictions) != evictions) from None
    except BaseException:
        prefill.cache.rollback()
        raise
    return BegunStep(request, inputs, started, carried_before, len(prefill.evictions) != evictions)


def run_rows(steps: Sequence[BegunStep], cache: Cache, graphs: StepGraphs, *, replay: bool,
             inputs: dict | None = None) -> torch.Tensor:
    """The begun ``steps`` (one stream each; their inputs stacked as rows) through ``cache`` (one stream's own
    cache, or a `BatchCache`): inside the streams' call (their attention through ``cache``, their RoPE), the
    device part (``graphs.device_step``, :func:`device_step`) replayed from ``graphs`` when ``replay`` and it
    holds it, else run eagerly; then each stream's host end (`StreamingPrefill.finish_step`). Returns the hidden
    states ``[S, T, D]`` (``[B, T, D]`` for one stream of ``B`` rows); `RowsFailed` when some streams could not
    finish their step. ``inputs``: the rows already stacked (a pooled batch's, padded to its bucket, with its
    ``rows``); else the steps' own, stacked here."""
    prefills = [step.prefill for step in steps]
    if inputs is None:
        inputs = stack_inputs([step.inputs for step in steps])
    first = prefills[0]
    share_language_attention(first.model)  # a no-op unless someone switched the model's attention since
    with first.streaming(cache):
        hidden = graphs.run(inputs, tuple(prefill.cache.layout_version for prefill in prefills)) if replay else None
        if hidden is None:
            hidden = graphs.device_step(inputs)
    chunk_len = chunk_of(inputs).shape[1]
    failed: dict[int, Exception] = {}
    for row, step in enumerate(steps):
        try:
            step.prefill.finish_step(chunk_len, step.started, step.carried_before,
                                     durable_record=step.request.durable_record,
                                     ends_vision_call=step.request.ends_vision_call, evicted=step.evicted)
        except Exception as error:  # its disk tier refused the step, or failed midway: it alone is back as it was
            failed[row] = error
    if failed:
        raise RowsFailed(failed, hidden)
    return hidden


def not_taken(error: OutputError, prefill: "StreamingPrefill", evicted: bool = False) -> OutputError:
    """``error`` (the disk tier refused a step: opening its files, an eviction's record, its commit), saying what
    the rollback kept; ``evicted``: frames were evicted to make room for the step, and stay so."""
    kept = "less the frames evicted to make room for it" if evicted else "as before it"
    return OutputError(f"{error}; the step was not taken: the stream holds its {prefill.seen_tokens} tokens {kept}")


class RowsFailed(Exception):
    """Raised by :func:`run_rows` when some streams of a step could not finish it (their disk tier could not write
    it: each is restored as it was before the step); the others took it. ``errors`` by row, ``hidden``
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
    """The device part of a step of ``prefills`` through ``cache`` (one stream's own `TwoStateCache`, or the
    `BatchCache` of several; what a CUDA graph records; run inside the streams' call, see :func:`run_rows`):
    positions (``cache.step_positions``: rows continue from each stream's own length), the decoder's forward over
    every row, every stream's commit. A pooled batch's rows run as `pooled.PooledBatch.forward_rows`."""
    if isinstance(cache, pooled.PooledBatch):
        return cache.forward_rows(inputs)
    first = prefills[0]
    positions = cache.step_positions(inputs["position_ids"], chunk_of(inputs).shape[0])
    if positions is not inputs["position_ids"]:
        inputs = dict(inputs, position_ids=positions)
    steady_compiled = first.compiled_decoder is not None and all(prefill.cache.is_steady() for prefill in prefills)
    decoder = first.compiled_decoder if steady_compiled else first.decoder  # `statekv.core.step.compiled`
    settled = cache.settled_rotary()
    with settled.active() if settled is not None else nullcontext():
        output = decoder(**inputs, attention_mask=first.step_mask, past_key_values=cache, use_cache=True)
    for prefill in prefills:
        missing = prefill.cache.missing_layers()
        if missing:
            raise UnsupportedModelError(
                f"{type(first.decoder).__name__} layers {missing} did not run their attention through "
                "transformers' AttentionInterface, so they cannot be streamed")
    hidden = output.last_hidden_state  # read before the commit: past it a failure could not be rolled back
    for prefill in prefills:
        prefill.cache.commit_device()
    return hidden


def step_together(requests: Sequence[StepRequest]) -> list[torch.Tensor | Exception]:
    """:meth:`StepBatcher.step` with a batcher of its own (no CUDA graphs kept between calls)."""
    return StepBatcher().step(requests)
