"""Questions asked together: questions of several streams of one model answered as the rows of one batch.

A row is a question as `StreamingPrefill.generate` answers it alone, token for token: at every layer it reads what
`AnswerLayer.read_context` reads for that question (the whole detailed cache, the steps still held, or the steps its
retrieval picks with the row's own queries at that layer; under bounded positions placed by its `QuestionPlan`), its
prompt sits at the positions ``generate`` gives it, and its answer is greedy, ending at the decoding model's end
tokens or at its ``max_new_tokens``. The prompts run in one forward, padded on the left and masked, then one forward
per answer token for every row still decoding (`statekv.core.answering.rows`). A streamer and stopping criteria (an
answer given token by token, stopped once its client has gone) are served as ``generate`` serves them; one that
raises ends its own row with that error, and the other rows go on.

`together_row` says which questions take this shape: one prompt, an answer length given, greedy, and a generation
config that adds no logits processor; anything else (sampling, a repetition penalty, beams...) is answered alone by
``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from ..positions.placing import QuestionPlan
from .answer_cache import AnswerCache
from .decoding import Prompt, moved_positions
from .retrieval import Retrieval
from .rows import LayerContext, RowCache, decode_rows, forward_rows, padded_left, rows_key

TOGETHER_ARGUMENTS = frozenset({"max_new_tokens", "do_sample", "streamer", "stopping_criteria"})
# generation settings that, away from their defaults, change what greedy decoding picks
PROCESSING = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
              "encoder_no_repeat_ngram_size", "bad_words_ids", "force_words_ids", "constraints", "min_length",
              "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id", "forced_decoder_ids", "suppress_tokens",
              "begin_suppress_tokens", "sequence_bias", "exponential_decay_length_penalty", "guidance_scale",
              "watermarking_config", "num_beams", "penalty_alpha", "dola_layers", "stop_strings", "max_time",
              "prompt_lookup_num_tokens", "assistant_early_exit")


@dataclass
class Asked:
    """A question to answer as a row of a batch (`together_row` makes it).

    prefill: its stream. prompt: as the adapter laid it out (``input_ids`` ``[1, Q]``). retrieve, plan: what it
    reads (`StreamingPrefill.check_question`). max_new_tokens: the longest answer. ends: the token ids that end it.
    head: the decoding model's output embeddings (hidden states -> logits). streamer, stopping: ``generate``'s
    ``streamer`` and ``stopping_criteria``, when given. read_steps: filled in, the steps its retrieved context read
    (None: the whole cache); layer_steps: filled in, the steps each layer's retrieval chose (`AnswerCache.steps_read`).
    told: filled in, whether its streamer was handed anything (a question whose batch failed before is asked again).
    """

    prefill: Any
    prompt: Prompt
    retrieve: Retrieval | None
    plan: QuestionPlan | None
    max_new_tokens: int
    ends: tuple[int, ...]
    head: torch.nn.Module
    streamer: Any = None
    stopping: Any = None
    read_steps: tuple[int, ...] | None = None
    layer_steps: tuple[tuple[int, ...], ...] | None = None
    told: bool = False


def together_row(prefill, prompt: Prompt, retrieve: Retrieval | None, plan: QuestionPlan | None,
                 generate_kwargs: dict) -> Asked | None:
    """The question (checked by `StreamingPrefill.check_question`) as a row of a batch, or None when it does not
    take that shape (module docstring) and ``generate`` answers it alone."""
    ids = prompt.input_ids
    length = generate_kwargs.get("max_new_tokens")
    if ids.dim() != 2 or ids.shape[0] != 1 or not set(generate_kwargs) <= TOGETHER_ARGUMENTS:
        return None
    if generate_kwargs.get("do_sample") or isinstance(length, bool) or not isinstance(length, int) or length < 1:
        return None
    model = prefill.model if prompt.model is None else prompt.model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "generation_config", None)
    if head is None or not _greedy(config) or not _plain_logits(model):
        return None
    return Asked(prefill, prompt, retrieve, plan, length, end_tokens(config), head, generate_kwargs.get("streamer"),
                 generate_kwargs.get("stopping_criteria"))


def _greedy(config: Any) -> bool:
    """Whether ``config`` (a ``GenerationConfig``, or None) leaves greedy decoding as the plain argmax."""
    if config is None:
        return True
    default = GenerationConfig()
    return all(getattr(config, name, None) in (None, getattr(default, name, None)) for name in PROCESSING)


def _plain_logits(model: Any) -> bool:
    """Whether ``model``'s logits are its output embeddings' output as they are (no soft-capping, no scale)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (getattr(text, "final_logit_softcapping", None) is None
            and getattr(text, "logit_scale", None) in (None, 1, 1.0))


def end_tokens(config: Any) -> tuple[int, ...]:
    """The token ids that end an answer under ``config`` (a ``GenerationConfig``, or None): its ``eos_token_id``."""
    ends = getattr(config, "eos_token_id", None)
    return tuple(ends if isinstance(ends, (list, tuple)) else [] if ends is None else [ends])


class _Row:
    """One question's row: its left padding, its prompt's length and the `AnswerCache` whose layers read its context
    (retrieval's scratch shared by the layers, as when it is answered alone)."""

    def __init__(self, question: Asked, pad: int):
        self.question, self.pad, self.length = question, pad, question.prompt.input_ids.shape[1]
        prefill = question.prefill
        self.answers = AnswerCache(prefill.cache, 0, prefill.device, question.retrieve, question.plan)

    @property
    def shared(self) -> tuple | None:
        """Questions of one stream reading its whole cache under one plan read one context."""
        question = self.question
        return None if question.retrieve is not None else (id(question.prefill), question.plan)

    def context(self, layer: int, queries: torch.Tensor, dtype: torch.dtype, scale: float) -> LayerContext:
        keys, values = self.answers.layers[layer].read_context(queries, self.question.retrieve, layer, scale,
                                                               self.answers.memory, dtype)
        return LayerContext(keys, values, torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device))


