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

Layouts (``BOUNDED_LAYOUTS``), compared in docs/benchmarks.md ("Bounded positions"):

``own-then-cache`` (`OwnThenCache`, one engine's default)
    Every token at its own position while the stream fits the range (exactly ``stream``); past it, the carried
    state in cache order (as ``cache``) where it fits the range with the chunk, else grouped distances (as
    ``grouped``: full attention, M-RoPE). Chosen from the comparison: see docs/engine.md, "Positions". A stream's
    default, the ``handover`` layout (`statekv.api.handover`), is two engines rather than one engine's layout:
    this one while the stream fits the range, then one that replayed the stream under ``cache`` from the first
    step.
``grouped`` (`GroupedDistances`)
    Self-Extend's rule with a group that grows with the stream: distances up to ``window`` are kept exactly and
    farther ones grouped, ``g`` to a position, ``g`` the smallest that fits the whole stream inside the range.
    Works for every method, full attention included (however much it carries). While the stream fits in the
    range, ``g`` is 1 and the positions are exactly ``stream``'s.
``cache`` (`CacheOrder`)
    StreamingLLM's rule: the carried tokens at consecutive positions in time order, right before the chunk, as
    if the cache were the whole sequence. Needs 1-D RoPE and a carried state that fits in the range (not full
    attention beyond it).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ...errors import ConfigurationError, HorizonError, InputError
from ...settings.engine import HANDOVER, check_positions
from ...settings.values import check_int
from .rope import SettledRotary, rope_capacity
from .rotation import Placer, place_carried

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


@dataclass(frozen=True)
class BoundedLayout:
    """Where a bounded stream puts a step's chunk and the keys it attends to, inside ``limit`` positions.

    A step's chunk is placed at its base; the carried keys it attends to are placed by the function `place`
    returns for the step (made once a step, applied to every layer's carried keys at once: `place_carried`). The
    chunk's own keys need no placing: they were computed where the chunk is placed.

    ``flat``: the model's RoPE is 1-D (False: M-RoPE, whose steps move as a whole)."""

    name: ClassVar[str] = ""
    one_dimensional: ClassVar[bool] = False  # needs 1-D RoPE (refused for M-RoPE)

    def cap(self, limit: int) -> int:
        """The highest base a chunk is placed at (room for a chunk of ``limit / 8`` positions after it)."""
        return limit - math.ceil(limit / 8)

    def ceiling(self, span: int, carried: int, limit: int) -> int:
        """The highest position a chunk of ``span`` positions after ``carried`` carried tokens is placed at."""
        raise NotImplementedError

    def base(self, first: int, span: int, carried: int, limit: int, flat: bool = True) -> int:
        """The rotary position of the chunk's first token (host): its own position while the stream fits."""
        return max(0, min(first, self.ceiling(span, carried, limit)))

    def base_on(self, first: torch.Tensor, span: int, carried: int, limit: int, flat: bool = True,
                moved: bool = False) -> torch.Tensor:
        """`base` on the device, from the chunk's first position ``first`` (``[1]``, or ``[S, 1]`` for S streams):
        what a steady step computes. ``moved``: the host knows this stream's step is placed away from its own
        position (a layout may then skip what that settles)."""
        return first.clamp(0, self.ceiling(span, carried, limit))

    def place(self, first: torch.Tensor, base: torch.Tensor, span: int, limit: int, flat: bool = True,
              moved: bool = False) -> Placer:
        """For a chunk of ``span`` positions starting at ``first`` placed at ``base`` (device, ``[1]`` or
        ``[S, 1, 1]``), the function from carried tokens' positions in the stream (temporal row for M-RoPE)
        ``anchors`` ``[..., B, H, K]`` (layers stacked in front; B the streams of a pooled batch) to their rotary
        positions, shaped alike. ``moved`` as in `base_on`."""
        raise NotImplementedError

    def settled(self, base: int, span: int, carried: int, limit: int, flat: bool = True) -> Placer | None:
        """`place`'s function for steps the host placed away from their own positions at ``base``, where the places
        read nothing of a step but ``base`` and the shapes (made once and kept: its tensors at its first call)."""
        return None


@dataclass(frozen=True)
class GroupedDistances(BoundedLayout):
    """Self-Extend's rule, adapting its group to the stream: distances up to ``window`` (a share of the cap) are
    kept exactly and the rest of the history is grouped, ``g`` distances to a position, with the smallest ``g``
    that fits the whole stream under the cap (1 while it fits: positions are then exactly the stream's)."""

    name: ClassVar[str] = "grouped"
    window: float = 0.5

    def ceiling(self, span: int, carried: int, limit: int) -> int:
        return min(self.cap(limit), limit - span)

    def place(self, first, base, span, limit, flat=True, moved=False):
        cap = self.cap(limit)
        return grouped_places(first, base, int(self.window * cap), cap)


def grouped_places(first: torch.Tensor, base: torch.Tensor, window: int, reach: int) -> Placer:
    """`GroupedDistances`' places for a chunk starting at ``first`` placed at ``base``: distances up to ``window``
    kept, the farther ones grouped by the smallest factor that fits every distance from ``first`` within ``reach``."""
    group = torch.div(first - window + reach - window - 1, reach - window, rounding_mode="floor").clamp_min(1)
    rounding = group - 1 - window

    def targets(anchors: torch.Tensor) -> torch.Tensor:
        distance = first - anchors
        far = window + torch.div(distance + rounding, group, rounding_mode="floor")
        grouped = torch.where(distance <= window, distance, far)
        return base - torch.minimum(grouped, base)
    return targets


@dataclass(frozen=True)
class CacheOrder(BoundedLayout):
    """The carried tokens at consecutive positions, in time order, ending right before the chunk."""

    name: ClassVar[str] = "cache"
    one_dimensional: ClassVar[bool] = True

    def ceiling(self, span: int, carried: int, limit: int) -> int:
        if carried + span > limit:
            raise HorizonError(f"positions='bounded' with the cache layout places the {carried} carried tokens and "
                               f"a {span}-token chunk in the model's {limit} positions, which they do not fit; "
                               "use the grouped layout or a method that carries fewer tokens")
        return carried

    def place(self, first, base, span, limit, flat=True, moved=False):
        made: dict[int, torch.Tensor] = {}  # by carried size: the same for every layer that carries as many

        def targets(anchors: torch.Tensor) -> torch.Tensor:
            carried = anchors.shape[-1]
            if carried not in made:
                made[carried] = base + torch.arange(-carried, 0, device=anchors.device)
            return made[carried].expand(anchors.shape)
        return targets

    def settled(self, base, span, carried, limit, flat=True):
        made: dict[tuple, torch.Tensor] = {}  # by carried size and device, kept from step to step

        def targets(anchors: torch.Tensor) -> torch.Tensor:
            key = (anchors.shape[-1], anchors.device)
            if key not in made:
                made[key] = torch.arange(base - anchors.shape[-1], base, device=anchors.device)
            return made[key].expand(anchors.shape)
        return targets


@dataclass(frozen=True)
class OwnThenCache(BoundedLayout):
    """Every token at its own position while the stream fits the range; past it, the carried state in cache order
    (`CacheOrder`) where it fits the range with the chunk (1-D RoPE), else `GroupedDistances`.

    A step placed away from its own position is past the range (its first position above the ceiling), and so is
    every later one: the next starts a span further on, above the lower of the cap and the range, which bounds
    every ceiling. A stream whose host planned the step away from its own position (``moved``) places the cache
    order's way or the grouped way without asking the device."""

    name: ClassVar[str] = "own-then-cache"
    grouped: GroupedDistances = GroupedDistances()
    cache: CacheOrder = CacheOrder()

    def ceiling(self, span: int, carried: int, limit: int) -> int:
        return self.grouped.ceiling(span, carried, limit)

    def compacts(self, span: int, carried: int, limit: int, flat: bool) -> bool:
        return flat and carried + span <= limit

    def base(self, first, span, carried, limit, flat=True):
        ceiling = self.ceiling(span, carried, limit)
        if first <= ceiling:
            return max(first, 0)
        return carried if self.compacts(span, carried, limit, flat) else ceiling

    def base_on(self, first, span, carried, limit, flat=True, moved=False):
        ceiling = self.ceiling(span, carried, limit)
        past = carried if self.compacts(span, carried, limit, flat) else ceiling
        if moved:
            return torch.full_like(first, past)
        return torch.where(first <= ceiling, first.clamp_min(0), torch.full_like(first, past))

    def place(self, first, base, span, limit, flat=True, moved=False):
        cache = self.cache.place(first, base, span, limit, flat, moved)
        made: dict[str, Placer | torch.Tensor] = {}  # what a layer needs, made by the first that does

        def grouped(anchors: torch.Tensor) -> torch.Tensor:
            if "grouped" not in made:
                made["grouped"] = self.grouped.place(first, base, span, limit, flat, moved)
            return made["grouped"](anchors)

        def targets(anchors: torch.Tensor) -> torch.Tensor:
            if not self.compacts(span, anchors.shape[-1], limit, flat):
                return grouped(anchors)
            if moved:
                return cache(anchors)
            if "past" not in made:
                made["past"] = first > self.ceiling(span, 0, limit)
            return torch.where(made["past"], cache(anchors), grouped(anchors))
        return targets

    def settled(self, base, span, carried, limit, flat=True):
        # placed away from its own position, a stream is past the range: the cache order's places where the
        # largest carried state compacts (then every layer's does), else the grouped ones, which move with the chunk
        return self.cache.settled(base, span, carried, limit, flat) if self.compacts(span, carried, limit, flat) \
            else None


BOUNDED_LAYOUTS: dict[str, BoundedLayout] = {layout.name: layout for layout in (
    OwnThenCache(), GroupedDistances(), CacheOrder())}
DEFAULT_LAYOUT = OwnThenCache.name


def bounded_layout(name: str | BoundedLayout) -> BoundedLayout:
    """The layout registered as ``name`` (or the layout given); a one-line ConfigurationError otherwise."""
    if isinstance(name, BoundedLayout):
        return name
    if name == HANDOVER:
        raise ConfigurationError(f"bounded_layout={HANDOVER!r} is a stream's (two engines: statekv.api.handover); one "
                                 f"engine takes {', '.join(BOUNDED_LAYOUTS)}")
    if name not in BOUNDED_LAYOUTS:
        raise ConfigurationError(f"unknown bounded layout {name!r}; choose one of {', '.join(BOUNDED_LAYOUTS)}")
    return BOUNDED_LAYOUTS[name]


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
        self.firsts, self.spans, self.bases = array("q"), array("q"), array("q")
        self.span_totals = array("q", [0])  # the spans of the steps before each, summed (`held_span`)
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
                       device: torch.device) -> list[torch.Tensor | None]:
        """Device part: each layer's keys for this step as `place_carried` makes them, with this step's places
        (all None while the stream is `still`: every layout keeps every token at its own position then)."""
        if self.still:
            return [None] * len(carried)
        return place_carried(self.placer, self.frequencies(device), carried, chunk_len)

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
    def question(self, held_span: int, keep_end: int, room: int, retrieve: int | None) -> QuestionPlan:
        """How a question whose prompt and answer take ``room`` positions reads the stream: the whole cache when
        its ``held_span`` positions fit with the room in the range (and no retrieval is asked), else ``retrieve``
        steps per layer (default: as many as fit after the kept prefix, which ends at ``keep_end``).

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
        if retrieve is None and held_span + room <= limit:
            return QuestionPlan(True, held_span)
        widest = max(self.widest, 1)
        fitting = (limit - room - keep_end) // widest
        if retrieve is not None and retrieve > fitting:
            raise HorizonError(f"{retrieve} retrieved steps of up to {widest} positions and the question "
                               f"({room} tokens) do not fit in the model's {limit} positions; retrieve at most "
                               f"{fitting}")
        if retrieve is None and fitting < 1:
            raise HorizonError(f"the question and answer ({room} tokens) leave no room for a retrieved step of "
                               f"{widest} positions in the model's {limit}; ask a shorter question or fewer answer "
                               "tokens")
        steps = retrieve if retrieve is not None else fitting
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
        spans, low = self.spans, self.keep_end(keep_steps)
        origin = self.firsts[keep_steps] if keep_steps < len(self.firsts) else low
        length = max(self.next_first - origin, 1)
        room = start - low - spans[later[-1]]
        placed: list[int] = []
        for step in later:  # in time order, never overlapping
            wanted = low + (self.firsts[step] - origin) * room // length
            placed.append(max(wanted, placed[-1] + spans[later[len(placed) - 1]] if placed else low))
        end = start
        for i in reversed(range(len(later))):  # and all before the prompt
            placed[i] = min(placed[i], end - spans[later[i]])
            end = placed[i]
        return dict(zip(later, placed))

    def scoring_turns(self, plan: QuestionPlan, steps: int, segment_steps: int = 0, segments: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Past the range (a packed ``plan``), the rotations that move each of the first ``steps`` steps' stored
        keys to where a question scoring them should see them, LongTensor ``[steps]``, and each of the first
        ``segments`` complete segments of ``segment_steps`` steps, ``[segments]`` (host).

        A step is encoded wherever its step was placed (past the range, the same few positions for every step, or
        thousands of positions after the question), never where the question reads it; compared as stored, the
        question's queries would score a step by that accident. Scored instead at the place its time in the stream
        scales to in the context the question reads (the stream's first step at the context's start, its end at
        the prompt), every step is compared at a distance the question could read it at, in time order. A segment
        is turned as its first step is, to a place rounded to one of `SEGMENT_PLACES` evenly spaced in the context
        (its bound costs a rotation of the queries per distinct turn). The first ``plan.keep_steps`` steps stay
        where they are read, at their own positions."""
        firsts = torch.tensor(self.firsts[:steps], dtype=torch.long)
        bases = torch.tensor(self.bases[:steps], dtype=torch.long)
        keep = min(plan.keep_steps, steps)
        low = self.keep_end(keep)
        origin = int(firsts[keep]) if keep < steps else low
        room = max(plan.start - low - self.widest, 0)
        targets = low + torch.div((firsts - origin).clamp_min(0) * room, max(self.next_first - origin, 1),
                                  rounding_mode="floor")
        targets[:keep] = firsts[:keep]
        firsts_of_segments = torch.arange(segments, dtype=torch.long) * segment_steps
        cell = max(room // SEGMENT_PLACES, 1)
        places = low + torch.div(targets[firsts_of_segments] - low + cell // 2, cell, rounding_mode="floor") * cell
        return targets - bases, places - bases[firsts_of_segments]

    def held_span(self, evicted: StepRuns) -> int:
        """Positions the steps still held take, laid end to end (``evicted``: the steps not held)."""
        return self.span_totals[-1] - evicted.total_over(self.span_totals)

    # -- saving --------------------------------------------------------------------------------------------------
    def export(self) -> dict:
        """JSON-able: the mode and, when bounded, the layout, the range and every step's ``[first, span, base]``."""
        if not self.bounded:
            return {"mode": self.mode}
        return {"mode": self.mode, "layout": self.layout.name, "limit": self.limit,
                "steps": [[f, s, b] for f, s, b in zip(self.firsts, self.spans, self.bases)]}

    def load(self, saved: dict | None, lengths: list[int]) -> None:
        """Install what `export` wrote for a state of steps of ``lengths`` tokens (a one-line `InputError` when it
        is not this stream's mode, layout or range, or places a step where no stream could have)."""
        steps = len(lengths)
        saved = saved or {"mode": "stream"}
        if not isinstance(saved, dict) or saved.get("mode") != self.mode:
            got = saved.get("mode") if isinstance(saved, dict) else saved
            raise InputError(f"the saved stream was streamed with positions={got}, this one with "
                             f"positions={self.mode}; resume it with positions={got}")
        self.firsts, self.spans, self.bases, self.widest = array("q"), array("q"), array("q"), 0
        self.span_totals = array("q", [0])
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
        if (not isinstance(placed, list) or len(placed) != steps
                or not all(isinstance(p, list) and len(p) == 3 and all(type(v) is int for v in p) for p in placed)):
            raise InputError(f"the saved stream's positions must list [first, span, base] for each of its {steps} "
                             "steps")
        for number, (first, span, base) in enumerate(placed):
            at = self.firsts[-1] + self.spans[-1] if number else 0  # each step follows the one before
            if first != at or not 1 <= span <= lengths[number] or not 0 <= base <= self.limit - span:
                raise InputError(f"the saved stream's positions place step {number} at [first {first}, span {span}, "
                                 f"base {base}]: a step of {lengths[number]} tokens follows the one before (first "
                                 f"{at}), spans 1 to its tokens, and is placed within the range of {self.limit}")
            self.append(StepPlan(first, span, base))


def _temporal(position_ids: torch.Tensor) -> torch.Tensor:
    """The row of explicit positions distances are measured on: ``[B, T]`` itself, M-RoPE's temporal row of
    ``[3, B, T]``, or of ``[4, B, T]`` (whose first row is the sequence index)."""
    if position_ids.dim() == 2:
        return position_ids
    return position_ids[-3]
