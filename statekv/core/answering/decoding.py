"""Decoding after a streamed prefill: transformers' ``generate`` over the detailed cache.

``generate`` receives an :class:`AnswerCache` (each layer's context from the detailed cache, with room for the
prompt and the answer), the new prompt ids and an all-ones attention mask over context plus prompt, so its
positions continue from the streamed length. The language model's attention goes through the engine's
attention function, which chooses each layer's context when the prompt's queries reach it (all of it, or the
steps a :class:`Retrieval` picks). The stream itself is never changed.

`StreamingPrefill.generate` is the one caller: it takes a :class:`Prompt` as a model family's adapter lays it out
(``VideoAdapter.prompt``) and checks it against the stream first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .answer_cache import AnswerCache, Retrieval
from .generation_args import answer_length
from ..positions.placing import QuestionPlan
from ..attention.switch import share_language_attention
from ...errors import InputError, UnsupportedModelError


@dataclass(frozen=True)
class Prompt:
    """What generation needs of the text that follows a stream, as a model family lays it out.

    input_ids: LongTensor ``[B, Q]``. position_ids: its RoPE positions when they do not simply continue from the
    stream's length (M-RoPE: ``[3 or 4, B, Q]``), else None. follows: the stream length, in tokens, it was laid out
    after (the engine refuses it after any other; None: unchecked). model: the module whose ``generate`` decodes
    (None: the stream's model; a wrapper whose own ``generate`` takes no cache names its language model).
    restores: ``(object, attribute)`` pairs that the model's ``generate`` may change and that are put back after
    it (Qwen3-VL's ``rope_deltas``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None = None
    follows: int | None = None
    model: torch.nn.Module | None = None
    restores: tuple[tuple[Any, str], ...] = ()


@torch.no_grad()
def generate_from_cache(prefill, input_ids: torch.Tensor, *, model: torch.nn.Module | None = None,
                        retrieve: Retrieval | None = None, plan: QuestionPlan | None = None,
                        **generate_kwargs) -> torch.Tensor:
    """Greedy (or any ``generate``) decoding of ``input_ids [B, Q]`` after ``prefill``'s context.

    model: the module whose ``generate`` decodes; default ``prefill.model`` (pass the language model of a
        wrapper whose own ``generate`` cannot take a cache). retrieve: answer from retrieved steps only.
    plan: under bounded positions, where the context is laid out and the prompt starts (what
        `StreamingPrefill.fit_question` planned).
    Returns the new tokens only, ``[B, N]``. `StreamingPrefill.generate` is its one caller, after its checks.
    """
    model = prefill.model if model is None else model
    if not hasattr(model, "generate"):
        raise UnsupportedModelError(f"{type(model).__name__} has no generate(); pass the model with its LM head")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError(f"the prompt must be non-empty input_ids [B, Q], got shape {tuple(input_ids.shape)}")
    if prefill.seen_tokens == 0:
        raise InputError("nothing has been streamed yet; call step() before generate()")
    if retrieve is not None and not isinstance(retrieve, Retrieval):
        raise InputError(f"retrieve must be a Retrieval (or None), got {type(retrieve).__name__}")
    room = input_ids.shape[1] + answer_length(generate_kwargs, input_ids.shape[1],
                                              getattr(model, "generation_config", None))
    context = prefill.seen_tokens if plan is None else plan.start
    if plan is not None and "position_ids" in generate_kwargs:  # explicit (M-RoPE) positions after the context
        generate_kwargs["position_ids"] = moved_positions(generate_kwargs["position_ids"],
                                                           prefill.positions.next_first - plan.start)
    mask = torch.ones(input_ids.shape[0], context + input_ids.shape[1], dtype=torch.long,
                      device=input_ids.device)
    generate_kwargs.setdefault("do_sample", False)
    cache = AnswerCache(prefill.cache, room, prefill.device, retrieve, plan)
    share_language_attention(prefill.model)
    with prefill.streaming(cache):
        output = model.generate(input_ids=input_ids, attention_mask=mask, past_key_values=cache, **generate_kwargs)
    prefill.last_read_steps, prefill.last_layer_steps = cache.steps_read()
    return output[:, input_ids.shape[1]:]


def moved_positions(position_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """Explicit prompt positions (``[B, Q]``, or M-RoPE's ``[3 or 4, B, Q]`` whose rows past a leading sequence
    index are moved) moved ``shift`` positions back."""
    moved = position_ids.clone()
    if moved.dim() == 2:
        return moved - shift
    moved[-3:] -= shift
    return moved
