"""Live streams: push frames as they arrive, ask at any time, save and resume.

    stream = qa.stream(horizon_frames=3600, max_fps=1)    # the RoPE horizon is fixed up front
    for image, t in camera:
        stream.push(image, t)                              # constant cost per kept frame
        if t > 60 and not asked:
            stream.ask("What has the person picked up so far?")   # the stream is not changed; keep pushing
    stream.save("desk.safetensors")                        # carried state + detailed cache + metadata
    stream = Stream.load("desk.safetensors", qa)           # continues bit-exactly

Families that put several frames in one step (Qwen3-VL: two) hold a pushed frame until its step is complete;
`ask` answers from the frames encoded so far, and `flush` encodes a waiting frame on its own (as the last
step of a finished video would be).

With ``vision_batch`` frames per vision-tower call (`VideoQA.stream`, default 1), pushed frames wait until a
batch is complete, so a frame waits for at most one batch; `ask` and `watch` first encode every complete step
waiting.

`push` copies a frame that waits, so a camera loop may reuse one buffer. One stream is used by one thread at a
time: `push`, `flush`, `ask` and `save` from different threads take turns (a per-stream lock), each seeing the
stream as the previous call left it.
"""


from __future__ import annotations

import functools
import logging
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .encoded import METHOD_DEFAULT, EncodedVideo
from ..settings.engine import EngineSettings
from ..errors import CacheLimitError, HorizonError, InputError, OutputError
from ..weak import weakly
from ..steps.jobs import StepJob
from ..steps.overlap import check_vision_batch, steps_per_batch
from ..stopping import whole
from .saving import engine_record, load_stream, save_stream
from .stream_disk import stream_setup
from .watch import DEFAULT_NEW_TOKENS as DEFAULT_WATCH_TOKENS, Watch, default_retrieve, open_watch
from .watch_saving import records as watch_records, tensors as watch_tensors
from .stream_file import model_identity, weights_fingerprint
from .stream_identity import check_owner, check_stream_id, new_created, new_stream_id, ownership
from ..settings.values import (HIGHEST_FPS, LATEST_TIMESTAMP, check_bool, check_int, is_finite_number, is_stream_rate,
                               shown)
from ..video import Frame
from ..video.images import rgb_frame
from ..video.sampling import tick

log = logging.getLogger("statekv")


