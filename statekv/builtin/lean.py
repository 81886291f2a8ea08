"""A training forward that keeps one head's attention map of the video, not every layer's.

The training forward reads attention probabilities for its auxiliary targets (`statekv.builtin.batches`): of the
video, only `COUNTING_HEAD`'s; of the questions, a few rows. The eager forward keeps every layer's and head's map
of the video for the backward pass, which grows with the square of the video's length and bounds the videos a
machine can train on (docs/accuracy.md, "Past the range: full attention trained on dense windows"). Under
`keeping_maps` the video's layers attend through SDPA (transformers' ``sdpa``, registered here as
``statekv-lean`` with ``sdpa``'s mask), and each layer named keeps the probabilities of its named head alone,
``[B, L, L]``, computed as the eager forward computes them. The questions' pass stays eager (its maps are
``[rows, heads, Lq, L + Lq]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..errors import ConfigurationError

LEAN_ATTENTION = "statekv-lean"
_wanted: dict[int, int] = {}  # layer -> head whose probabilities the forward keeps
_kept: dict[int, torch.Tensor] | None = None  # where they go, while `keeping_maps` runs


def lean_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (``query [B, Hq, L, D]``, ``key``/``value`` ``[B, Hkv, L, D]``): SDPA's
    output; for a layer `keeping_maps` names, its head's probabilities ``[B, L, L]`` (causal) kept aside, as
    `eager_attention_forward` computes them."""
    if attention_mask is not None or dropout:
        raise ConfigurationError("the lean training forward takes unpadded videos without attention dropout")
    scaling = module.scaling if scaling is None else scaling
    output, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)
    head = _wanted.get(module.layer_idx)
    if head is not None and _kept is not None:
        keys = key[:, head // module.num_key_value_groups]  # [B, L, D]: the head's KV head
        logits = torch.matmul(query[:, head], keys.transpose(1, 2)) * scaling
        future = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).triu(
            1 + key.shape[2] - query.shape[2])
        _kept[module.layer_idx] = torch.softmax(logits.masked_fill(future, torch.finfo(logits.dtype).min), dim=-1,
                                                dtype=torch.float32).to(query.dtype)
    return output, None


AttentionInterface.register(LEAN_ATTENTION, lean_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(LEAN_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def keeping_maps(language_model: torch.nn.Module, heads: dict[int, int]) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block ``language_model`` (a decoder whose layers share its config) attends through
    `lean_attention`, keeping the probabilities of ``heads`` (layer -> head); yields them by layer once its forward
    ran. Not reentrant."""
    global _kept
    if _kept is not None:
        raise ConfigurationError("keeping_maps is already active: one lean forward at a time")
    before = language_model.config._attn_implementation
    kept: dict[int, torch.Tensor] = {}
    _wanted.clear()
    _wanted.update(heads)
    _kept = kept
    language_model.set_attn_implementation(LEAN_ATTENTION)
    try:
        yield kept
    finally:
        language_model.set_attn_implementation(before)
        _kept = None
        _wanted.clear()
