"""Saving and resuming a two-state cache: its tensors and metadata, and the checks a saved state must pass.

A layer saves its detailed cache, its step summaries (means and sampled keys) and, unless its carried state is a
window of the detailed cache (then only where the window starts), the carried keys, values and positions.
Resuming installs them in whatever form fits the resumed stream (a window saved without offload becomes explicit
slots when offloaded).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import forms
from .step_runs import StepRuns
from ..storage.step_values import StepValues
from ..storage.buffers import CarriedSlots
from ...errors import InputError
from ...settings.values import check_int, is_finite_number
from ..storage.memory import CacheGeometry
from ..storage.quantized import expected_tensors, saved_scale_dtypes
from ..storage.host_pages import RELEASED
from ..storage import layer_storage
from ..storage.layer_storage import SAMPLES_PER_STEP

TALLY = "attention_tally"  # metadata: evict-least-attended's totals of the steps it may still evict
# the tensors that can be saved without released rows: read from buffers an evicting stream gives rows of back
RELEASABLE = ("keys", "values", "key_codes", "value_codes", "value_scales", "key_scales", "block_keys",
              "step_samples", "segment_index")
SHARED_ROWS = {"values": "keys", "keys": "values"}  # saved from one buffer's parts
PER_STEP_ROWS = ("key_scales", "block_keys", "step_samples")  # a row per step (segment_index: per segment)

# The cache's classes (``TwoStateCache``, ``StreamingLayer``) are named in annotations only: the cache imports
# this module.


def state_dict(cache: "TwoStateCache", as_runs: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Everything a resumed stream needs: tensors named ``layers.{i}.{name}`` and JSON-able metadata
    (``chunk_lengths``, ``seen_tokens``, ``window_starts``). ``as_runs``: the lists with an entry per step as the
    cache holds them instead (copies: the lengths a `StepValues`, the evicted steps a `StepRuns`, the placements
    three `StepValues`), so a stream's save makes no list a step; `load_state_dict` takes either."""
    tensors, window_starts = {}, []
    for index, layer in enumerate(cache.layers):
        layer_tensors, window_start = export_layer(layer)
        tensors.update({f"layers.{index}.{name}": t for name, t in layer_tensors.items() if t is not None})
        window_starts.append(window_start)
    metadata = {"chunk_lengths": StepValues(cache.chunk_lengths) if as_runs else list(cache.chunk_lengths),
                "seen_tokens": cache.seen_tokens, "window_starts": window_starts}
    if cache.evicted_steps:  # absent unless a cache limit evicted steps (so states without any read as before)
        metadata["evicted_steps"] = cache.evicted_steps.copy() if as_runs else sorted(cache.evicted_steps)
    if cache.tier.kv_cache_dtype is not None:  # absent: stored in the model's dtype (as every earlier save)
        metadata["kv_cache_dtype"] = cache.tier.kv_cache_dtype
    if cache.positions.bounded:  # absent: stream positions (as every earlier save)
        metadata["positions"] = cache.positions.export(as_runs)
    if cache.tally is not None:  # evict-least-attended ranks by it (absent: every total zero, as earlier saves)
        steps, totals = cache.tally.export(cache.evicted_steps)
        metadata[TALLY] = {"steps": steps.tolist(), "totals": totals.tolist()}
    return tensors, metadata


