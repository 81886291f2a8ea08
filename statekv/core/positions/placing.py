"""Where a stream's tokens sit in RoPE: at their index in the whole stream, or inside the model's trained range.

``positions="stream"`` (the paper's): a token's RoPE position is its index in the whole stream (for M-RoPE, the
adapter's positions). Streaming is then exactly the model's one-shot forward, but a stream can only be as long as
the model's positional range, fixed up front as its horizon.

``positions="bounded"``: every position the model sees stays inside the range it was trained on
(`statekv.core.positions.rope.trained_range`), so a stream needs no horizon and never ends. Each step's chunk is
placed at a rotary position inside the range (its *base*); the keys a step attends to besides its own (the carried
state) are rotated, for that step only, to positions the `BoundedLayout` gives them relative to the chunk; a
question lays out the context it reads (the whole detailed cache when it fits in the range, else the retrieved
frames) contiguously, in time order, and the prompt after it (`QuestionPlan`). Keys are stored as computed, at the
rotation they had in their own step, and are rotated from there each time they are read, so no rounding
accumulates however long a token is carried.

A rotation by ``delta`` positions is RoPE's own rotation (`rotate`): ``R(p + delta) k = R(delta) R(p) k``, with
the model's frequencies. M-RoPE (Qwen3-VL) moves its three position rows together by the same ``delta``, which
is that same rotation; distances are measured on the temporal row.

Where a step's carried keys go is its layout's (`statekv.core.positions.layouts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...errors import ConfigurationError, HorizonError, InputError, RetrievalTooWide
from ...settings.engine import check_positions
from ...settings.values import check_int
from .layouts import BOUNDED_LAYOUTS, DEFAULT_LAYOUT, BoundedLayout, bounded_layout
from .rope import SettledRotary, rope_capacity
from .rotation import Placer, place_carried
from ..storage.step_values import StepValues, aligned_runs

if TYPE_CHECKING:
    from ..cache.step_runs import StepRuns

SEGMENT_PLACES = 16  # places a past-the-range question scores segments at (`StreamPositions.scoring_turns`)


def choose_positions(requested: str | None, config, horizon: int | None) -> str:
    """The positions a stream of ``horizon`` tokens (None: no horizon) streams with: ``requested``, or (None)
    ``stream`` where the horizon fits the model's RoPE and ``bounded`` otherwise. ``stream`` asked for a horizon
    beyond the RoPE (or none where one is needed) is refused with a one-line `HorizonError`."""
    if requested is not None:
        check_positions(requested)
    if requested == "bounded":
        return "bounded"
    if horizon is None:
        if requested == "stream":
            raise HorizonError("positions='stream' (--positions stream) needs a horizon inside the model's RoPE "
                               "range (a stream's horizon_frames, --max-frames); without one use positions='bounded' "
                               "(--positions bounded)")
        return "bounded"
    capacity = rope_capacity(config)
    if requested is None and capacity is not None and horizon > capacity:
        return "bounded"
    return "stream"


def spread_places(firsts: list[int], spans: list[int], low: int, origin: int, length: int, start: int) -> list[int]:
    """Where steps first at stream positions ``firsts`` (ascending) and ``spans`` positions long are read between
    ``low`` and a prompt at ``start``: each where its time since ``origin`` in a stream of ``length`` positions
    scales to, moved the least to keep them in time order, apart and before the prompt (`StreamPositions.spread`)."""
    room = start - low - spans[-1]
    placed: list[int] = []
    for index, first in enumerate(firsts):  # in time order, never overlapping
        wanted = low + (first - origin) * room // length
        placed.append(max(wanted, placed[-1] + spans[index - 1]) if placed else max(wanted, low))
    end = start
    for index in reversed(range(len(firsts))):  # and all before the prompt
        placed[index] = min(placed[index], end - spans[index])
        end = placed[index]
    return placed


@dataclass(frozen=True)
class StepPlan:
    """Where one step's chunk goes: ``first`` its first position in the stream (temporal row for M-RoPE),
    ``span`` the positions it takes, ``base`` the rotary position it is placed at (its positions are moved by
    ``first - base``)."""

    first: int
    span: int
    base: int


@dataclass(frozen=True)
class QuestionPlan:
    """How a bounded stream's question reads its context: ``whole`` (every held step) or ``retrieve`` steps per
    layer; the prompt starts at rotary position ``start``. ``packed``: the steps are laid out one after another
    before the prompt (the stream does not fit the range); else each at its own position in the stream, as under
    ``stream`` positions. The first ``keep_steps`` steps (the prompt prefix and sinks) always stay at their own."""

    whole: bool
    start: int
    retrieve: int | None = None
    keep_steps: int = 0
    packed: bool = True


class StreamPositions:
    """One stream's RoPE positions (see the module docstring): its mode, and for ``bounded`` the layout, the
    range, the model's frequencies, and every step's placement (three integers per step, on the host).

    Args:
        mode: ``"stream"`` or ``"bounded"``. limit: the trained range (bounded only). layout: a `BoundedLayout` or
        its name. inv_freq: the rotary frequencies ``[R / 2]`` (the stream's frozen ones for dynamic RoPE).
        question_span: past the range, the positions before the prompt a question's retrieved steps are spread over
        by their time (0: packed right before it; see `question`).
    """

    def __init__(self, mode: str = "stream", limit: int | None = None, layout: str | BoundedLayout = DEFAULT_LAYOUT,
                 inv_freq: torch.Tensor | None = None, question_span: int = 0):
        self.mode = check_positions(mode)
        self.limit = limit
        self.question_span = check_int(question_span, "question_span", minimum=0)
        self.layout = bounded_layout(layout)
        self.inv_freq = inv_freq
        self._frequencies: dict[torch.device, torch.Tensor] = {}
        # each step's first position, span and base (as runs: a steady stream's take a few at any age)
        self.firsts, self.spans, self.bases = StepValues(), StepValues(), StepValues()
        self.span_totals = StepValues([0])  # the spans of the steps before each, summed (`held_span`)
        self.widest = 0  # the largest step span so far
        self.devices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pending: StepPlan | None = None
        self._placing = (0, 0, True)  # the step's span, carried tokens, and whether its RoPE is 1-D (set by plan)
        self.moved = False  # some committed step was placed away from its own position
        self.placer: Placer | None = None  # the carried keys' places in the step placed away from its own (`chunk`)
        self.step_base: torch.Tensor | None = None  # that step's base, ``[1]`` on the device (`chunk`)
        self.rotary: SettledRotary | None = None  # the rotary outputs of a step the host settled (`chunk`)
        self._settled: dict[tuple, tuple | None] = {}  # `settled_step`'s, by base and shapes
        self.still = True  # the step planned, and every one before it, sits at its own position (set by plan)

    @property
    def bounded(self) -> bool:
        return self.mode == "bounded"

    @property
    def next_first(self) -> int:
        """The stream's next position (temporal row for M-RoPE)."""
        return self.firsts[-1] + self.spans[-1] if self.firsts else 0

    # -- one step ----------------------------------------------------------------------------------------------
    def plan(self, chunk_len: int, seen_tokens: int, position_ids: torch.Tensor | None, carried: int) -> StepPlan:
        """Place the step about to run (host; explicit M-RoPE positions are read: a sync). Its device part finds
        the same place on the device (`chunk`), so a steady step reads no host value."""
        if position_ids is None:
            first, span = seen_tokens, chunk_len
        else:
            if position_ids.dim() == 3 and self.layout.one_dimensional:
                raise ConfigurationError(f"the {self.layout.name} layout of bounded positions needs 1-D RoPE; use "
                                         "the grouped layout for this model")
            temporal = _temporal(position_ids)
            first = int(temporal[0, 0])
            rows = position_ids if position_ids.dim() == 2 else position_ids[-3:]
            span = int(rows.max()) + 1 - first
        self._placing = (span, carried, position_ids is None or position_ids.dim() == 2)  # for the device part
        plan = StepPlan(first, span, self.layout.base(first, span, carried, self.limit, self._placing[2]))
        self.pending = plan
        self.still = not self.moved and plan.base == plan.first
        return plan

    @property
    def starts_moving(self) -> bool:
        """Whether the step planned is the first placed away from its own position: from it on, the device part
        places and rotates (a step recorded before it did neither)."""
        return not self.still and not self.moved

    def device_scalars(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(first, base, shift)``: LongTensors ``[1]`` on ``device`` the device part of a step that finds its
        places there sets and reads (kept: a recorded step reads the same memory)."""
        if device not in self.devices:
            self.devices[device] = tuple(torch.zeros(1, dtype=torch.long, device=device) for _ in range(3))
        return self.devices[device]

    def chunk(self, write_index: torch.Tensor, position_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Device part: ``(position_ids for the decoder, anchors [T], rotations [T])`` of the chunk: its positions
        in the stream (``write_index`` for 1-D, else the given ones) moved to its base, found on the device unless
        the host settled them (`settled_step`). While the stream is `still`, its own positions."""
        anchors = write_index if position_ids is None else _temporal(position_ids)[0]
        self.rotary = None
        if self.still:
            return (write_index if position_ids is None else position_ids), anchors, anchors
        span, carried, flat = self._placing
        away = self.pending is not None and self.pending.base != self.pending.first  # the host's plan says so
        if away and position_ids is None:
            settled = self.settled_step(self.pending.base, span, carried, write_index.device)
            if settled is not None:
                self.placer, rotations, self.step_base, self.rotary = settled
                return rotations, anchors, rotations
        first, base, shift = self.device_scalars(write_index.device)
        self.step_base = base
        first.copy_(anchors[:1])
        base.copy_(self.layout.base_on(first, span, carried, self.limit, flat, moved=away))
        torch.sub(first, base, out=shift)
        self.placer = self.layout.place(first, base, span, self.limit, flat, moved=away)
        rotations = anchors - shift
        if position_ids is None:
            return rotations, anchors, rotations
        moved = position_ids.clone()
        if moved.dim() == 2:
            moved = moved - shift
        else:
            moved[-3:] -= shift  # the three M-RoPE rows; a fourth row before them is the sequence index
        return moved, anchors, rotations

    def settled_step(self, base: int, span: int, carried: int, device: torch.device
                     ) -> tuple[Placer, torch.Tensor, torch.Tensor, SettledRotary] | None:
        """A 1-D step placed away from its own position at ``base`` whose layout settles its places on the host
        (`BoundedLayout.settled`): ``(placer, the chunk's rotary positions [span], base [1], their SettledRotary)``,
        made once for these shapes and kept (a recorded step reads them), so the step finds nothing on the device.
        None where the places move with the chunk."""
        key = (base, span, carried, device)  # a handful: steady steps share one; a chunk length adds one
        if key not in self._settled:
            placer = self.layout.settled(base, span, carried, self.limit, flat=True)  # no explicit positions: 1-D
            rotations = torch.arange(base, base + span, device=device)
            self._settled[key] = None if placer is None else (
                placer, rotations, torch.tensor([base], device=device), SettledRotary(rotations))
        return self._settled[key]

    def placed_carried(self, carried: list[tuple[torch.Tensor, torch.Tensor] | None], chunk_len: int,
                       device: torch.device, fused: bool = False) -> list[torch.Tensor | None]:
        """Device part: each layer's keys for this step as `place_carried` makes them (``fused``: by its Triton
        kernel), with this step's places (all None while the stream is `still`: every layout keeps every token at
        its own position then)."""
        if self.still:
            return [None] * len(carried)
        return place_carried(self.placer, self.frequencies(device), carried, chunk_len, fused)

    def frequencies(self, device: torch.device) -> torch.Tensor:
        """The rotary frequencies on ``device`` (copied there once)."""
        if device not in self._frequencies:
            self._frequencies[device] = self.inv_freq.to(device, torch.float32)
        return self._frequencies[device]

    def commit(self) -> None:
        plan, self.pending = self.pending, None
        if plan is not None:
            self.append(plan)

    def append(self, plan: StepPlan) -> None:
        self.firsts.append(plan.first)
        self.spans.append(plan.span)
        self.span_totals.append(self.span_totals[-1] + plan.span)
        self.bases.append(plan.base)
        self.widest = max(self.widest, plan.span)
        self.moved = self.moved or plan.base != plan.first

    # -- questions ---------------------------------------------------------------------------------------------
    def question(self, held_span: int, keep_end: int, room: int, retrieve: int | None,
                 held_steps: int | None = None) -> QuestionPlan:
        """How a question whose prompt and answer take ``room`` positions reads the stream: the whole cache when
        its ``held_span`` positions fit with the room in the range (and no retrieval is asked, or one of at least
        the ``held_steps`` steps it could choose from), else ``retrieve`` steps per layer (default: as many as fit
        after the kept prefix, which ends at ``keep_end``).

        Retrieved steps past the range are read `spread` over the last ``question_span`` positions before the
        prompt when they take fewer: packed right before it, 16 frames read like a 16-frame video whose last frame
        is now; spread, the distances say how long ago each frame was, as in a video of ``question_span``
        positions (the span the model was trained on). 0: packed."""
        limit = self.limit
        if room > limit - keep_end - 1:
            raise HorizonError(f"the question and answer ({room} tokens) do not fit in the model's {limit} positions "
                               "after the prompt prefix; ask a shorter question or fewer answer tokens")
        if self.next_first + room <= limit:  # the stream fits: everything at its own position, as `stream` does
            return QuestionPlan(retrieve is None, self.next_first, retrieve, packed=False)
        read = retrieve if retrieve is None or held_steps is None else min(retrieve, held_steps)
        if (retrieve is None or read == held_steps) and held_span + room <= limit:  # every held step is read
            return QuestionPlan(True, held_span)
        widest = max(self.widest, 1)
        fitting = (limit - room - keep_end) // widest
        if fitting < 1 and (retrieve is None or read > 0):  # no count of steps to hint at
            raise HorizonError(f"the question and answer ({room} tokens) leave no room for a retrieved step of "
                               f"{widest} positions in the model's {limit}; ask a shorter question or fewer answer "
                               "tokens")
        if retrieve is not None and read > fitting:
            raise RetrievalTooWide(read, widest, room, limit, fitting)
        steps = read if retrieve is not None else fitting
        start = keep_end + steps * widest
        if self.question_span:
            start = min(max(start, keep_end + self.question_span), limit - room)
        return QuestionPlan(False, start, steps)

    def keep_end(self, keep_steps: int) -> int:
        """Where the first ``keep_steps`` steps (the prompt prefix and sinks) end."""
        return self.firsts[keep_steps - 1] + self.spans[keep_steps - 1] if keep_steps else 0

    def context_deltas(self, steps: list[int], plan: QuestionPlan) -> torch.Tensor:
        """Per step of ``steps`` (ascending), the rotation that moves its stored keys to where the question reads
        them: the first ``plan.keep_steps`` steps of the stream at their own positions, the others one after another
        (the whole cache) or ending right before the prompt (retrieved; `spread` with a ``question_span``).
        LongTensor ``[len(steps)]``."""
        keep_steps = plan.keep_steps if plan.packed else len(self.firsts)  # unpacked: every step at its own place
        later = [s for s in steps if s >= keep_steps]
        placed, spans = {}, self.spans
        if plan.whole:
            position = self.keep_end(keep_steps)
            for step in later:
                placed[step], position = position, position + spans[step]
        elif self.question_span and later:
            placed = self.spread(later, keep_steps, plan.start)
        else:
            position = plan.start
            for step in reversed(later):
                position -= spans[step]
                placed[step] = position
        return torch.tensor([(self.firsts[s] if s < keep_steps else placed[s]) - self.bases[s] for s in steps],
                            dtype=torch.long)

    def spread(self, later: list[int], keep_steps: int, start: int) -> dict[int, int]:
        """Where each retrieved step of ``later`` (ascending, none of the first ``keep_steps``) is read by a question
        whose prompt starts at ``start``: at the place its time in the stream scales to between the kept prefix's
        end and ``start`` (the stream's first step after the prefix at the prefix's end, its latest ending right
        before the prompt), moved the least to keep the steps in time order without overlapping and before the
        prompt. Packed when the steps fill the room."""
        low = self.keep_end(keep_steps)
        origin = self.firsts[keep_steps] if keep_steps < len(self.firsts) else low
        places = spread_places([self.firsts[step] for step in later], [self.spans[step] for step in later], low,
                               origin, max(self.next_first - origin, 1), start)
        return dict(zip(later, places))

    def scoring_turns(self, plan: QuestionPlan, steps: int, segment_steps: int = 0, segments: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Past the range (a packed ``plan``), the rotations that move each of the first ``steps`` steps' stored
        keys to where a question scoring them should see them, LongTensor ``[steps]``, and each of the first
        ``segments`` complete segments of ``segment_steps`` steps, ``[segments]`` (host): `ScoringTurns` of every
        step and segment."""
        turns = ScoringTurns(self, plan, steps, segment_steps)
        return turns.of_steps(torch.arange(steps)), turns.of_segments(torch.arange(segments))

    def held_span(self, evicted: StepRuns) -> int:
        """Positions the steps still held take, laid end to end (``evicted``: the steps not held)."""
        return self.span_totals[-1] - evicted.total_over(self.span_totals)

    # -- saving --------------------------------------------------------------------------------------------------
    def export(self, as_runs: bool = False) -> dict:
        """JSON-able: the mode and, when bounded, the layout, the range and every step's ``[first, span, base]``
        (``as_runs``: those as three `StepValues` instead, copies of the firsts, spans and bases: what `load`
        takes too)."""
        if not self.bounded:
            return {"mode": self.mode}
        steps = tuple(map(StepValues, (self.firsts, self.spans, self.bases))) if as_runs else \
            [[f, s, b] for f, s, b in zip(self.firsts, self.spans, self.bases)]
        return {"mode": self.mode, "layout": self.layout.name, "limit": self.limit, "steps": steps}

    def check_mode(self, saved: dict | None) -> None:
        """Refuse (one-line `InputError`) what `export` wrote for a stream of another mode."""
        saved = saved or {"mode": "stream"}
        if not isinstance(saved, dict) or saved.get("mode") != self.mode:
            got = saved.get("mode") if isinstance(saved, dict) else saved
            raise InputError(f"the saved stream was streamed with positions={got}, this one with "
                             f"positions={self.mode}; resume it with positions={got}")

    def load(self, saved: dict | None, lengths: list[int]) -> None:
        """Install what `export` wrote for a state of steps of ``lengths`` tokens (a one-line `InputError` when it
        is not this stream's mode, layout or range, or places a step where no stream could have)."""
        steps = len(lengths)
        saved = saved or {"mode": "stream"}
        self.check_mode(saved)
        self.firsts, self.spans, self.bases, self.widest = StepValues(), StepValues(), StepValues(), 0
        self.span_totals = StepValues([0])
        self.moved = False
        if not self.bounded:
            return
        if saved.get("layout") != self.layout.name or saved.get("limit") != self.limit:
            hint = (f"; resume it with bounded_layout={saved.get('layout')}" if saved.get("limit") == self.limit
                    and saved.get("layout") in BOUNDED_LAYOUTS else "")
            raise InputError(f"the saved stream's bounded positions ({saved.get('layout')}, range "
                             f"{saved.get('limit')}) are not this stream's ({self.layout.name}, range "
                             f"{self.limit}){hint}")
        placed = saved.get("steps")
        if isinstance(placed, tuple) and len(placed) == 3 and all(isinstance(p, StepValues) for p in placed):
            if not all(len(part) == steps for part in placed):
                raise InputError(f"the saved stream's positions must list [first, span, base] for each of its "
                                 f"{steps} steps")
            self._load_runs(*placed, StepValues(lengths))
            return
        if (not isinstance(placed, list) or len(placed) != steps
                or not all(isinstance(p, list) and len(p) == 3 and all(type(v) is int for v in p) for p in placed)):
            raise InputError(f"the saved stream's positions must list [first, span, base] for each of its {steps} "
                             "steps")
        for number, (first, span, base) in enumerate(placed):
            self._check_step(number, first, span, base, lengths[number])
            self.append(StepPlan(first, span, base))

    def _check_step(self, number: int, first: int, span: int, base: int, length: int) -> None:
        at = self.firsts[-1] + self.spans[-1] if number else 0  # each step follows the one before
        if first != at or not 1 <= span <= length or not 0 <= base <= self.limit - span:
            raise InputError(f"the saved stream's positions place step {number} at [first {first}, span {span}, "
                             f"base {base}]: a step of {length} tokens follows the one before (first {at}), spans 1 "
                             f"to its tokens, and is placed within the range of {self.limit}")

    def _load_runs(self, firsts: StepValues, spans: StepValues, bases: StepValues, lengths: StepValues) -> None:
        """`load` of placements as runs (a disk tier's journal): checked and appended a piece at a time where
        every value of the piece is checked by its ends, as a step at a time would (its first failing step named)."""
        number = 0
        for count, ((first, df), (span, ds), (base, db), (length, dl)) in aligned_runs(
                *(values.runs() for values in (firsts, spans, bases, lengths))):
            ends = [(first + df * j, span + ds * j, base + db * j, length + dl * j) for j in (0, count - 1)]
            follows = count == 1 or df == span and (ds == 0 or count == 2)
            if not follows or not all(1 <= s <= n and 0 <= b <= self.limit - s for _, s, b, n in ends) \
                    or self.firsts and first != self.firsts[-1] + self.spans[-1] or not self.firsts and first:
                for j in range(count):  # the step that fails, named as `load` names it
                    self._check_step(number + j, first + df * j, span + ds * j, base + db * j, length + dl * j)
                    self.append(StepPlan(first + df * j, span + ds * j, base + db * j))
                number += count
                continue
            self.firsts.extend_run(first, df, count)
            self.spans.extend_run(span, ds, count)
            self.bases.extend_run(base, db, count)
            if ds:
                for j in range(count):
                    self.span_totals.append(self.span_totals[-1] + span + ds * j)
            else:
                self.span_totals.extend_run(self.span_totals[-1] + span, span, count)
            self.widest = max(self.widest, ends[0][1], ends[1][1])
            self.moved = self.moved or any(b != f for f, _, b, _ in ends)
            number += count


def _temporal(position_ids: torch.Tensor) -> torch.Tensor:
    """The row of explicit positions distances are measured on: ``[B, T]`` itself, M-RoPE's temporal row of
    ``[3, B, T]``, or of ``[4, B, T]`` (whose first row is the sequence index)."""
    if position_ids.dim() == 2:
        return position_ids
    return position_ids[-3]


class ScoringTurns:
    """Past the range (a packed ``plan``), the rotations that move the stored keys of steps of a stream of ``count``
    steps (``positions``), and of its complete segments of ``segment_steps`` steps, to where a question scoring them
    should see them: read for the steps a question holds alone, never a tensor of every step.

    A step is encoded wherever its step was placed (past the range, the same few positions for every step, or
    thousands of positions after the question), never where the question reads it; compared as stored, the
    question's queries would score a step by that accident. Scored instead at the place its time in the stream
    scales to in the context the question reads (the stream's first step at the context's start, its end at the
    prompt), every step is compared at a distance the question could read it at, in time order. A segment is turned
    as its first step is, to a place rounded to one of `SEGMENT_PLACES` evenly spaced in the context (its bound costs
    a rotation of the queries per distinct turn). The first ``plan.keep_steps`` steps stay where they are read, at
    their own positions."""

    def __init__(self, positions: StreamPositions, plan: QuestionPlan, count: int, segment_steps: int = 0):
        self.positions, self.count, self.segment_steps = positions, count, segment_steps
        self.frequencies = positions.inv_freq
        self.keep = min(plan.keep_steps, count)
        self.low = positions.keep_end(self.keep)
        self.origin = positions.firsts[self.keep] if self.keep < count else self.low
        self.room = max(plan.start - self.low - positions.widest, 0)

    def _targets(self, steps: torch.Tensor) -> torch.Tensor:
        firsts = self.positions.firsts.gathered(steps)
        targets = self.low + torch.div((firsts - self.origin).clamp_min(0) * self.room,
                                       max(self.positions.next_first - self.origin, 1), rounding_mode="floor")
        return torch.where(steps < self.keep, firsts, targets)

    def of_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """LongTensor ``[M]``: the turns of ``steps`` (LongTensor ``[M]``, host, each below ``count``)."""
        return self._targets(steps) - self.positions.bases.gathered(steps)

    def of_segments(self, segments: torch.Tensor) -> torch.Tensor:
        """LongTensor ``[M]``: the turns of the complete ``segments`` (LongTensor ``[M]``, host)."""
        firsts = segments * self.segment_steps
        cell = max(self.room // SEGMENT_PLACES, 1)
        places = self.low + torch.div(self._targets(firsts) - self.low + cell // 2, cell, rounding_mode="floor") * cell
        return places - self.positions.bases.gathered(firsts)
