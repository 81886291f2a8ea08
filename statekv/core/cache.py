"""The two-state cache: a small carried state per layer and KV head, and a detailed cache of every token.

During a step the model's attention modules call :meth:`StreamingLayer.update` with the chunk's keys and values,
which returns ``[carried; chunk]``; the registered attention function then scores those keys and asks the policy
what to carry (:func:`attend`, for one stream's cache or the rows of several streams' batch). The step is a
transaction (:mod:`statekv.core.transaction`): :meth:`TwoStateCache.commit_device` installs the new carried state,
:meth:`TwoStateCache.commit_host` advances the committed lengths, :meth:`TwoStateCache.rollback` forgets it.

Each layer holds two objects: its ``storage`` (:mod:`statekv.core.storage`: the detailed cache and step
means, with the model or offloaded) and its ``carry``, the form of its carried state
(:mod:`statekv.core.forms`: a window of the detailed cache, slots, or a ring). In the slots and ring forms,
everything that changes from step to step lives in device tensors that the step itself advances
(:class:`~statekv.core.transaction.StepContext`), so a steady step is static and can be captured as a CUDA graph.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import UnsupportedModelError
from . import forms, persistence, tiers
from .attention import ChunkMask, chunk_attention, scored_attention
from .policies import Candidates, CarryPolicy
from .positions import StreamPositions
from .steering import steered
from .transaction import NotBatchable, StepContext, StepTransaction, checked
from .untraced import engine_call


class StreamingLayer(CacheLayerMixin):
    """One decoder layer's two states: ``storage`` (every token, see :mod:`statekv.core.storage`) and
    ``carry`` (the carried state's form, see :mod:`statekv.core.forms`).

    ``detailed``: every token's keys and values (a :class:`TokenBuffer` of 2 parts, length = tokens);
    ``block_keys``: every step's mean key ``[B, H_kv, steps, D]`` (1 part, length = steps).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, on_replace: Callable[[], None], index: int, capacity_hint: int | None = None,
                 storage_device: torch.device | str | None = None, kv_cache_dtype: str | None = None,
                 make_storage=None):
        super().__init__()
        self.index, self._on_replace = index, on_replace  # called when a buffer a captured step reads is replaced
        self.storage = tiers.layer_storage(index, capacity_hint, storage_device, kv_cache_dtype, on_replace,
                                           make_storage)
        self._carry = forms.initial(self.storage)
        self.step: StepContext | None = None  # the step being run, handed in by begin()

    @property
    def carry(self):
        """The carried state's form (:class:`forms.Window`, :class:`forms.Slots` or :class:`forms.RingForm`)."""
        return self._carry

    @carry.setter
    def carry(self, form) -> None:
        replaced, self._carry = form.buffer is not self._carry.buffer, form
        if replaced:
            self._on_replace()

    detailed = property(lambda self: self.storage.detailed)
    block_keys = property(lambda self: self.storage.block_keys)
    offloaded = property(lambda self: self.storage.offloaded)
    form = property(lambda self: self.carry.name, doc="The carried form's name: window, slots or ring.")
    slots = property(lambda self: self.carry.buffer, doc="The slots buffer (None in the window form).")
    window_start = property(lambda self: self.carry.start, doc="Where a window form starts (else None).")

    # transformers' CacheLayerMixin interface ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.carry = self.carry.begin(self.storage, key_states, placed=self.step.placements is not None)
        self.storage.start(key_states)
        self.carry.reserve(self.storage, key_states.shape[2])  # slots over a storage the step writes in place

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' call: :meth:`stage` (untraced in a compiled step, `statekv.core.untraced`)."""
        return engine_call(self.stage, key_states, value_states)

    def stage(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the chunk ``[B, H_kv, T, D]`` and return ``[carried; chunk]`` keys and values (under bounded
        positions, the keys rotated to where this step places them; what is stored keeps its own rotation)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.storage.stage_summaries(key_states, self.step.step_device)
        keys, values = self.carry.stage(self.storage, key_states, value_states, self.step)
        if self.step.placements is not None:
            anchors, rotations = self.carry.placements()
            keys = self.step.positions.rotated(keys, anchors, rotations, self.carried_length)
        return keys, values

    def get_seq_length(self) -> int:
        """Logical tokens committed (what the model's positions count), as transformers' sliding layers."""
        return self.storage.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(carried + query_length, offset)``: the keys handed to attention and the logical position the
        first of them would have if they were contiguous (so the chunk is causal at the end)."""
        return self.carried_length + query_length, self.storage.length - self.carried_length

    def get_max_length(self) -> int:  # no maximum
        return -1

    # The rest of the mixin acts on ``keys``/``values`` fields this layer never sets: its detailed cache is
    # offloaded by its storage (the ``offload`` setting), never reset in place, and one stream is one sequence.
    def offload(self):
        raise UnsupportedModelError("a streaming layer is offloaded by its storage (the offload setting), not by "
                                    "transformers' layer offloading")

    def prefetch(self):
        raise UnsupportedModelError("a streaming layer is offloaded by its storage (the offload setting), not by "
                                    "transformers' layer offloading")

    def reset(self) -> None:
        raise UnsupportedModelError("a stream's cache is never reset in place; make a new stream")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("a stream's cache holds one sequence and cannot be reordered (beam search)")

    # two-state bookkeeping -------------------------------------------------------------------------------
    @property
    def carried_length(self) -> int:
        return self.carry.carried_length(self.storage)

    @property
    def device_nbytes(self) -> int:
        """Bytes of this layer's cache on the model's device."""
        return self.carry.nbytes + self.storage.device_nbytes()

    def carried(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The carried keys and values, ``[B, H_kv, K, D]`` each, in time order."""
        return self.carry.carried(self.storage)

    def positions(self) -> torch.Tensor:
        """Logical positions of the carried tokens, ``[B, H_kv, K]`` (``[1, 1, 0]`` before the first step)."""
        return self.carry.positions(self.storage)

    def candidate_positions(self) -> torch.Tensor:
        """Positions ``[B, H_kv, K + T]`` of the tokens handed to attention this step."""
        return self.carry.candidate_positions(self.storage, self.step)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[carried; chunk]`` keys and values ``[B, H_kv, K + T, D]`` as handed to attention this step."""
        return self.carry.candidates(self.storage, self.step)

    def prepare(self, step: StepContext) -> None:
        """Host-side preparation of ``step`` (before the forward): buffers sized for its chunk."""
        self.step = step
        if not self.is_initialized:
            return
        self.storage.prepare(step.chunk_len)
        self.carry = self.carry.prepare(self.storage, step.chunk_len)
        self.carry.reserve(self.storage, step.chunk_len)

    def export(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The committed state as tensors and the window start (see :func:`persistence.export_layer`)."""
        return persistence.export_layer(self)

    def restore(self, tensors: dict[str, torch.Tensor], window_start: int | None, steps: list[int],
                device: torch.device) -> None:
        """Install a state saved by :meth:`export` (see :func:`persistence.restore_layer`)."""
        persistence.restore_layer(self, tensors, window_start, steps, device)


class TwoStateCache(Cache):
    """A transformers ``Cache`` of :class:`StreamingLayer` s, driven one step at a time by a carry policy.

    Args:
        num_layers: decoder layers of the model.
        policy: the carry rule.
        backend: attention backend for policies that need scores (see :func:`scored_attention`).
        capacity_hint: tokens to preallocate in each detailed buffer (the planned horizon), if known.
        storage_device: where the detailed cache lives, if not with the model (offload, e.g. ``"cpu"``).
        kv_cache_dtype: ``"int8"`` or ``"int4"`` to store the detailed cache quantized
            (:mod:`statekv.core.quantized`); None: in the model's dtype (checked by `EngineSettings`).
        make_storage: builds each layer's storage instead (``(index, capacity_hint, on_replace,
            kv_cache_dtype)``; the disk tier's, :class:`statekv.core.disk.DiskTier`).
        positions: the stream's RoPE positions (:class:`~statekv.core.positions.StreamPositions`; default: the
            stream's own, ``stream``). Under ``bounded`` every layer carries slots (no window, no ring), each slot
            with its placement.

    ``evicted_steps``: steps whose detailed keys and values were given up under a cache limit
    (:mod:`statekv.core.limits`); answers never read them. ``tally``: when kept, the attention mass
    each step's tokens received from the stream's own scored steps, summed over layers and heads.

    A step is ``begin`` (host) -> ``begin_device`` -> the model's forward (``update``/``attend`` per layer)
    -> ``commit_device`` -> ``commit_host``; the device part may be a CUDA graph replay. The steps of several
    streams may share one forward (:class:`statekv.core.batching.BatchCache`): each cache is then one row.
    """

    def __init__(self, num_layers: int, policy: CarryPolicy, backend: str = "auto",
                 capacity_hint: int | None = None, storage_device: torch.device | str | None = None,
                 kv_cache_dtype: str | None = None, make_storage=None, positions: StreamPositions | None = None):
        super().__init__(layers=[])
        self.kv_cache_dtype = kv_cache_dtype
        self.layout_version = 0  # bumped whenever a buffer that a captured step reads is replaced
        self.peak_device_bytes = 0  # most bytes of cache this stream held on the model's device at once
        self.layers = [StreamingLayer(self.buffers_replaced, i, capacity_hint, storage_device, self.kv_cache_dtype,
                                      make_storage) for i in range(num_layers)]
        self.positions = positions or StreamPositions()
        self.evicted_steps: set[int] = set()
        self.tally = None  # a limits.AttentionTally, only under evict-least-attended
        self.guide = None  # a steering.QuestionGuide while standing questions steer what is carried
        self.policy, self.backend = policy, backend
        self.chunk_lengths, self.seen_tokens = [], 0  # each committed step's length; their sum
        self._starts = array("q", [0])  # each committed step's first token, then the end (8 bytes a step)
        self.shared_ring = forms.SharedRing()
        self.seen_device: torch.Tensor | None = None  # seen_tokens, kept on the model's device by the step
        self.step_device: torch.Tensor | None = None  # LongTensor [1]: the step's index, likewise
        self.transaction: StepTransaction | None = None  # the step being run
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        if self.positions.bounded:  # each carried slot is rotated on its own: slots in every layer
            self.shared_ring.allowed = False
            for layer in self.layers:
                layer.storage.holds_window = False
                layer.carry = forms.initial(layer.storage)

    @property
    def step_index(self) -> int:
        """Index of the step being run (or about to run)."""
        return len(self.chunk_lengths)

    @property
    def chunk_len(self) -> int:
        """Tokens of the step being run (0 before the first)."""
        return 0 if self.transaction is None else self.transaction.context.chunk_len

    @property
    def ring(self):
        """The ring every layer holds its carried state in, if any (:class:`~statekv.core.buffers.Ring`)."""
        return self.shared_ring.ring

    @property
    def read_host_state(self) -> bool:
        """Whether the policy read per-step host values during the current step (it cannot be captured)."""
        return self.transaction is not None and self.transaction.read_host_state

    # one step ----------------------------------------------------------------------------------------------
    def begin(self, chunk_len: int, device: torch.device, position_ids: torch.Tensor | None = None) -> None:
        """Host-side preparation of a step of ``chunk_len`` tokens on ``device`` (at explicit ``position_ids``, if
        given): buffers sized for it, the ring entered or left, the chunk placed (bounded positions). Nothing the
        stream has committed changes."""
        if self.seen_device is None or self.seen_device.device != device:
            self.seen_device = torch.tensor(self.seen_tokens, device=device)
            self.step_device = torch.tensor([self.step_index], device=device)
            self.buffers_replaced()
        if (chunk_len, device) not in self._aranges:
            self._aranges[chunk_len, device] = torch.arange(chunk_len, device=device)
        context = StepContext(chunk_len, self.step_index, self.step_device)
        if self.positions.bounded:
            carried = max(layer.carried_length for layer in self.layers)
            self.positions.plan(chunk_len, self.seen_tokens, position_ids, carried)
            context.positions = self.positions
        self.transaction = StepTransaction(context, self.layers)
        self.shared_ring.update(self.layers, self.policy, self.chunk_lengths, self.seen_tokens, context, device)
        for layer in self.layers:
            layer.prepare(context)

    def buffers_replaced(self) -> None:
        """Some buffer a captured step reads moved: recorded steps are no longer valid."""
        self.layout_version += 1
        self.note_device_bytes()

    def device_bytes(self) -> int:
        """Bytes of cache held on the model's device now (carried state, and the detailed cache unless it is
        offloaded)."""
        return sum(layer.device_nbytes for layer in self.layers)

    def note_device_bytes(self, extra: int = 0) -> None:
        """Record the device cache in use now, plus ``extra`` bytes held for answering, in the peak."""
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes() + extra)

    def is_steady(self) -> bool:
        """Whether the step just begun has the static form a CUDA graph can replay: every layer in a ring, or
        in slots holding the tokens its rule carries once steady (`CarryPolicy.steady_budget`). A step steered by
        standing questions is not (its scores read their queries)."""
        if self.guide is not None and self.guide.active:
            return False
        return all(layer.carry.is_static(self.policy.steady_budget(layer.index)) for layer in self.layers)

    def begin_device(self, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Device-side start of the step: the chunk's RoPE positions for the decoder (``position_ids`` if given,
        else ``[T]``). Its logical positions (where it goes in the detailed cache) are computed from the device
        copy of ``seen_tokens``; under ``stream`` positions they are also its RoPE positions, under ``bounded``
        the chunk is moved to its place (:mod:`statekv.core.positions`)."""
        context = self.transaction.context
        context.write_index = torch.add(self._aranges[context.chunk_len, self.seen_device.device], self.seen_device)
        if context.positions is None:
            return context.write_index if position_ids is None else position_ids
        rotary, anchors, rotations = self.positions.chunk(context.write_index, position_ids)
        context.placements = (anchors, rotations)
        return rotary

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the chunk's queries ``q [B, Hq, T, D]`` over ``[carried; chunk]`` keys ``k``/``v``;
        stages the policy's selection for this layer and returns ``[B, T, Hq, D]`` (see :func:`attend`)."""
        return attend([self], layer_idx, q, k, v, scale)

    def history(self) -> tuple[int, ...]:
        """Every step's length, the step being run last (what a rule reading ``chunk_lengths`` sees)."""
        return (*self.chunk_lengths, self.chunk_len)

    def missing_layers(self) -> list[int]:
        """Layers whose attention did not run through :meth:`attend` during the current step."""
        return self.transaction.missing_layers()

    def commit_device(self) -> None:
        self.transaction.context.ring_target = self.shared_ring.target()
        self.transaction.commit_device()
        self.shared_ring.advance()
        self.seen_device.add_(self.chunk_len)
        self.step_device.add_(1)

    def commit_host(self) -> None:
        self.transaction.commit_host()
        self.chunk_lengths.append(self.chunk_len)
        self.seen_tokens += self.chunk_len
        self.positions.commit()
        if len(self._starts) == len(self.chunk_lengths):
            self._starts.append(self.seen_tokens)

    def step_starts(self) -> torch.Tensor:
        """LongTensor ``[steps + 1]`` on the host: each committed step's first token, then the stream's end (kept
        as the steps commit, so a question never walks the stream's history to find them)."""
        if len(self._starts) != len(self.chunk_lengths) + 1:  # a state was loaded or resumed
            self._starts = array("q", [0, *accumulate(self.chunk_lengths)])
        return torch.frombuffer(self._starts, dtype=torch.long).clone()

    def rollback(self) -> None:
        if self.transaction is not None:
            self.transaction.rollback()

    # saving and resuming (see persistence) -----------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resumed stream needs: tensors named ``layers.{i}.{name}`` and JSON-able metadata."""
        return persistence.state_dict(self)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], metadata: dict, device: torch.device) -> None:
        """Install a state from :meth:`state_dict` (checked first with `check_state_dict`); carried tensors go
        to ``device``."""
        persistence.load_state_dict(self, tensors, metadata, device)

    def to_dynamic_cache(self, device: torch.device | None = None) -> DynamicCache:
        """Every token's keys/values as a ``DynamicCache`` (see :func:`persistence.to_dynamic_cache`)."""
        return persistence.to_dynamic_cache(self, device)