def load_state_dict(cache: "TwoStateCache", tensors: dict[str, torch.Tensor], metadata: dict,
                    device: torch.device) -> None:
    """Install a state from :func:`state_dict` (checked first with `check_state_dict` by
    `StreamingPrefill.load_state_dict`); carried tensors go to ``device``."""
    if len(metadata["window_starts"]) != len(cache.layers):
        raise InputError(f"the saved state has {len(metadata['window_starts'])} layers, the model "
                         f"{len(cache.layers)}")
    lengths = StepValues(metadata["chunk_lengths"])  # as runs (a list given is folded)
    cache.positions.load(metadata.get("positions"), lengths)
    cache.shared_ring.reset()
    for index, (layer, window_start) in enumerate(zip(cache.layers, metadata["window_starts"])):
        prefix = f"layers.{index}."
        layer_tensors = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        restore_layer(layer, layer_tensors, window_start, lengths, device)
    cache.chunk_lengths = lengths
    cache.seen_tokens = int(metadata["seen_tokens"])
    cache.evicted_steps = _step_set(metadata.get("evicted_steps", ()))
    if cache.tally is not None:
        tally = metadata.get(TALLY) or {"steps": [], "totals": []}
        cache.tally.restore(torch.tensor(tally["steps"], dtype=torch.long),
                            torch.tensor(tally["totals"], dtype=torch.float64), len(cache.chunk_lengths))
    cache.seen_device = None
    cache.settle_placement()
    cache.buffers_replaced()


def _step_set(steps: Sequence[int] | StepRuns) -> StepRuns:
    """``steps`` (a list, or a `StepRuns`) as a `StepRuns` of its own."""
    return steps.copy() if isinstance(steps, StepRuns) else StepRuns(steps)


def _check_tally(tally: Any, steps: int) -> None:
    """A one-line `InputError` unless ``tally`` (the metadata's, if any) lists ascending steps among ``steps``
    and as many finite, non-negative totals."""
    if tally is None:
        return
    listed = tally.get("steps") if isinstance(tally, dict) else None
    totals = tally.get("totals") if isinstance(tally, dict) else None
    if (not isinstance(listed, list) or not isinstance(totals, list) or len(listed) != len(totals)
            or not all(type(s) is int and 0 <= s < steps for s in listed)
            or any(b <= a for a, b in zip(listed, listed[1:]))
            or not all(type(t) in (int, float) and is_finite_number(t) and t >= 0 for t in totals)):
        raise InputError(f"the cache metadata's {TALLY} must list ascending steps among its {steps} and a finite, "
                         "non-negative total for each")


def export_layer(layer: "StreamingLayer") -> tuple[dict[str, torch.Tensor], int | None]:
    """The committed state as tensors (views where possible) and the window start (None: explicit form)."""
    layer.storage.synchronize()
    tensors = layer.storage.export()
    start = layer.carry.saved_start(layer.storage)
    if start is not None or layer.slots is None:
        return tensors, start
    carried_keys, carried_values = layer.carried()
    tensors.update(carried_keys=carried_keys, carried_values=carried_values, carried_positions=layer.positions())
    placements = layer.slots.head_placements()
    if placements is not None:  # bounded positions: where each carried key sits in RoPE
        tensors["carried_placements"] = placements
    return tensors, None


def restore_layer(layer: "StreamingLayer", tensors: dict[str, torch.Tensor], window_start: int | None,
                  steps: Sequence[int], device: torch.device) -> None:
    """Install a state saved by :func:`export_layer` (``steps``: the token count of every step); the carried
    state goes to ``device`` (the model's)."""
    storage = layer.storage
    released = {name.removesuffix(RELEASED): [tuple(run) for run in runs.tolist()]
                for name, runs in tensors.items() if name.endswith(RELEASED)}
    tensors = {name: t for name, t in tensors.items() if not name.endswith(RELEASED)}
    storage.load(tensors, steps, device, released)
    layer.carry = forms.Slots(None) if window_start is None else forms.Window(window_start)
    if window_start is not None and not storage.holds_window:  # saved without offload: make it explicit
        keys, values = storage.read_range(window_start, storage.length)
        b, h = keys.shape[:2]
        positions = torch.arange(window_start, storage.length).expand(b, h, -1)
        tensors = dict(tensors, carried_keys=keys, carried_values=values, carried_positions=positions)
        window_start, layer.carry = None, forms.Slots(None)
    if window_start is None and "carried_keys" in tensors:
        kv = torch.stack([tensors["carried_keys"], tensors["carried_values"]]).to(device)
        placements = tensors.get("carried_placements")
        layer.carry = forms.Slots(CarriedSlots.holding(kv, tensors["carried_positions"].to(device), 0,
                                                       None if placements is None else placements.to(device)))
    layer.is_initialized = storage.length > 0
    if layer.is_initialized:
        like = storage.means_like  # the step summaries' dtype (reading them whole would copy them)
        layer.dtype, layer.device = (storage.summaries.means if like is None else like).dtype, device
        storage.restored(layer.dtype, device)


