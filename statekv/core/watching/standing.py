"""Standing questions: a question asked of a live stream again and again as it grows, at a cost that does not.

A :class:`StandingQuestion` is a question laid out once (its prompt's ids) and evaluated as the stream grows
(:func:`evaluate`). An evaluation never re-reads the stream: at each layer its prompt and answer attend to what
:mod:`statekv.core.watching.context` assembles, namely the carried state, the frames streamed since the question's
last evaluation and, when asked for, the frames retrieval picks for it; the rest of the stream reaches it only
through what the carried state keeps. An evaluation therefore costs the same at any point of the stream
(docs/engine.md, "Standing questions"): ``(Q + N)`` tokens through the model, each attending to at most ``B +
F + Q + N`` keys per layer (``B`` carried, ``F`` new frames' tokens, ``Q`` the prompt, ``N`` the answer).

The prompt's keys and values are recomputed at each evaluation, not kept from the first one: they carry what the
question's tokens read of the video (its colour word finding the frames of that colour, say), and kept from an
earlier evaluation they answer from what the stream showed then (docs/engine.md measures it). Its queries at
every layer are kept from the latest evaluation (`StandingQuestion.queries`): they steer what the stream carries
while the question stands (`statekv.core.rules.steering`).

Evaluations of several questions, of one stream or of several streams of one model, run as the rows of one
batch (prompts of different lengths padded on the left, masked): one forward for all their prompts, then one per
answer token. The streams are never written to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import InputError, QuestionTooLong
from ..answering.decoding import Prompt
from ..answering.retrieval import Retrieval
from ..answering.rows import LayerContext, RowCache, decode_rows, finished, forward_rows, padded_left, rows_key
from ..positions.rope import model_frequencies
from .context import Placement, layer_context, placement
from .drafts import RUNNERS_UP, DraftTree, draft_tree, kept_answers
from .fitting import Scoring, retrieval_scoring, tail_start


@dataclass
class StandingQuestion:
    """A question evaluated against one stream as it grows.

    ids: LongTensor ``[1, Q]``, its prompt (as the adapter lays a question out after a video). frequencies: the
    stream's rotary frequencies ``[R / 2]`` (float32, host). queries: per layer ``[1, Hq, Q, D]``, the prompt's
    queries at its latest evaluation (None before the first), RoPE applied from rotary position ``start``. answer:
    LongTensor ``[N]``, its latest answer's tokens. earlier: its earlier distinct answers (latest first);
    runners_up: the first tokens the model ranked after its answer's at its latest evaluation (with ``answer``, the
    drafts the next evaluation checks first, :mod:`.drafts`).
    """

    ids: torch.Tensor
    frequencies: torch.Tensor
    queries: list[torch.Tensor] | None = None
    start: int = 0
    answer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    earlier: list[torch.Tensor] = field(default_factory=list)
    runners_up: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def standing_question(prefill, prompt: Prompt) -> StandingQuestion:
    """``prompt`` (a question laid out after ``prefill``'s stream, `VideoAdapter.prompt`) as a standing question,
    checked; nothing runs through the model until its first evaluation."""
    prefill.check_open()
    ids = prompt.input_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise InputError(f"a standing question needs a prompt [1, Q] of at least one token, got {tuple(ids.shape)}")
    prefill.check_ids(ids, "input_ids (the question)")
    return StandingQuestion(ids.clone(), model_frequencies(prefill.decoder, prefill.rope))


def prompt_start(prompt: Prompt, prefill) -> int:
    """Where ``prompt`` starts in the stream: its first position (the temporal row of explicit M-RoPE positions),
    else the stream's length."""
    if prompt.position_ids is None:
        return prefill.seen_tokens
    rows = prompt.position_ids
    return int((rows if rows.dim() == 2 else rows[-3])[0, 0])


def prompt_positions(prompt: Prompt, prefill, shift: int) -> torch.Tensor:
    """``prompt``'s positions moved ``shift`` back: ``[1, Q]`` (1-D) or its explicit M-RoPE rows ``[3 or 4, 1,
    Q]``."""
    if prompt.position_ids is None:
        start = prefill.seen_tokens - shift
        return torch.arange(start, start + prompt.input_ids.shape[1], device=prompt.input_ids.device)[None]
    moved = prompt.position_ids.clone()
    if moved.dim() == 2:
        return moved - shift
    moved[-3:] -= shift
    return moved


@dataclass
class Evaluation:
    """One evaluation of a standing question against its stream as it stands now.

    prompt: the question laid out after the stream now (its ids, and its positions when explicit). since: the first
    token its last evaluation did not read (the new frames start there, or past the range later: `tail_start`).
    max_new_tokens: the longest answer. eos: token ids that end an answer. retrieval: also read the steps it picks
    among those before ``since`` (scored with the prompt's queries at each layer, as a question asked is).
    retrieved: filled in, the steps retrieval picked over the layers.
    """

    prefill: object
    question: StandingQuestion
    prompt: Prompt
    since: int
    max_new_tokens: int
    eos: tuple[int, ...] = ()
    retrieval: Retrieval | None = None
    retrieved: set[int] = field(default_factory=set)


class _Row:
    """One row of an evaluation batch: its evaluation, the first token it reads as new (``since``, bounded by the
    range: `tail_start`), where it is placed, its padding, its prompt's length and how its retrieval scores the
    steps past the range (`retrieval_scoring`)."""

    def __init__(self, evaluation: Evaluation, since: int, place: Placement, pad: int, length: int,
                 scoring: Scoring | None = None, reads: dict | None = None):
        self.evaluation, self.since, self.place, self.pad, self.length = evaluation, since, place, pad, length
        self.scoring = scoring
        self.memory: dict = {}
        self.reads = {} if reads is None else reads  # shared with the rows of its stream (`layer_context`)

    @property
    def first(self) -> int:
        """The rotary position of the prompt's first token."""
        return self.place.question_first - self.place.shift

    @property
    def shared(self) -> tuple | None:
        """What rows reading the same context share (None: this row reads its own, retrieving for its question)."""
        if self.evaluation.retrieval is not None:
            return None
        return id(self.evaluation.prefill), self.since, self.place if self.place.shift else 0

    def context(self, layer: int, queries: torch.Tensor, dtype: torch.dtype, scale: float) -> LayerContext:
        """The row's context at ``layer``; ``queries`` ``[1, Hq, Q, D]``: its prompt's at this layer, placed (what
        retrieval scores the steps with, as a question asked does)."""
        evaluation = self.evaluation
        question = evaluation.question
        device = queries.device
        context = layer_context(evaluation.prefill, layer, self.since, self.place, device=device, dtype=dtype,
                                frequencies=question.frequencies.to(device),
                                queries=queries if evaluation.retrieval is not None else None,
                                retrieval=evaluation.retrieval, scale=scale, memory=self.memory,
                                scoring=self.scoring, reads=self.reads)
        evaluation.retrieved.update(context.retrieved)
        return context


def batch_key(evaluation: Evaluation) -> tuple:
    """What evaluations must share to run as rows of one batch: the decoder, its dtype and device, the rotation,
    whether positions are explicit (M-RoPE)."""
    return rows_key(evaluation.prefill, evaluation.prompt.position_ids is None)


@torch.inference_mode()
def evaluate(evaluations: Sequence[Evaluation], lm_head: torch.nn.Module) -> list[torch.Tensor]:
    """Greedy answers of ``evaluations`` (each: new tokens ``[1, N]`` on the host, cut after its first end token or
    at its ``max_new_tokens``), those sharing a `batch_key` as rows of one batch. ``lm_head``: the model's output
    embeddings (hidden states -> logits). Each question's queries are kept (`StandingQuestion.queries`); the
    streams are not changed. Runs in inference mode: nothing it makes is written in place afterwards, so autograd's
    bookkeeping is skipped for every operation (less work per operation than under ``no_grad``)."""
    answers: list[torch.Tensor | None] = [None] * len(evaluations)
    groups: dict[tuple, list[int]] = {}
    for index, evaluation in enumerate(evaluations):
        groups.setdefault(batch_key(evaluation), []).append(index)
    for members in groups.values():
        for index, tokens in zip(members, _evaluate_rows([evaluations[i] for i in members], lm_head)):
            answers[index] = tokens
    return answers


def _evaluate_rows(evaluations: list[Evaluation], lm_head: torch.nn.Module) -> list[torch.Tensor]:
    """The rows' greedy answers. Each prompt runs with its question's drafts after it (:mod:`.drafts`: its last
    answer, its earlier ones, the runner-up first tokens of its last evaluation, as a tree): the forward that reads
    the prompt also predicts the token after each draft token, so an answer found in the tree (one that did not
    change, or changed to a draft) costs that one forward; decoding goes on, one forward per token, from where the
    tree ends (the draft tokens off the answer's path are not read again)."""
    first = evaluations[0].prefill
    device = first.device
    ends = [set(evaluation.eos) for evaluation in evaluations]
    latest = [evaluation.question.answer.tolist() for evaluation in evaluations]
    earlier = [[answer.tolist() for answer in evaluation.question.earlier] for evaluation in evaluations]
    trees = [draft_tree(latest[row], earlier[row], evaluation.question.runners_up, ends[row],
                        evaluation.max_new_tokens) for row, evaluation in enumerate(evaluations)]
    longest = max(evaluation.prompt.input_ids.shape[1] + len(tree) for evaluation, tree in zip(evaluations, trees))
    longest_answer = max(evaluation.max_new_tokens for evaluation in evaluations)
    rows, ids, positions = [], [], []
    carried_of: dict[int, int] = {}  # per stream: the most tokens a layer carries
    reads_of: dict[int, dict] = {}  # per stream: what its rows read alike (`layer_context`), and how many rows
    for evaluation in evaluations:
        reads_of.setdefault(id(evaluation.prefill), {"rows": 0})["rows"] += 1
    for evaluation, tree in zip(evaluations, trees):
        prefill, prompt = evaluation.prefill, evaluation.prompt
        prefill.check_open()
        length = prompt.input_ids.shape[1]
        room = length + evaluation.max_new_tokens
        if not prefill.positions.bounded and prefill.horizon is not None \
                and prefill.seen_tokens + room > prefill.horizon:
            raise QuestionTooLong(length, evaluation.max_new_tokens, prefill.horizon - prefill.seen_tokens)
        flat = prompt.position_ids is None or prompt.position_ids.dim() == 2
        carried = carried_of.get(id(prefill))
        if carried is None:
            carried = carried_of[id(prefill)] = max(layer.carried_length for layer in prefill.cache.layers)
        question_first = prompt_start(prompt, prefill)
        since = tail_start(prefill, evaluation.since, question_first, length, evaluation.max_new_tokens, carried,
                           flat)
        place = placement(prefill, since, question_first, room, carried, flat)
        pad = longest - length - len(tree)
        scoring = None if evaluation.retrieval is None else retrieval_scoring(
            prefill, evaluation.retrieval, room, question_first - place.shift)
        rows.append(_Row(evaluation, since, place, pad, length, scoring, reads_of[id(prefill)]))
        laid_ids, laid_positions = _laid_out(prompt, prefill, place.shift, tree, pad, device)
        ids.append(laid_ids)
        positions.append(laid_positions)
    cache = RowCache(rows, longest + longest_answer, len(first.cache.layers))
    cache.valid, cache.among = _masks(rows, trees, longest, device)
    if all(isinstance(laid, list) for laid in ids):  # 1-D positions: every row's ids and positions made at once
        ids, positions = (torch.from_numpy(np.array(laid, dtype=np.int64)).to(device) for laid in (ids, positions))
    else:  # explicit positions in some row: each row's as a [1, T] row (lists from rows without them)
        ids = torch.cat([torch.tensor([laid], device=device) if isinstance(laid, list) else laid for laid in ids])
        positions = torch.cat([torch.tensor([laid], device=device) if isinstance(laid, list) else laid
                               for laid in positions], dim=-2)
    hidden = forward_rows(first, cache, ids, positions)  # [W, L, D]
    prompt_ends = [longest - len(tree) - 1 for tree in trees]  # each row's prompt's last token
    low = min(prompt_ends)
    logits = lm_head(hidden[:, low:])  # [W, n + 1, V]: after the prompt, after each draft token
    told = logits.argmax(-1).tolist()
    ats = [at - low for at in prompt_ends]
    ranked = logits[list(range(len(rows))), ats].topk(min(RUNNERS_UP + 1, logits.shape[-1])).indices.tolist()
    answers, paths = [], []
    for row, (evaluation, tree) in enumerate(zip(evaluations, trees)):
        at = ats[row]
        answer, path = tree.walk(told[row][at:], ends[row], evaluation.max_new_tokens)
        answers.append(answer)
        paths.append(path)
        evaluation.question.runners_up = [token for token in ranked[row] if token != told[row][at]][:RUNNERS_UP]
    cache.valid = cache.among = None
    done = [finished(answer, ends[row], evaluations[row].max_new_tokens) for row, answer in enumerate(answers)]
    if not all(done):  # the draft tokens off each answer's path are not read again
        for row, (tree, path) in enumerate(zip(trees, paths)):
            off = sorted(set(range(len(tree))) - set(path))
            if off:
                cache.forget(row, [longest - len(tree) + node for node in off])

    def take(row: int, token: int, logits: torch.Tensor) -> bool:
        answers[row].append(token)
        return finished(answers[row], ends[row], evaluations[row].max_new_tokens)

    if not all(done):  # each row's prompt's last position, the answer's tokens go on from
        lasts = [positions[..., row:row + 1, at:at + 1] for row, at in enumerate(prompt_ends)]
        decode_rows(first, cache, answers, lasts, done, lm_head, take)
    with torch.inference_mode(False):  # what outlives the evaluation is made as ordinary tensors
        _keep_queries(rows, cache.queries)
        made = [torch.tensor(answer, dtype=torch.long)[None] for answer in answers]
    for row, (evaluation, tokens) in enumerate(zip(evaluations, made)):
        question = evaluation.question
        question.earlier = kept_answers([question.answer, *question.earlier], [latest[row], *earlier[row]],
                                        answers[row])
        question.answer = tokens[0]
    return made


def _laid_out(prompt: Prompt, prefill, shift: int, tree: DraftTree, pad: int, device: torch.device) -> tuple:
    """One row's ids and positions: ``pad`` padding tokens, the prompt (its positions moved ``shift`` back), then
    ``tree``'s tokens, each at the position after its parent. Under 1-D positions two lists of ints (the batch's
    tensors are made at once); under explicit ones ``[1, T]`` and ``[3 or 4, 1, T]`` (`padded_left`)."""
    if prompt.position_ids is None:
        prompt_ids = prompt.input_ids[0].tolist()
        start = prefill.seen_tokens - shift
        last = start + len(prompt_ids) - 1
        return (prompt_ids[:1] * pad + prompt_ids + tree.tokens,
                [start] * pad + list(range(start, last + 1)) + [last + depth for depth in tree.depths])
    laid = prompt_positions(prompt, prefill, shift).to(device)
    after = laid[..., -1:] + torch.tensor(tree.depths, dtype=torch.long, device=device)
    drafted = torch.tensor(tree.tokens, dtype=torch.long, device=device)
    return padded_left(torch.cat([prompt.input_ids.to(device), drafted[None]], 1), torch.cat([laid, after], -1), pad)


def _masks(rows: list[_Row], trees: list[DraftTree], longest: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first forward's ``valid`` ``[W, T]`` (a row's padding is not) and ``among`` ``[W, T, T]`` (causal, a
    draft token reading the prompt, its ancestors and itself; None without drafts), made on the host at once."""
    valid = np.ones((len(rows), longest), dtype=bool)
    for row, each in enumerate(rows):
        valid[row, :each.pad] = False
    among = None
    if any(trees):
        among = np.repeat(np.tri(longest, dtype=bool)[None], len(rows), axis=0)
        for row, tree in enumerate(trees):
            if len(tree):
                among[row, longest - len(tree):, longest - len(tree):] = tree.reads()
        among = torch.from_numpy(among).to(device)
    return torch.from_numpy(valid).to(device), among


def _keep_queries(rows: list[_Row], queries: list[torch.Tensor]) -> None:
    """Each row's prompt queries at every layer (its prompt's ``length`` after its padding) kept on its question,
    with where they sit."""
    for index, row in enumerate(rows):
        question = row.evaluation.question
        question.queries = [layer[index:index + 1, :, row.pad:row.pad + row.length].clone() for layer in queries]
        question.start = row.first
