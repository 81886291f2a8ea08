"""Question families: each turns a `VideoPlan` into one four-option multiple-choice question.

===========  ===================================================  =========================================
family       question                                             evidence
===========  ===================================================  =========================================
needle       What colour was the triangle?                        the one frame of the object seen once
attribute    What shape was shown in red?                         every appearance of that object
count        How many times did the video show red?               every appearance of that object (1-4)
order        Which came first, red or blue?                       the first appearance of both
first_last   Which colour was shown first (last)?                 the first (last) appearance of any object
position     When did the video show red?                         the one frame of the object seen once;
                                                                  the options are the four quarters
===========  ===================================================  =========================================

Every family keeps one fixed list of options (the colours, the shapes, the counts or the quarters, in their
natural order), so a letter always means the same thing within a family and the answers are spread evenly.
Questions end on the words that name what they ask about, which a small model finds far sooner than words
further back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .plans import VideoPlan
from .scenes import COLOURS, SHAPES

LETTERS = "ABCD"
COLOUR_OPTIONS = tuple(COLOURS)
SHAPE_OPTIONS = SHAPES
COUNT_OPTIONS = ("1", "2", "3", "4")
QUARTERS = ("first quarter", "second quarter", "third quarter", "last quarter")


@dataclass(frozen=True)
class QuestionSpec:
    """A question about one video. answer: index into ``options``; evidence: the frames (0-based) that
    decide it."""

    family: str
    question: str
    options: tuple[str, ...]
    answer: int
    evidence: tuple[int, ...]

    @property
    def answer_letter(self) -> str:
        return LETTERS[self.answer]


def needle(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    thing = plan.things[plan.single]
    return QuestionSpec("needle", f"What colour was the {thing.shape}?", COLOUR_OPTIONS,
                        COLOUR_OPTIONS.index(thing.colour), plan.appearances[plan.single])


def attribute(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    index = int(rng.integers(len(plan.things)))
    thing = plan.things[index]
    return QuestionSpec("attribute", f"What shape was shown in {thing.colour}?", SHAPE_OPTIONS,
                        SHAPE_OPTIONS.index(thing.shape), plan.appearances[index])


def count(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    index = int(rng.integers(len(plan.things)))
    return QuestionSpec("count", f"How many times did the video show {plan.things[index].colour}?",
                        COUNT_OPTIONS, plan.count(index) - 1, plan.appearances[index])


def order(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    first, second = (int(i) for i in rng.choice(len(plan.things), size=2, replace=False))
    earlier = min(first, second, key=lambda i: plan.appearances[i][0])
    question = f"Which came first, {plan.things[first].colour} or {plan.things[second].colour}?"
    return QuestionSpec("order", question, COLOUR_OPTIONS, COLOUR_OPTIONS.index(plan.things[earlier].colour),
                        tuple(sorted((plan.appearances[first][0], plan.appearances[second][0]))))


def first_last(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    events = plan.events()
    which = "first" if rng.random() < 0.5 else "last"
    frame, thing = events[0] if which == "first" else events[-1]
    return QuestionSpec("first_last", f"Which colour was shown {which}?", COLOUR_OPTIONS,
                        COLOUR_OPTIONS.index(plan.things[thing].colour), (frame,))


def position(plan: VideoPlan, rng: np.random.Generator) -> QuestionSpec:
    (frame,) = plan.appearances[plan.single]
    return QuestionSpec("position", f"When did the video show {plan.things[plan.single].colour}?", QUARTERS,
                        plan.quarter(frame), (frame,))


# answerable from one or two of the frames a question names (count needs every appearance, position the absolute
# time): docs/accuracy.md's target families
FEW_FRAME_FAMILIES = ("needle", "attribute", "order", "first_last")

FAMILIES: dict[str, Callable[[VideoPlan, np.random.Generator], QuestionSpec]] = {
    "needle": needle,
    "attribute": attribute,
    "count": count,
    "order": order,
    "first_last": first_last,
    "position": position,
}


def ask_all(plan: VideoPlan, rng: np.random.Generator, families: Sequence[str] = tuple(FAMILIES)) -> list[QuestionSpec]:
    """One question of each family in ``families``, in that order."""
    unknown = [name for name in families if name not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown question family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    return [FAMILIES[name](plan, rng) for name in families]