def check_state_dict(tensors: dict[str, torch.Tensor], metadata: dict, geometry: CacheGeometry,
                     kv_cache_dtype: str | None = None) -> None:
    """Refuse (one-line `InputError`) a state that :func:`state_dict` of a stream over a model of
    ``geometry`` could not have written: its metadata's types and counts, and every tensor's presence, dtype
    and shape (``layers.{i}.keys``/``values`` ``[B, H_kv, tokens, D]``, ``block_keys`` ``[B, H_kv, steps, D]``,
    ``step_samples`` ``[B, H_kv, steps, SAMPLES_PER_STEP * D]``,
    and, for a layer saved in explicit form, ``carried_keys``/``carried_values`` ``[B, H_kv, K, D]`` with
    ``carried_positions`` ``[B, H_kv, K]`` among the tokens; a tensor saved without its released rows,
    `host_pages.saved_rows`, is that much shorter). Reads tensor values only to range-check positions and runs."""
    if not isinstance(metadata, dict):
        raise InputError(f"the cache metadata must be a mapping, got {type(metadata).__name__}")
    if not isinstance(tensors, Mapping):
        raise InputError(f"the saved tensors must be a mapping of names to tensors (state_dict()'s first value), "
                         f"got {type(tensors).__name__}")
    for key in ("chunk_lengths", "seen_tokens", "window_starts"):
        if key not in metadata:
            raise InputError(f"the cache metadata lacks {key!r}")
    saved = metadata.get("kv_cache_dtype")
    if saved != kv_cache_dtype:
        raise InputError(f"the saved detailed cache is stored as kv_cache_dtype={saved or 'auto'}, this stream's "
                         f"as {kv_cache_dtype or 'auto'}; resume it with kv_cache_dtype={saved or 'auto'}")
    lengths, starts = metadata["chunk_lengths"], metadata["window_starts"]
    if not isinstance(lengths, (list, StepValues)) or not isinstance(starts, list):
        raise InputError("the cache metadata's chunk_lengths and window_starts must be lists")
    for length in lengths if isinstance(lengths, list) else ():  # a `StepValues` holds ints
        check_int(length, "a saved step length", error=InputError)
    lengths = StepValues(lengths)  # as runs: summed and read a run at a time
    seen = check_int(metadata["seen_tokens"], "seen_tokens", minimum=0, error=InputError)
    if seen != lengths.total():
        raise InputError(f"the cache metadata says {seen} tokens, but its steps add up to {lengths.total()}")
    evicted = metadata.get("evicted_steps", [])
    held = evicted.runs() if isinstance(evicted, StepRuns) else None
    if not (held is not None and (not held or held[0][0] >= 0 and held[-1][1] <= len(lengths))
            or isinstance(evicted, list) and all(isinstance(s, int) and not isinstance(s, bool)
                                                 and 0 <= s < len(lengths) for s in evicted)):
        raise InputError(f"the cache metadata's evicted_steps must list steps among its {len(lengths)}")
    _check_tally(metadata.get(TALLY), len(lengths))
    if len(starts) != geometry.layers:
        raise InputError(f"the saved state has {len(starts)} layers, the model {geometry.layers}")
    expected = {}
    batch = None
    placed = _placed(metadata, tensors)
    for index, start in enumerate(starts):
        prefix = f"layers.{index}."
        if start is not None and check_int(start, f"layer {index}'s window start", minimum=0,
                                           error=InputError) > seen:
            raise InputError(f"layer {index}'s window starts at {start}, after the {seen} tokens saved")
        first = "keys" if kv_cache_dtype is None else "key_codes"
        keys = tensors.get(prefix + first)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            raise InputError(f"the saved state lacks {prefix}{first} [B, H_kv, tokens, D]")
        batch = keys.shape[0] if batch is None else batch
        head = (batch, geometry.kv_heads)
        expected.update({prefix + name: shaped for name, shaped in expected_tensors(
            kv_cache_dtype, head, seen, len(lengths), geometry.head_dim, geometry.dtype).items()})
        width = getattr(tensors.get(prefix + "key_scales"), "dtype", None)
        if kv_cache_dtype and width in saved_scale_dtypes(geometry.dtype):  # both scales in the keys' one
            for name in ("key_scales", "value_scales"):
                expected[prefix + name] = (expected[prefix + name][0], width)
        if prefix + "block_keys" in tensors:  # absent in states saved before step means were kept
            expected[prefix + "block_keys"] = ((*head, len(lengths), geometry.head_dim), geometry.dtype)
        if prefix + "step_samples" in tensors:  # absent in states saved before sampled keys were kept
            expected[prefix + "step_samples"] = ((*head, len(lengths), SAMPLES_PER_STEP * geometry.head_dim),
                                                 geometry.dtype)
        if prefix + "segment_index" in tensors:  # absent in states saved before the index was kept
            index = tensors[prefix + "segment_index"]
            segments = index.shape[2] if isinstance(index, torch.Tensor) and index.dim() == 4 else -1
            if segments >= 0 and prefix + "segment_index" + RELEASED in tensors:
                segments += _released_rows(tensors, prefix + "segment_index", len(lengths))
            if not 0 <= segments <= len(lengths):
                raise InputError(f"the saved state's {prefix}segment_index must be [B, H_kv, segments, 3 D] with at "
                                 f"most one segment per step")
            expected[prefix + "segment_index"] = ((*head, segments, 3 * geometry.head_dim), geometry.dtype)
            expected[prefix + "segment_partial"] = ((*head, 1, 3 * geometry.head_dim), geometry.dtype)
        if start is None and seen:
            carried = tensors.get(prefix + "carried_positions")
            size = carried.shape[-1] if isinstance(carried, torch.Tensor) and carried.dim() == 3 else -1
            if not 0 <= size <= seen:
                raise InputError(f"the saved state lacks {prefix}carried_positions [B, H_kv, K] with K <= {seen}")
            expected[prefix + "carried_keys"] = expected[prefix + "carried_values"] = (
                (*head, size, geometry.head_dim), geometry.dtype)
            expected[prefix + "carried_positions"] = ((*head, size), torch.long)
            if placed:
                expected[prefix + "carried_placements"] = ((2, *head, size), torch.long)
    for name in [name for name in tensors if name.endswith(RELEASED)]:
        saved = name.removesuffix(RELEASED)
        layer, _, kind = saved.rpartition(".")
        if saved not in expected or kind not in RELEASABLE:
            raise InputError(f"the saved state holds unexpected tensors: {name}")
        partner = SHARED_ROWS.get(kind)  # a buffer's parts share their rows: given back alike
        other = tensors.get(f"{layer}.{partner}{RELEASED}") if partner else None
        if partner and not (isinstance(other, torch.Tensor) and torch.equal(other, tensors[name])):
            raise InputError(f"{name} must list the runs {layer}.{partner}{RELEASED} lists (one buffer holds both)")
        shape, dtype = expected[saved]
        expected[saved] = ((*shape[:2], shape[2] - _released_rows(tensors, saved, shape[2]), *shape[3:]), dtype)
    _check_released_evicted(tensors, lengths, evicted)
    unexpected = sorted(set(tensors) - set(expected) - {name for name in tensors if name.endswith(RELEASED)})
    if unexpected:
        raise InputError(f"the saved state holds unexpected tensors: {', '.join(unexpected[:3])}")
    for name, (shape, dtype) in expected.items():
        tensor = tensors.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"the saved state lacks {name} {list(shape)}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise InputError(f"{name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, expected "
                             f"{str(dtype).removeprefix('torch.')} {list(shape)} for this model")
        if name.endswith("carried_positions") and tensor.numel() and not (
                int(tensor.min()) >= 0 and int(tensor.max()) < seen):
            raise InputError(f"{name} holds positions outside the {seen} tokens saved")


