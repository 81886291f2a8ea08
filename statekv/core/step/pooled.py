"""Steady steps of many streams as rows of the tensors they share: O(1) ops per layer whoever steps together.

Streams whose steady steps batch (`statekv.core.step.batching.batch_key`) and whose state can be pooled
(:func:`poolable`: the detailed cache in the model's dtype on its device, no per-frame tally)
take seats in their model's `statekv.core.cache.pool.StreamPool`. A batch of them is a set of rows, addressed by
a device LongTensor ``rows`` ``[2, S]`` (seats, then carried-slot rows) that is an input of the step like the
chunk itself, so the device part of a step (`PooledBatch.forward_rows`) never loops over streams:

* the rows' counters give each row's positions and, through the page tables, where its chunk and its step's
  summaries go: one indexed write per layer and field writes every row's;
* each layer gathers the rows' carried slots (``index_select``), writes the chunk into the last T, attends once
  over all rows and selects once (through the engine's one attention function, `statekv.core.cache.two_state.attend`);
  under bounded positions the step gathers every layer's rows at its start and rotates their carried keys to
  where the layout puts them, all layers at once (`statekv.core.positions.rotation.place_carried`);
* the commit gathers the selected slots and writes every row back (``index_copy_``), folds the rows' open
  segments, and advances the rows' counters.

A batch of S streams is padded to its bucket (:data:`BUCKETS`) with scratch rows (row 0 of every table, the first
stream's inputs again) whose results are dropped, so on CUDA each bucket (per batch key) is one recorded graph,
replayed whatever streams fill it (:class:`PooledGraphs`; re-recorded only when a shared tensor moves). The host
part of each stream's step (beginning it, committing its lengths) stays the stream's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from transformers.cache_utils import Cache

from ...errors import UnsupportedModelError
from ..attention.scored import resolve_backend
from ..attention.untraced import engine_call
from ..cache import two_state
from ..cache.engine_layer import EngineLayer
from ..cache.pool import SlotRows, SlotShape, StreamPool, holding, pool_of
from ..cache.transaction import NotBatchable
from ..positions.rotation import place_carried
from ..storage.layer_storage import LayerStorage, sample_index
from ..storage.paged import PagedStorage
from .graphs import StepGraphs

BUCKETS = (1, 2, 4, 8, 16, 32)  # rows of a pooled batch: S streams are padded to the first bucket >= S
KEPT_BATCHES = 16  # pooled batches (batch key and bucket) a pool keeps recorded
KEPT_ROWS = 64  # rows inputs a pooled batch keeps on the device


def bucket(count: int) -> int:
    """The rows a batch of ``count`` streams (at most the last bucket) is padded to."""
    return next(size for size in BUCKETS if size >= count)


def poolable(prefills: Sequence) -> bool:
    """Whether the begun steps of ``prefills`` (equal batch keys) can be rows of their model's pools: each stream's
    detailed cache in the model's dtype on the model's device, a frozen rotation, no per-frame tally, slots or a
    ring in every layer; under bounded positions (1-D RoPE: explicit positions never batch), one layout and range."""
    placing = {(prefill.positions.layout, prefill.positions.limit) for prefill in prefills}
    return len(placing) == 1 and all(
        prefill.rope is not None and prefill.disk is None and prefill.tier.device is None
        and prefill.tier.kv_cache_dtype is None and prefill.cache.tally is None
        and all(type(layer.storage) in (LayerStorage, PagedStorage) for layer in prefill.cache.layers)
        and SlotShape.of(prefill.cache) is not None for prefill in prefills)


class PooledLayer(EngineLayer):
    """Layer ``index`` of a :class:`PooledBatch`: transformers' update stages every row's chunk at once."""

    def __init__(self, batch: "PooledBatch", index: int):
        super().__init__()
        self.batch, self.index = batch, index
        self.is_initialized = True

    @property
    def carry(self) -> SlotRows:
        """The rows' carried form (its ``selects``: False for a ring)."""
        return self.batch.slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return engine_call(self.batch.stage, self.index, key_states, value_states)

    def candidate_positions(self) -> torch.Tensor:
        """Positions ``[S, H_kv, K + T]`` of the keys the rows attend to this step."""
        return self.batch.staged[self.index][1]

    def get_seq_length(self) -> int:
        return 0  # the step's positions are always given

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        carried = self.batch.slots.shape.carried[self.index]
        return carried + query_length, 0


