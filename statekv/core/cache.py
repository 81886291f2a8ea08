"""The two-state cache: a small carried state per layer and KV head, and a detailed cache of every token.

During a step the model's attention modules call :meth:`StreamingLayer.update` with the chunk's keys and
values, which returns ``[carried; chunk]``; the registered attention function then scores those keys and
asks the policy what to carry (:meth:`TwoStateCache.attend`). Nothing becomes visible until the whole forward
succeeded: :meth:`TwoStateCache.commit` appends every layer's chunk to its detailed cache and installs the new
carried state, :meth:`TwoStateCache.rollback` forgets the step. A failed step therefore leaves the cache
exactly as it was.

While a layer's carried state is a suffix of its detailed cache (always for full attention and recency; for
StateKV until the budget is first exceeded) it is kept as a view of the detailed buffer, so carrying costs no
copy. Once a policy picks tokens per head, the layer keeps its own carried tensors.

With ``storage_device`` set (offload), the detailed cache lives there (e.g. CPU memory) while the carried
state stays with the model, so accelerator memory does not grow with the stream; the carried state is then
always kept in its own tensors.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .attention import chunk_attention, scored_attention
from .errors import InputError
from .policies import Candidates, CarryPolicy


class DetailedBuffer:
    """Every token's keys and values of one layer, in order, in a buffer that grows geometrically.

    ``keys``/``values`` are ``[B, H_kv, capacity, D]``; the first ``length`` slots are committed. Appends
    write in place, so a stream of N chunks copies O(N) bytes in total (amortised), not O(N^2).
    """

    GROWTH = 2.0

    def __init__(self, capacity_hint: int | None = None, device: torch.device | str | None = None):
        self.capacity_hint = capacity_hint
        self.device = torch.device(device) if device is not None else None  # None: where the chunks come from
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.steps: torch.Tensor | None = None  # LongTensor [capacity]: the step that produced each token
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def stage(self, keys: torch.Tensor, values: torch.Tensor, step: int) -> None:
        """Write a chunk ``[B, H_kv, T, D]`` just past the committed tokens, without committing it."""
        end = self.length + keys.shape[2]
        if end > self.capacity:
            self._grow(keys, end)
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.steps[self.length : end] = step

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        capacity = max(needed, math.ceil(self.capacity * self.GROWTH), self.capacity_hint or 0)
        b, h, _, d = like.shape
        device = self.device or like.device
        keys = torch.empty(b, h, capacity, d, dtype=like.dtype, device=device)
        values = torch.empty(b, h, capacity, d, dtype=like.dtype, device=device)
        steps = torch.empty(capacity, dtype=torch.long, device=device)
        if self.keys is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            steps[: self.length] = self.steps[: self.length]
        self.keys, self.values, self.steps = keys, values, steps

    def view(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, start:end], self.values[:, :, start:end]

    def load(self, keys: torch.Tensor, values: torch.Tensor, steps: torch.Tensor) -> None:
        """Replace the contents with ``length`` committed tokens: keys/values ``[B, H_kv, length, D]``, steps
        ``[length]``."""
        self.keys = self.values = self.steps = None
        self.length = 0
        if keys.shape[2]:
            self._grow(keys, keys.shape[2])
            self.keys[:, :, : keys.shape[2]] = keys
            self.values[:, :, : keys.shape[2]] = values
            self.steps[: keys.shape[2]] = steps
            self.length = keys.shape[2]


class StreamingLayer(CacheLayerMixin):
    """One decoder layer's two states.

    The carried state is either the window ``detailed[window_start : length]`` (``window_start`` not None)
    or explicit tensors: ``carried_keys``/``carried_values`` ``[B, H_kv, K, D]`` with the logical positions
    and step indices of what they hold, ``carried_positions``/``carried_steps`` ``[B, H_kv, K]``.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity_hint: int | None = None, storage_device: torch.device | str | None = None):
        super().__init__()
        self.detailed = DetailedBuffer(capacity_hint, storage_device)
        self.offloaded = storage_device is not None
        self.window_start: int | None = None if self.offloaded else 0
        self.carried_keys = self.carried_values = None
        self.carried_positions = self.carried_steps = None
        self.step = 0  # index of the step being staged; set by TwoStateCache.begin
        self._clear_pending()

    def _clear_pending(self) -> None:
        self.pending_keys = self.pending_values = None  # [carried; chunk] as handed to attention
        self.pending_selection: slice | torch.Tensor | None = None
        self.pending_chunk_len = 0

    # transformers' CacheLayerMixin interface ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        if self.window_start is None and self.carried_keys is None:  # offloaded: start with an empty carried state
            b, h, _, d = key_states.shape
            self.carried_keys = key_states.new_empty(b, h, 0, d)
            self.carried_values = value_states.new_empty(b, h, 0, d)
            self.carried_positions = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)
            self.carried_steps = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stage the chunk ``[B, H_kv, T, D]`` and return ``[carried; chunk]`` keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.detailed.stage(key_states, value_states, self.step)
        n, t = self.detailed.length, key_states.shape[2]
        if self.window_start is not None:
            keys, values = self.detailed.view(self.window_start, n + t)
        else:
            keys = torch.cat([self.carried_keys, key_states], dim=2)
            values = torch.cat([self.carried_values, value_states], dim=2)
        self.pending_keys, self.pending_values, self.pending_chunk_len = keys, values, t
        return keys, values

    def get_seq_length(self) -> int:
        return self.carried_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Physical sizes: the carried keys come first, the chunk is causal after them.
        return self.carried_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # two-state bookkeeping -------------------------------------------------------------------------------
    @property
    def carried_length(self) -> int:
        if self.window_start is not None:
            return self.detailed.length - self.window_start
        return 0 if self.carried_keys is None else self.carried_keys.shape[2]

    def carried(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The carried keys and values, ``[B, H_kv, K, D]`` each (views while in window form)."""
        if self.window_start is None:
            return self.carried_keys, self.carried_values
        return self.detailed.view(self.window_start, self.detailed.length)

    def positions(self) -> torch.Tensor:
        """Logical positions of the carried tokens, ``[B, H_kv, K]`` (``[1, 1, 0]`` before the first step)."""
        if self.window_start is None:
            return self.carried_positions
        if self.detailed.keys is None:
            return torch.empty(1, 1, 0, dtype=torch.long)
        b, h = self.detailed.keys.shape[:2]
        window = torch.arange(self.window_start, self.detailed.length, device=self.detailed.keys.device)
        return window.expand(b, h, -1)

    def candidate_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and steps ``[B, H_kv, K + T]`` of the tokens handed to attention this step."""
        b, h = self.pending_keys.shape[:2]
        n, t = self.detailed.length, self.pending_chunk_len
        if self.window_start is not None:
            positions = torch.arange(self.window_start, n + t, device=self.pending_keys.device)
            return positions.expand(b, h, -1), self.detailed.steps[self.window_start : n + t].expand(b, h, -1)
        chunk_positions = torch.arange(n, n + t, device=self.pending_keys.device).expand(b, h, -1)
        chunk_steps = self.detailed.steps[n : n + t].to(self.pending_keys.device).expand(b, h, -1)
        return (torch.cat([self.carried_positions, chunk_positions], dim=-1),
                torch.cat([self.carried_steps, chunk_steps], dim=-1))

    def commit(self) -> None:
        """Append the staged chunk to the detailed cache and carry what the policy selected."""
        selection = self.pending_selection
        n_candidates = self.pending_keys.shape[2]
        if isinstance(selection, slice):
            start, stop, stride = selection.indices(n_candidates)
            if stride != 1:
                raise InputError("a carry policy returned a strided slice; return indices instead")
            if self.window_start is not None and stop == n_candidates:
                self.window_start += start
                self.detailed.length += self.pending_chunk_len
                self._clear_pending()
                return
            index = torch.arange(start, stop, device=self.pending_keys.device)
            selection = index.expand(*self.pending_keys.shape[:2], -1)
        positions, steps = self.candidate_positions()
        gather_kv = selection[..., None].expand(-1, -1, -1, self.pending_keys.shape[-1])
        self.carried_keys = self.pending_keys.gather(2, gather_kv)
        self.carried_values = self.pending_values.gather(2, gather_kv)
        self.carried_positions = positions.gather(2, selection)
        self.carried_steps = steps.gather(2, selection)
        self.window_start = None
        self.detailed.length += self.pending_chunk_len
        self._clear_pending()


    def export(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The committed state as tensors (views where possible) and the window start (None: explicit form)."""
        keys, values = self.detailed.view(0, self.detailed.length)
        tensors = {"keys": keys, "values": values, "steps": self.detailed.steps[: self.detailed.length]}
        if self.window_start is None:
            tensors.update(carried_keys=self.carried_keys, carried_values=self.carried_values,
                           carried_positions=self.carried_positions, carried_steps=self.carried_steps)
        return tensors, self.window_start

    def restore(self, tensors: dict[str, torch.Tensor], window_start: int | None, device: torch.device) -> None:
        """Install a state saved by :meth:`export`; the carried state goes to ``device`` (the model's)."""
        storage = self.detailed.device or device
        self.detailed.load(*(tensors[name].to(storage) for name in ("keys", "values", "steps")))
        if self.detailed.length:
            self.lazy_initialization(tensors["keys"].to(device), tensors["values"].to(device))
        if window_start is not None and self.offloaded:  # saved without offload: make the window explicit
            keys, values = self.detailed.view(window_start, self.detailed.length)
            b, h = keys.shape[:2]
            positions = torch.arange(window_start, self.detailed.length, device=device).expand(b, h, -1)
            tensors = dict(tensors, carried_keys=keys, carried_values=values, carried_positions=positions,
                           carried_steps=self.detailed.steps[window_start : self.detailed.length].expand(b, h, -1))
            window_start = None
        self.window_start = window_start
        if window_start is None and "carried_keys" in tensors:  # else: nothing streamed yet, lazily initialised
            for name in ("carried_keys", "carried_values", "carried_positions", "carried_steps"):
                setattr(self, name, tensors[name].to(device).contiguous())
        self._clear_pending()


class TwoStateCache(Cache):
    """A transformers ``Cache`` of :class:`StreamingLayer` s, driven one step at a time by a carry policy.

    Args:
        num_layers: decoder layers of the model.
        policy: the carry rule.
        backend: attention backend for policies that need scores (see :func:`scored_attention`).
        capacity_hint: tokens to preallocate in each detailed buffer (the planned horizon), if known.
        storage_device: where the detailed cache lives, if not with the model (offload, e.g. ``"cpu"``).
    """

    def __init__(self, num_layers: int, policy: CarryPolicy, backend: str = "auto",
                 capacity_hint: int | None = None, storage_device: torch.device | str | None = None):
        super().__init__(layers=[StreamingLayer(capacity_hint, storage_device) for _ in range(num_layers)])
        self.policy = policy
        self.backend = backend
        self.chunk_lengths: list[int] = []
        self.seen_tokens = 0
        self._attended: set[int] = set()

    @property
    def step_index(self) -> int:
        """Index of the step being run (or about to run)."""
        return len(self.chunk_lengths)

    def begin(self, chunk_len: int) -> None:
        for layer in self.layers:
            layer.step = self.step_index
        self._chunk_len = chunk_len
        self._attended.clear()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the chunk's queries ``q [B, Hq, T, D]`` over ``[carried; chunk]`` keys ``k``/``v``;
        stages the policy's selection for this layer and returns ``[B, T, Hq, D]``."""
        layer = self.layers[layer_idx]
        if self.policy.scores_needed(k.shape[2]):
            out, scores = scored_attention(q, k, v, scale=scale, backend=self.backend)
        else:
            out, scores = chunk_attention(q, k, v, scale=scale), None
        candidates = Candidates(size=k.shape[2], scores=scores, step=self.step_index,
                                chunk_lengths=(*self.chunk_lengths, q.shape[2]), layer=layer_idx,
                                locate=layer.candidate_positions)
        layer.pending_selection = self.policy.select(candidates)
        self._attended.add(layer_idx)
        return out

    def missing_layers(self) -> list[int]:
        """Layers whose attention did not run through :meth:`attend` during the current step."""
        return [i for i in range(len(self.layers)) if i not in self._attended]

    def commit(self) -> None:
        for layer in self.layers:
            layer.commit()
        self.chunk_lengths.append(self._chunk_len)
        self.seen_tokens += self._chunk_len

    def rollback(self) -> None:
        for layer in self.layers:
            layer._clear_pending()

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resumed stream needs: tensors named ``layers.{i}.{name}`` and JSON-able metadata."""
        tensors, window_starts = {}, []
        for index, layer in enumerate(self.layers):
            layer_tensors, window_start = layer.export()
            tensors.update({f"layers.{index}.{name}": t for name, t in layer_tensors.items() if t is not None})
            window_starts.append(window_start)
        return tensors, {"chunk_lengths": list(self.chunk_lengths), "seen_tokens": self.seen_tokens,
                         "window_starts": window_starts}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], metadata: dict, device: torch.device) -> None:
        """Install a state from :meth:`state_dict`; carried tensors go to ``device``."""
        if len(metadata["window_starts"]) != len(self.layers):
            raise InputError(f"the saved state has {len(metadata['window_starts'])} layers, the model "
                             f"{len(self.layers)}")
        for index, (layer, window_start) in enumerate(zip(self.layers, metadata["window_starts"])):
            prefix = f"layers.{index}."
            layer_tensors = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
            layer.restore(layer_tensors, window_start, device)
        self.chunk_lengths = list(metadata["chunk_lengths"])
        self.seen_tokens = int(metadata["seen_tokens"])

    def to_dynamic_cache(self, device: torch.device | None = None) -> DynamicCache:
        """Every token's keys/values as a ``DynamicCache`` of views (no copy), or copies on ``device`` when the
        detailed cache is stored elsewhere (offload).

        ``DynamicCache.update`` concatenates into new tensors, so decoding from it never writes into the
        detailed buffers.
        """
        cache = DynamicCache()
        for layer in self.layers:
            exported = DynamicLayer()
            cache.layers.append(exported)
            if layer.detailed.keys is None:
                continue  # nothing streamed yet: an empty layer
            keys, values = layer.detailed.view(0, layer.detailed.length)
            if device is not None:
                keys, values = keys.to(device), values.to(device)
            exported.lazy_initialization(keys, values)
            exported.keys, exported.values = keys, values
        return cache
