"""How an evaluation of a standing question fits a bounded stream's trained range (`positions="bounded"`).

An evaluation is placed as a step would be whose chunk is its tail: the new frames, the prompt and the answer
(:func:`statekv.core.watching.context.placement`), after the carried state. Two things keep it inside the range:

* Its tail (`tail_start`): at most `tail_room` positions, what the range leaves beside the carried state (beside
  at most the layout's cap of it, as a step's chunk gets past the range). A watch evaluated long after its last
  evaluation (a large ``every``, ``every_seconds`` on a slow stream, or on demand) reads as new only the newest
  steps that fit with its prompt and answer; the frames before them reach it through the carried state, as they
  reach every step. Its memory and its positions are bounded by the range, however long the wait.
* Its retrieval's scores (`retrieval_scoring`): past the range a step's keys are stored wherever its step was
  placed, so a question retrieving scores them turned to where its time in the stream scales to
  (`ScoringTurns`). An evaluation scores them as `ask` of its question would: the steps turned
  for the plan `StreamingPrefill.question_plan` makes for that question, and its prompt's queries turned to where
  that plan starts the prompt.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ...errors import QuestionTooLong, RetrievalTooWide
from ..answering.retrieval import Retrieval
from ..positions.placing import ScoringTurns


def tail_room(prefill, carried: int) -> int:
    """The positions an evaluation's tail may take in ``prefill``'s bounded stream after ``carried`` carried
    tokens: the range less the carried state (less at most the layout's cap, `BoundedLayout.cap`)."""
    positions = prefill.positions
    return positions.limit - min(carried, positions.layout.cap(positions.limit))


def check_question_fits(prefill, prompt: int, answer: int, carried: int, reserve: int | None = None) -> None:
    """A one-line `QuestionTooLong` when a question of ``prompt`` tokens and its answer of up to ``answer`` leave no
    room: in the tail beside ``carried`` carried tokens (bounded positions), or before the horizon (stream
    positions): the room left now, and at most ``reserve``, what the horizon keeps after its declared frames (a
    watch is evaluated until they are all in)."""
    if not prefill.positions.bounded:
        room = None if prefill.horizon is None else prefill.horizon - prefill.seen_tokens
        if room is not None and reserve is not None:
            room = min(room, reserve)
        if room is not None and prompt + answer > room:
            raise QuestionTooLong(prompt, answer, room)
        return
    room = tail_room(prefill, carried)
    if prompt + answer > room:
        raise QuestionTooLong(prompt, answer, room, limit=prefill.positions.limit)


def check_retrieval_fits(prefill, room: int, retrieval: Retrieval, least_span: int) -> None:
    """A one-line `RetrievalTooWide` (counted in steps) when ``retrieval`` cannot fit ``prefill``'s bounded stream
    once past its range, beside a question and answer of ``room`` positions, as an evaluation then finds: checked
    while the stream still fits the range (a watch opened then must not fail at every evaluation past it), from
    what it kept so far and the ``least_span`` positions each later step takes at least. Under a cache cap, an
    evaluation reads no more steps than the cap can hold (`most_held`), so only those are checked. Nothing under
    ``stream`` positions or past the range (the evaluation itself refuses there)."""
    positions = prefill.positions
    if not positions.bounded or positions.next_first + room > positions.limit:
        return
    keep_steps = prefill.steps_kept_whole(retrieval.keep_tokens)  # so far
    widest = max(positions.widest, least_span, 1)
    fitting = (positions.limit - room - positions.keep_end(keep_steps)) // widest
    if 1 <= fitting < min(retrieval.steps, most_held(prefill, least_span)):
        raise RetrievalTooWide(retrieval.steps, widest, room, positions.limit, fitting,
                               least=widest > positions.widest)


def most_held(prefill, least_span: int) -> int | float:
    """The most steps ``prefill``'s cache cap can hold (each costs its tokens and its own bytes, its journal's share
    on the disk tier, `CacheKeeper`): what a retrieval of more reads at most (inf: no cap). A step takes at least
    ``least_span`` tokens, and as many as the shortest streamed after the first (which may hold the prompt prefix):
    ``least_span`` counts a frame's visual tokens, not the text that labels it in every step."""
    keeper = prefill.keeper
    if keeper is None:
        return float("inf")
    lengths = prefill.cache.chunk_lengths
    tokens = max(least_span, min(lengths[1:], default=0))
    return keeper.limit.max_bytes // max(tokens * keeper.bytes_per_token + keeper.bytes_per_step
                                         + keeper.step_other_bytes, 1)


