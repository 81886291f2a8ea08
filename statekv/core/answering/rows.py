"""Rows: several questions answered as the rows of one batch, each over its own stream's context.

Each row reads a context of its own at every layer (keys and values ``[1, H_kv, C, D]``, some masked out), assembled
when the batch's first forward reaches that layer from the row's queries there (`Row.context`). The prompts run
together, padded on the left to one length and masked (`RowCache`, `masked_attention`): one forward for every
prompt, then one forward per answer token for every row still decoding (`decode_rows`), each row's new tokens
appended after its context. A row reads nothing of another row; among its own new tokens it reads the earlier
ones, or those `RowCache.among` names (a standing question's drafts read their ancestors only).

Standing questions (`statekv.core.watching.standing`) and questions asked together
(`statekv.core.answering.together`) run this way; what a row reads is theirs to say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.cache_utils import Cache

from ..attention.switch import share_language_attention
from ..cache.engine_layer import EngineLayer
from ..step.batching import rope_key


@dataclass
class LayerContext:
    """One row's context at one layer: ``keys``/``values`` ``[1, H_kv, C, D]`` and ``valid`` ``[1, H_kv, C]`` (a
    carried token of the new frames, or retrieved twice, is not read). ``retrieved``: the steps whose tokens it
    reads besides the carried state and the new frames (retrieval), for what an answer read."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    retrieved: tuple[int, ...] = ()


class Row(Protocol):
    """One row of a batch: ``pad`` (its prompt's left padding), ``length`` (its prompt's tokens: those after them,
    drafts of its answer, do not score its retrieval), ``shared`` (a key rows reading the same context share, None:
    its own) and its context at a layer."""

    pad: int
    length: int

    @property
    def shared(self) -> tuple | None: ...

    def context(self, layer: int, queries: torch.Tensor, dtype: torch.dtype, scale: float) -> LayerContext:
        """The row's context at ``layer``; ``queries`` ``[1, Hq, Q, D]``: its prompt's there (padding left out)."""


class RowContexts:
    """The contexts of W rows at one layer, padded to one length, with room for the tokens each forward appends.

    ``keys``/``values`` ``[W, H_kv, C + room, D]``: row ``w``'s context in its first slots (padding masked), then
    the tokens appended by the forwards so far (``appended``), the same count for every row.
    """

    def __init__(self, contexts: list[LayerContext], room: int):
        longest = max(context.keys.shape[2] for context in contexts)
        first = contexts[0].keys
        rows, heads, dim = len(contexts), first.shape[1], first.shape[3]
        # every slot a forward reads is written before it is read (a context, its padding, an appended token)
        self.keys = first.new_empty(rows, heads, longest + room, dim)
        self.values = torch.empty_like(self.keys)
        self.valid = torch.zeros(rows, heads, longest + room, dtype=torch.bool, device=first.device)
        readers: dict[int, list[int]] = {}  # rows reading one context (those of one stream) are written together
        for row, context in enumerate(contexts):
            readers.setdefault(id(context), []).append(row)
        for members in readers.values():
            context, length = contexts[members[0]], contexts[members[0]].keys.shape[2]
            if members == list(range(members[0], members[-1] + 1)):  # a run of rows: written through a slice
                at = slice(members[0], members[-1] + 1)
            else:
                at = torch.tensor(members, device=first.device)
            for buffer, part in ((self.keys, context.keys), (self.values, context.values)):
                buffer[at, :, :length] = part
                if length < longest:  # padding no query reads, zeros (never what an unset slot might hold)
                    buffer[at, :, length:longest] = 0
            self.valid[at, :, :length] = context.valid
        self.context, self.appended = longest, 0
        self.retrieved = [context.retrieved for context in contexts]

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append every row's new tokens ``[W, H_kv, T, D]`` (``valid`` ``[W, T]``: which are real, the others
        padding no query reads; None: all); return the keys, values and validity read so far."""
        start = self.context + self.appended
        end = start + keys.shape[2]
        if end > self.keys.shape[2]:  # more tokens than planned: grow once
            grow = end - self.keys.shape[2]
            self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:2], grow, self.keys.shape[3])], 2)
            self.values = torch.cat([self.values, torch.zeros_like(self.keys[:, :, -grow:])], 2)
            self.valid = torch.cat([self.valid, self.valid.new_zeros(*self.valid.shape[:2], grow)], 2)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.valid[:, :, start:end] = True if valid is None else valid[:, None, :]
        self.appended += keys.shape[2]
        return self.keys[:, :, :end], self.values[:, :, :end], self.valid[:, :, :end]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     scale: float, among: torch.Tensor | None = None, own: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Attention of ``q [W, Hq, T, D]`` over ``keys``/``values`` ``[W, H_kv, L, D]`` whose last ``T`` are the
    queries' own tokens (causal among them, or as ``among`` ``[W, T, T]`` says: which of them each query reads),
    reading only the ``valid`` ``[W, H_kv, L]`` keys and always its own token, so a query whose own token is not
    valid (padding) still reads something and computes nothing undefined. Returns ``[W, T, Hq, D]``.

    For several queries the mask is handed to SDPA as the additive one it would make of a boolean mask (0 where
    read, -inf elsewhere), built from its parts (the keys' validity, the tokens' order) by one broadcast sum.
    ``own`` ``[W, T, T]``: that mask's part over the queries' own tokens, made once for every layer of a forward
    by `own_mask` (their order, their validity, each its own token read); then ``valid``'s last ``T`` columns and
    ``among`` are not read, and each layer only lays the keys' validity before it."""
    rows, query_heads, length, _ = q.shape
    assert among is None or among.shape[-1] == length, "among names the order of the queries' own tokens"
    total = keys.shape[2]
    group = query_heads // keys.shape[1]
    # per KV head (a carried token of the new frames is skipped in its own head), for its queries: [W, Hq, 1, L]
    if length == 1:  # one query (an answer token) reads every valid key, its own token among them
        mask = (valid if group == 1 else valid.repeat_interleave(group, dim=1))[:, :, None, :]
    elif own is not None:
        before = total - length
        mask = torch.empty(rows, keys.shape[1], group, length, total, dtype=q.dtype, device=q.device)
        mask[..., :before] = torch.where(valid[:, :, None, None, :before], 0.0, float("-inf"))
        mask[..., before:] = own[:, None, None]
        mask = mask.view(rows, query_heads, length, total)  # query head h reads KV head h // group
    else:
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
        mask = (mask if group == 1 else mask.repeat_interleave(group, dim=1))[:, :, None, :]
        if among is None:
            order = _causal(length, total, q.device, q.dtype)  # [T, L]
        else:
            order = torch.zeros(rows, 1, length, total, dtype=q.dtype, device=q.device)
            order[:, 0, :, total - length:].masked_fill_(~among, float("-inf"))
        mask = mask + order
        mask[..., total - length:].diagonal(dim1=-2, dim2=-1).fill_(0.0)  # every query reads at least its own token
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


