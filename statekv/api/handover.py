"""The ``handover`` layout of bounded positions: a stream encoded twice, the second time only if it leaves the range.

Inside the model's range, ``own-then-cache`` keeps every token at its own position, so the model reads the stream
as it reads a video, "when" questions included. Past the range a stream answers best when its carried state sat in
cache order from its first frame (``cache``): how the first frames were encoded stays in the carried state for good
(docs/accuracy.md, "Past the range: the handover layout"). ``handover`` keeps both. While the stream fits the
range, its engine streams it under ``own-then-cache`` (what questions and watches read) and each step's inputs go
to a `Backlog` beside it (`EncodedVideo.record_step`). Once that engine places a step away from its own position
(the stream passed the range, `EncodedVideo.handover_due`; on the disk tier at the end of that step's
vision-tower call, `statekv.steps.jobs.handover_now`), a *successor* engine under ``cache`` replays the backlog,
every step of the stream in order, and becomes the stream's engine; the first is closed
(`statekv.steps.jobs.hand_over`: `replay_backlogs`, then `EncodedVideo.adopt_successor`).
From then on the stream is, bit for bit, the one the ``cache`` layout would have streamed (a steering watch aside:
the replayed steps are steered by the watches open at the replay). Inside the range a step costs one, and each
step's embeddings are kept (at most the range's tokens); the step that passes the range replays every step before
it, once; past the range a step costs one, the cache layout's. A stream that never leaves the range never pays
for its successor. `EncodedVideo.catch_up` replays the backlog earlier, at a moment the caller chooses.

A successor is made only where it can take over and the stream has one record of itself (`why_alone` says
otherwise): a horizon that can take the stream past the range, a rule whose carried state settles at a fixed size
or in a ring (not full attention) and 1-D RoPE (not M-RoPE). On the disk tier the successor is a file set in a
subfolder of the stream's, kept at the stream's close when it replayed steps and otherwise rebuilt from the
backlog (kept durable in the stream's file set) when the stream is resumed before its handover, and given the
stream's folder at the handover (`statekv.core.disk.successor`). At the
first frame step, whose size is then known,
`cannot_place` leaves it behind where no step could take the stream past its engine's ceiling, or where the
carried state and a step do not fit the range in cache order. Under a cache cap each engine keeps to the cap, and
the successor stays only while the cap could hold the stream's steps twice with the backlog (`over_cap`: at the
first frame step for what the stream will hold at its handover, `held_at_handover`, then before every step): so
the cap holds both engines whatever the successor replays meanwhile, and the successor, which at the handover
holds what the first held, evicts nothing in its replay. Elsewhere, and when the replay fails, the stream streams as
``own-then-cache`` alone; `EncodedVideo.handover` says which and why. A replayed step the successor's disk tier
refused (a full disk), or a backlog file unreadable for a moment, or memory short, only puts the replay off to the
stream's next step (`EncodedVideo.replayed`); the disk refusing it again puts it off for twice as many steps as the
last time, and `PUT_OFF_TRIES` refusals in a row drop the successor; a damaged backlog drops it at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..core.positions.layouts import CacheOrder, OwnThenCache
from ..core.positions.rope import rope_parameters, trained_range
from ..core.rules.base import CarryPolicy
from ..errors import InputError, OutputError
from ..settings.engine import HANDOVER, CacheLimit, EngineSettings
from ..settings.values import format_bytes, printable

CATCH_UP_SHARE = 0.5  # of the model's range: past it, quiet moments replay a stream's backlog (`catch_up_due`)
OWN_LAYOUT = OwnThenCache.name  # the stream's engine while it fits the range
SUCCESSOR_LAYOUT = CacheOrder.name  # the successor's, and the stream's once past the range
# what a replayed step may meet once and not the next time (the disk tier refusing it or its backlog file unreadable
# for a moment, memory short): the replay is put off, the successor kept (`EncodedVideo.replayed`, `passing`)
PASSING_FAULTS = (OutputError, torch.OutOfMemoryError, MemoryError)
# refusals by the disk in a row (a full disk) a replay is put off for, tried again after 1, 2, 4, ... steps streamed
# (`Backlog.refused`); the next drops the successor, so a disk full for good costs a few tries and bounded backlog
PUT_OFF_TRIES = 6


def refusal_reason(fault: BaseException) -> str:
    """The first line of why the disk refused a successor's step, without what the refusal says of the step's
    tokens (the successor's, not the stream's)."""
    reason = str(fault).split("; the step was not taken", 1)[0]
    return (reason.strip().splitlines() or [type(fault).__name__])[0]


def passing(fault: BaseException, backlog: "Backlog") -> bool:
    """Whether ``fault``, met by ``backlog``'s first step as it was replayed, puts the replay off (`PASSING_FAULTS`):
    memory short again once the backlog grew since it first fell short (a step streamed, its replay still short)
    does not, or a memory short for good would keep the successor and its growing backlog beside the stream."""
    if not isinstance(fault, PASSING_FAULTS):
        return False
    if isinstance(fault, OutputError):
        return backlog.refused()
    if backlog.short_at is None:
        backlog.short_at = len(backlog.steps)
    return len(backlog.steps) <= backlog.short_at


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
    return None


def over_cap(cap: CacheLimit | None, held: int, embeddings: int) -> str | None:
    """Why a successor cannot stay beside a stream under the cache cap ``cap`` once the stream's engine holds
    ``held`` bytes under it and its steps' embeddings take ``embeddings`` bytes (every step's, replayed or not, so
    that when the backlog was replayed never decides); None when it can. At the handover both engines hold the
    stream's steps (the successor replays them all beside the first), so the cap must hold them twice with the
    backlog for the cap to stay hard. Then the stream's engine never reaches the cap, and never evicts, while its
    successor is beside it."""
    if cap is None or 2 * held + embeddings <= cap.max_bytes:
        return None
    return (f"max_cache_bytes={format_bytes(cap.max_bytes)} cannot hold its detailed cache twice "
            f"({format_bytes(held)} each) with the backlog, as its handover would")


def held_at_handover(config: Any, span: int, prefix_tokens: int, bytes_per_token: int, bytes_per_step: int,
                     embedding_bytes: int) -> tuple[int, int]:
    """At least what a stream whose frame steps take ``span`` tokens (after a prompt prefix of ``prefix_tokens``)
    holds at its handover, as `over_cap` counts it: the detailed cache's bytes (``bytes_per_token``,
    ``bytes_per_step`` as its cap counts them) and every step's embeddings (``embedding_bytes`` a token): its
    engine's ceiling and the step past it."""
    limit = trained_range(config)
    tokens = OwnThenCache().ceiling(span, 0, limit) + span
    steps = (tokens - prefix_tokens) // span + (1 if prefix_tokens else 0)
    return tokens * bytes_per_token + steps * bytes_per_step, tokens * embedding_bytes


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