def _check_released_evicted(tensors: dict[str, torch.Tensor], lengths: StepValues,
                            evicted: Sequence[int] | StepRuns) -> None:
    """Refuse rows a save left out (read back as zeros) that the state did not evict: a token's only within an
    evicted step, a step's only of an evicted step, an index row only of a segment all of whose steps are evicted.
    (A file edited to list fewer evicted steps would have those zeros read as the stream's keys and values.)"""
    steps = _step_set(evicted).runs()
    starts = lengths.running_totals()  # a run at a time: a stream that evicted for weeks is not walked
    tokens = [[starts[first], starts[end]] for first, end in steps]
    per_segment = layer_storage.SEGMENT_STEPS  # read when a storage is made, so read here as it is now
    segments = [[-(-first // per_segment), end // per_segment] for first, end in steps]
    for name in [name for name in tensors if name.endswith(RELEASED)]:
        kind = name.removesuffix(RELEASED).rpartition(".")[2]
        what, allowed = (("segments", segments) if kind == "segment_index" else ("steps", steps)
                         if kind in PER_STEP_ROWS else ("tokens", tokens))
        firsts = [first for first, _ in allowed]
        for start, end in tensors[name].tolist():
            at = bisect.bisect_right(firsts, start) - 1
            if at < 0 or allowed[at][1] < end:
                raise InputError(f"{name} leaves out {what} [{start}, {end}), which the state did not evict (its "
                                 "evicted_steps)")


def _released_rows(tensors: dict[str, torch.Tensor], name: str, rows: int) -> int:
    """How many of ``name``'s ``rows`` rows its runs ``{name}.released`` say it was saved without, refusing runs
    that are not ascending, disjoint and among those rows."""
    runs = tensors[name + RELEASED]
    if not isinstance(runs, torch.Tensor) or runs.dtype != torch.long or runs.dim() != 2 or runs.shape[1] != 2:
        raise InputError(f"{name}{RELEASED} must be int64 [runs, 2], the [start, end) runs of rows it was saved "
                         "without")
    at = 0
    for start, end in runs.tolist():
        if not at <= start < end <= rows:
            raise InputError(f"{name}{RELEASED} must list ascending, disjoint runs of rows among its {rows}, got "
                             f"[{start}, {end})")
        at = end
    return int((runs[:, 1] - runs[:, 0]).sum())


def _placed(metadata: dict, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a saved bounded state carries placements in every explicit layer: it was placed (a step placed
    away from its own position, or any layer saved with placements; `TwoStateCache.place_slots`)."""
    positions = metadata.get("positions")
    if not isinstance(positions, dict) or positions.get("mode") != "bounded":
        return False
    steps = positions.get("steps")
    moved = isinstance(steps, list) and any(isinstance(step, list) and len(step) == 3 and step[0] != step[2]
                                            for step in steps) or \
        isinstance(steps, tuple) and len(steps) == 3 and steps[0] != steps[2]  # as runs: firsts and bases
    return moved or any(name.endswith(".carried_placements") for name in tensors)


def to_dynamic_cache(cache, device: torch.device | None = None) -> DynamicCache:
    """Every token's keys/values of ``cache`` (a `TwoStateCache`) as a ``DynamicCache``: views (no copy) of a
    detailed cache held in the model's dtype, or copies on ``device`` when it is stored elsewhere (offloaded,
    quantized, on disk).

    ``DynamicCache.update`` concatenates into new tensors, so decoding from it never writes into the detailed
    buffers.
    """
    exported_cache = DynamicCache()
    for layer in cache.layers:
        exported = DynamicLayer()
        exported_cache.layers.append(exported)
        if not layer.is_initialized:
            continue  # nothing streamed yet: an empty layer
        keys, values = layer.storage.read_range(0, layer.storage.length, device, layer.dtype)
        exported.lazy_initialization(keys, values)
        exported.keys, exported.values = keys, values
    return exported_cache
