"""Bounded layouts: where a bounded stream places a step's chunk and the carried keys it attends to, inside the
model's trained range (`statekv.core.positions.placing` for the stream's positions and its questions').

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
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import ConfigurationError, HorizonError
from ...settings.engine import HANDOVER
from .rotation import Placer


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