def attend(caches: Sequence[TwoStateCache], layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scale: float) -> torch.Tensor:
    """The attention of a step and its carry selection, for one stream's cache or S streams stepped together.

    Row ``s`` of ``q [S, Hq, T, D]`` and of the ``[carried; chunk]`` keys and values ``k``/``v [S, H_kv, K + T, D]``
    is stream ``caches[s]``'s. The attention (and the attention mass, when the policy needs it) is computed once
    for every row, the policy selects once, and each stream's transaction keeps its row of the selection, checked.
    A policy that reads per-step host values, or a stream tallying attention per frame, cannot share its step
    (`NotBatchable`: the batch then runs alone). Returns ``[S, T, Hq, D]``.
    """
    first, alone = caches[0], len(caches) == 1
    for cache in caches:
        cache.transaction.attended[layer_idx] = True
    mask = ChunkMask.of(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
    layer = first.layers[layer_idx]
    if not layer.carry.selects:
        return chunk_attention(q, k, v, scale=scale, mask=mask)
    policy = first.policy
    if policy.scores_needed(k.shape[2]):
        out, scores = scored_attention(q, k, v, scale=scale, backend=first.backend, mask=mask)
    else:
        out, scores = chunk_attention(q, k, v, scale=scale, mask=mask), None
    if alone:
        positions, history = layer.candidate_positions, first.history
        if scores is not None and first.tally is not None:
            first.tally.add(first, layer.candidate_positions(), scores)
    else:
        if any(cache.tally is not None for cache in caches):
            raise NotBatchable("a stream tallies the attention of its own steps")
        positions = lambda: torch.cat([cache.layers[layer_idx].candidate_positions() for cache in caches])  # noqa: E731
        history = _no_history
    if scores is not None:  # standing questions steer what is carried (`statekv.core.steering`)
        scores = steered(caches, layer_idx, k, scores, q.shape[2], scale)
    candidates = Candidates(layer=layer_idx, scores=scores, keys=k, values=v, positions=positions, history=history,
                            queries=q)
    selection = checked(policy.select(candidates), candidates)
    if alone:
        first.transaction.keep(layer_idx, selection, candidates.read_host_state)
        return out
    if candidates.read_host_state:
        raise NotBatchable("the carry policy read per-stream host values")
    for row, cache in enumerate(caches):
        cache.transaction.keep(layer_idx, selection if isinstance(selection, slice) else selection[row:row + 1], False)
    return out


def _no_history() -> tuple[int, ...]:
    raise NotBatchable("the carry policy reads each stream's step history")