def _one_at_a_time(method):
    """Run ``method`` holding the stream's lock, so calls from different threads take turns, as one `whole`
    region: a signal arriving meanwhile stops the program only once the call is done."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with whole(), self.lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class Offer:
    """What `Stream.offer` made of a frame: whether it was ``kept`` (``max_fps`` drops frames between its ticks),
    its ``timestamp``, and whether the pending frames now make a batch ``ready`` to encode."""

    kept: bool
    timestamp: float
    ready: bool


class Stream(EncodedVideo):
    """A video encoded as it arrives (see the module docstring). Create it with `VideoQA.stream`.

    Attributes beyond `EncodedVideo`'s: ``horizon_frames`` (the most frames it can take), ``max_fps``,
    ``vision_batch``, ``pushed`` (frames offered), ``pending`` (kept frames waiting for their step or batch),
    ``last_timestamp`` and ``next_tick`` (where the push clock stands), ``kept_timestamp`` (the last kept frame's
    time), ``encoded_timestamp`` (the last encoded frame's), ``encoded_pushed`` (the frames pushed up to the last
    encoded one: those a disk-tier stream's `sync` makes durable), ``lock`` (the calls' turns), ``id``,
    ``created`` and ``owner_digest`` (who it is, recorded in its files and checked when they are loaded;
    ``identity``: all of it as recorded).

    A push is `offer` (checks; a kept frame joins ``pending``), the encoding of a ready batch (`pending_job`, run
    by the `VideoQA`'s step scheduler, then `settle`), then `accept` (the push clock advances). `VideoQA.push_many`
    takes several streams through the same steps at once.
    """

    RECORDS_FRAMES = True
    KEEPS_FILES = True

    def __init__(self, qa: Any, horizon_frames: int | None, *, max_fps: float | None = None, name: str = "stream",
                 vision_batch: int = 1, reserve_tokens: int | None = None, prefix_tokens: int | None = None,
                 engine: EngineSettings | None = None, disk_tier: Any = None, stream_id: str | None = None,
                 owner: str | None = None, created: str | None = None):
        """prefix_tokens: when resuming (see `load`), the prompt prefix already streamed; None: `start` streams
        it (`VideoQA.stream` returns a started stream). engine: the engine's settings (default: the VideoQA's;
        resuming: as the stream was made, its positions included). disk_tier: when resuming a disk-tier stream, its
        file set. stream_id: the stream's id, recorded in its files (default: a new random one). owner: who owns it
        (any text, e.g. an API key's id; its digest is recorded, `load` checks it). created: when the stream was
        made (resuming: as recorded; default: now). horizon_frames: None: no horizon, the stream never ends (bounded
        positions)."""
        stream_id, vision_batch = check_making(horizon_frames, vision_batch, stream_id, owner)
        self.id = new_stream_id() if stream_id is None else stream_id
        self.created = new_created() if created is None else str(created)
        self.identity = ownership(self.id, self.created, owner)  # what its files record of who it is
        self.owner_digest = self.identity["owner_digest"]
        max_fps = check_max_fps(max_fps)
        super().__init__(qa, qa.horizon_for(horizon_frames, reserve_tokens=reserve_tokens),
                         num_frames=horizon_frames, fps=max_fps, name=name, prefix_tokens=prefix_tokens,
                         engine=engine, disk_tier=disk_tier, reserve_tokens=reserve_tokens)
        self.horizon_frames = horizon_frames
        self.reserve_tokens = qa.reserve_tokens if reserve_tokens is None else reserve_tokens
        self.max_fps = max_fps
        self.vision_batch = vision_batch
        self.pushed = 0
        self.pending: list[Frame] = []
        self.next_tick = 0
        self.last_timestamp: float | None = None
        self.kept_timestamp: float | None = None  # the last kept frame's (a later one may have been dropped)
        self.encoded_timestamp: float | None = None  # the last encoded frame's (later kept ones may be pending)
        self.encoded_pushed = 0  # frames pushed up to the last encoded one: what `sync` makes durable
        self.frames_lost = 0  # after `load`: frames pushed before a crash that were not durable
        self.watching = None  # its watches (`statekv.api.watch.Watches`), once one is opened
        self.durability.open_watches = weakly(self, lambda stream: (watch_records(stream), watch_tensors(stream)),
                                              ([], {}))
        if disk_tier is None:  # a new file set: what `load` resumes it from
            try:
                self.durability.describe(stream_setup(
                    name, {**model_identity(qa), "weights": weights_fingerprint(self.adapter.model)},
                    engine_record(self), horizon=self.horizon, horizon_frames=horizon_frames, max_fps=self.max_fps,
                    prefix_tokens=self.prefix_tokens, vision_batch=self.vision_batch,
                    kv_cache_dtype=self.engine.kv_cache_dtype, **self.identity))
            except BaseException:
                self.close()
                raise

    @_one_at_a_time
    def start(self) -> "Stream":
        return super().start()

    # -- pushing ----------------------------------------------------------------------------------------
    @_one_at_a_time
    def push(self, image: Any, timestamp: float | None = None) -> bool:
        """Offer one frame; return whether it was kept (``max_fps`` drops frames between its ticks).

        image: RGB uint8 array ``[H, W, 3]``, a PIL image, or a `Frame` (whose timestamp is used).
        timestamp: seconds since the stream began (or an epoch's seconds), non-decreasing, at most
            `LATEST_TIMESTAMP`; default: one ``1 / max_fps`` (or 1 s) after the previous frame. A prompt that shows
            times (Qwen3-VL, Eagle) shows them, or, from a first frame timed at 10^6 s or later (an epoch's), the
            seconds since it.

        Pushes to several streams of one `VideoQA` from different threads share batched steps (see
        `VideoQA.push_many`); this call still returns once its frame is streamed or safely pending.
        """
        offer = self.offer(image, timestamp)
        if offer.ready:
            self.encode_pending(offer=offer)
        else:
            self.accept(offer)
        return offer.kept

    def offer(self, image: Any, timestamp: float | None) -> Offer:
        """The checks of `push` and, for a kept frame, its place in ``pending`` (journaled on the disk tier).
        Nothing else changes until `accept`."""
        self.prefill.check_open()  # before anything is journaled (a closed disk tier has no journal open)
        if isinstance(image, Frame):
            timestamp = image.timestamp if timestamp is None else timestamp
            image = image.image
        timestamp = self._check_timestamp(timestamp)
        pixels = rgb_frame(image)
        if self.max_fps is not None:
            if tick(timestamp, self.max_fps) < self.next_tick:
                return Offer(False, timestamp, False)
        kept = self.state.frames + len(self.pending)
        if self.horizon_frames is not None and kept + 1 > self.horizon_frames:
            raise HorizonError(f"{self.name}: declared for {self.horizon_frames} frames; create it with a "
                               "larger horizon_frames to push more")
        # a copy: the caller may refill its buffer (a camera loop) while this frame waits for its step or batch
        frame = Frame(self.pushed, timestamp, np.array(pixels, copy=True))
        try:
            self.durability.pushed(frame)  # journaled first: a frame is pending only once a crash would count it
        except OutputError as error:
            raise OutputError(f"{error}; the frame was not taken: the stream is as it was") from None
        self.pending.append(frame)
        return Offer(True, timestamp, len(self.pending) == self.batch_frames)

    def accept(self, offer: Offer) -> None:
        """Only now, with the offered frame encoded, safely queued or dropped, does the stream advance."""
        self.pushed += 1
        self.last_timestamp = offer.timestamp
        if offer.kept:
            self.kept_timestamp = offer.timestamp
        if offer.kept and self.max_fps is not None:
            self.next_tick = tick(offer.timestamp, self.max_fps) + 1

    def push_many(self, frames: Any) -> int:
        """Push ``(image, timestamp)`` pairs, `Frame` objects or images (timed as `push` times them) in order;
        return how many were kept."""
        if isinstance(frames, (str, bytes)) or not isinstance(frames, Iterable):
            raise InputError(f"push_many takes (image, timestamp) pairs, Frames or images, got {type(frames).__name__}")
        kept = 0
        for item in frames:  # a time may be a NumPy scalar (np.arange's times), as `push` takes it
            pair = (isinstance(item, (tuple, list)) and len(item) == 2
                    and (item[1] is None or isinstance(item[1], numbers.Real)))
            kept += self.push(*item) if pair else self.push(item)
        return kept

    @_one_at_a_time
    def flush(self) -> None:
        """Encode frames still waiting for their step or batch (an incomplete step is completed by repetition).

        A frame encoded so stays alone: frames pushed after it pair from the next one, so the stream is no longer
        one never flushed over the same frames. Flush where the video ends: `ask` and `watch` need no flush, and
        `save` (a disk-tier stream's `close` too) keeps the frames waiting for `load` to pair on."""
        if self.pending:
            self.encode_pending()

    @_one_at_a_time
    def ask_tokens(self, question: str, **ask_kwargs: Any) -> torch.Tensor:
        """As `EncodedVideo.ask_tokens`, after encoding every complete step still waiting for its batch. Steps
        that ``max_cache_bytes`` refuses (``cache_limit="refuse"``) stay pending, and the question is answered
        from the frames encoded (``answer_info.frames``)."""
        self.flush_complete_steps()
        return super().ask_tokens(question, **ask_kwargs)

    @_one_at_a_time
    def catch_up(self, steps: int | None = None) -> None:
        """As `EncodedVideo.catch_up` (the successor replays its backlog now, or its first ``steps``), taking its
        turn with the other calls."""
        super().catch_up(steps)

    def flush_complete_steps(self) -> None:
        """Encode every complete step still waiting for its batch (a step the cache cap refuses stays pending)."""
        try:
            self.encode_pending(complete_steps_only=True)
        except CacheLimitError:
            pass  # the push that filled the cache said so; the stream still answers from what it holds

    # -- watching ---------------------------------------------------------------------------------------
    @_one_at_a_time
    def watch(self, question: str, every: int | None = None, *, every_seconds: float | None = None,
              max_new_tokens: int = DEFAULT_WATCH_TOKENS, retrieve: int | None | object = METHOD_DEFAULT,
              retrieval: str | None = None, steer: bool | None = None) -> Watch:
        """A standing question, evaluated after every ``every`` frames encoded (or ``every_seconds`` of stream
        time; neither: only when `Watch.evaluate` is called), recording an event each time its answer changes
        (`statekv.api.watch`). Each evaluation reads the carried state and the frames since the last one (and
        ``retrieve`` frames per layer that match the question best, by ``retrieval``; default: the VideoQA's, as
        for `ask`: none but under ``rekv``, and none on a bounded-positions stream of an M-RoPE model, where a watch
        cannot retrieve), never the whole stream.
        ``steer``: while it is open, the question also steers what the stream carries (methods that carry by
        attention; default: the VideoQA's, True unless made with ``steer=False``)."""
        self.prefill.check_open()
        self.start()
        self.flush_complete_steps()  # as `ask`: its first answer reads every frame a complete step holds
        return open_watch(self, question, every=every, every_seconds=every_seconds, max_new_tokens=max_new_tokens,
                          retrieve=default_retrieve(self) if retrieve is METHOD_DEFAULT else retrieve,
                          retrieval=retrieval, steer=self.qa.steer if steer is None else steer)

    @property
    def watches(self) -> list[Watch]:
        """The open watches, oldest first."""
        return [] if self.watching is None else list(self.watching.open)

    @property
    def batch_frames(self) -> int:
        """Pending frames that make a batch: whole steps, at least one."""
        per_step = self.adapter.frames_per_step
        return steps_per_batch(self.vision_batch, per_step) * per_step

    def pending_job(self, complete_steps_only: bool = False) -> StepJob | None:
        """The pending frames as a job of steps (None: no step to encode); ``complete_steps_only`` leaves an
        incomplete last step waiting."""
        per_step = self.adapter.frames_per_step
        count = len(self.pending) // per_step * per_step if complete_steps_only else len(self.pending)
        groups = [self.pending[start:start + per_step] for start in range(0, count, per_step)]
        return StepJob(self, groups, self.vision_batch) if groups else None

    def settle(self, job: StepJob, *, failed: bool, offered: bool = False) -> None:
        """After ``job`` ran: its streamed steps' frames leave ``pending``; if it ``failed`` and the frame just
        ``offered`` made it ready and is not streamed, that frame is not taken (earlier ones stay encoded or
        pending)."""
        self.pending = self.pending[sum(len(group) for group in job.groups[:job.streamed]):]
        if job.streamed and job.groups[job.streamed - 1]:
            self.encoded_timestamp = job.groups[job.streamed - 1][-1].timestamp
            self.encoded_pushed = job.groups[job.streamed - 1][-1].index + 1
        if failed and offered and job.streamed < len(job.groups):
            self.durability.withdrawn(self.pending.pop())

    def encode_pending(self, complete_steps_only: bool = False, *, offer: Offer | None = None) -> None:
        """Encode the pending frames (see `pending_job`), one vision call for all, batched by the `VideoQA`'s
        step scheduler with other threads' pushes; steps streamed before a failure stay streamed. ``offer``: the
        frame `push` just offered, which made a step ready: accepted unless a failure withdrew it. The watches'
        listeners are told last, with the stream as pushed."""
        job = self.pending_job(complete_steps_only)
        taken = self.state.frames + len(self.pending)
        if job is None:
            self.accept_kept(offer, taken)
            return
        try:
            self.start()
        except BaseException:  # nothing streamed: the frames wait, the offered one with them
            self.accept_kept(offer, taken)
            raise
        try:
            self.qa.step_scheduler.run([job])
        except BaseException:
            self.settle(job, failed=True, offered=offer is not None)
            self.accept_kept(offer, taken)
            raise
        self.settle(job, failed=job.error is not None, offered=offer is not None)
        self.accept_kept(offer, taken)
        job.tell()
        job.raise_error()

    def accept_kept(self, offer: Offer | None, taken: int) -> None:
        """`accept` ``offer`` unless `settle` withdrew its frame (the frames held are no longer ``taken``)."""
        if offer is not None and self.state.frames + len(self.pending) == taken:
            self.accept(offer)

    @property
    def waiting_frames(self) -> list[Frame]:
        return self.pending

    @_one_at_a_time
    def close(self) -> None:
        watches = (watch_records(self), watch_tensors(self))
        lost = ([f"{len(self.pending)} frame(s) waiting for their batch are lost"] if self.pending else []) + (
            [f"its {len(watches[0])} watch(es) will not be reopened"] if watches[0] else [])
        if not self.prefill.closed and self.durability.enabled and self.durability.tier.nothing_resumable:
            if lost:  # no step to resume from: the folder goes (a resume starts from a step's checkpoint)
                log.warning("%s: closed before its first step: %s (flush() before close encodes the frames waiting, "
                            "and the folder then keeps them)", self.name, "; ".join(lost))
        elif not self.prefill.closed and self.durability.enabled:  # what `load` takes back from the folder
            try:
                self.durability.closing(self.pending, self.pushed, self.last_timestamp, watches)
                if self.successor is not None and self.durability.keep_successor(self.successor):
                    successor, self.successor = self.successor, None
                    successor.close()  # its files stay, for `load` to go on with (not replaying its steps again)
            except OutputError as error:
                if lost:
                    log.warning("%s: %s: %s", self.name, "; ".join(lost), error)
        for watch in self.watches:  # only now: a close that raised otherwise (a MemoryError) left them open
            watch.close()
        self.qa.step_scheduler.forget(self)  # batches recorded with this stream (CUDA graphs) are released
        super().close()

    def _check_timestamp(self, timestamp: float | None) -> float:
        return checked_timestamp(timestamp, self.last_timestamp, self.max_fps)

    # -- saving -----------------------------------------------------------------------------------------
    @_one_at_a_time
    def save(self, path: str | Path) -> Path:
        """Write the stream (carried state, detailed cache, pending frames, metadata, checksums, the weights'
        fingerprint, the engine settings) to one safetensors file (see `statekv.api.stream_file`); an `OutputError`
        when it cannot be written there (a folder, an unwritable place, a full disk), leaving nothing behind."""
        self.prefill.check_open()
        self.start()
        if self.prefill.seen_tokens == 0:
            raise InputError(f"{self.name}: nothing is encoded yet to save (the {len(self.pending)} frame(s) pushed "
                             f"wait for a batch of {self.batch_frames}); push more frames or flush() first")
        return save_stream(self, path)

    @_one_at_a_time
    def sync(self) -> None:
        """Make a disk-tier stream's file set durable up to now, as `save` does first: the carried state
        checkpointed at its last step and every file forced to the storage device, so its folder resumes
        (`load`) with every step taken so far. Nothing to do off the disk tier; an `OutputError` when the device
        fails it. Its cost follows the steps since the last sync, not the stream's length. The open watches are
        kept as they stand, also those opened or closed since the last step."""
        self.prefill.check_open()
        self.prefill.sync()
        if self.durability.journal_watches():  # (after the checkpoint: a resume from an older one never reads it)
            self.prefill.sync()
        self.durability.sync()

    @classmethod
    def load(cls, path: str | Path, qa: Any, *, allow_other_weights: bool = False,
             kv_cache_dtype: str | None = None, stream_id: str | None = None, owner: str | None = None) -> "Stream":
        """Resume a stream saved by `save` with ``qa`` (the same model, layout and method it was saved with).

        The whole file is verified first (schema, every tensor's presence, dtype, shape and checksum, the model,
        method and binding engine settings), so a damaged or foreign file is refused with a one-line `InputError`
        before anything is built. A stream saved with other weights (another checkpoint of the same
        architecture) is refused unless ``allow_other_weights=True``: its cache would not be what this model
        computes. kv_cache_dtype: how the saved detailed cache is stored (default: the VideoQA's); a file stored
        otherwise is refused.

        ``path`` may also be the folder of a disk-tier stream's file set (``offload="disk"``), e.g. after its
        process was killed (with any ``qa`` of the model: the stream stays on the disk tier, in that folder): the
        stream resumes in it from the last step whose data is durable, every step's checksum verified first, and
        ``frames_lost`` (also stated in one log line) counts the frames pushed after that step. A damaged or
        foreign file set is refused with one line, and so is a file set another live stream holds (naming it):
        the resumed stream holds its folder's lock until it is closed.

        stream_id: refuse a file that is not this stream's (None: any). owner: refuse a file that is not this
        owner's (None: a file saved with no owner). The stream keeps the id and owner it was saved with.
        """
        from .videoqa import VideoQA  # here: videoqa imports this module

        if not isinstance(qa, VideoQA):
            raise InputError(f"Stream.load takes the VideoQA to resume the stream with, got {type(qa).__name__}")
        check_bool(allow_other_weights, "allow_other_weights")
        if stream_id is not None:
            check_stream_id(stream_id)
        check_owner(owner)  # checked before any file is read
        engine = qa.engine if kv_cache_dtype is None else qa.engine.with_changes(kv_cache_dtype=kv_cache_dtype)
        with whole():
            return load_stream(cls, path, qa, engine, allow_other_weights=allow_other_weights, stream_id=stream_id,
                               owner=owner)


def check_making(horizon_frames: int | None, vision_batch: int, stream_id: str | None, owner: str | None
                 ) -> tuple[str | None, int]:
    """A new stream's ``horizon_frames``, ``vision_batch``, ``stream_id`` and ``owner`` checked (one-line errors),
    also for a stream that keeps none of them (`VideoQA.stream` under simplestream); returns the checked id (None:
    not given) and batch."""
    if horizon_frames is not None:
        check_int(horizon_frames, "horizon_frames", error=InputError)
    vision_batch = check_vision_batch(vision_batch)
    check_owner(owner)
    return (None if stream_id is None else check_stream_id(stream_id)), vision_batch


def check_max_fps(max_fps: float | None) -> float | None:
    """``max_fps`` as a float (None: keep every frame), or a one-line `InputError` unless it is a number above 0
    and at most `HIGHEST_FPS`."""
    if max_fps is None:
        return None
    if not is_stream_rate(max_fps):
        raise InputError(f"max_fps must be a number above 0 and at most {HIGHEST_FPS:g} (or None to keep every "
                         f"frame), got {shown(max_fps)}")
    return float(max_fps)


def checked_timestamp(timestamp: float | None, last: float | None, max_fps: float | None) -> float:
    """A pushed frame's time in seconds, checked against the ``last`` pushed and the ``max_fps`` clock (None: the
    next tick after ``last``); a one-line `InputError` before anything changes."""
    if timestamp is None:
        timestamp = 0.0 if last is None else last + (1.0 / max_fps if max_fps else 1.0)
        if not timestamp <= LATEST_TIMESTAMP:
            raise InputError(f"max_fps={max_fps} puts the next frame at {timestamp:g} s, past the latest time a "
                             f"stream takes ({LATEST_TIMESTAMP:g} s): push it with its timestamp, or stream at a "
                             "higher max_fps")
        return timestamp
    if isinstance(timestamp, numbers.Real) and not isinstance(timestamp, (bool, int, float)):
        timestamp = float(timestamp)  # a NumPy scalar (np.arange's times), or another real number type
    if not is_finite_number(timestamp) or timestamp < 0:
        raise InputError(f"timestamp must be a finite number of seconds >= 0, got {shown(timestamp)}")
    if last is not None and timestamp < last:
        raise InputError(f"timestamps must be non-decreasing; got {timestamp} after {last}")
    if timestamp > LATEST_TIMESTAMP:
        raise InputError(f"timestamp {timestamp:g} s is past the latest time a stream takes ({LATEST_TIMESTAMP:g} s; "
                         "timestamps are seconds, not milliseconds)")
    return float(timestamp)
