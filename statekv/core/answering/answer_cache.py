"""Answering from a stream: the question and the answer attend to a context taken from the detailed cache.

The context of every layer is either the whole detailed cache or, with a :class:`Retrieval`, the steps (frames)
its rule scores highest for the question at that layer (:mod:`statekv.core.answering.retrieval`), plus the first
``keep_tokens`` tokens (the prompt prefix and any sinks), in time order. ReKV (Di et al., ICLR 2025) answers
this way; here every method can, since every stream keeps its detailed cache and each step's summaries
(:attr:`statekv.core.storage.layer_storage.LayerStorage.summaries`). The detailed cache is read only through its storage
(``read_range``, ``read_tokens``), which may keep it elsewhere or quantized.

The context is chosen when the question's queries reach a layer's attention, one layer at a time, so a
layer's retrieved tokens are the only part of an offloaded detailed cache brought to the model's device. The
prompt and the answer are written after the context into room reserved up front: decoding never copies the
cache per generated token. Without retrieval and with the detailed cache on the model's device, the context is
the detailed buffer itself and the answer goes into its free room past the stream's end, which the stream
treats as scratch: the stream itself never changes.

Retrieving at least as many steps as the stream has reproduces the whole detailed cache, in order: answers are
then identical to answering without retrieval.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from ..attention.scored import ChunkMask, chunk_attention
from ..cache.engine_layer import EngineLayer
from ..cache.step_runs import StepRuns
from ..storage.step_values import StepValues
from ..positions.placing import QuestionPlan, ScoringTurns
from ..positions.rotation import rotate
from .held import held_question
from .retrieval import Retrieval
from ...errors import InputError

if TYPE_CHECKING:
    from ..cache.layer import StreamingLayer
    from ..cache.two_state import TwoStateCache


class AnswerLayer(EngineLayer):
    """One layer's keys and values while answering: the context, then the prompt and the answer so far.

    ``keys``/``values`` ``[B, H_kv, capacity, D]`` on the model's device; slots ``[0, context)`` hold the
    context, the next ``answered`` slots the prompt and answer tokens.
    """

    def __init__(self, stream: "StreamingLayer", room: int, device: torch.device, evicted: StepRuns | None = None,
                 placing: "ContextPlacing | None" = None, starts: StepValues | None = None):
        """starts: the stream's steps' first tokens, then the end (what retrieval scores); evicted: the steps
        given up under a cache limit (never read); placing: under bounded positions, where the context's keys
        go."""
        super().__init__()
        self.stream, self.room, self.model_device = stream, room, device
        self.evicted, self.starts = StepRuns() if evicted is None else evicted, starts
        self.placing = placing
        self.keys = self.values = None
        self.context = self.answered = 0
        self.owned_bytes = 0  # bytes this layer allocated on the model's device (0 when it writes in place)
        self.retrieved: torch.Tensor | None = None  # with retrieval: the tokens [M] this layer's context read
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stage the prompt's keys/values ``[B, H_kv, T, D]`` until the context is chosen, then append."""
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
            self._pending = key_states, value_states
            return key_states, value_states
        self._append(key_states, value_states)
        return self.view()

    def open(self, question: torch.Tensor, retrieval: Retrieval | None, layer: int = 0, scale: float = 1.0,
             memory: dict | None = None) -> None:
        """Choose the context for ``question`` (queries ``[B, Hq, Q, D]``) and append the staged prompt.

        layer, scale, memory: what the retrieval rule sees (`LayerQuestion`)."""
        keys, values = self._pending
        length = self.stream.storage.length
        in_place = (self.stream.storage.answer_in_place(keys, self.room)
                    if retrieval is None and not self.evicted and self.placing is None else None)
        if in_place is not None:  # answer in the free room past the stream's end: no copy
            (self.keys, self.values), self.context = in_place, length
        else:
            context_keys, context_values = self.read_context(question, retrieval, layer, scale, memory, keys.dtype)
            self.context = context_keys.shape[2]
            self._allocate(keys, self.context + self.room)
            self.keys[:, :, :self.context], self.values[:, :, :self.context] = context_keys, context_values
        self._pending = None
        self._append(keys, values)

    def read_context(self, question: torch.Tensor, retrieval: Retrieval | None, layer: int, scale: float,
                     memory: dict | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values ``[B, H_kv, C, D]`` on the model's device, in time order (under bounded
        positions, the keys rotated to their places): the whole detailed cache, every step still held, or the
        tokens ``retrieval`` picks for ``question`` (queries ``[1, Hq, Q, D]``; ``self.retrieved`` records them).
        A question answered alone and a row of questions answered together (`statekv.core.answering.together`)
        read it here."""
        storage = self.stream.storage
        index = None  # the tokens read, when not the whole cache
        if retrieval is None and not self.evicted:  # the whole cache, copied to the model's device
            keys, values = storage.read_range(0, storage.length, self.model_device, dtype)
        elif retrieval is None:  # every token still held, in order
            index = _held_tokens(self.starts, self.evicted)
            keys, values = storage.read_tokens(index, self.model_device, dtype)
        else:
            if question.shape[0] != 1:
                raise InputError(f"retrieval answers one stream at a time (batch 1), got batch {question.shape[0]}")
            count = len(self.starts) - 1
            turns = None if self.placing is None else self.placing.scoring_turns(count, storage.segment_steps)
            seen = held_question(layer, question, storage, count, self.starts, self.evicted, retrieval.keep_tokens,
                                 scale, {} if memory is None else memory, dtype, turns=turns)
            index = self.retrieved = retrieval.tokens(seen)
            keys, values = storage.read_tokens(index, self.model_device, dtype)
        if self.placing is not None:
            keys = self.placing.placed(keys, torch.arange(storage.length) if index is None else index)
        return keys, values

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.context + self.answered
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        start = self.context + self.answered
        end = start + keys.shape[2]
        if end > self.keys.shape[2]:  # more answer than planned: grow once (a copy), then carry on in place
            old_keys, old_values = self.view()
            self._allocate(keys, 2 * end)
            self.keys[:, :, :start], self.values[:, :, :start] = old_keys, old_values
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.answered += keys.shape[2]

    def _allocate(self, like: torch.Tensor, capacity: int) -> None:
        b, h, _, d = like.shape
        self.keys = torch.empty(b, h, capacity, d, dtype=like.dtype, device=self.model_device)
        self.values = torch.empty_like(self.keys)
        self.owned_bytes = 2 * self.keys.numel() * self.keys.element_size()

    def get_seq_length(self) -> int:
        """Logical tokens before the next one: the stream's (under bounded positions, where the prompt was
        placed), then the prompt and answer so far."""
        if self.placing is not None:
            return self.placing.plan.start + self.answered
        return self.stream.storage.length + self.answered

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.context + self.answered + query_length, self.get_seq_length() - self.context - self.answered


def _held_tokens(starts: torch.Tensor, evicted: StepRuns) -> torch.Tensor:
    """Token indices ``[M]`` of the steps (first tokens ``starts`` ``[S + 1]``, then the end) not evicted,
    ascending: one range per run of held steps, so a stream that evicted for weeks is read at the cost of what it
    holds."""
    parts = [torch.arange(int(starts[first]), int(starts[end])) for first, end in evicted.held_runs(len(starts) - 1)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class ContextPlacing:
    """Under bounded positions, where a question's context goes (:mod:`statekv.core.positions.placing`): each step's
    keys rotated from the rotation they were stored at to the place ``plan`` gives them."""

    def __init__(self, stream: "TwoStateCache", plan: QuestionPlan, starts: StepValues):
        self.stream, self.plan, self.starts = stream, plan, starts
        self._turns: tuple | None = None

    def scoring_turns(self, steps: int, segment_steps: int) -> ScoringTurns | None:
        """How retrieval turns the stream's ``steps`` steps and its complete segments past the range
        (`statekv.core.positions.placing.ScoringTurns`); None while the stream fits the range (each step is read at
        its own position, where it was encoded). Made once per question."""
        if not self.plan.packed:
            return None
        if self._turns is None or self._turns.count != steps:
            self._turns = ScoringTurns(self.stream.positions, self.plan, steps, segment_steps)
        return self._turns

    def placed(self, keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[B, H_kv, M, D]`` of the tokens ``index`` ``[M]`` (ascending) rotated to their places."""
        steps = self.starts.searched(index.cpu()) - 1
        unique, inverse = torch.unique_consecutive(steps, return_inverse=True)
        deltas = self.stream.positions.context_deltas(unique.tolist(), self.plan)[inverse]
        positions = self.stream.positions
        return rotate(keys, deltas.to(keys.device).expand(*keys.shape[:2], -1), positions.frequencies(keys.device))


