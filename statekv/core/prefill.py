"""StreamingPrefill: feed a frozen Hugging Face decoder one chunk at a time under a carry policy.

Each :meth:`StreamingPrefill.step` is one ordinary forward of the model's own decoder. The only things
swapped in are a transformers ``Cache`` (:class:`TwoStateCache`) and, for the duration of the call, the
attention function registered under the name ``"statekv"``, which computes the chunk's attention over
``[carried; chunk]`` and lets the policy choose what to carry. The language model alone is switched (the
vision tower of a VLM keeps its own attention), and the previous implementation is restored afterwards, also
when the forward raises.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, DynamicCache

from .attention import resolve_backend
from .cache import TwoStateCache
from .errors import ConfigurationError, HorizonError, InputError, UnsupportedModelError
from .policies import CarryPolicy
from . import rope as rotary
from .rope import FrozenRope, check_horizon

ATTENTION_NAME = "statekv"
CACHE_KWARG = "statekv_cache"  # how the attention function finds the running cache (must not start with image_/video_)


def statekv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, K+T, D]``."""
    cache: TwoStateCache | None = kwargs.get(CACHE_KWARG)
    if cache is None:
        raise UnsupportedModelError(
            f"the {ATTENTION_NAME!r} attention runs only inside StreamingPrefill.step; switch the model back "
            "to 'sdpa' before calling it directly"
        )
    if kwargs.get("sliding_window"):
        raise UnsupportedModelError("sliding-window attention layers are not supported by the streaming engine")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, key, value, scale), None


AttentionInterface.register(ATTENTION_NAME, statekv_attention)


