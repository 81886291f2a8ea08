"""The built-in model's last phase: training for the regime it is used in past its range.

The curriculum (`statekv.builtin.training.Recipe.curriculum`) ends on videos of 96 consecutive frames (about
400 positions), so a model trained on it alone reads every question as if the video spanned that much: far
apart frames, frames named past ``Frame96`` and retrieved frames laid out for a question past the range are
distances and anchors it never saw (docs/accuracy.md, "Past the range: causes"). The long-range phase
(`LongRange`) goes on from the curriculum's weights with a fresh optimiser; each step draws one of these regimes:

* the curriculum's own last batch (share ``video_share``): 96 consecutive frames, so that what the model knows
  inside its range is kept;
* a stream batch (`stream_batch`): ``n`` frames (drawn from ``frames``) of a stream ``T`` frames long
  (log-uniform from ``2 n`` to ``stream_frames``), at sorted random seconds, each named by its second
  (``Frame{t+1}``), laid out one after another as the engine packs retrieved frames or (share ``spread_share``)
  spread over ``S`` positions by their time (``S`` uniform from ``4 n`` to ``span``) as a question past the range
  reads them; every object appearance is among the ``n`` frames, as the evidence is among a question's retrieved
  frames when retrieval finds it. Quarters (the position family and the frames' targets) are of ``t / T``;
* a dense batch (share ``dense_share`` of the steps that are not the curriculum's; none in the shipped recipe):
  consecutive frames, every token attending to all before it, either a window of a longer stream placed as full
  attention places its history past the range (`dense_batch`) or whole videos longer than the curriculum's, at
  their own positions (``dense_whole``, `whole_batch`), whose questions read the whole video or (``dense_read``)
  a few of its frames placed as a question past the range reads its retrieved frames (`read_frames`). Tried, not
  shipped (docs/accuracy.md, "Past the range: full attention trained on dense windows" and after).

Every target and loss weight is the curriculum's (`statekv.builtin.batches`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.positions.layouts import GroupedDistances, grouped_places
from ..core.positions.placing import spread_places
from ..core.positions.rope import trained_range
from ..settings.engine import DEFAULT_QUESTION_SPAN
from ..synthetic.seeds import TRAINING_SEEDS
from .batches import Batch, BatchMaker, Reading

CURRICULUM_FRAMES = 96  # the curriculum's last video length, the long-range phase's video regime
# A dense batch's questions: count's options stop at 4 and a window's frames lie in one or two quarters of a stream
# whose length it does not show, so those families would teach an answer from the batch's shape, not its frames
DENSE_FAMILIES = ("needle", "attribute", "order", "first_last")
UNTRAINED = -100  # a target the cross-entropy skips (its ``ignore_index``)


@dataclass(frozen=True)
class LongRange:
    """The long-range phase (module docstring). steps: 0 skips it. learning_rate: cosine from this to 0 over
    ``steps``. seed: the phase's training seed (in `TRAINING_SEEDS`), step ``i`` drawing from
    ``training_rng(seed, i)``. dense_share: of the steps that are not the curriculum's, the share of dense batches
    (`dense_batch`, of ``dense_videos`` videos; 0, the shipped recipe's: none). dense_whole: a dense batch is
    whole videos from their first frame instead (`whole_batch`); dense_quarters: such a batch trains each frame's
    quarter of its video (False: untrained, as a window's). dense_read: each question of such a whole batch reads
    the prompt's prefix and this many of its video's frames, its evidence among them (`read_frames`), not the whole
    video (0: the whole video); each video is then asked `DENSE_FAMILIES` ``dense_asked`` times (a window's too).
    window_share: with ``dense_whole``, the share of dense batches that are windows all the same (`dense_batch`)."""

    steps: int = 600
    learning_rate: float = 5e-4
    video_share: float = 0.3
    spread_share: float = 0.5
    frames: tuple[int, ...] = (16, 24, 48, 96)
    stream_frames: int = 24000
    span: int = 4000
    seed: int = TRAINING_SEEDS.start + 45
    dense_share: float = 0.0
    dense_frames: tuple[int, ...] = (384, 768)
    dense_videos: int = 2
    dense_whole: bool = False
    dense_quarters: bool = True
    dense_read: int = 0
    dense_asked: int = 2
    window_share: float = 0.0

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of the phase's step ``step`` (0-based)."""
        return self.learning_rate * 0.5 * (1 + math.cos(math.pi * step / self.steps))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "frames": list(self.frames), "dense_frames": list(self.dense_frames)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LongRange":
        data = {**data, "frames": tuple(data["frames"])}
        if "dense_frames" in data:
            data["dense_frames"] = tuple(data["dense_frames"])
        return cls(**data)


def draw_batch(phase: LongRange, maker: BatchMaker, rng: np.random.Generator, videos: int) -> Batch:
    """One step's batch of the phase: the curriculum's last regime, a dense batch or a stream batch (module
    docstring)."""
    if rng.random() < phase.video_share:
        return maker.make(rng, videos, CURRICULUM_FRAMES)
    if phase.dense_share > 0 and rng.random() < phase.dense_share:
        return dense_batch(phase, maker, rng)
    return stream_batch(phase, maker, rng, videos)


def stream_batch(phase: LongRange, maker: BatchMaker, rng: np.random.Generator, videos: int) -> Batch:
    """``videos`` videos of ``n`` frames taken at the same sorted seconds of a longer stream (module docstring)."""
    frames = int(rng.choice(phase.frames))
    length = int(math.exp(rng.uniform(math.log(2 * frames), math.log(phase.stream_frames))))
    times = tuple(sorted(int(t) for t in rng.choice(length, size=frames, replace=False)))
    batch = maker.make(rng, videos, frames, times=times, length=length)
    if rng.random() < phase.spread_share:
        span = int(rng.uniform(4 * frames, phase.span))
        batch.video_positions = spread_positions(batch, maker, times, length, span)
    return batch


def spread_positions(batch: Batch, maker: BatchMaker, times: tuple[int, ...], length: int, span: int
                     ) -> torch.Tensor:
    """``[1, Lv]``: the prefix at its own positions, then each frame's tokens from where its second scales to in
    ``span`` positions after the prefix, never overlapping the frame before."""
    adapter = maker.adapter
    prefix = adapter.prefix(adapter.start(len(times)))
    total = batch.video_ids.shape[1]
    starts = [0 if prefix is None else prefix.input_ids.shape[1]]
    starts += (batch.frame_positions[:-1, 1] + 1).tolist()  # each frame's text ends with its </img>
    positions = torch.arange(total)
    placed = starts[0]
    for index, first in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else total
        placed = max(starts[0] + int(times[index] * (span - (end - first)) / max(length, 1)), placed)
        positions[first:end] = placed + torch.arange(end - first)
        placed += end - first
    return positions[None]


def dense_batch(phase: LongRange, maker: BatchMaker, rng: np.random.Generator) -> Batch:
    """``phase.dense_videos`` videos of ``n`` consecutive frames (``n`` from ``phase.dense_frames``) of a stream of
    ``T`` frames (log-uniform from ``2 n`` to ``phase.stream_frames``), starting at a random second, placed as full
    attention places its history past the range, asked `DENSE_FAMILIES` (with ``phase.dense_whole``: `whole_batch`
    of ``n`` frames instead). Every frame is placed as the last frame's step sees it (the engine placed each earlier
    frame as its own step saw it), and the questions read the whole window so placed (the engine's questions read
    retrieved frames, packed or spread)."""
    frames = int(rng.choice(phase.dense_frames))
    if phase.dense_whole and not (phase.window_share and rng.random() < phase.window_share):
        return whole_batch(phase, maker, rng, frames)
    length = int(math.exp(rng.uniform(math.log(2 * frames), math.log(phase.stream_frames))))
    window_first = int(rng.integers(0, length - frames + 1))
    batch = maker.make(rng, phase.dense_videos, frames, times=tuple(range(window_first, window_first + frames)),
                       length=length, asked=DENSE_FAMILIES * (phase.dense_asked if phase.dense_read else 1))
    batch.video_positions = grouped_positions(batch, maker, window_first)
    batch.frame_targets[:, :, 1, 1] = UNTRAINED  # the quarter: a window does not show how long its stream is
    if phase.dense_read:
        prefix = maker.adapter.prefix(maker.adapter.start(frames))
        first = 0 if prefix is None else prefix.input_ids.shape[1]
        per_frame = (batch.video_ids.shape[1] - first) / frames  # tokens a frame, as `grouped_positions` counts
        batch.reading = read_frames(batch, maker, rng, phase.dense_read, before=round(window_first * per_frame),
                                    stream=round(length * per_frame))
    return batch


def whole_batch(phase: LongRange, maker: BatchMaker, rng: np.random.Generator, frames: int) -> Batch:
    """Videos of ``frames`` frames from their first, every token at its own position and attending to all before
    it, as the curriculum's are but longer (a one-shot forward of a long video: full attention inside the range);
    as many videos as make ``phase.dense_videos`` of the longest of ``phase.dense_frames``, every family asked."""
    videos = max(1, phase.dense_videos * max(phase.dense_frames) // frames)
    if phase.dense_read:
        batch = maker.make(rng, videos, frames, asked=DENSE_FAMILIES * phase.dense_asked)
        batch.reading = read_frames(batch, maker, rng, phase.dense_read)
    else:
        batch = maker.make(rng, videos, frames)
    if not phase.dense_quarters:  # of videos of several lengths, a frame's quarter is not in what it attends to
        batch.frame_targets[:, :, 1, 1] = UNTRAINED
    return batch


def read_frames(batch: Batch, maker: BatchMaker, rng: np.random.Generator, frames: int, before: int = 0,
                stream: int | None = None) -> Reading:
    """Each question of ``batch`` reads the prompt's prefix and ``frames`` of its video's frames, its evidence and
    others drawn at random, as a question past the range reads the frames it retrieved of a stream
    (`StreamPositions.question` and ``spread``, the default ``question_span``): each frame where its time scales to
    in the span before the prompt. The video's frames are a stream's from ``before`` tokens after the prefix, in a
    stream of ``stream`` tokens after it (None: a whole video, the first part of a stream up to four times as long,
    log-uniform; one length a batch)."""
    adapter = maker.adapter
    prefix = adapter.prefix(adapter.start(batch.still_ids.shape[1]))
    low = 0 if prefix is None else prefix.input_ids.shape[1]
    ends = (batch.frame_positions[:, 1] + 1).tolist()  # each frame's text ends with its </img>
    firsts = [low] + ends[:-1]
    count = len(ends)
    if stream is None:
        stream = round((ends[-1] - low) * math.exp(rng.uniform(0, math.log(4))))
    length = max(stream, 1)
    widest = max(end - first for first, end in zip(firsts, ends))
    start = low + max(frames * widest, DEFAULT_QUESTION_SPAN)
    rows = []
    for evidence in batch.evidence_frames:
        others = [frame for frame in range(count) if frame not in evidence]
        drawn = rng.choice(others, size=min(max(frames - len(evidence), 0), len(others)), replace=False).tolist()
        chosen = sorted({*evidence, *drawn})
        spans = [ends[frame] - firsts[frame] for frame in chosen]
        places = spread_places([firsts[frame] + before for frame in chosen], spans, low, low, length, start)
        tokens = list(range(low)) + [token for frame in chosen for token in range(firsts[frame], ends[frame])]
        placed = list(range(low)) + [place + offset for place, span in zip(places, spans) for offset in range(span)]
        rows.append((tokens, placed))
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    places = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (read, placed) in enumerate(rows):  # left-padded: the prompt follows the last frame read
        tokens[row, width - len(read):] = torch.tensor(read)
        places[row, width - len(read):] = torch.tensor(placed)
        valid[row, width - len(read):] = True
    return Reading(tokens, valid, places, torch.full((len(rows),), start, dtype=torch.long))


def grouped_positions(batch: Batch, maker: BatchMaker, earlier: int) -> torch.Tensor:
    """``[1, Lv]``: where `GroupedDistances` places each video token as seen from the last frame, the video's frames
    preceded by ``earlier`` frames of as many tokens on average (the prefix first, at its own stream positions)."""
    adapter = maker.adapter
    prefix = adapter.prefix(adapter.start(batch.still_ids.shape[1]))
    prefix_end = 0 if prefix is None else prefix.input_ids.shape[1]
    total = batch.video_ids.shape[1]
    own = torch.arange(total)
    own[prefix_end:] += round(earlier * (total - prefix_end) / batch.still_ids.shape[1])
    last = int(batch.frame_positions[-2, 1]) + 1 if batch.frame_positions.shape[0] > 1 else prefix_end
    first = own[last: last + 1]  # the last frame's first token: the chunk a step of full attention places
    layout = GroupedDistances()
    cap = layout.cap(trained_range(adapter.model.config.text_config))
    places = grouped_places(first, first.clamp_max(cap), int(layout.window * cap), cap)
    return places(own)[None]
