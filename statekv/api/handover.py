"""The ``handover`` layout of bounded positions: a stream encoded twice while it fits the model's range.

Inside the range, ``own-then-cache`` keeps every token at its own position, so the model reads the stream as it
reads a video, "when" questions included. Past the range a stream answers best when its carried state sat in cache
order from its first frame (``cache``): how the first frames were encoded stays in the carried state for good
(docs/accuracy.md, "Past the range: the handover layout"). ``handover`` keeps both. While the stream fits the
range, every step is taken twice: by the stream's engine under ``own-then-cache``, which questions and watches
read, and by a *successor* engine under ``cache``. Once the stream's engine places a step away from its own
position (the stream passed the range), the successor becomes the stream's engine and the first is closed
(`EncodedVideo.adopt_successor`): from then on the stream is, bit for bit, the one the ``cache`` layout would have
streamed (a steering watch aside: its queries come from the evaluations of the stream's engine, so they steer the
successor as they steer that engine). Inside the range a step costs two; past it one, the cache layout's.

A successor is made only where it can take over and the stream has one record of itself (`why_alone` says
otherwise): a horizon that can take the stream past the range, a rule whose carried state settles at a fixed size
or in a ring (not full attention), 1-D RoPE (not M-RoPE), a detailed cache in memory or offloaded (not the disk
tier, whose file set is the stream's durable record) and no cache cap (which holds one detailed cache). At the
first frame step, whose size is then known, `cannot_place` leaves it behind where no step could take the stream
past its engine's ceiling, or where the carried state and a step do not fit the range in cache order. Elsewhere,
and when a successor's step fails, the stream streams as ``own-then-cache`` alone; `EncodedVideo.handover` says
which and why.
"""

from __future__ import annotations

from typing import Any

from ..core.positions.placing import CacheOrder, OwnThenCache, trained_range
from ..core.positions.rope import rope_parameters
from ..core.rules.base import CarryPolicy
from ..errors import InputError
from ..settings.engine import HANDOVER, EngineSettings

OWN_LAYOUT = OwnThenCache.name  # the stream's engine while it fits the range
SUCCESSOR_LAYOUT = CacheOrder.name  # the successor's, and the stream's once past the range


def handing_over(engine: EngineSettings) -> bool:
    """Whether a stream under ``engine`` (its positions decided) is laid out by ``handover``: asked for, or the
    layout not set (a stream's default; one engine's alone is ``own-then-cache``)."""
    return engine.positions == "bounded" and engine.bounded_layout in (None, HANDOVER)


def own_engine(engine: EngineSettings) -> EngineSettings:
    """The settings of a stream's own engine: ``engine``, its ``handover`` made ``own-then-cache``."""
    return engine.with_changes(bounded_layout=OWN_LAYOUT) if engine.bounded_layout == HANDOVER else engine


def successor_engine(engine: EngineSettings) -> EngineSettings:
    """The settings of a ``handover`` stream's successor: ``engine`` under the ``cache`` layout."""
    return engine.with_changes(bounded_layout=SUCCESSOR_LAYOUT)


def why_alone(engine: EngineSettings, policy: CarryPolicy, config: Any, video_tokens: int | None) -> str | None:
    """Why a ``handover`` stream under ``engine`` and ``policy`` (``config``: its model's text config;
    ``video_tokens``: the most tokens its steps will take, the reserve for a question aside; None: no end) gets no
    successor, or None when it gets one (`cannot_place` checks its first frame step)."""
    limit = trained_range(config)
    cap = OwnThenCache().cap(limit)  # no step starting at or below it is placed away from its own position
    if video_tokens is not None and video_tokens <= cap:
        return never_past(video_tokens, cap, limit)
    if "mrope_section" in rope_parameters(config):
        return "its model's RoPE has several rows (M-RoPE), which the cache layout does not place"
    if policy.recent_steps is None and any(policy.steady_budget(layer) is None
                                           for layer in range(config.num_hidden_layers)):
        return f"{policy!r} carries more than the cache layout can place (no fixed budget)"
    if engine.offload == "disk":
        return "its detailed cache is on the disk tier, whose file set is the stream's one record"
    if engine.cache_cap is not None:
        return "a cache cap holds one detailed cache"
    return None


def cannot_place(policy: CarryPolicy, config: Any, span: int, video_tokens: int | None) -> str | None:
    """Why a successor is of no use to a stream whose frame steps take ``span`` tokens (``video_tokens`` as in
    `why_alone`): no step of the stream's starts past its engine's ceiling, or the cache layout cannot place
    ``policy``'s carried state with such a step in the model's range (its first step past it would fail). None
    when neither."""
    limit = trained_range(config)
    ceiling = OwnThenCache().ceiling(span, 0, limit)
    if video_tokens is not None and video_tokens - span <= ceiling:
        return never_past(video_tokens, ceiling, limit)
    if policy.recent_steps is not None:
        carried = policy.recent_steps * span + policy.sink_tokens
    else:
        carried = max(policy.steady_budget(layer) or 0 for layer in range(config.num_hidden_layers))
    if carried + span > limit:
        return (f"it carries up to {carried} tokens, which with a {span}-token step do not fit the model's {limit} "
                "positions in cache order")
    return None


def resumed_disk_engine(engine: EngineSettings, recorded_layout: str | None, folder: Any) -> EngineSettings:
    """The settings a disk-tier stream (which never has a successor: its engine's layout is ``recorded_layout``, or
    own-then-cache under ``handover``) is resumed with from its ``folder``, asked for as ``engine``: its own layout
    under the default or ``handover``; another one asked for is refused in one line."""
    if engine.positions != "bounded":
        return engine
    streamed = OWN_LAYOUT if recorded_layout in (None, HANDOVER) else recorded_layout
    if engine.bounded_layout in (None, HANDOVER):
        return engine if streamed == OWN_LAYOUT else engine.with_changes(bounded_layout=streamed)
    if engine.bounded_layout != streamed:
        raise InputError(f"{folder}: the stream was streamed with bounded_layout={streamed}, not "
                         f"{engine.bounded_layout}; resume it with bounded_layout={streamed} or the default")
    return engine


def never_past(video_tokens: int, ceiling: int, limit: int) -> str:
    """Why a stream whose steps take at most ``video_tokens`` tokens gets no successor: none starts past ``ceiling``."""
    return (f"its {video_tokens} tokens never take a step past {ceiling} of the model's {limit} positions, where "
            "its engine would place it away from its own position")


def resumed_engine(engine: EngineSettings, recorded_layout: str | None, saved_layout: str | None
                   ) -> tuple[EngineSettings, bool]:
    """The settings a saved stream is resumed with, asked for as ``engine``: one whose engine was the cache
    layout's (``saved_layout``, its positions' layout) continues with that engine when it was streamed
    (``recorded_layout``) or is resumed under ``handover``; True then (it is past its handover)."""
    handover = (None, HANDOVER)
    if saved_layout == SUCCESSOR_LAYOUT and (recorded_layout in handover or engine.bounded_layout in handover):
        return engine.with_changes(bounded_layout=SUCCESSOR_LAYOUT), True
    return engine, False