def own_mask(valid: torch.Tensor | None, among: torch.Tensor | None, rows: int, length: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """``[W, T, T]`` the additive mask (0 where read, -inf elsewhere) of ``T`` queries over their own tokens:
    query ``t`` reads token ``j`` when ``among`` ``[W, T, T]`` says so (None: ``j <= t``) and ``j`` is ``valid``
    ``[W, T]`` (None: every token), and always its own token (`masked_attention`'s ``own``)."""
    reads = torch.ones(length, length, dtype=torch.bool, device=device).tril() if among is None else among
    if valid is not None:
        reads = reads & valid[:, None, :]
    reads = reads | torch.eye(length, dtype=torch.bool, device=device)
    return torch.zeros(rows, length, length, dtype=dtype, device=device).masked_fill_(~reads, float("-inf"))


_causal_masks: dict[tuple, torch.Tensor] = {}


def _causal(length: int, total: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[T, L]`` additive mask: 0 where a query reads a key (those before its own token's, and its own), -inf
    elsewhere (kept per shape)."""
    key = (length, total, device, dtype)
    mask = _causal_masks.get(key)
    if mask is None:
        with torch.inference_mode(False):  # kept for later calls, inside inference mode or not
            later = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
            mask = torch.zeros(length, total, dtype=dtype, device=device)
            mask[:, total - length:].masked_fill_(later, float("-inf"))
        if len(_causal_masks) > 256:
            _causal_masks.clear()
        _causal_masks[key] = mask
    return mask


class RowLayer(EngineLayer):
    """One layer of a :class:`RowCache`: the rows' contexts, assembled when the first forward reaches it, then the
    tokens every forward appends (what transformers' layer contract would move or reorder is refused, as for every
    engine layer)."""

    def __init__(self):
        super().__init__()
        self.rows: RowContexts | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stage the new tokens' keys and values ``[W, H_kv, T, D]`` until `RowCache.attend` reads them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.rows is None else self.rows.context + self.rows.appended

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class RowCache(Cache):
    """The transformers ``Cache`` a batch of rows runs with (see the module docstring): ``valid`` ``[W, T]`` marks
    the real tokens of the forward being run (the prompts' left padding is not) and ``among`` ``[W, T, T]`` which of
    its tokens each of them reads (None: the causal ones; a draft token reads its ancestors only); the first
    forward's queries are kept per layer (``queries``)."""

    def __init__(self, rows: Sequence[Row], room: int, layers: int):
        super().__init__(layers=[])
        self.rows, self.room = rows, room
        self.layers = [RowLayer() for _ in range(layers)]
        self.valid: torch.Tensor | None = None
        self.among: torch.Tensor | None = None
        self.queries: list[torch.Tensor] = []
        self.own: tuple | None = None  # (valid, among, shape, `own_mask`): the same at every layer of a forward

    def forget(self, row: int, columns: list[int]) -> None:
        """Row ``row``'s appended tokens at ``columns`` (counted from the first appended) are read no more."""
        for layer in self.layers:
            if layer.rows is not None:
                start = layer.rows.context
                layer.rows.valid[row, :, [start + column for column in columns]] = False

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Attention of the rows' new tokens ``q [W, Hq, T, D]`` over their contexts and the tokens so far; returns
        ``[W, T, Hq, D]``."""
        layer = self.layers[layer_idx]
        first = layer.rows is None
        if first:
            made: dict[tuple, LayerContext] = {}  # rows of one stream reading the same context share it
            contexts = []
            for index, row in enumerate(self.rows):
                key = row.shared
                if key is None or key not in made:
                    context = row.context(layer_idx, q[index:index + 1, :, row.pad:row.pad + row.length], k.dtype,
                                          scale)
                    if key is not None:
                        made[key] = context
                contexts.append(context if key is None else made[key])
            layer.rows = RowContexts(contexts, self.room)
            self.queries.append(q)
        keys, values, valid = layer.rows.append(*layer.pending, self.valid)
        layer.pending = None
        own = None
        if q.shape[2] > 1:
            shape = (q.shape[0], q.shape[2], q.dtype, q.device)
            if self.own is None or self.own[0] is not self.valid or self.own[1] is not self.among \
                    or self.own[2] != shape:
                self.own = (self.valid, self.among, shape,
                            own_mask(self.valid, self.among, q.shape[0], q.shape[2], q.dtype, q.device))
            own = self.own[3]
        return masked_attention(q, keys, values, valid, scale, among=self.among, own=own)


def finished(answer: list[int], ends: set[int], longest: int) -> bool:
    """Whether ``answer`` is complete: it holds an end token (cut after the first) or ``longest`` tokens."""
    for index, token in enumerate(answer):
        if token in ends:
            del answer[index + 1:]
            return True
    return len(answer) >= longest


def forward_rows(prefill, cache: RowCache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One forward of the decoder over ``ids`` ``[W, T]`` at ``positions`` through ``cache`` inside ``prefill``'s
    call (its RoPE); returns the last hidden states ``[W, T, D]``."""
    share_language_attention(prefill.model)
    with prefill.streaming(cache):
        output = prefill.decoder(input_ids=ids, position_ids=positions, attention_mask=prefill.step_mask,
                                 past_key_values=cache, use_cache=True)
    return output.last_hidden_state


def rows_key(prefill, explicit_positions: bool) -> tuple:
    """What rows must share to run as one batch: the decoder, its dtype and device, the rotation, and whether
    positions are explicit (M-RoPE)."""
    return id(prefill.decoder), prefill.dtype, prefill.device, rope_key(prefill), explicit_positions


def padded_left(ids: torch.Tensor, positions: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` ``[1, T]`` and ``positions`` ``[..., 1, T]`` after ``pad`` padding tokens: the first token's id and
    position repeated (masked as keys by `RowCache.valid`, their queries' outputs unused)."""
    return (torch.cat([ids[:, :1].expand(1, pad), ids], 1),
            torch.cat([positions[..., :1].expand(*positions.shape[:-1], pad), positions], -1))


def decode_rows(prefill, cache: RowCache, answers: list[list[int]], lasts: list[torch.Tensor], done: list[bool],
                lm_head: torch.nn.Module, take: Callable[[int, int, torch.Tensor], bool]) -> None:
    """One forward per token until every row is ``done``: each feeds every row its last answer token at the next
    position after ``lasts`` (its prompt's last position, ``[..., 1, 1]``), and ``take(row, token, logits [V])``
    books the greedy next token of each row not yet done, saying whether it is done now. ``prefill``: the stream
    whose call (its RoPE) the forwards run in."""
    device = prefill.device
    while not all(done):
        fed = torch.tensor([[answer[-1]] for answer in answers], device=device)
        at = torch.cat([last + len(answer) for last, answer in zip(lasts, answers)], dim=-2)
        logits = lm_head(forward_rows(prefill, cache, fed, at)[:, -1])  # [W, V]
        tokens = logits.argmax(-1).tolist()
        for row, token in enumerate(tokens):
            if not done[row]:
                done[row] = take(row, token, logits[row])
