"""Where a layer's detailed cache lives: with the model (:class:`LayerStorage`) or elsewhere, e.g. CPU memory
(:class:`OffloadedStorage`); :mod:`statekv.core.storage.quantized` stores it quantized.

The detailed cache holds every token's keys and values (``detailed``, a buffer of 2 parts, length = tokens).
Beside it, every step's summaries (:class:`StepSummaries`, kept in the model's dtype, what question-time
retrieval scores steps by, :mod:`statekv.core.answering.retrieval`): its mean key (``block_keys``
``[B, H_kv, steps, D]``) and ``SAMPLES_PER_STEP`` of its keys evenly spaced (``step_samples``
``[B, H_kv, steps, SAMPLES_PER_STEP * D]``); and an index of segments of ``SEGMENT_STEPS`` steps (``segment_index`` ``[B, H_kv, segments, 3 * D]``: the
element-wise minimum, maximum and sum of every key of the segment, what retrieval ranks segments by before it
scores the steps of the best ones).
Answering and retrieval read the detailed cache only through :meth:`LayerStorage.read_range`,
:meth:`LayerStorage.read_tokens` and :attr:`LayerStorage.summaries`, so a storage may keep it in any form.

Every buffer comes from a ``make_buffer(name, parts, capacity_hint)`` factory (default: a :class:`TokenBuffer` on
the storage's device), so a storage can keep its tensors in any buffer with TokenBuffer's API.
Storage is not a carried form: any form (:mod:`statekv.core.cache.forms`) works over any storage, except that only a
storage that ``holds_window`` (the detailed cache with the model, in its dtype) can carry a window of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from .blocks import BlockBuffer
from .buffers import CarriedSlots, TokenBuffer
from .compact import CompactBuffer
from .host_pages import saved

SAMPLES_PER_STEP = 16  # keys of each step kept for the `attention` retrieval rule (its default keys_per_step)
SEGMENT_STEPS = 16  # steps per segment of the retrieval index (read when a storage is made)

Released = dict[str, Sequence[tuple[int, int]]] | None  # tensor name -> the runs of rows it was saved without
Runs = Sequence[tuple[int, int]]  # ascending, disjoint [start, end) runs of rows


class BufferFactory(Protocol):
    def __call__(self, name: str, parts: int, capacity_hint: int | None
                 ) -> TokenBuffer | BlockBuffer | CompactBuffer: ...


PER_TOKEN = ("detailed", "key_codes", "value_codes", "value_scales")  # the buffers with a row per token
# read only row by row, never as one view of every row: kept in blocks by a stream that evicts (the keys' scales
# have a row per step, read for the tokens read; the step summaries and segment index are read whole by retrieval)
IN_BLOCKS = (*PER_TOKEN, "key_scales")
# read whole by retrieval: kept packed by a stream that evicts, only the rows it holds (`CompactBuffer`)
COMPACTED = ("step_means", "step_samples", "segment_index")


def memory_buffers(device: torch.device | str | None, on_replace: Callable[[], None],
                   evicts: bool = False) -> BufferFactory:
    """The default ``make_buffer``: a :class:`TokenBuffer` in ``device`` memory (None: where the first write
    comes from) that tells ``on_replace`` when it moves. For a stream that ``evicts`` (in host memory): never
    pinned, its buffers read row by row (`IN_BLOCKS`: those with a row per token, the keys' scales) in blocks
    (`statekv.core.storage.blocks`) and those read whole (`COMPACTED`: the step summaries, the segment index) packed
    (`statekv.core.storage.compact`), so what it holds of them follows what it keeps, not what it streamed."""
    in_blocks = evicts and device is not None and torch.device(device).type == "cpu"

    def make_buffer(name: str, parts: int, capacity_hint: int | None
                    ) -> TokenBuffer | BlockBuffer | CompactBuffer:
        if in_blocks and name in IN_BLOCKS:
            return BlockBuffer(parts, capacity_hint, on_replace)
        if in_blocks and name in COMPACTED:
            return CompactBuffer(parts, on_replace)
        return TokenBuffer(parts, capacity_hint, device, on_replace=on_replace, pin=not evicts)
    return make_buffer


def sample_index(chunk_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``[SAMPLES_PER_STEP]`` token offsets of a step's sampled keys: ``min(chunk_len, SAMPLES_PER_STEP)`` evenly
    spaced offsets first (the `attention` rule's picks), then the last offset repeated as padding. Made once per
    length and device and shared (every layer of every step reads it; a recorded step too): read it, never write."""
    key = (chunk_len, device)
    made = _SAMPLE_INDEXES.get(key)
    if made is None:
        count = min(chunk_len, SAMPLES_PER_STEP)
        picks = torch.arange(SAMPLES_PER_STEP, device=device).clamp(max=count - 1)
        # never replaced once kept: a thread that made one too takes the kept one
        made = _SAMPLE_INDEXES.setdefault(key, picks * chunk_len // count)
    return made


_SAMPLE_INDEXES: dict[tuple[int, torch.device | None], torch.Tensor] = {}


class Segments(NamedTuple):
    """The segment index as retrieval reads it: ``index`` ``[B, H_kv, G, 3 * D]`` (per complete segment of ``steps``
    steps, the minimum, maximum and sum of its keys, in the model's dtype)."""

    index: torch.Tensor
    steps: int


class StepSummaries(NamedTuple):
    """What retrieval rules score steps from, in the model's dtype: ``means`` ``[B, H_kv, S, D]`` each step's mean
    key; ``samples`` ``[B, H_kv, S, SAMPLES_PER_STEP, D]`` its sampled keys (the first ``min(tokens,
    SAMPLES_PER_STEP)`` of each step are real, the rest padding)."""

    means: torch.Tensor
    samples: torch.Tensor


class LayerStorage:
    """The detailed cache and step summaries of one layer, on the model's device.

    A step writes its chunk and summaries in place, past the committed ends (scratch space until
    :meth:`commit_host` advances the lengths), at indices the step advances on the device.
    """

    offloaded = False
    holds_window = True  # a carried window can be a view of this storage
    kv_cache_dtype = None  # stored in the model's dtype

    def __init__(self, capacity_hint: int | None, device: torch.device | str | None,
                 on_replace: Callable[[], None], make_buffer: BufferFactory | None = None):
        make_buffer = make_buffer or memory_buffers(device, on_replace)
        self._make_detailed(make_buffer, capacity_hint)
        self.block_keys = make_buffer("step_means", 1, None)
        self.step_samples = make_buffer("step_samples", 1, None)
        self.segment_index = make_buffer("segment_index", 1, None)
        self.segment_steps = SEGMENT_STEPS
        self.samples_like: torch.Tensor | None = None  # [B, H_kv, 1, SAMPLES_PER_STEP * D]
        self.means_like: torch.Tensor | None = None  # [B, H_kv, 1, D]
        # [3, B, H_kv, 1, D]: the open segment's minimum, maximum and sum over its committed steps' keys (the
        # identities +inf, -inf and -0.0 while it holds none: a step folds itself in with the same ops whichever
        # step of its segment it is); each part contiguous, so it is folded into in place (`out=`)
        self.segment_open: torch.Tensor | None = None
        self.segment_like: torch.Tensor | None = None  # [B, H_kv, 0, 3 * D]: no rows, an index row's shape
        self._segment_empty: torch.Tensor | None = None  # the identities, as segment_open
        self._segment_chunk: tuple[torch.Tensor, ...] | None = None  # the step's keys' min, max, sum, until its commit

    def _make_detailed(self, make_buffer: BufferFactory, capacity_hint: int | None) -> None:
        self.detailed = make_buffer("detailed", 2, capacity_hint)

    # what the layer and the forms read -------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens committed."""
        return self.detailed.length

    @property
    def batch_heads(self) -> tuple[int, int] | None:
        like = self.samples_like  # not the step means: on disk, reading their shape would map their file
        return None if like is None else tuple(like.shape[:2])

    @property
    def nbytes(self) -> int:
        """Bytes the detailed cache takes where it is stored (summaries excluded)."""
        return self.detailed.nbytes

    scale_nbytes = 0  # bytes of quantization scales (a quantized storage's)

    @property
    def summary_nbytes(self) -> int:
        """Bytes of the step summaries and the segment index."""
        return self.block_keys.nbytes + self.step_samples.nbytes + self.segment_index.nbytes

    @property
    def segments(self) -> Segments:
        """The complete segments' index (a view)."""
        return Segments(self._index_view(), self.segment_steps)

    def _index_view(self) -> torch.Tensor:
        """The complete segments' rows ``[B, H_kv, G, 3 * D]`` (empty before the first one)."""
        if not self.segment_index.length:
            like = self.segment_like
            return like[:, :, :0] if like is not None else torch.empty(1, 1, 0, 0)
        return self.segment_index.view(0, self.segment_index.length)[0]

    # the read path -----------------------------------------------------------------------------------------
    def read_range(self, start: int, end: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``[start, end)``, ``[B, H_kv, end - start, D]`` each, on ``device`` in
        ``dtype`` (None: where and as stored; views when nothing changes)."""
        keys, values = self.detailed.view(start, end)
        return _moved(keys, device, dtype), _moved(values, device, dtype)

    def read_tokens(self, index: torch.Tensor, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the tokens ``index`` (LongTensor ``[N]``), ``[B, H_kv, N, D]`` each."""
        return tuple(_moved(part, device, dtype) for part in self.detailed.gather(index))

    def step_rows(self, steps: torch.Tensor) -> StepSummaries:
        """The summaries of the committed steps ``steps`` (LongTensor ``[S]``, ascending), copies (a step evicted
        reads as zeros)."""
        means, samples = self.block_keys.gather(steps)[0], self.step_samples.gather(steps)[0]
        return StepSummaries(means, samples.unflatten(-1, (SAMPLES_PER_STEP, means.shape[-1])))

    def segment_rows(self, segments: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, G, 3 * D]`` the index rows of the complete segments ``segments`` (LongTensor ``[G]``,
        ascending), copies."""
        return self.segment_index.gather(segments)[0]

    @property
    def summaries(self) -> StepSummaries:
        """The committed steps' summaries (views; copies for a stream that evicts, every step's)."""
        steps = self.block_keys.length
        means = self.block_keys.view(0, steps)[0]
        samples = self.step_samples.view(0, steps)[0]
        return StepSummaries(means, samples.unflatten(-1, (SAMPLES_PER_STEP, means.shape[-1])))

    def answer_in_place(self, like: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers ``[B, H_kv, capacity, D]`` holding the whole detailed cache with ``room`` free slots after it, on
        the model's device, for answering without a copy (the slots past the stream's end are scratch); None if
        this storage cannot (the whole cache is then read with :meth:`read_range`)."""
        self.detailed.reserve(like, self.length + room)
        return self.detailed.keys, self.detailed.values

    # one step ----------------------------------------------------------------------------------------------
    def start(self, key_states: torch.Tensor) -> None:
        """First chunk ``[B, H_kv, T, D]`` seen: room for its summaries."""
        b, h, _, d = key_states.shape
        self.samples_like = key_states.new_empty(b, h, 1, SAMPLES_PER_STEP * d)
        self.means_like = key_states.new_empty(b, h, 1, d)
        self.block_keys.reserve(key_states, self.block_keys.length + 1)
        self.step_samples.reserve(self.samples_like, self.step_samples.length + 1)
        self._start_segments(key_states)
        self.segment_index.reserve(self.segment_like, self.segment_index.length + 1)

    def _start_segments(self, like: torch.Tensor) -> None:
        """The open segment's accumulators on the model's device, like ``like`` ``[B, H_kv, T, D]``: empty."""
        if self.segment_open is None:
            b, h, _, d = like.shape
            self._hold_segment(like.new_empty(b, h, 1, 3 * d), steps=0)

    def _hold_segment(self, saved: torch.Tensor, steps: int) -> None:
        """The open segment is ``saved`` ``[B, H_kv, 1, 3 * D]`` (as :meth:`saved_segment` gives it; its device is
        the model's) after ``steps`` of its steps (0: it holds none, whatever ``saved`` says)."""
        b, h, _, width = saved.shape
        d = width // 3
        empty = saved.new_empty(3, b, h, 1, d)
        empty[0], empty[1], empty[2] = math.inf, -math.inf, -0.0  # -0.0 + x is x for every x, -0.0 included
        self._segment_empty = empty
        self.segment_like = saved.new_empty(b, h, 0, width)
        self.segment_open = empty.clone() if steps == 0 else saved.reshape(b, h, 1, 3, d).movedim(3, 0).contiguous()

    def _stage_segment(self, keys: torch.Tensor) -> None:
        """The step's keys ``[B, H_kv, T, D]`` reduced (their minimum, maximum and sum ``[B, H_kv, 1, D]``),
        staged until the step's device commit folds them into the open segment."""
        self._segment_chunk = (*torch.aminmax(keys, dim=2, keepdim=True), keys.sum(2, keepdim=True))

    def commit_device(self) -> None:
        """Device part of a step's commit: its staged reductions folded into the open segment's accumulators, in
        place (the same three ops at every step, whichever step of its segment it is)."""
        if self._segment_chunk is None:  # the layer staged nothing
            return
        (low, high, total), self._segment_chunk = self._segment_chunk, None
        least, most, summed = self.segment_open.unbind(0)
        torch.minimum(least, low, out=least)
        torch.maximum(most, high, out=most)
        torch.add(summed, total, out=summed)

    def commit_segment(self) -> None:
        """Host part of a step's commit (``block_keys.length`` is the step's index here): a segment it completes is
        added to the index, and the open segment starts empty again (once every ``segment_steps`` steps)."""
        if (self.block_keys.length + 1) % self.segment_steps == 0:
            self.segment_index.write(self.segment_index.length, torch.cat(self.segment_open.unbind(0), -1))
            self.segment_index.length += 1
            self.segment_open.copy_(self._segment_empty)

    def saved_segment(self) -> torch.Tensor | None:
        """The open segment as saved streams and checkpoints hold it, ``[B, H_kv, 1, 3 * D]``: the minimum, maximum
        and sum of its steps' keys; right after a segment completes, the completed segment's (its index row);
        zeros before the first step; None before the first chunk."""
        if self.segment_open is None:
            return None
        steps = self.block_keys.length
        if steps % self.segment_steps:
            return torch.cat(self.segment_open.unbind(0), -1)
        if not steps:
            return self.segment_open.new_zeros(*self.segment_like.shape[:2], 1, self.segment_like.shape[-1])
        rows = self.segment_index.length
        return self.segment_index.view(rows - 1, rows)[0].to(self.segment_open.device, copy=True)

    def prepare(self, chunk_len: int) -> None:
        """Room for the next step's summaries (and every later one's until the horizon, if it is known)."""
        horizon = self.detailed.capacity_hint
        expected = 0 if horizon is None else self.block_keys.length + math.ceil(
            max(horizon - self.length, 0) / chunk_len) + 1
        self.block_keys.reserve(self.means_like, self.block_keys.length + 1, expected)
        self.step_samples.reserve(self.samples_like, self.step_samples.length + 1, expected)
        rows = expected // self.segment_steps + 1 if expected else 0  # every row until the horizon, at once
        self.segment_index.reserve(self.segment_like, max(self.segment_index.length + 1, rows))

    def reserve_chunk(self, slots: CarriedSlots, chunk_len: int) -> None:
        """Room in the detailed cache for a chunk of ``chunk_len`` tokens written on the device (alongside the
        carried form's ``slots``)."""
        self.detailed.reserve(slots.keys, self.detailed.length + chunk_len)

    def stage_summaries(self, keys: torch.Tensor, step_device: torch.Tensor) -> None:
        """The step's summaries from its chunk's keys ``[B, H_kv, T, D]``, written at the step's index
        ``step_device`` ``[1]``."""
        mean, samples = _summaries(keys)
        self.block_keys.write_at(step_device, mean)
        self.step_samples.write_at(step_device, samples)
        self._stage_segment(keys)

    def stage_mean(self, mean: torch.Tensor, step_device: torch.Tensor) -> None:
        """The step's mean key ``[B, H_kv, 1, D]`` only (kept for callers of the former interface)."""
        self.block_keys.write_at(step_device, mean)

    def stage_chunk(self, write_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The chunk ``[B, H_kv, T, D]`` written at its logical positions ``write_index`` ``[T]``."""
        self.detailed.write_at(write_index, keys, values)

    def keep_chunk(self, slots: CarriedSlots) -> None:
        """Device part of the commit: the chunk as the carried form's ``slots`` hold it (already written here
        by :meth:`stage_chunk`)."""

    def commit_host(self, chunk_len: int) -> None:
        self.commit_segment()
        self.detailed.length += chunk_len
        self.block_keys.length += 1
        self.step_samples.length += 1

    def device_nbytes(self) -> int:
        return self.detailed.nbytes + self.summary_nbytes + self._segment_nbytes()

    def _segment_nbytes(self) -> int:
        """The open segment's accumulators and their identities."""
        accumulators = self.segment_open
        return 0 if accumulators is None else 2 * accumulators.numel() * accumulators.element_size()

    def synchronize(self) -> None:
        """Wait for asynchronous copies into this storage before the host reads it."""
        self.detailed.synchronize()

    # saving and resuming (see persistence) -----------------------------------------------------------------
    def export(self) -> dict[str, torch.Tensor]:
        """The committed detailed cache and summaries as tensors (views where possible), each without the rows its
        buffer released (``{name}.released`` lists them, `host_pages.saved`)."""
        tensors = saved(("keys", "values"), self.detailed, self.length)
        tensors.update(self.export_summaries())
        tensors.update(self.export_segments())
        return tensors

    def export_summaries(self) -> dict[str, torch.Tensor]:
        """The committed steps' summaries (nothing before the first step)."""
        steps = self.block_keys.length
        if not steps:
            return {}
        return {**saved(("block_keys",), self.block_keys, steps), **saved(("step_samples",), self.step_samples, steps)}

    def export_segments(self) -> dict[str, torch.Tensor]:
        """The segment index and the open segment's accumulators (nothing before the first step)."""
        if self.segment_open is None:
            return {}
        index = (saved(("segment_index",), self.segment_index, self.segment_index.length)
                 if self.segment_index.length else {"segment_index": self._index_view()})
        return {**index, "segment_partial": self.saved_segment()}

    def load(self, tensors: dict[str, torch.Tensor], steps: Sequence[int], device: torch.device,
             released: Released = None) -> None:
        """Install what :meth:`export` saved (``steps``: every step's token count; summaries missing from older
        saves are recomputed from the keys; ``released``: by tensor name, the runs of released rows a tensor was
        saved without, see `TokenBuffer.load`)."""
        released = released or {}
        storage = self.detailed.device or device
        keys = tensors["keys"]
        self.detailed.load(keys.to(storage), tensors["values"].to(storage), released=released.get("keys", ()))
        self.load_summaries(tensors, keys, steps, storage, released)
        self.load_segments(tensors, keys, steps, storage, released)

    def load_summaries(self, tensors: dict[str, torch.Tensor], keys: torch.Tensor, steps: Sequence[int],
                       storage: torch.device, released: Released = None) -> None:
        """Install saved step summaries (``block_keys``, ``step_samples``), recomputed from ``keys`` for a state
        saved before they were kept (a subclass's `load` calls it too)."""
        means, samples = tensors.get("block_keys"), tensors.get("step_samples")
        if (means is None or samples is None) and steps:  # saved before these were kept: recompute them
            parts = [_summaries(part) for part in keys.split(list(steps), dim=2)]  # runs, when resumed
            means = torch.cat([m for m, _ in parts], dim=2) if means is None else means
            samples = torch.cat([s for _, s in parts], dim=2) if samples is None else samples
        if means is None:
            means = keys[:, :, :0]
            samples = keys.new_empty(*keys.shape[:2], 0, SAMPLES_PER_STEP * keys.shape[-1])
        released = released or {}
        self.block_keys.load(means.to(storage), released=released.get("block_keys", ()))
        self.step_samples.load(samples.to(storage), released=released.get("step_samples", ()))
        self.samples_like = samples[:, :, :1].new_empty(*samples.shape[:2], 1, samples.shape[-1])
        self.means_like = means[:, :, :1].new_empty(*means.shape[:2], 1, means.shape[-1])

    def load_segments(self, tensors: dict[str, torch.Tensor], keys: torch.Tensor | None, steps: Sequence[int],
                       storage: torch.device, released: Released = None) -> None:
        """The segment index saved, or (saved before it was kept) recomputed from ``keys`` (all tokens' keys in
        the model's dtype, on any device; None: what `read_range` gives). The saved open segment is what
        :meth:`saved_segment` gives: after a complete segment, the open one starts empty."""
        index, partial = tensors.get("segment_index"), tensors.get("segment_partial")
        if index is None or partial is None:
            index, partial = self._segments_of(keys, steps)
        if partial is None:
            return
        self._hold_segment(partial, len(steps) % self.segment_steps)
        self.segment_index.load(index.to(storage), released=(released or {}).get("segment_index", ()))
        if not self.segment_index.length:  # an empty load leaves nothing to append to: room for the first row
            self.segment_index.reserve(partial.to(storage), 1)

    def _segments_of(self, keys: torch.Tensor | None, steps: Sequence[int]) -> tuple[torch.Tensor | None, ...]:
        """``(index, open segment)`` computed from every step's keys."""
        if not steps:
            return None, None
        if keys is None:
            keys = self.read_range(0, sum(steps))[0]
        rows, open_segment = [], None
        for number, part in enumerate(keys.split(list(steps), dim=2)):  # runs, when resumed
            chunk = torch.cat([part.amin(2, keepdim=True), part.amax(2, keepdim=True), part.sum(2, keepdim=True)], -1)
            if number % self.segment_steps == 0:
                open_segment = chunk
            else:
                d = part.shape[-1]
                open_segment = torch.cat([torch.minimum(open_segment[..., :d], chunk[..., :d]),
                                          torch.maximum(open_segment[..., d:2 * d], chunk[..., d:2 * d]),
                                          open_segment[..., 2 * d:] + chunk[..., 2 * d:]], -1)
            if (number + 1) % self.segment_steps == 0:
                rows.append(open_segment)
        index = torch.cat(rows, 2) if rows else open_segment[:, :, :0]
        return index, open_segment

    def restored(self, dtype: torch.dtype, device: torch.device) -> None:
        """A saved state was loaded; ``device`` is the model's (where the open segment is accumulated)."""
        if self.segment_open is not None and self.segment_open.device != device:
            self._hold_segment(self.saved_segment().to(device), self.block_keys.length % self.segment_steps)

    def release_tokens(self, tokens: Runs) -> None:
        """Tokens ``tokens`` (ascending ``[start, end)`` runs of positions) were evicted
        (:mod:`statekv.core.storage.limits`): give back what can be. One buffer on the model's device cannot give
        part of itself back (evicting is refused there)."""

    def release_steps(self, steps: Runs) -> None:
        """Steps ``steps`` (ascending ``[start, end)`` runs) were evicted: give back their summaries, where that can
        be."""

    def release_segments(self, segments: Runs) -> None:
        """Every step of ``segments`` (ascending ``[start, end)`` runs) was evicted: give back their index rows,
        where that can be (retrieval no longer ranks them)."""

    def release_step_scales(self, steps: Runs) -> None:
        """Evicted ``steps`` (ascending ``[start, end)`` runs) none of whose tokens is carried any more: give back
        their keys' quantization scales (a quantized storage's)."""


class OffloadedStorage(LayerStorage):
    """The detailed cache and step summaries in ``device`` memory other than the model's: a step stages its
    chunk and summaries on the model's device and copies them here when it commits, so the model's memory does
    not grow with the stream."""

    offloaded = True
    holds_window = False

    def __init__(self, capacity_hint: int | None, device: torch.device | str | None,
                 on_replace: Callable[[], None], make_buffer: BufferFactory | None = None):
        super().__init__(capacity_hint, device, on_replace, make_buffer)
        self.staged: torch.Tensor | None = None  # the chunk [2, B, H_kv, T, D] to copy here
        self.staged_mean: torch.Tensor | None = None  # the step's mean key [B, H_kv, 1, D]
        self.staged_samples: torch.Tensor | None = None  # its sampled keys [B, H_kv, 1, SAMPLES_PER_STEP * D]

    def start(self, key_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if self.staged_mean is None:
            self.staged_mean = key_states.new_empty(b, h, 1, d)
            self.staged_samples = key_states.new_empty(b, h, 1, SAMPLES_PER_STEP * d)
        super().start(key_states)

    def answer_in_place(self, like: torch.Tensor, room: int) -> None:
        return None

    def reserve_chunk(self, slots: CarriedSlots, chunk_len: int) -> None:
        pass  # the detailed cache grows when the chunk is copied in

    def stage_summaries(self, keys: torch.Tensor, step_device: torch.Tensor) -> None:
        mean, samples = _summaries(keys)
        self.staged_mean.copy_(mean)
        self.staged_samples.copy_(samples)
        self._stage_segment(keys)

    def stage_mean(self, mean: torch.Tensor, step_device: torch.Tensor) -> None:
        self.staged_mean.copy_(mean)

    def stage_chunk(self, write_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        pass  # copied from the carried form at commit

    def keep_chunk(self, slots: CarriedSlots) -> None:
        self.staged = slots.tail()

    def commit_host(self, chunk_len: int) -> None:
        self.store_chunk(self.staged[0], self.staged[1])
        self.block_keys.write(self.block_keys.length, self.staged_mean)
        self.step_samples.write(self.step_samples.length, self.staged_samples)
        super().commit_host(chunk_len)

    def store_chunk(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the committed chunk ``[B, H_kv, T, D]`` (on the model's device) past the detailed cache's end
        (the length is advanced by :meth:`commit_host`)."""
        self.detailed.write(self.detailed.length, keys, values)

    def device_nbytes(self) -> int:
        staged = (self.staged_mean, self.staged_samples)
        return sum(0 if t is None else t.numel() * t.element_size() for t in staged) + self._segment_nbytes()

    def release_tokens(self, tokens: Runs) -> None:
        for name in PER_TOKEN:  # keys and values, or (quantized) their codes and scales
            if getattr(self, name, None) is not None:
                _release(getattr(self, name), tokens)

    def release_steps(self, steps: Runs) -> None:
        """Steps ``steps`` (ascending ``[start, end)`` runs) were evicted: give back their summaries (never read
        again)."""
        for buffer in (self.block_keys, self.step_samples):
            _release(buffer, steps)

    def release_segments(self, segments: Runs) -> None:
        _release(self.segment_index, segments)

    def release_step_scales(self, steps: Runs) -> None:
        scales = getattr(self, "key_scales", None)  # a quantized storage's
        if scales is not None:
            _release(scales, steps)

    def restored(self, dtype: torch.dtype, device: torch.device) -> None:
        b, h = self.batch_heads
        d = self.means_like.shape[-1]
        self.staged_mean = torch.empty(b, h, 1, d, dtype=dtype, device=device)
        self.staged_samples = torch.empty(b, h, 1, SAMPLES_PER_STEP * d, dtype=dtype, device=device)
        super().restored(dtype, device)


def _release(buffer, rows: Runs) -> None:
    """Give rows ``rows`` (ascending ``[start, end)`` runs) of ``buffer`` back: a disk buffer to the file system,
    host memory's whole pages to the OS."""
    for start, end in rows:
        buffer.release(start, end)


def _summaries(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's chunk keys ``[B, H_kv, T, D]`` -> its mean key ``[B, H_kv, 1, D]`` and sampled keys
    ``[B, H_kv, 1, SAMPLES_PER_STEP * D]``."""
    samples = keys.index_select(2, sample_index(keys.shape[2], keys.device))
    return keys.mean(dim=2, keepdim=True), samples.flatten(2).unsqueeze(2)


def _moved(tensor: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(device=device or tensor.device, dtype=dtype or tensor.dtype)
