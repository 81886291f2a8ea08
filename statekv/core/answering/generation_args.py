"""Checking the generation arguments a user passes to ``ask`` before they reach ``model.generate``.

``ask(question, temperature=0.7, do_sample=True)`` forwards its keyword arguments to transformers' ``generate``.
A misspelt name or a value ``generate`` cannot use would surface there as a traceback (or, for some values, be
silently ignored); here each is refused with one line naming it.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from typing import Any

from ...errors import InputError
from ...settings.values import is_finite_number

DEFAULT_NEW_TOKENS = 64  # room reserved for the answer when generate_kwargs give no length

ENGINE_ARGUMENTS = ("input_ids", "inputs_embeds", "attention_mask", "past_key_values", "position_ids",
                    "cache_position", "use_cache")  # set by statekv for decoding from the detailed cache


# what ``generate`` takes besides generation settings (its parameters, and ``tokenizer`` for ``stop_strings``)
GENERATE_ARGUMENTS = frozenset({"generation_config", "logits_processor", "stopping_criteria", "streamer",
                                "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "negative_prompt_ids",
                                "negative_prompt_attention_mask", "use_model_defaults", "custom_generate",
                                "tokenizer", "assistant_tokenizer"})


ASK_ARGUMENTS = ("max_new_tokens", "retrieve", "retrieval")  # ask's own keywords, suggested for a misspelt one


def _positive_number(value: Any) -> bool:
    return is_finite_number(value) and value > 0


def _integer(least: int):
    return lambda value: not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= least


RULES = {  # name: (test, what it must be)
    "temperature": (_positive_number, "a finite number > 0"),
    "top_p": (lambda v: _positive_number(v) and v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (_integer(0), "a non-negative integer"),
    # a stream's cache holds one sequence: beams would each need their own copy of it
    "num_beams": (lambda v: v == 1 and not isinstance(v, bool), "1 (a stream's cache holds one sequence: no beam "
                  "search; greedy or do_sample=True)"),
    "num_beam_groups": (lambda v: v == 1 and not isinstance(v, bool), "1 (no beam search over a stream's cache)"),
    "num_return_sequences": (lambda v: v == 1 and not isinstance(v, bool), "1 (ask returns one answer)"),
    "repetition_penalty": (_positive_number, "a finite number > 0"),
    "length_penalty": (is_finite_number, "a finite number"),
    "min_new_tokens": (_integer(0), "a non-negative integer"),
    "max_length": (_integer(1), "a positive integer"),
    "max_new_tokens": (_integer(1), "a positive integer"),
    "return_dict_in_generate": (lambda v: v is False, "False (ask returns the answer's tokens)"),
    "no_repeat_ngram_size": (_integer(0), "a non-negative integer"),
    "do_sample": (lambda v: isinstance(v, bool), "True or False"),
    "early_stopping": (lambda v: isinstance(v, bool) or v == "never", "True, False or 'never'"),
}


def check_generation_arguments(arguments: Mapping[str, Any], generation_config: Any = None) -> None:
    """Refuse (one-line `InputError`) a name that is not a generation setting, one statekv sets itself, or a
    value out of its range."""
    from transformers import GenerationConfig

    known = generation_config if generation_config is not None else GenerationConfig()
    for name, value in arguments.items():
        if name in ENGINE_ARGUMENTS:
            raise InputError(f"ask() sets {name} itself (it decodes from the encoded video's cache); leave it out")
        if name in RULES and value is not None:  # None: not given (transformers' default)
            test, expected = RULES[name]
            if not test(value):
                raise InputError(f"ask(): {name} must be {expected}, got {value!r}"[:200])
        elif not hasattr(known, name) and name not in GENERATE_ARGUMENTS:
            raise InputError(f"ask(): unknown generation argument {name!r}{_suggestion(name, known)} "
                             "(see transformers' GenerationConfig)")


def _suggestion(name: str, known: Any) -> str:
    """'; did you mean X?' for the closest of ask's own keywords and the generation settings, else ''."""
    candidates = [*ASK_ARGUMENTS, *RULES, *GENERATE_ARGUMENTS,
                  *(key for key in vars(known) if not key.startswith("_"))]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
    return f"; did you mean {close[0]}?" if close else ""


def answer_length(arguments: Mapping[str, Any], prompt_tokens: int, generation_config: Any = None) -> int:
    """The most tokens an answer to a prompt of ``prompt_tokens`` takes under checked ``arguments``:
    ``max_new_tokens``, else the generation config's (``arguments``' own, else ``generation_config``, the model's:
    transformers takes it before ``max_length``), else what ``max_length`` (prompt and answer) leaves, else
    statekv's default."""
    if arguments.get("max_new_tokens") is not None:
        return int(arguments["max_new_tokens"])
    config = arguments.get("generation_config") or generation_config
    if getattr(config, "max_new_tokens", None) is not None:
        return int(config.max_new_tokens)
    if arguments.get("max_length") is not None:
        return max(int(arguments["max_length"]) - prompt_tokens, 1)
    return DEFAULT_NEW_TOKENS
