"""The question layouts and ways of scoring frames `past_range.py` asks questions with, besides the engine's own.

Question layouts, past the range (`statekv.core.positions.placing.StreamPositions.question`, the stream's
``question_span`` set for each question): ``engine`` (the stream's own setting), ``packed`` (``question_span``
0: a question's retrieved steps one after another, ending right before the prompt, so a question about a
24,000-frame stream sees its 16 frames as a 16-frame video would lay them out, about 100 positions) and
``spread:S`` (``question_span`` S: the retrieved steps in time order over the last ``S`` positions before the
prompt, each where its time in the stream scales to, never overlapping; `StreamPositions.spread`).

And other ways of scoring frames (`retrieval_variant`):

``stored``: the engine's rule with every step's keys compared as they were stored (before
`statekv.core.positions.placing.ScoringTurns`): past the range a step is then scored at the rotation it
was encoded at, the same few positions for every step (own-then-cache) or thousands of positions *after* the
question (grouped), never where the question reads it.
``flat``: the engine's rule without its segment index: every step scored (what hierarchical retrieval costs).
``wide``: the engine's rule expanding twice as many segments (`statekv.core.answering.retrieval.SEGMENTS_PER_STEP` 4).
"""

from __future__ import annotations

from contextlib import contextmanager


_ACTIVE = {"question_layout": "engine", "retrieval": "engine"}
RETRIEVAL_VARIANTS = ("engine", "stored", "flat", "wide")


def install() -> None:
    """Record each question's plan on its prefill (``last_plan``) and set each question's ``question_span`` by
    `question_layout`."""
    from statekv.core.positions import placing
    from statekv.core.stream.prefill import StreamingPrefill

    if getattr(StreamingPrefill, "_past_range_installed", False):
        return
    plan_question = StreamingPrefill.question_plan

    def question_plan(self, room, retrieve=None):
        plan = plan_question(self, room, retrieve)
        self.last_plan = plan
        return plan

    StreamingPrefill.question_plan = question_plan
    StreamingPrefill.last_plan = None
    StreamingPrefill._past_range_installed = True
    question, deltas = placing.StreamPositions.question, placing.StreamPositions.context_deltas

    def spanned(own):
        def call(self, *args):
            kept = self.question_span
            self.question_span = question_span_for(kept)
            try:
                return own(self, *args)
            finally:
                self.question_span = kept
        return call

    placing.StreamPositions.question = spanned(question)
    placing.StreamPositions.context_deltas = spanned(deltas)
    _install_retrieval_variants()


def _install_retrieval_variants() -> None:
    from statekv.core.answering.answer_cache import ContextPlacing
    from statekv.core.answering.retrieval import Retrieval

    turns, candidates = ContextPlacing.scoring_turns, Retrieval.candidates

    def scoring_turns(self, steps, segment_steps):
        if _ACTIVE["retrieval"] == "stored":
            return None  # every step scored as stored
        return turns(self, steps, segment_steps)

    def some_candidates(self, seen, first):
        return None if _ACTIVE["retrieval"] == "flat" else candidates(self, seen, first)

    ContextPlacing.scoring_turns = scoring_turns
    Retrieval.candidates = some_candidates


def wrap_anchors(period: int = 96) -> None:
    """Frames named ``Frame1`` to ``Frame{period}`` over and over in InternVL's ``chat`` layout: only anchors the
    built-in model was trained on, whatever the stream's length."""
    from statekv.models import InternVLAdapter

    own = InternVLAdapter.frame_text

    def frame_text(self, index, timestamp):
        text = own(self, index, timestamp)
        if self.layout != "chat":
            return text
        return text.replace(f"Frame{index + 1}: ", f"Frame{index % period + 1}: ", 1)

    InternVLAdapter.frame_text = frame_text


def question_span_for(own: int) -> int:
    name = _ACTIVE["question_layout"]
    if name == "engine":
        return own
    return 0 if name == "packed" else int(name.split(":", 1)[1])


@contextmanager
def question_layout(name: str):
    """Questions asked inside use the question layout ``name`` (``engine``, ``packed`` or ``spread:S``)."""
    if name not in ("engine", "packed") and not (name.startswith("spread:") and name[7:].isdigit()):
        raise SystemExit(f"unknown question layout {name!r}: engine, packed or spread:S")
    before, _ACTIVE["question_layout"] = _ACTIVE["question_layout"], name
    try:
        yield
    finally:
        _ACTIVE["question_layout"] = before


@contextmanager
def retrieval_variant(name: str):
    """Questions asked inside score frames the ``name`` way (``engine``: the engine's own)."""
    if name not in RETRIEVAL_VARIANTS:
        raise SystemExit(f"unknown retrieval variant {name!r}: {', '.join(RETRIEVAL_VARIANTS)}")
    from statekv.core.answering import retrieval

    before, _ACTIVE["retrieval"] = _ACTIVE["retrieval"], name
    expanded = retrieval.SEGMENTS_PER_STEP
    retrieval.SEGMENTS_PER_STEP = 2 * expanded if name == "wide" else expanded
    try:
        yield
    finally:
        _ACTIVE["retrieval"] = before
        retrieval.SEGMENTS_PER_STEP = expanded