class StreamingPrefill:
    """Stream chunks through ``model`` under ``policy``, building a detailed cache of every token.

    Args:
        model: a transformers causal LM or decoder (Qwen2, Qwen3, Llama...) or a VLM whose language model is
            such a decoder. It is used as is: no weights or modules are replaced.
        policy: the carry rule (:class:`FullAttention`, :class:`Recency`, :class:`StateKV`, ...).
        attention: scoring backend for policies that need scores: ``auto``, ``eager``, ``chunked``, ``triton``.
        horizon: the most tokens the run will hold, question and answer included. It sizes the detailed
            buffers and fixes the RoPE rotation (required beyond the model's trained length for dynamic RoPE).
        freeze_rope: keep True; False leaves dynamic RoPE recomputing per chunk (only to study why freezing is
            needed).
        offload: keep the detailed cache on this device (``True`` means ``"cpu"``) instead of the model's, so
            accelerator memory stays constant as the stream grows; it is copied back for decoding.
    """

    def __init__(self, model: torch.nn.Module, policy: CarryPolicy, attention: str = "auto",
                 horizon: int | None = None, freeze_rope: bool = True, offload: bool | str | torch.device = False):
        if not isinstance(policy, CarryPolicy):
            raise ConfigurationError(f"policy must be a CarryPolicy (FullAttention, Recency, StateKV...), "
                                     f"got {type(policy).__name__}")
        self.model = model
        self.policy = policy
        self.decoder = _language_decoder(model)
        self.config = self.decoder.config
        _check_supported(self.config)
        self.device = next(self.decoder.parameters()).device
        self.attention = resolve_backend(attention, self.device)  # used whenever the policy needs scores
        self.horizon = check_horizon(self.config, horizon)
        self.storage_device = torch.device("cpu" if offload is True else offload) if offload else None
        self.rope: FrozenRope | None = rotary.freeze_rope(self.decoder, self.horizon) if freeze_rope else None
        self.cache = TwoStateCache(self.config.num_hidden_layers, policy, self.attention,
                                   capacity_hint=horizon, storage_device=self.storage_device)

    @property
    def seen_tokens(self) -> int:
        """Logical tokens consumed so far (the virtual sequence length)."""
        return self.cache.seen_tokens

    @property
    def detailed_cache(self) -> DynamicCache:
        """Every token's keys/values, in order, as a fresh ``DynamicCache`` of views (decoding never mutates it);
        copies on the model's device when the detailed cache is offloaded."""
        return self.cache.to_dynamic_cache(self.device if self.storage_device is not None else None)

    def carried_positions(self, layer: int) -> torch.Tensor:
        """Logical positions carried by ``layer`` into the next step, LongTensor ``[B, H_kv, K]``."""
        return self.cache.layers[layer].positions()

    @torch.no_grad()
    def step(self, inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
             input_ids: torch.Tensor | None = None, **forward_kwargs) -> torch.Tensor:
        """Run one chunk; return its last hidden states ``[B, T, D]``.

        Args:
            inputs_embeds: ``[B, T, D]`` chunk embeddings (or pass ``input_ids`` ``[B, T]`` for text).
            position_ids: RoPE positions; default ``arange(seen_tokens, seen_tokens + T)`` as ``[B, T]``.
                Pass them explicitly for M-RoPE (``[3 or 4, B, T]``).
            forward_kwargs: passed to the decoder's forward unchanged (e.g. DeepStack inputs).
        """
        chunk = self._check_chunk(inputs_embeds, input_ids)
        batch, chunk_len = chunk.shape[:2]
        if self.seen_tokens + chunk_len > self.horizon:
            raise HorizonError(
                f"this chunk would bring the stream to {self.seen_tokens + chunk_len} tokens, beyond the declared "
                f"horizon of {self.horizon}; declare a longer horizon when creating the stream"
            )
        if position_ids is None:
            position_ids = torch.arange(self.seen_tokens, self.seen_tokens + chunk_len,
                                        device=chunk.device).expand(batch, -1)
        if self.rope is not None:
            self.rope.apply()
        self.cache.begin(chunk_len)
        try:
            with self._attention_switched():
                output = self.decoder(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                                      past_key_values=self.cache, use_cache=True,
                                      **{CACHE_KWARG: self.cache}, **forward_kwargs)
            missing = self.cache.missing_layers()
            if missing:
                raise UnsupportedModelError(
                    f"{type(self.decoder).__name__} layers {missing} did not run their attention through "
                    "transformers' AttentionInterface, so they cannot be streamed"
                )
        except BaseException:
            self.cache.rollback()
            raise
        self.cache.commit()
        return output.last_hidden_state

    def generate(self, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """Decode after ``input_ids`` (the prompt that follows the streamed context) from the detailed cache.

        Returns only the new tokens ``[B, N]``. The stream is not changed: ask again, or keep streaming.
        """
        from .decoding import generate_from_cache

        return generate_from_cache(self, input_ids, **generate_kwargs)

    def close(self) -> None:
        """Give the model its own RoPE behaviour back (the frozen rotation stays until then, for decoding)."""
        if self.rope is not None:
            self.rope.restore()
            self.rope = None

    def __enter__(self) -> "StreamingPrefill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # internals ------------------------------------------------------------------------------------------
    def _check_chunk(self, inputs_embeds, input_ids) -> torch.Tensor:
        """The chunk's ``inputs_embeds [B, T, D]`` or ``input_ids [B, T]``, validated."""
        if (inputs_embeds is None) == (input_ids is None):
            raise InputError("pass exactly one of inputs_embeds [B, T, D] or input_ids [B, T]")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3:
                raise InputError(f"inputs_embeds must be [B, T, D], got shape {tuple(inputs_embeds.shape)}")
            if inputs_embeds.shape[-1] != self.config.hidden_size:
                raise InputError(f"inputs_embeds has hidden size {inputs_embeds.shape[-1]}, but the model's is "
                                 f"{self.config.hidden_size}")
            chunk = inputs_embeds
        else:
            if input_ids.dim() != 2:
                raise InputError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
            chunk = input_ids
        if chunk.shape[1] == 0:
            raise InputError("empty chunk: a step needs at least one token")
        streamed = self.cache.layers[0].detailed.keys
        if streamed is not None and chunk.shape[0] != streamed.shape[0]:
            raise InputError(f"chunk has batch size {chunk.shape[0]}, but the stream has {streamed.shape[0]}")
        return chunk

    @contextmanager
    def _attention_switched(self):
        previous = self.config._attn_implementation
        _set_language_attention(self.model, ATTENTION_NAME)
        try:
            yield
        finally:
            _set_language_attention(self.model, previous)


def _language_decoder(model: torch.nn.Module) -> torch.nn.Module:
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


def _check_supported(config) -> None:
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise UnsupportedModelError("models with sliding-window attention layers are not supported")


def _set_language_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch the attention of the language model only (a VLM's vision tower keeps its own).

    transformers VLMs declare a ``text_config`` sub-config and take the dict form. Remote-code VLMs without one
    (the original InternVL release) would switch every sub-model with the string form, so there the decoder
    alone is switched.
    """
    has_text_config = "text_config" in (getattr(model.config, "sub_configs", None) or {})
    target = model if has_text_config or _language_decoder(model) is model else _language_decoder(model)
    try:
        target.set_attn_implementation({"text_config": implementation} if has_text_config else implementation)
    except (ValueError, ImportError) as error:
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot use a custom attention function: {str(error).splitlines()[0]}"
        ) from None
