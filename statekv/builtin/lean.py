"""A training forward that keeps one head's attention map, not every layer's.

The training forward reads attention probabilities for its auxiliary targets (`statekv.builtin.batches`): of the
video, only `COUNTING_HEAD`'s; of the questions, a few rows. The eager forward keeps every layer's and head's map
of the video for the backward pass, which grows with the square of its length: a batch of two 768-frame videos
takes about 6 GB, a 2,400-frame stream (13,400 tokens) about 23 GB a layer pair. Under `keeping_maps` the video's
layers attend through SDPA (transformers' ``sdpa``, registered here as ``statekv-lean`` with ``sdpa``'s mask), and
each layer named keeps the probabilities of its named head alone, ``[B, L, L]``, computed as the eager forward
computes them. The questions' pass stays eager (its maps are ``[rows, heads, Lq, L + Lq]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

LEAN_ATTENTION = "statekv-lean"
_wanted: dict[int, int] = {}  # layer -> head whose probabilities the forward keeps
_kept: dict[int, torch.Tensor] | None = None  # where they go, while `keeping_maps` runs


def lean_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA's output; for a layer `keeping_maps` names, its head's probabilities
    ``[B, L, L]`` (causal, no padding) kept aside, as `eager_attention_forward` computes them."""
    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    head = _wanted.get(module.layer_idx)
    if head is not None and _kept is not None:
        keys = repeat_kv(key, module.num_key_value_groups)[:, head]
        logits = torch.matmul(query[:, head], keys.transpose(1, 2)) * scaling
        future = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).triu(
            1 + keys.shape[1] - query.shape[2])
        _kept[module.layer_idx] = torch.softmax(logits.masked_fill(future, torch.finfo(logits.dtype).min), dim=-1,
                                                dtype=torch.float32).to(query.dtype)
    return output, None


AttentionInterface.register(LEAN_ATTENTION, lean_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(LEAN_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def keeping_maps(language_model: torch.nn.Module, heads: dict[int, int]) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block ``language_model`` (a decoder whose layers share its config) attends through
    `lean_attention`, keeping the probabilities of ``heads`` (layer -> head); yields them by layer once its forward
    ran."""
    global _kept
    config = language_model.config
    before = config._attn_implementation
    kept: dict[int, torch.Tensor] = {}
    _wanted.clear()
    _wanted.update(heads)
    _kept, config._attn_implementation = kept, LEAN_ATTENTION
    try:
        yield kept
    finally:
        config._attn_implementation, _kept = before, None
        _wanted.clear()
