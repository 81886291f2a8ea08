"""Timestamped questions about a synthetic video, asked while it plays: their evidence comes before (backward), at
(real-time) or after (forward) the time they are asked. Written in OVO-Bench's annotation format.

A video shows one still per second, so frame ``k`` is on screen during second ``k``; a question asked at
``realtime = t`` (whole seconds) sees frames ``0 .. t - 1``. The questions use the families the built-in model
knows (`statekv.synthetic.tasks`), with their texts and options:

============  ========  =======================================  ============================================
task          group     question                                 asked at
============  ========  =======================================  ============================================
needle_past   backward  What colour was the <shape>?             at least `PAST_GAP` seconds after the frame
                                                                 of the object seen once
order_past    backward  Which came first, <colour> or <colour>?  at least `PAST_GAP` seconds after both first
                                                                 appearances
needle_now    realtime  What colour was the <shape>?             just after the frame of the object seen once
                                                                 (the evidence is the last frame seen)
shape_now     realtime  What shape was shown in <colour>?        just after that object's first appearance
count_ahead   forward   How many times did the video show        just after the object's first appearance,
                        <colour>?                                then polled after each later one: each poll's
                                                                 answer is the count so far
============  ========  =======================================  ============================================

Rows follow ``ovo_bench_new.json``: ``id``, ``task``, ``video``, ``realtime``, ``question``, ``options``, ``gt``
(index of the right option), ``answer`` (its text); a forward row has no ``realtime`` or ``gt`` but a
``test_info`` list of polls ``{"realtime", "gt"}`` (OVO-Bench's forward polls carry counts or yes/no instead:
the built-in model answers with option letters). ``evidence`` lists the frames that decide each answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plans import VideoPlan
from .tasks import COLOUR_OPTIONS, COUNT_OPTIONS, SHAPE_OPTIONS

GROUPS = {"needle_past": "backward", "order_past": "backward", "needle_now": "realtime", "shape_now": "realtime",
          "count_ahead": "forward"}
PAST_GAP = 17  # backward evidence lies outside a 16-frame window of the frames seen last
EARLIEST = 3  # no question before 3 frames are seen (the built-in model never trained on shorter videos)


def streaming_rows(plan: VideoPlan, rng: np.random.Generator, video: str, first_id: int) -> list[dict[str, Any]]:
    """One question of each task in `GROUPS` about ``plan`` (the video file ``video``), ids from ``first_id``."""
    end = plan.num_frames
    rows = []

    def row(task: str, question: str, options: tuple[str, ...], **fields: Any) -> None:
        entry = {"id": first_id + len(rows), "task": task, "video": video, "question": question,
                 "options": list(options), **fields}
        if "gt" in fields:
            entry["answer"] = options[fields["gt"]]
        rows.append(entry)

    single = plan.things[plan.single]
    (needle_frame,) = plan.appearances[plan.single]
    row("needle_past", f"What colour was the {single.shape}?", COLOUR_OPTIONS,
        realtime=_draw(rng, needle_frame + PAST_GAP, end), gt=COLOUR_OPTIONS.index(single.colour),
        evidence=[needle_frame])

    first, second = (int(i) for i in rng.choice(len(plan.things), size=2, replace=False))
    starts = (plan.appearances[first][0], plan.appearances[second][0])
    earlier = first if starts[0] < starts[1] else second
    row("order_past", f"Which came first, {plan.things[first].colour} or {plan.things[second].colour}?",
        COLOUR_OPTIONS, realtime=_draw(rng, max(starts) + PAST_GAP, end),
        gt=COLOUR_OPTIONS.index(plan.things[earlier].colour), evidence=sorted(starts))

    row("needle_now", f"What colour was the {single.shape}?", COLOUR_OPTIONS, realtime=needle_frame + 1,
        gt=COLOUR_OPTIONS.index(single.colour), evidence=[needle_frame])

    things = _late(list(range(len(plan.things))), lambda index: plan.appearances[index][0])
    thing = things[int(rng.integers(len(things)))]
    shown = plan.appearances[thing][0]
    row("shape_now", f"What shape was shown in {plan.things[thing].colour}?", SHAPE_OPTIONS, realtime=shown + 1,
        gt=SHAPE_OPTIONS.index(plan.things[thing].shape), evidence=[shown])

    several = _late([index for index in range(len(plan.things)) if plan.count(index) >= 2],
                    lambda index: plan.appearances[index][0])
    thing = several[int(rng.integers(len(several)))]
    frames = plan.appearances[thing]
    row("count_ahead", f"How many times did the video show {plan.things[thing].colour}?", COUNT_OPTIONS,
        test_info=[{"realtime": frame + 1, "gt": COUNT_OPTIONS.index(str(seen + 1))}
                   for seen, frame in enumerate(frames)], evidence=list(frames))
    return rows


def _late(choices: list, frame_of) -> list:
    """The ``choices`` whose frame is seen once `EARLIEST` frames are (all of them if none is)."""
    late = [choice for choice in choices if frame_of(choice) + 1 >= EARLIEST]
    return late or choices


def _draw(rng: np.random.Generator, earliest: int, end: int) -> int:
    """A whole second in ``[earliest, end]`` (``end`` when ``earliest`` lies past it)."""
    return end if earliest >= end else int(rng.integers(earliest, end + 1))
