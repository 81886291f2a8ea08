"""The story of one synthetic video: which objects appear, how often and when.

A video of ``N`` frames (one still per second) shows four objects, one of each colour, each with a shape of
its own, so an object is named by its colour or by its shape alone. They appear 1, 2, 3 and 4 times (which
object appears how often is drawn), ten moments in all; every other frame is empty or shows grey clutter.
Videos too short for ten moments (used only to start training) show fewer objects: ``k`` objects of
drawn colours appearing 1 to ``k`` times, for the largest ``k`` that fits (two in a 3-frame video).
The last sixth of the video (16 frames of 96) is quiet: no object appears there, so the evidence for every
question lies outside a recency window of that size. The object seen once is placed in a uniformly drawn
quarter of the video, so *when* questions have evenly spread answers.

Everything is drawn from a `numpy.random.Generator`, so a plan is a pure function of its seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scenes import COLOURS, EMPTY, OFFSETS, SHAPES, Still

COUNTS = (1, 2, 3, 4)  # how often the four objects appear, in a drawn order
EVENTS_PER_VIDEO = sum(COUNTS)
CLUTTER_RATE = 0.2  # share of non-event frames showing a grey shape
MIN_FRAMES = 12  # of a benchmark video: the quiet sixth leaves room for all ten appearances
MIN_TRAINING_FRAMES = 3  # two objects, seen once and twice


@dataclass(frozen=True)
class Thing:
    """An object of a video: a shape in a colour (each unique within the video)."""

    colour: str
    shape: str

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class VideoPlan:
    """One video's frames and the objects' appearances.

    stills: what each frame shows (``num_frames`` entries). things: the video's four objects.
    appearances[i]: sorted frames where ``things[i]`` appears. single: the object that appears once.
    times, length: when the frames are moments of a longer stream (the built-in model's long-range training),
    each frame's second in a stream of ``length`` frames; None: frame ``i`` is second ``i`` of ``num_frames``.
    """

    stills: tuple[Still, ...]
    things: tuple[Thing, ...]
    appearances: tuple[tuple[int, ...], ...]
    single: int
    times: tuple[int, ...] | None = None
    length: int | None = None

    @property
    def num_frames(self) -> int:
        return len(self.stills)

    def count(self, thing: int) -> int:
        return len(self.appearances[thing])

    def quarter(self, frame: int) -> int:
        """Which quarter (0-3) of the video, or of the stream it was taken from, frame ``frame`` lies in."""
        if self.times is None:
            return quarter_of(frame, self.num_frames)
        return quarter_of(self.times[frame], self.length)

    def events(self) -> list[tuple[int, int]]:
        """``(frame, thing index)`` of every appearance, in time order."""
        return sorted((frame, thing) for thing, frames in enumerate(self.appearances) for frame in frames)


def quiet_tail(num_frames: int) -> int:
    """Frames at the end of a video in which no object appears (16 of 96)."""
    return num_frames // 6


def plan_video(rng: np.random.Generator, num_frames: int = 96) -> VideoPlan:
    """Draw one video's plan of ``num_frames`` frames (`MIN_FRAMES` or more for a benchmark video, down to
    `MIN_TRAINING_FRAMES` to start training)."""
    if num_frames < MIN_TRAINING_FRAMES:
        raise ValueError(f"a synthetic video needs at least {MIN_TRAINING_FRAMES} frames, got {num_frames}")
    region = num_frames - quiet_tail(num_frames)  # objects appear in frames [0, region)
    objects = max(k for k in range(2, len(COUNTS) + 1) if sum(COUNTS[:k]) <= region)
    colours = list(COLOURS) if objects == len(COLOURS) else sorted(rng.choice(list(COLOURS), objects, replace=False),
                                                                    key=list(COLOURS).index)
    shapes = rng.permutation(len(SHAPES))[:objects]
    things = tuple(Thing(str(colour), SHAPES[int(shape)]) for colour, shape in zip(colours, shapes, strict=True))
    counts = [COUNTS[int(i)] for i in rng.permutation(objects)]
    single = counts.index(1)
    free = set(range(region))
    appearances: list[list[int]] = [[] for _ in things]
    appearances[single].append(_take(rng, free, _quarter_frames(rng, num_frames)))
    for thing, count in enumerate(counts):
        while len(appearances[thing]) < count:
            appearances[thing].append(_take(rng, free, range(region)))
    stills = [_filler(rng) for _ in range(num_frames)]
    for thing, frames in enumerate(appearances):
        for frame in frames:
            stills[frame] = Still(things[thing].colour, things[thing].shape, int(rng.integers(len(OFFSETS))))
    return VideoPlan(stills=tuple(stills), things=things, appearances=tuple(tuple(sorted(f)) for f in appearances),
                     single=single)


def quarter_of(frame: int, num_frames: int) -> int:
    """Which quarter of the video (0-3) frame ``frame`` (0-based) lies in."""
    return min(3, 4 * frame // num_frames)


def _quarter_frames(rng: np.random.Generator, num_frames: int) -> range:
    """The frames of a uniformly drawn quarter, a frame clear of its edges when the quarter is long enough."""
    quarter = int(rng.integers(4))
    start = -(-quarter * num_frames // 4)  # first frame whose quarter_of is `quarter`
    stop = -(-(quarter + 1) * num_frames // 4)
    if stop - start > 4:
        start, stop = start + 1, stop - 1
    return range(start, stop)


def _take(rng: np.random.Generator, free: set[int], frames: range) -> int:
    """A frame drawn uniformly from the free ones among ``frames`` (any free one if none); no longer free."""
    choices = sorted(free.intersection(frames)) or sorted(free)
    frame = int(choices[rng.integers(len(choices))])
    free.discard(frame)
    return frame


def _filler(rng: np.random.Generator) -> Still:
    if rng.random() >= CLUTTER_RATE:
        return EMPTY
    return Still("grey", str(rng.choice(SHAPES)), int(rng.integers(len(OFFSETS))))