class PooledTransaction:
    """The pending part of a pooled step: which layers attended and each layer's selection ``[S, H_kv, K]``."""

    def __init__(self, batch: "PooledBatch"):
        self.batch = batch
        self.attended = [False] * len(batch.layers)
        self.pending: list[torch.Tensor | None] = [None] * len(batch.layers)

    def keep(self, layer_idx: int, selection: slice | torch.Tensor, read_host_state: bool) -> None:
        """Keep a layer's selection: rows of one batch must each carry as many slots as before."""
        if read_host_state:
            raise NotBatchable("the carry policy read per-stream host values")
        carried = self.batch.slots.shape.carried[layer_idx]
        keys = self.batch.staged[layer_idx][0]
        if isinstance(selection, slice):
            start, stop, _ = selection.indices(keys.shape[3])
            selection = torch.arange(start, stop, device=keys.device).expand(*keys.shape[1:3], -1)
        if selection.shape[-1] != carried:
            raise NotBatchable("a pooled row's carried length would change")
        self.pending[layer_idx] = selection

    def missing_layers(self) -> list[int]:
        return [index for index, attended in enumerate(self.attended) if not attended]


class PooledBatch(Cache):
    """The transformers ``Cache`` of a pooled batch of ``size`` rows of ``pool`` whose carried slots are ``slots``
    (one batch key: the decoder, its rule and attention backend, rotation and compiled step are those of ``first``,
    the stream it was made for). Every step's rows come in as the ``rows`` input of :meth:`forward_rows`; its CUDA
    graphs record ``device_step(members, batch, inputs)`` (`statekv.core.step.batching.device_step`, which comes back
    to :meth:`forward_rows`)."""

    tally = None  # never tallied: such streams are not pooled
    probe = None  # never probed: a probed stream steps alone

    def __init__(self, pool: StreamPool, slots: SlotRows, first, size: int, device_step: Callable):
        super().__init__(layers=[])
        self.pool, self.slots, self.size = pool, slots, size
        self.layers = [PooledLayer(self, index) for index in range(pool.layers)]
        self.policy, self.backend = first.policy, first.attention
        self.decoder, self.compiled = first.decoder, first.compiled_decoder
        self.mask, self.rope = first.step_mask, first.rope  # kept: a recorded step reads the rotation's tensors
        self.placing = first.positions if first.cache.placed else None  # its layout and range, once it placed slots
        self.frequencies = None if self.placing is None else self.placing.frequencies(pool.device)
        self.placer = None  # the carried keys' places in this step (`begin_rows`, bounded positions)
        self.gathered: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer the rows' kv and position rows
        self.placed_keys: list[torch.Tensor | None] = []  # per layer the keys for attention, carried ones placed
        chunk_len = slots.shape.chunk_len
        self.samples = sample_index(chunk_len, pool.device)
        self.transaction = PooledTransaction(self)
        self.staged: list[tuple | None] = [None] * len(self.layers)
        self.graphs = PooledGraphs(self, device_step)
        self.members: list = []  # the streams of the step being run (its rows, padding left out)
        self.tables: dict[tuple[int, ...], torch.Tensor] = {}  # rows inputs by the streams they hold, last used last

    def forward_rows(self, inputs: dict) -> torch.Tensor:
        """The device part of a pooled step (what a CUDA graph records; `statekv.core.step.batching.device_step`
        comes here for a pooled batch): ``inputs`` are the decoder's for the bucket's rows plus ``rows`` ``[2, S]``;
        returns the hidden states ``[S, T, D]`` (the padding rows' included)."""
        inputs = dict(inputs)
        rows = inputs.pop("rows")
        with self.pool.lock:
            try:
                positions = self.begin_rows(rows)
                if inputs["position_ids"] is None:
                    inputs["position_ids"] = positions
                decoder = self.compiled or self.decoder
                with self.rope.active() if self.rope is not None else nullcontext():
                    output = decoder(**inputs, attention_mask=self.mask, past_key_values=self, use_cache=True)
                missing = self.transaction.missing_layers()
                if missing:
                    raise UnsupportedModelError(
                        f"{type(self.decoder).__name__} layers {missing} did not run their attention through "
                        "transformers' AttentionInterface, so they cannot be streamed")
                hidden = output.last_hidden_state  # read before the commit, as `batching.device_step` does
                self.commit()
                return hidden
            finally:  # what the step gathered and placed is held for the step only, whatever became of it
                self.staged = [None] * len(self.layers)
                self.gathered, self.placed_keys = [], []

    def rows(self, table: tuple[int, ...]) -> torch.Tensor:
        """The ``rows`` input ``[2, size]`` of ``table`` (seats, then slot rows), kept for the next steps of the same
        streams: a copy to the device made each step would wait for the device to finish the step before."""
        rows = self.tables.pop(table, None)
        if rows is None:
            rows = torch.tensor(table, dtype=torch.long).view(2, -1).to(self.pool.device)
            while len(self.tables) >= KEPT_ROWS:
                self.tables.pop(next(iter(self.tables)))
        self.tables[table] = rows
        return rows

    def history(self) -> tuple[int, ...]:
        raise NotBatchable("the carry policy reads each stream's step history")

    @property
    def read_host_state(self) -> bool:
        return False  # a rule reading host values raises NotBatchable instead

    def begin_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Device start of a step of the ``rows`` ``[2, S]`` (seats, slot rows): where each row's chunk and summaries
        go, and its positions ``[S, T]`` (returned: the decoder's, under stream positions). Under bounded
        positions, every layer's rows gathered and their carried keys placed (`place_carried`), and the rotary
        positions ``[S, T]`` of each row's chunk returned."""
        pool, chunk_len = self.pool, self.slots.shape.chunk_len
        self.transaction = PooledTransaction(self)
        self.seats, self.slot_rows = rows[0], rows[1]
        self.counters = pool.counters.index_select(1, self.seats)  # [3, S]: seen, step, ring slot
        seen, step, ring = self.counters.unbind(0)
        self.positions = seen[:, None] + pool.arange(chunk_len)
        self.token_places = pool.tokens.places(pool.tokens.table.index_select(0, self.seats), self.positions)
        self.step_places = pool.steps.places(pool.steps.table.index_select(0, self.seats), step[:, None])
        self.ring_target = None if self.slots.ring_index is None else self.slots.ring_index.index_select(0, ring)
        if self.placing is None:
            return self.positions
        # bounded positions: each row's chunk moved to its base (as `StreamPositions.chunk` places one stream's)
        placing, first = self.placing, self.positions[:, :1]
        base = placing.layout.base_on(first, chunk_len, max(self.slots.shape.carried), placing.limit)
        self.placer = placing.layout.place(first[:, :, None], base[:, :, None], chunk_len, placing.limit)
        self.rotations = self.positions - (first - base)
        self.chunk_marks = torch.stack((self.positions, self.positions, self.rotations))  # [3, S, T]
        self.gathered = [(kv.index_select(1, self.slot_rows), marks.index_select(1, self.slot_rows))
                         for kv, marks in zip(self.slots.kv, self.slots.position_rows)]
        self.placed_keys = place_carried(
            self.placer, self.frequencies,
            [(kv[0, :, :, :carried], marks[1:, ..., :carried])
             for (kv, marks), carried in zip(self.gathered, self.slots.shape.carried)], chunk_len,
            fused=resolve_backend(self.backend, pool.device) == "triton")
        return self.rotations

    def stage(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s chunk ``[S, H_kv, T, D]``: every row's summaries and detailed cache written (past the
        committed ends: scratch until the step commits), its carried slots gathered with the chunk in the last T;
        returns ``[carried; chunk]`` keys and values ``[S, H_kv, K + T, D]``."""
        pool, slots = self.pool, self.slots
        mean = keys.mean(dim=2, keepdim=True)
        samples = keys.index_select(2, self.samples).flatten(2).unsqueeze(2)
        pool.steps.data["means"][index][:, self.step_places] = mean.transpose(0, 1)
        pool.steps.data["samples"][index][:, self.step_places] = samples.transpose(0, 1)
        pool.tokens.data["keys"][index][:, self.token_places] = keys.transpose(0, 1)
        pool.tokens.data["values"][index][:, self.token_places] = values.transpose(0, 1)
        reduced = (*torch.aminmax(keys, dim=2, keepdim=True), keys.sum(2, keepdim=True))
        carried = slots.shape.carried[index]
        if self.placing is not None:  # rows gathered, carried keys placed, by `begin_rows`
            kv, marks = self.gathered[index]
            kv[0, :, :, carried:] = keys
            kv[1, :, :, carried:] = values
            marks[..., carried:] = self.chunk_marks[:, :, None]
            self.staged[index] = (kv, marks[0], reduced, marks)
            placed = self.placed_keys[index]
            if placed is None:
                return kv[0], kv[1]
            placed[:, :, carried:] = keys
            return placed, kv[1]
        kv = slots.kv[index].index_select(1, self.slot_rows)
        kv[0, :, :, carried:] = keys
        kv[1, :, :, carried:] = values
        positions = None
        if slots.positions is not None:
            positions = slots.positions[index].index_select(0, self.slot_rows)
            positions[..., carried:] = self.positions[:, None]
        self.staged[index] = (kv, positions, reduced, None)
        return kv[0], kv[1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Every row's attention and the carry selection, once (`statekv.core.cache.two_state.attend`)."""
        return two_state.attend([self], layer_idx, q, k, v, scale)

    def commit(self) -> None:
        """Device part of the commit: every row's open segment folded, its selected slots (or, in a ring, its chunk
        over the oldest step) written back, its counters advanced; the scratch row's counters reset."""
        pool, slots, rows = self.pool, self.slots, self.slot_rows
        for index, (kv, positions, (low, high, total), marks) in enumerate(self.staged):
            segments = pool.segments[index]
            folded = segments.index_select(1, self.seats)
            least, most, summed = folded.unbind(0)
            torch.minimum(least, low, out=least)
            torch.maximum(most, high, out=most)
            torch.add(summed, total, out=summed)
            segments.index_copy_(1, self.seats, folded)
            carried = slots.shape.carried[index]
            if slots.ring_index is not None:
                slots.kv[index][:, rows[:, None], :, self.ring_target] = kv[:, :, :, carried:].permute(1, 3, 0, 2, 4)
                continue
            chosen = self.transaction.pending[index]
            kept = kv.gather(3, chosen[None, ..., None].expand(2, -1, -1, -1, kv.shape[-1]))
            slots.kv[index][:, :, :, :carried].index_copy_(1, rows, kept)
            if marks is not None:  # positions, anchors and rotations: [3, S, H_kv, K + T]
                slots.position_rows[index][..., :carried].index_copy_(
                    1, rows, marks.gather(3, chosen.expand(3, -1, -1, -1)))
            else:
                slots.positions[index][:, :, :carried].index_copy_(0, rows, positions.gather(2, chosen))
        seen, step, ring = self.counters.unbind(0)
        if slots.shape.ring is not None:
            ring = torch.remainder(ring + 1, slots.shape.ring[0])
        pool.counters.index_copy_(1, self.seats, torch.stack([seen + slots.shape.chunk_len, step + 1, ring]))
        pool.counters[:, 0].zero_()


class PooledGraphs(StepGraphs):
    """The recorded steps of one pooled batch (batch key and bucket): valid while the pool's shared tensors stay
    where they are (its ``version``), whichever streams fill the rows."""

    def __init__(self, batch: PooledBatch, device_step: Callable):
        super().__init__(lambda inputs: device_step(batch.members, batch, inputs), lambda: False)
        self.streams = batch.pool  # (``pool`` is the graphs' memory pool)

    def run(self, inputs: dict, layout) -> torch.Tensor | None:
        with self.streams.lock:
            return super().run(inputs, self.streams.version)


def rows(prefills: Sequence, key: tuple, device_step: Callable) -> tuple[PooledBatch, PooledGraphs, torch.Tensor]:
    """The pooled batch of ``prefills`` (at most the last bucket; begun, equal batch ``key``, each `poolable`): their
    seats taken and settled, room made for the step, and the batch's ``rows`` ``[2, bucket]`` (padding: row 0).
    ``device_step``: what a new batch's graphs record (`PooledBatch`)."""
    first = prefills[0]
    pool = pool_of(first.decoder, first.geometry, first.device)
    with pool.lock:
        seats = [pool.seat(prefill.cache) for prefill in prefills]
        chunk_len = seats[0].slots.shape.chunk_len
        for prefill, seat in zip(prefills, seats):
            seat.tokens.ensure(prefill.cache.seen_tokens + chunk_len)
            seat.steps.ensure(prefill.cache.step_index + 1)
        pool.tokens.widen(math.ceil(chunk_len / pool.tokens.page))  # the scratch row's chunk, too
        size = bucket(len(prefills))
        batch = pool.batches.pop((key, size), None)  # put back last: the batches kept are those used last
        if batch is None or batch.slots is not seats[0].slots:
            batch = PooledBatch(pool, seats[0].slots, first, size, device_step)
            while len(pool.batches) >= KEPT_BATCHES:
                pool.batches.pop(next(iter(pool.batches))).graphs.clear()
        pool.batches[key, size] = batch
        batch.members = list(prefills)
        padding = (0,) * (size - len(seats))
        return batch, batch.graphs, batch.rows((*(seat.row for seat in seats), *padding,
                                                *(seat.slot for seat in seats), *padding))


def pages_held(prefills: Sequence):
    """The lock of the pool whose pages the streams of ``prefills`` stepping without it hold (a stream seated by an
    earlier pooled step writes its pages still, and a pooled step of other streams, another `VideoQA`'s of the same
    model or a catch-up on another thread, may move those pages meanwhile), or a null context. The streams of one
    step share a model, so one pool at most."""
    pool = next((pool for pool in (holding(prefill.cache) for prefill in prefills) if pool is not None), None)
    return nullcontext() if pool is None else pool.lock