def resumed_disk_engine(engine: EngineSettings, recorded_layout: str | None, engine_layout: str | None,
                        folder: Any) -> tuple[EngineSettings, bool]:
    """The settings a disk-tier stream is resumed with from its ``folder``, asked for as ``engine``; and whether it
    is past its handover. ``recorded_layout``: the layout it was streamed with (its ``stream.json``);
    ``engine_layout``: its file set's engine's (its manifest's; the cache layout's once a ``handover`` stream
    handed over). A stream streamed under ``handover`` goes on under it, or under own-then-cache alone when that is
    asked for, until its handover, and under the cache layout after it; another one goes on with its own layout;
    any other layout asked for is refused in one line."""
    if engine.positions != "bounded":
        return engine, False
    by_handover = recorded_layout in (None, HANDOVER)
    handed_over = by_handover and engine_layout == SUCCESSOR_LAYOUT
    streamed = SUCCESSOR_LAYOUT if handed_over else HANDOVER if by_handover else recorded_layout
    asked = engine.bounded_layout
    if asked in (None, HANDOVER):
        return (engine, False) if streamed == HANDOVER else (engine.with_changes(bounded_layout=streamed), handed_over)
    if asked == streamed or (streamed == HANDOVER and asked == OWN_LAYOUT):
        return engine, handed_over
    how = (f"under {HANDOVER} it handed over to the {streamed} layout past the model's range" if handed_over
           else f"it was streamed with bounded_layout={streamed}")
    raise InputError(f"{printable(folder)}: {how}, not {asked}; resume it with bounded_layout={streamed} or the "
                     "default")


def never_past(video_tokens: int, ceiling: int, limit: int) -> str:
    """Why a stream whose steps take at most ``video_tokens`` tokens gets no successor: none starts past ``ceiling``."""
    return (f"its horizon of {video_tokens} tokens fits the model's range: every step stays at its own positions "
            f"(a step starting past {ceiling} of the {limit} would be placed elsewhere)")


def resumed_engine(engine: EngineSettings, recorded_layout: str | None, saved_layout: str | None,
                   handed_over: bool = False) -> tuple[EngineSettings, bool]:
    """The settings a saved stream is resumed with, asked for as ``engine``: one whose engine was the cache
    layout's (``saved_layout``, its positions' layout) continues with that engine when it was streamed
    (``recorded_layout``) or is resumed under ``handover``; and whether it is past its handover (streamed under
    ``handover``, its engine the cache layout's, or saved after such a resume: ``handed_over``, as recorded)."""
    handover = (None, HANDOVER)
    if saved_layout == SUCCESSOR_LAYOUT and (recorded_layout in handover or engine.bounded_layout in handover):
        return engine.with_changes(bounded_layout=SUCCESSOR_LAYOUT), recorded_layout in handover or handed_over
    return engine, False


class StoredStep:
    """A backlog step whose embeddings ``[1, T, D]`` (``shape``) lie in the disk tier's backlog file, where
    ``entry`` (``[offset, bytes, crc]``) says: read back by ``read`` when replayed, never held in RAM."""

    def __init__(self, entry: list[int], shape: torch.Size, dtype: torch.dtype, read: Callable[..., torch.Tensor]):
        self.entry, self.shape, self.dtype, self.read = entry, shape, dtype, read

    @property
    def nbytes(self) -> int:
        return self.entry[1]

    def load(self) -> torch.Tensor:
        return self.read(self.entry, self.shape, self.dtype)


