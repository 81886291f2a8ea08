"""Decoding after a streamed prefill: transformers' ``generate`` over the detailed cache.

``generate`` receives a fresh ``DynamicCache`` of views into the detailed buffers, the new prompt ids and an
all-ones attention mask over context plus prompt, so its positions continue from the streamed length. Its
cache grows by concatenation into new tensors, so the stream itself is never written to.
"""

from __future__ import annotations

import torch

from .errors import InputError, UnsupportedModelError


@torch.no_grad()
def generate_from_cache(prefill, input_ids: torch.Tensor, *, model: torch.nn.Module | None = None,
                        **generate_kwargs) -> torch.Tensor:
    """Greedy (or any ``generate``) decoding of ``input_ids [B, Q]`` after ``prefill``'s context.

    model: the module whose ``generate`` decodes; default ``prefill.model`` (pass the language model of a
        wrapper whose own ``generate`` cannot take a cache). Returns the new tokens only, ``[B, N]``.
    """
    model = prefill.model if model is None else model
    if not hasattr(model, "generate"):
        raise UnsupportedModelError(f"{type(model).__name__} has no generate(); pass the model with its LM head")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError(f"the prompt must be non-empty input_ids [B, Q], got shape {tuple(input_ids.shape)}")
    if prefill.seen_tokens == 0:
        raise InputError("nothing has been streamed yet; call step() before generate()")
    if prefill.rope is not None:
        prefill.rope.apply()
    context = prefill.seen_tokens
    mask = torch.ones(input_ids.shape[0], context + input_ids.shape[1], dtype=torch.long,
                      device=input_ids.device)
    generate_kwargs.setdefault("do_sample", False)
    output = model.generate(input_ids=input_ids, attention_mask=mask, past_key_values=prefill.detailed_cache,
                            **generate_kwargs)
    return output[:, input_ids.shape[1]:]