def most_carried(prefill, carried: int) -> int:
    """The most tokens a layer of ``prefill``'s stream will carry, for a check made before it carries them (a watch
    opened on a stream with few frames): its rule's settled budget where every layer has one, else the layout's
    cap (the most an evaluation sets beside its tail); never less than ``carried``, what it carries now. Bounded
    positions only (else ``carried``)."""
    positions = prefill.positions
    if not positions.bounded:
        return carried
    budgets = [prefill.policy.steady_budget(layer) for layer in range(len(prefill.cache.layers))]
    settled = None if None in budgets else max(budgets, default=0)
    return max(carried, positions.layout.cap(positions.limit) if settled is None else settled)


def tail_start(prefill, since: int, question_first: int, prompt: int, answer: int, carried: int,
               flat: bool = True) -> int:
    """The first token an evaluation reads as new: ``since`` (the first its last evaluation did not read) when
    the frames from there, the question (``prompt`` tokens from stream position ``question_first``) and its answer
    (up to ``answer`` tokens) fit `tail_room`, or all sit at their own positions inside the range (as while
    the stream fits it); else the first token of the newest steps that fit (the stream's length when none does).
    Under ``stream`` positions, ``since``. ``flat``: 1-D RoPE (False: M-RoPE)."""
    positions, cache = prefill.positions, prefill.cache
    if not positions.bounded or since >= cache.seen_tokens:
        return since
    check_question_fits(prefill, prompt, answer, carried)
    question_positions = prompt + answer
    room = tail_room(prefill, carried)
    step, start = cache.step_of(since)
    first = positions.firsts[step] + (since - start)
    span = question_first + question_positions - first
    if span <= room or (first + span <= positions.limit
                        and positions.layout.base(first, span, carried, positions.limit, flat) == first):
        return since
    lowest = question_first + question_positions - room  # the earliest stream position a tail may start at
    fitting = bisect.bisect_left(positions.firsts, lowest, lo=step + 1)
    return cache.starts[fitting] if fitting < len(positions.firsts) else cache.seen_tokens


@dataclass(frozen=True)
class Scoring:
    """How an evaluation's retrieval scores the steps past the range, as `ask` of its question would: its
    prompt's queries turned by ``shift`` positions (to where that question's prompt starts), each step's and
    complete segment's keys by ``turns`` (read for the steps it holds alone)."""

    shift: int
    turns: ScoringTurns


def retrieval_scoring(prefill, retrieval: Retrieval, question_positions: int, prompt_first: int
                      ) -> Scoring | None:
    """The `Scoring` of an evaluation retrieving with ``retrieval`` whose question and answer take
    ``question_positions`` and whose prompt starts at rotary position ``prompt_first``; None while the stream
    fits the range (every step is scored where it was encoded, as `ask` scores it) and under ``stream``
    positions. The plan's one-line `HorizonError` when the retrieved steps and the question cannot fit."""
    plan = prefill.question_plan(question_positions, retrieval)
    if plan is None or not plan.packed:
        return None
    cache = prefill.cache
    storage = cache.layers[0].storage
    turns = ScoringTurns(prefill.positions, plan, len(cache.chunk_lengths), storage.segment_steps)
    return Scoring(plan.start - prompt_first, turns)