class Backlog:
    """The steps a stream's successor has yet to replay: each step's ``inputs_embeds`` ``[1, T, D]``, in order (a
    successor's stream is 1-D RoPE: its steps carry no positions of their own), or on the disk tier where they lie
    in the stream's backlog file (a `StoredStep`), with the record the successor journals with it (``records``:
    the stream's own step's; None off the disk tier). ``spans``: their lengths ``T``. ``home``: where the steps
    held in memory are kept: with the detailed cache, where it is offloaded to (None: where the steps come from,
    the model's device). ``nbytes``: the steps' bytes, wherever they are."""

    def __init__(self, home: torch.device | None = None):
        self.home = home
        self.steps: deque[torch.Tensor | StoredStep] = deque()
        self.records: deque[dict | None] = deque()
        self.nbytes = 0
        self.short_at: int | None = None  # the steps it held when memory fell short for its replay (`passing`)
        self.added = 0  # steps added since it was made: the clock a replay the disk refused backs off on
        self.refusals = 0  # replays the disk refused in a row (`refused`), the first at ``added`` = ``refused_at``
        self.refused_at = 0
        self.retry_at = 0  # ``added`` at which a replay the disk refused is tried again (`retry_due`)
        self.handover_refused = False  # the disk refused the handover itself, which a step replayed since does not
        # make likelier to go through: its refusals in a row go on counting

    def add(self, inputs_embeds: torch.Tensor | StoredStep, record: dict | None = None) -> None:
        """Keep one streamed step's embeddings (copied when they are a view of a larger tensor, which a kept
        view would hold whole), or where they are stored, and the record its replay journals."""
        if isinstance(inputs_embeds, torch.Tensor):
            if self.home is not None and inputs_embeds.device != self.home:
                inputs_embeds = inputs_embeds.to(self.home)
            elif inputs_embeds.untyped_storage().nbytes() > inputs_embeds.nbytes:
                inputs_embeds = inputs_embeds.clone()
        self.steps.append(inputs_embeds)
        self.records.append(record)
        self.nbytes += inputs_embeds.nbytes
        self.added += 1

    def first(self) -> torch.Tensor:
        """The next step to replay's embeddings ``[1, T, D]`` (read back when stored)."""
        step = self.steps[0]
        return step.load() if isinstance(step, StoredStep) else step

    def replayed_first(self) -> None:
        """The first step was replayed: it leaves the backlog."""
        self.nbytes -= self.steps.popleft().nbytes
        self.records.popleft()
        self.short_at = None
        if not self.handover_refused:
            self.refusals, self.retry_at = 0, 0

    def refused(self) -> bool:
        """The replay (or the handover after it) was refused by the disk: whether it is put off, to be tried again
        once twice as many steps as the last time were streamed (`retry_due`), or given up (False), after
        `PUT_OFF_TRIES` refusals in a row."""
        if not self.refusals:
            self.refused_at = self.added
        self.handover_refused = self.handover_refused or not self.steps  # nothing left to replay: the handover's
        self.refusals += 1
        self.retry_at = self.added + 2 ** (self.refusals - 1)
        return self.refusals < PUT_OFF_TRIES

    @property
    def retry_due(self) -> bool:
        """Whether a replay is due at this step: none the disk refused is backing off (`refused`)."""
        return self.added >= self.retry_at

    def why_dropped(self, fault: BaseException) -> str:
        """Why the successor is dropped after ``fault`` met its replay, in one line: the disk's `PUT_OFF_TRIES`-th
        refusal in a row, or a fault its next try would meet again."""
        if self.refusals < PUT_OFF_TRIES:
            return f"the successor's step failed ({fault})"
        return (f"the disk refused its {'handover' if self.handover_refused else 'replay'} {self.refusals} times in "
                f"a row over {self.added - self.refused_at} steps ({refusal_reason(fault)})")

    @property
    def spans(self) -> list[int]:
        return [step.shape[1] for step in self.steps]

    def tensor(self) -> torch.Tensor:
        """``[1, sum(spans), D]``: every step's embeddings, one after another (what a saved stream keeps)."""
        return torch.cat([step.load() if isinstance(step, StoredStep) else step for step in self.steps], dim=1)

    def restore(self, tensor: torch.Tensor, spans: list[int], hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> None:
        """The backlog a saved stream kept (`tensor`, cut at ``spans``), checked against the model's embeddings
        (one-line `InputError`), kept at ``home`` or else on ``device`` (the model's); it replaces this one's
        steps."""
        expected = [1, sum(spans), hidden_size]
        if list(tensor.shape) != expected or tensor.dtype != dtype:
            raise InputError(f"the successor's backlog (backlog.inputs_embeds) is {tensor.dtype} "
                             f"{list(tensor.shape)}, not {dtype} {expected}")
        self.steps = deque(tensor.to(self.home or device).split(spans, dim=1))
        self.records = deque([None] * len(self.steps))
        self.nbytes = sum(step.nbytes for step in self.steps)
