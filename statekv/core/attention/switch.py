"""The language model's attention, switched once per model so that streams and ordinary calls share it.

transformers picks a layer's attention function by the name in the language config (``AttentionInterface``) and
the mask it builds by the same name (``AttentionMaskInterface``). :func:`share_language_attention` switches
that name, once per model, to ``statekv+<original>``: a call made inside :func:`streaming_through` (in the
same thread) attends through the stream's cache, with no mask built for it; every other call falls through to
the original implementation (``sdpa``, ``eager``...) and its mask, so a plain ``generate`` on the same model,
even from another thread while streams step, is what it was.
"""

from __future__ import annotations

import sys
import threading
from contextlib import AbstractContextManager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...errors import UnsupportedModelError
from .thread_value import ThreadValue
from .untraced import engine_call

ATTENTION_NAME = "statekv"
_streaming = ThreadValue()  # the cache of the stream whose call runs in this thread, for the attention
_install_lock = threading.Lock()


def _stream_cache():
    return _streaming.get()


def streaming_through(cache) -> AbstractContextManager[None]:
    """Calls of the engine's attention made in this thread inside the block attend through ``cache`` (a
    `TwoStateCache` while stepping, an `AnswerCache` while answering)."""
    return _streaming.set(cache)


def statekv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, K+T, D]``.

    Serves the stream whose call runs in this thread, attending causally over ``[carried; chunk]``: whatever
    mask reaches it is the engine's own (:func:`prepared_mask` while stepping, none while answering), the
    caller's having been checked to be plain causal. Under the bare name ``statekv`` it refuses any other call."""
    cache = _stream_cache()
    if cache is None:
        raise UnsupportedModelError(
            f"the {ATTENTION_NAME!r} attention runs only inside StreamingPrefill.step; switch the model back "
            "to 'sdpa' before calling it directly"
        )
    if kwargs.get("sliding_window"):
        raise UnsupportedModelError("sliding-window attention layers are not supported by the streaming engine")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return engine_call(cache.attend, module.layer_idx, query, key, value, scale), None


AttentionInterface.register(ATTENTION_NAME, statekv_attention)


_prepared: dict[torch.device, torch.Tensor] = {}


def prepared_mask(device: torch.device) -> torch.Tensor:
    """A 4D mask ``[1, 1, 1, 1]`` to pass as a step's ``attention_mask``: transformers takes a 4D mask as
    already prepared, so it reads nothing of the cache to build one (a step stays the same from step to step,
    for CUDA graphs and ``torch.compile``); the engine's attention ignores it. One tensor per device, kept."""
    mask = _prepared.get(device)
    if mask is None:
        mask = _prepared.setdefault(device, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device))
    return mask


def shared_attention_name(original: str | None) -> str:
    """The name of the engine's attention over ``original`` (registered on first use): streams' calls attend
    through the engine, every other call through ``original`` with ``original``'s mask."""
    original = original or "eager"
    if original.startswith(ATTENTION_NAME):
        return original
    name = f"{ATTENTION_NAME}+{original}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if _stream_cache() is not None:
            return statekv_attention(module, query, key, value, attention_mask, *args, **kwargs)
        return _original_attention(module, original)(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, attention)
    original_mask = AttentionMaskInterface._global_mapping.get(original)
    if original_mask is not None:  # else transformers builds no mask for this name, as for the original

        def mask(*args, **kwargs):
            return None if _stream_cache() is not None else original_mask(*args, **kwargs)

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


def _original_attention(module, original: str):
    if original != "eager":
        return ALL_ATTENTION_FUNCTIONS[original]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(f"cannot find the eager attention of {type(module).__name__} to fall back to")
    return eager


def share_language_attention(model: torch.nn.Module) -> None:
    """Switch ``model``'s language attention, once, to the engine's function over its current implementation
    (:func:`shared_attention_name`); idempotent and safe to call from several threads."""
    config = language_decoder(model).config
    if (config._attn_implementation or "").startswith(ATTENTION_NAME):
        return
    with _install_lock:
        current = config._attn_implementation
        shared = shared_attention_name(current)
        if shared != current:
            _set_language_attention(model, shared)


def language_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose forward takes ``inputs_embeds`` and returns ``last_hidden_state``."""
    if not hasattr(model, "get_decoder") or not hasattr(model, "config"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model")
    decoder = model.get_decoder()
    # Some wrappers answer with a causal-LM head around the decoder (for example a VLM's language model).
    while decoder is not decoder.get_decoder():
        decoder = decoder.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder.config, "num_hidden_layers"):
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return decoder


def _set_language_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch the attention of the language model only (a VLM's vision tower keeps its own).

    transformers VLMs declare a ``text_config`` sub-config and take the dict form. Remote-code VLMs without one
    (the original InternVL release) would switch every sub-model with the string form, so there the decoder
    alone is switched.
    """
    has_text_config = "text_config" in (getattr(model.config, "sub_configs", None) or {})
    target = model if has_text_config or language_decoder(model) is model else language_decoder(model)
    try:
        target.set_attn_implementation({"text_config": implementation} if has_text_config else implementation)
    except (ValueError, ImportError) as error:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot use a custom attention function: {str(error).splitlines()[0]}"
        ) from None