class AnswerCache(Cache):
    """The transformers ``Cache`` that ``generate`` decodes with after a stream (see the module docstring).

    Args:
        stream: the stream's cache. room: prompt plus answer tokens to make room for. device: the model's.
        retrieval: how to choose each layer's context (None: the whole detailed cache).
        plan: under bounded positions, how the context is laid out (`statekv.core.positions.placing.QuestionPlan`).
    """

    def __init__(self, stream: "TwoStateCache", room: int, device: torch.device, retrieval: Retrieval | None,
                 plan: QuestionPlan | None = None):
        super().__init__(layers=[])
        starts = StepValues(stream.starts)  # as runs: what a question builds follows the steps it holds
        evicted = stream.evicted_steps.copy()
        placing = None if plan is None else ContextPlacing(stream, plan, starts)
        self.layers = [AnswerLayer(layer, room, device, evicted, placing, starts) for layer in stream.layers]
        self.stream, self.retrieval = stream, retrieval
        self.memory: dict = {}  # the retrieval rule's scratch for this question, shared by the layers
        self.masks: dict[tuple, ChunkMask] = {}  # the prompt's causal masks, by shape: built once, read by every layer
        self.opened = 0  # layers whose context is open

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the prompt's (or a new token's) queries ``q [B, Hq, T, D]`` over the layer's context and
        the answer so far; returns ``[B, T, Hq, D]``."""
        layer = self.layers[layer_idx]
        if layer.keys is None:
            layer.open(q, self.retrieval, layer_idx, scale, self.memory)
            self.opened += 1
            if self.opened == len(self.layers):  # what it holds only grows as layers open: noted once, at its most
                self.stream.note_device_bytes(self.device_bytes)
        keys, values = layer.view()
        mask = None
        if q.shape[2] > 1:
            shape = (q.shape[2], keys.shape[2], q.shape[1] // keys.shape[1], q.device)
            mask = self.masks.get(shape) or self.masks.setdefault(shape, ChunkMask(*shape))
        return chunk_attention(q, keys, values, scale=scale, mask=mask)

    def steps_read(self) -> tuple[tuple[int, ...] | None, tuple[tuple[int, ...], ...] | None]:
        """The steps whose tokens some layer's retrieved context read (ascending), and per layer that retrieved, the
        steps its rule chose (ascending; the steps wholly inside the kept tokens, the prompt prefix and sinks, left
        out); each None when every layer read the whole cache. One copy from the device for every layer."""
        retrieved = [layer.retrieved for layer in self.layers if layer.retrieved is not None]
        host = torch.cat(retrieved).cpu().split([len(tokens) for tokens in retrieved]) if retrieved else ()
        starts = self.layers[0].starts
        read = tuple(torch.unique(starts.searched(torch.cat(host)) - 1).tolist()) if host \
            else None
        if self.retrieval is None:
            return read, None
        keep = self.retrieval.keep_tokens
        return read, tuple(tuple(torch.unique(starts.searched(tokens[tokens >= keep]) - 1)
                                 .tolist()) for tokens in host)

    @property
    def device_bytes(self) -> int:
        """Bytes this cache allocated on the model's device (retrieved contexts, copies, answer room)."""
        return sum(layer.owned_bytes for layer in self.layers)