def question_positions(question: Asked) -> torch.Tensor:
    """Where ``generate`` puts the question's prompt: ``[1, Q]``, or its explicit M-RoPE rows ``[3 or 4, 1, Q]``;
    after the stream's tokens, or under bounded positions at its plan's start."""
    prefill, prompt, plan = question.prefill, question.prompt, question.plan
    if prompt.position_ids is None:
        start = prefill.seen_tokens if plan is None else plan.start
        return torch.arange(start, start + prompt.input_ids.shape[1], device=prefill.device)[None]
    if plan is None:
        return prompt.position_ids
    return moved_positions(prompt.position_ids, prefill.positions.next_first - plan.start)


def batches(questions: Sequence[Asked]) -> list[list[int]]:
    """The indices of ``questions`` that can share a batch, by batch: the same decoder, dtype, device and rotation
    (`rows_key`), positions explicit or not, one output head."""
    groups: dict[tuple, list[int]] = {}
    for index, question in enumerate(questions):
        key = (*rows_key(question.prefill, question.prompt.position_ids is None), id(question.head))
        groups.setdefault(key, []).append(index)
    return list(groups.values())


@torch.no_grad()
def answer_together(questions: Sequence[Asked]) -> list[torch.Tensor | Exception]:
    """The answers ``[1, N]`` (on the host) of ``questions``, each batch of them (`batches`) as the rows of one:
    each the tokens `StreamingPrefill.generate` gives it alone (its logits within float rounding), or the error its
    own streamer or stopping criteria raised. The streams are not changed."""
    answers: list[torch.Tensor | Exception | None] = [None] * len(questions)
    for members in batches(questions):
        for index, tokens in zip(members, _answer_rows([questions[i] for i in members])):
            answers[index] = tokens
    return answers


def _answer_rows(questions: list[Asked]) -> list[torch.Tensor | Exception]:
    first = questions[0].prefill
    device, head = first.device, questions[0].head
    longest = max(question.prompt.input_ids.shape[1] for question in questions)
    rows, ids, positions, lasts = [], [], [], []
    for question in questions:
        question.prefill.check_open()
        row = _Row(question, longest - question.prompt.input_ids.shape[1])
        laid = question_positions(question).to(device)
        laid_ids, laid_positions = padded_left(question.prompt.input_ids.to(device), laid, row.pad)
        rows.append(row)
        ids.append(laid_ids)
        positions.append(laid_positions)
        lasts.append(laid[..., -1:])
    cache = RowCache(rows, longest + max(question.max_new_tokens for question in questions), len(first.cache.layers))
    cache.valid = torch.ones(len(rows), longest, dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        cache.valid[index, :row.pad] = False
    logits = head(forward_rows(first, cache, torch.cat(ids), torch.cat(positions, dim=-2))[:, -1])  # [W, V]
    failed: dict[int, Exception] = {}  # a row whose streamer or criteria raised: its own error, the others go on
    for index, question in enumerate(questions):
        if question.streamer is not None:  # as generate does: the prompt first (once the prompts ran: a batch
            question.told = True  # failing there, a row's retrieval say, is answered again alone, unseen)
            try:
                question.streamer.put(question.prompt.input_ids.cpu())
            except Exception as error:  # noqa: BLE001 -- the caller's callback: its row's error alone
                failed[index] = error
    cache.valid = None
    answers: list[list[int]] = [[] for _ in questions]

    def take(row: int, token: int, scores: torch.Tensor) -> bool:
        question = questions[row]
        answers[row].append(token)
        if row in failed:
            return True
        try:
            if question.streamer is not None:
                question.streamer.put(torch.tensor([token]))
            # as generate: the criteria see every token, the one that ends the answer included
            stopped = question.stopping is not None and _stopped(question, answers[row], scores)
        except Exception as error:  # noqa: BLE001 -- as above
            failed[row] = error
            return True
        return stopped or token in question.ends or len(answers[row]) >= question.max_new_tokens

    done = [take(row, token, logits[row]) for row, token in enumerate(logits.argmax(-1).tolist())]
    decode_rows(first, cache, answers, lasts, done, head, take)
    for index, (row, question) in enumerate(zip(rows, questions)):
        question.read_steps, question.layer_steps = row.answers.steps_read()
        question.prefill.last_read_steps, question.prefill.last_layer_steps = question.read_steps, question.layer_steps
        held = [layer.rows for layer in cache.layers if layer.rows is not None]
        question.prefill.cache.note_device_bytes(sum(2 * rows_of.keys[index].numel() * rows_of.keys.element_size()
                                                     for rows_of in held))
        if question.streamer is not None and index not in failed:
            try:
                question.streamer.end()
            except Exception as error:  # noqa: BLE001 -- as above
                failed[index] = error
    return [failed.get(index, torch.tensor(answer, dtype=torch.long)[None]) for index, answer in enumerate(answers)]


def _stopped(question: Asked, answer: list[int], scores: torch.Tensor) -> bool:
    """Whether the question's stopping criteria stop its answer now, called as ``generate`` calls them (the prompt
    and the answer so far ``[1, Q + N]``, this token's scores ``[1, V]``) but with the ids on the host, where the
    answer's tokens already are: a criterion that reads the ids alone costs no copy to the device and no wait."""
    ids = torch.cat([question.prompt.input_ids.cpu(), torch.tensor([answer])], 1)
    criteria = question.stopping if isinstance(question.stopping, (list, tuple)) else [question.stopping]
    return any(bool(criterion(ids, scores[None]).any()) for criterion in criteria)
