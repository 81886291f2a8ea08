"""The two-state cache: a small carried state per layer and KV head, and a detailed cache of every token.

During a step the model's attention modules call :meth:`StreamingLayer.update` with the chunk's keys and values,
which returns ``[carried; chunk]``; the registered attention function then scores those keys and asks the policy
what to carry (:func:`attend`, for one stream's cache or the rows of several streams' batch). The step is a
transaction (:mod:`statekv.core.cache.transaction`): :meth:`TwoStateCache.commit_device` installs the new carried state,
:meth:`TwoStateCache.commit_host` advances the committed lengths, :meth:`TwoStateCache.rollback` forgets it.

Each layer holds two objects: its ``storage`` (:mod:`statekv.core.storage.layer_storage`: the detailed cache and step
means, with the model or offloaded) and its ``carry``, the form of its carried state
(:mod:`statekv.core.cache.forms`: a window of the detailed cache, slots, or a ring). In the slots and ring forms,
everything that changes from step to step lives in device tensors that the step itself advances
(:class:`~statekv.core.cache.transaction.StepContext`), so a steady step is static and can be captured as a CUDA graph.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from . import forms, persistence
from .layer import StreamingLayer
from .step_runs import StepRuns
from ..storage.step_values import StepValues
from ..attention.scored import ChunkMask, chunk_attention, resolve_backend, scored_attention
from ..rules.base import CarryPolicy
from ..rules.candidates import Candidates
from ..positions.placing import StreamPositions
from ..positions.rope import SettledRotary
from ..rules.steering import steered
from ..storage.tiers import StorageTier
from .transaction import NotBatchable, StepContext, StepTransaction, checked
from ...weak import weakly


class TwoStateCache(Cache):
    """A transformers ``Cache`` of :class:`StreamingLayer` s, driven one step at a time by a carry policy.

    Args:
        num_layers: decoder layers of the model.
        policy: the carry rule.
        backend: attention backend for policies that need scores (see :func:`scored_attention`).
        capacity_hint: tokens to preallocate in each detailed buffer (the planned horizon), if known.
        tier: where and how the detailed cache is kept (`statekv.core.storage.tiers.StorageTier`: offloaded,
            quantized, or the disk tier's; default: with the model, in its dtype).
        positions: the stream's RoPE positions (:class:`~statekv.core.positions.placing.StreamPositions`; default: the
            stream's own, ``stream``). Under ``bounded`` the steps placed at their own positions are ``stream``'s
            steps; from the first placed elsewhere (or given explicit positions) on, every layer carries slots (no
            window, no ring), each slot with its placement (`place_slots`).

    ``evicted_steps``: steps whose detailed keys and values were given up under a cache limit
    (:mod:`statekv.core.storage.limits`); answers never read them. ``tally``: when kept, the attention mass
    each step's tokens received from the stream's own scored steps, summed over layers and heads. ``probe``: while
    set (`statekv.core.stream.prefill.StreamingPrefill.probing`), shown each layer's attention inputs of every step.

    A step is ``begin`` (host) -> ``begin_device`` -> the model's forward (``update``/``attend`` per layer)
    -> ``commit_device`` -> ``commit_host``; the device part may be a CUDA graph replay. The steps of several
    streams may share one forward (:class:`statekv.core.step.batching.BatchCache`): each cache is then one row.
    """

    def __init__(self, num_layers: int, policy: CarryPolicy, backend: str = "auto",
                 capacity_hint: int | None = None, tier: StorageTier = StorageTier(),
                 positions: StreamPositions | None = None):
        super().__init__(layers=[])
        self.tier = tier
        self.layout_version = 0  # bumped whenever a buffer that a captured step reads is replaced
        self.peak_device_bytes = 0  # most bytes of cache this stream held on the model's device at once
        replaced = weakly(self, lambda cache: cache.buffers_replaced())  # a dropped cache is freed at once
        self.layers = [StreamingLayer(replaced, i, capacity_hint, tier) for i in range(num_layers)]
        self.positions = positions or StreamPositions()
        self.evicted_steps = StepRuns()
        self.tally = None  # a limits.AttentionTally, only under evict-least-attended
        self.guide = None  # a steering.QuestionGuide while standing questions steer what is carried
        self.probe = None  # a callable shown each layer's step attention inputs (StreamingPrefill.probing)
        self.policy, self.backend = policy, backend
        self.chunk_lengths, self.seen_tokens = (), 0  # each committed step's length; their sum (sets `_starts`)
        self.shared_ring = forms.SharedRing()
        self.seen_device: torch.Tensor | None = None  # seen_tokens, kept on the model's device by the step
        self.step_device: torch.Tensor | None = None  # LongTensor [1]: the step's index, likewise
        self.transaction: StepTransaction | None = None  # the step being run
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.placed = False  # every layer in slots with placements, for good (see `place_slots`)

    @property
    def chunk_lengths(self) -> StepValues:
        """Each committed step's length (as runs: a steady stream's take a few at any age)."""
        return self._lengths

    @chunk_lengths.setter
    def chunk_lengths(self, lengths: Sequence[int]) -> None:
        self._lengths = StepValues(lengths)
        # each step's first token, then the end: rebuilt from the lengths at the next read, since a state loaded or
        # resumed may hold as many steps as before
        self._starts: StepValues | None = None

    @property
    def starts(self) -> StepValues:
        """Each committed step's first token, then the stream's end (``steps + 1`` values, kept as runs as the
        steps commit: a steady stream's take a few at any age). Read it, never append to it."""
        return self._kept_starts()

    @property
    def step_bytes(self) -> int:
        """Host bytes the cache keeps of its steps' lengths and first tokens (as runs: a steady stream's stay a few
        dozen bytes however long it streams)."""
        return self.chunk_lengths.nbytes + self.starts.nbytes

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
        """The ring every layer holds its carried state in, if any (:class:`~statekv.core.storage.buffers.Ring`)."""
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
            if not self.placed and (position_ids is not None or not self.positions.still):
                self.place_slots(chunk_len)
            if self.placed:
                context.positions = self.positions
                if self.positions.starts_moving:  # steps recorded so far neither placed nor rotated
                    self.buffers_replaced()
        self.transaction = StepTransaction(context, self.layers)
        self.shared_ring.update(self.layers, self.policy, self.chunk_lengths, self.seen_tokens, context, device)
        for layer in self.layers:
            layer.prepare(context)

    def place_slots(self, chunk_len: int = 0) -> None:
        """Bounded positions: every layer's carried state in slots, each slot with its placement (its anchor and
        the rotation its key was computed at), for the rest of the stream. Until a step is placed away from its
        own position (1-D RoPE), a bounded stream's steps are ``stream``'s (window, slots or ring, nothing
        rotated), so its carried tokens' anchors and rotations are their logical positions."""
        self.placed = True
        self.shared_ring.allowed = False
        if self.shared_ring.ring is not None:
            for layer in self.layers:
                layer.carry = layer.carry.left(layer.storage, chunk_len)
            self.shared_ring.reset()
        for layer in self.layers:
            layer.storage.holds_window = False
            layer.carry = forms.placed(layer.carry, layer.storage)
        self.buffers_replaced()

    def settle_placement(self) -> None:
        """After a state was installed: place every slot if that state was placed (a layer holds placements, or
        a step was placed away from its own position)."""
        self.placed = False
        if self.positions.bounded and (self.positions.moved or any(
                getattr(layer.slots, "placements", None) is not None for layer in self.layers)):
            self.place_slots()

    def release(self) -> None:
        """Let go of every layer's keys and values and the step's device buffers, for good (a closed stream's):
        a stream object still referenced after its close then holds none of its cache. Its lengths stay."""
        self.layers, self.shared_ring, self.transaction = [], forms.SharedRing(), None
        self.seen_device = self.step_device = None
        self._aranges.clear()
        self.layout_version += 1

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
        the chunk is moved to its place (:mod:`statekv.core.positions.placing`)."""
        context = self.transaction.context
        context.write_index = torch.add(self._aranges[context.chunk_len, self.seen_device.device], self.seen_device)
        if context.positions is None:
            return context.write_index if position_ids is None else position_ids
        rotary, anchors, rotations = self.positions.chunk(context.write_index, position_ids)
        context.position_rows = torch.stack((context.write_index, anchors, rotations))  # [3, T]: one write a layer
        device = context.write_index.device
        context.placed_keys = self.positions.placed_carried([layer.carried_for_placing() for layer in self.layers],
                                                            context.chunk_len, device,
                                                            fused=resolve_backend(self.backend, device) == "triton")
        return rotary

    def step_positions(self, position_ids: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The decoder's positions for this stream's step of ``rows`` rows, begun on the device (`begin_device`):
        ``position_ids`` as given (moved to where the chunk is placed under ``bounded`` positions), else the
        chunk's own continued from the stream's length, ``[rows, T]``."""
        positions = self.begin_device(position_ids)
        return positions.expand(rows, -1) if position_ids is None else positions

    def settled_rotary(self) -> SettledRotary | None:
        """The rotary outputs the decoder reads in the step begun (`step_positions`), where the host settled its
        places (`StreamPositions.settled_step`); else None."""
        return self.positions.rotary if self.transaction.context.positions is not None else None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the chunk's queries ``q [B, Hq, T, D]`` over ``[carried; chunk]`` keys ``k``/``v``;
        stages the policy's selection for this layer and returns ``[B, T, Hq, D]`` (see :func:`attend`)."""
        return attend([self], layer_idx, q, k, v, scale)

    def history(self) -> StepValues:
        """Every step's length, the step being run last (what a rule reading ``chunk_lengths`` sees)."""
        return self.chunk_lengths.then(self.chunk_len)

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
        if self.tally is not None:
            self.tally.commit(len(self.chunk_lengths), self.evicted_steps)
        self.seen_tokens += self.chunk_len
        self.positions.commit()
        if self._starts is not None and len(self._starts) == len(self.chunk_lengths):
            self._starts.append(self.seen_tokens)

    def step_starts(self) -> torch.Tensor:
        """LongTensor ``[steps + 1]`` on the host: `starts` as a tensor, made at each call (a stream keeps no
        tensor of every step: a stream that never ends would hold eight bytes a step for good), so read it once
        per question; the starts of a few steps are read from `starts` itself."""
        return self._kept_starts().tensor()

    def step_of(self, token: int) -> tuple[int, int]:
        """``(step, its first token)``: the committed step holding ``token`` (``0 <= token < seen_tokens``), found
        on the host without a tensor (what ``searchsorted(step_starts(), token, right=True) - 1`` finds)."""
        starts = self._kept_starts()
        step = bisect.bisect_right(starts, token) - 1
        return step, starts[step]

    def evicted_tokens(self) -> int:
        """Tokens of the evicted steps (read from their runs: a stream that evicted for weeks is not walked)."""
        return self.evicted_steps.total_over(self._kept_starts())

    def _kept_starts(self) -> StepValues:
        starts = self._starts
        if starts is None or len(starts) != len(self.chunk_lengths) + 1:  # loaded, resumed, or stepped elsewise
            starts = self._starts = self.chunk_lengths.running_totals()
        return starts

    def rollback(self) -> None:
        if self.transaction is not None:
            self.transaction.rollback()

    # saving and resuming (see persistence) -----------------------------------------------------------------
    def state_dict(self, *, as_runs: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resumed stream needs: tensors named ``layers.{i}.{name}`` and JSON-able metadata (``as_runs``:
        its lists with an entry per step as runs, see :func:`persistence.state_dict`)."""
        return persistence.state_dict(self, as_runs)

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
    A policy that reads per-step host values, a stream tallying attention per frame, or a probed stream cannot
    share its step (`NotBatchable`: the batch then runs alone); a probed stream's ``probe`` is shown its layer's
    inputs first. Returns ``[S, T, Hq, D]``.
    """
    first, alone = caches[0], len(caches) == 1
    for cache in caches:
        cache.transaction.attended[layer_idx] = True
        if cache.probe is not None:
            if not alone:
                raise NotBatchable("a probed stream steps alone")
            cache.probe(len(cache.chunk_lengths), layer_idx, q, k, v)
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
    if scores is not None:  # standing questions steer what is carried (`statekv.core.rules.steering`)
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


def _no_history() -> Sequence[int]:
    raise NotBatchable("the carry policy reads each stream's step history")
