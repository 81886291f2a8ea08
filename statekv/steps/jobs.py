"""Steps of one or several videos streamed: their frames planned, vision-encoded in one call, laid out, and taken
in rounds of one step per video through the engine's batcher (`statekv.core.step.batching.StepBatcher`).

A video takes part through its step protocol (`statekv.api.encoded.EncodedVideo`): ``plan_steps`` (its frames
prepared after its layout state), ``lay_out`` (a vision-encoded step as the engine's `StepRequest`; ``step_of``
for a chunk the adapter laid out already, such as the prompt prefix) and ``record_step`` (its bookkeeping once the
step is streamed). Every step of a video goes through here, and one video's steps through exactly the code several
videos' do: with one video, every round is the batcher's step of one request.

`StepScheduler` (owned by each `VideoQA`, ``qa.step_scheduler``) batches the steps of streams pushed from
different threads: a pushing thread queues its stream's steps; the thread that finds no batch running leads,
takes every queued job and streams them together, and each caller gets its own result or error in its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.step.batching import StepBatcher, StepRequest
from ..errors import HandoverError, OutputError, StateKVError
from ..stopping import whole
from .overlap import EncodedStep, encode_batch
from ..video import Frame

log = logging.getLogger("statekv")


@dataclass
class LaidOutStep:
    """One video's step ready for the language model: ``encoded`` (its frames and visual features; None for a text
    chunk), ``chunk`` (the adapter's layout of it) and ``request`` (what the engine steps)."""

    chunk: Any
    request: StepRequest
    encoded: EncodedStep | None = None


@dataclass
class StepJob:
    """One video's steps to stream: ``groups`` (each a list of frames) to plan and vision-encode, ``encoded``
    steps already vision-encoded elsewhere (`statekv.steps.overlap`), or ``chunks`` the adapter laid out already
    (text, such as the prompt prefix). ``vision_batch``: the frames per vision call asked for (for its
    statistics). ``streamed`` counts the steps streamed; ``error`` is set if one failed (the steps before it stay
    streamed). ``after``: calls made on the thread that queued the job once it is done (its watches' listeners),
    not on the thread that ran its batch, which may not hold the job's stream; the caller makes them (`tell`)
    once it has settled the stream, so that a listener that asks or saves it sees its frames streamed once."""

    video: Any
    groups: list[list[Frame]] = field(default_factory=list)
    vision_batch: int = 1
    encoded: list[EncodedStep] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    streamed: int = 0
    after: list[Callable[[], None]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """The steps ready to lay out (vision-encoded, or laid out already)."""
        return len(self.encoded) + len(self.chunks)

    def laid_out(self, index: int) -> LaidOutStep:
        """Step ``index`` as the engine's request (`EncodedVideo.lay_out`, or ``step_of`` a chunk), marked when it
        ends the job's vision-tower call."""
        step = self.video.step_of(self.chunks[index]) if self.chunks else self.video.lay_out(self.encoded[index])
        if index + 1 < self.steps:
            step.request = replace(step.request, ends_vision_call=False)
        return step

    def tell(self) -> None:
        """Make the ``after`` calls (once)."""
        calls, self.after = self.after, []
        for call in calls:
            call()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def stream_jobs(jobs: Sequence[StepJob], batcher: StepBatcher) -> None:
    """Stream every job's steps: frames planned per video, vision-encoded in one call for all videos (each video on
    its own if that call fails), then rounds of one step per video through ``batcher``. A job that fails stops
    there with its ``error``; the others go on. A stopping signal waits for the call to end (`whole`)."""
    with whole():
        _stream_jobs(jobs, batcher)


def _stream_jobs(jobs: Sequence[StepJob], batcher: StepBatcher) -> None:
    planned = []
    for job in jobs:
        if job.steps:
            continue  # vision-encoded or laid out already
        started = time.perf_counter()
        try:
            steps = job.video.plan_steps(job.groups)
        except Exception as error:
            job.error = error
            continue
        planned.append((job, steps, time.perf_counter() - started))
    encode_vision(planned)
    live = [(job, 0) for job in jobs if job.error is None and job.steps]
    while live:
        started = time.perf_counter()
        laid_out, stepping = [], []
        for job, index in live:
            try:
                laid_out.append(job.laid_out(index))
            except Exception as error:
                job.error = error
                continue
            stepping.append((job, index))
        outcomes = batcher.step([step.request for step in laid_out])
        stepped = []
        for (job, index), step, outcome in zip(stepping, laid_out, outcomes):
            if isinstance(outcome, Exception):
                job.error = outcome
            else:
                stepped.append((job, index, step))
        finished = time.perf_counter()
        following = []
        for job, index, step in stepped:
            job.video.record_step(step, started, finished, vision_batch=job.vision_batch)
            job.streamed += 1
            if index + 1 < job.steps:
                following.append((job, index + 1))
        stopped = hand_over([job.video for job, index, step in stepped if job.video.handover_due
                             and job.video.backlog.retry_due and handover_now(job.video, step, job.steps - index - 1)],
                            batcher)
        for job, _, _ in stepped:
            if id(job.video) in stopped:  # closed in its handover: its job ends there, the others go on
                job.error = stopped[id(job.video)]
        live = [(job, index) for job, index in following if job.error is None]


def handover_now(video: Any, step: LaidOutStep, later: int) -> bool:
    """Whether ``video``, due to hand over after ``step``, does so now rather than after the ``later`` steps left
    in its vision-tower call: on the disk tier it waits for the call's end, where the handover's checkpoint lets
    a killed stream resume as the stream that never stopped (a stream resumed inside a call encodes the frames
    after it in other calls), unless its cache cap could not hold both engines that long."""
    return (step.request.ends_vision_call or not video.durability.enabled
            or not video.can_wait_for_handover(later))


def hand_over(videos: Sequence[Any], batcher: StepBatcher) -> dict[int, HandoverError]:
    """The successors of ``videos`` (whose engines left the model's range, `statekv.api.handover`) replay their
    backlogs, together, and take over; one whose replay met a passing fault (its disk tier refused a step, its backlog
    file could not be read, memory was short) goes on at a later step, one whose replay fails otherwise is dropped,
    its video going on alone. Returns, by ``id`` of the video, the handovers that stopped once marked on the disk
    tier (those videos are closed)."""
    if not videos:
        return {}
    started = time.perf_counter()
    for video in videos:
        if not video.replay_put_off:
            log.info("%s: past the model's range: encoding again in cache order, once, the steps not yet so encoded "
                     "(%d), for the engine that goes on", video.name, len(video.backlog.steps))
    _, refused = replay_backlogs(videos, batcher)
    stopped = {}
    for video in videos:
        if id(video) in refused:
            if not video.replay_put_off:  # a disk full for hours is one line, not one a push
                log.warning("%s", video.put_off(refused[id(video)]))
            video.replay_put_off = True
            continue
        try:
            video.adopt_successor()
        except HandoverError as error:  # the video was closed: its folder resumes it
            stopped[id(video)] = error
            log.error("%s", error)
            continue
        except OutputError as error:  # refused before it was marked: both engines as they were, for a later step
            if not video.backlog.refused():
                video.drop_successor(video.backlog.why_dropped(error))
                continue
            if not video.replay_put_off:
                log.warning("%s", video.put_off(error))
            video.replay_put_off = True
            continue
        except Exception as error:  # the step is streamed: the video goes on with the engine it has
            video.drop_successor(f"its handover failed ({error})")
        video.replay_put_off = False
        log.info("%s: %s after %.1f s", video.name, video.handover, time.perf_counter() - started)
    return stopped


def catch_up_together(videos: Sequence[Any], steps: int | None = None) -> int:
    """The successors of ``videos`` replay their backlogs now, together (`EncodedVideo.catch_up`): all of each, or
    its first ``steps``; a video past the range whose backlog is then replayed takes over. Returns the steps
    replayed; `ReplayPutOff` when a successor's disk tier refused a step."""
    for video in videos:
        video.prefill.check_open()
    replayed, refused = replay_backlogs(videos, StepBatcher(), waves=steps)
    stopped = []
    for video in videos:
        if video.handover_due and not video.backlog.steps:  # a handover stopped in its replay: finished now
            try:
                video.adopt_successor()
            except HandoverError as error:  # the video was closed; the others still take over
                log.error("%s", error)
                stopped.append(error)
                continue
            except OutputError as error:  # refused before it was marked: put off, as a refused replay is
                if video.backlog.refused():
                    refused[id(video)] = error
                else:
                    video.drop_successor(video.backlog.why_dropped(error))
        video.book_engines()
    if stopped:
        raise stopped[0]
    if refused:
        put_off = [video for video in videos if id(video) in refused]
        video = next((video for video in put_off if not video.replay_put_off), put_off[0])  # one not said yet
        said = video.replay_put_off
        for other in videos:
            other.replay_put_off = id(other) in refused
        raise ReplayPutOff(video.put_off(refused[id(video)]), replayed, set(refused), said=said)
    for video in videos:
        video.replay_put_off = False
    return replayed


class ReplayPutOff(OutputError):
    """`catch_up_together`'s refusal: a successor's disk tier refused a step (`EncodedVideo.put_off` says which);
    the other videos replayed theirs. ``replayed``: the steps replayed; ``put_off``: the ``id`` of each video whose
    replay was put off; ``said``: each of them was put off at its last replay too (said then)."""

    def __init__(self, message: str, replayed: int, put_off: set[int], said: bool = False):
        super().__init__(message)
        self.replayed, self.put_off, self.said = replayed, put_off, said


def replay_backlogs(videos: Sequence[Any], batcher: StepBatcher,
                    waves: int | None = None) -> tuple[int, dict[int, Exception]]:
    """Every video's successor replays its backlog (`EncodedVideo.replay_request`), in waves of one step per video
    through ``batcher``, so the successors of several videos step together; at most ``waves`` waves (None: until
    every backlog is replayed). A stopping signal waits for the wave to end: a step replayed leaves its backlog
    with it. A video whose step failed, or whose backlog cannot be read now, replays no more now
    (`EncodedVideo.replayed`). Returns the steps replayed and, by ``id`` of the video, the faults that put a replay
    off."""
    replaying, replayed, refused = list(videos), 0, {}
    while waves is None or waves > 0:
        waves = None if waves is None else waves - 1
        requests = []
        for video in replaying:
            try:
                request = video.replay_request()
            except Exception as error:  # its backlog unreadable now or memory short: put off as a refused step is
                if video.replayed(error):
                    refused[id(video)] = error
                continue
            if request is not None:
                requests.append((video, request))
        if not requests:
            break
        with whole():
            replaying = []
            for (video, _), outcome in zip(requests, batcher.step([request for _, request in requests])):
                if video.replayed(outcome):
                    refused[id(video)] = outcome
                elif not isinstance(outcome, Exception):
                    replaying.append(video)
        replayed += len(replaying)
    return replayed, refused


def encode_vision(planned: list[tuple[StepJob, list, float]]) -> None:
    """Every planned job's steps through the vision tower in one call (each job's ``encoded``); if it fails, each
    job's alone (so a frame the tower refuses fails only its video)."""
    if not planned:
        return
    adapter = planned[0][0].video.adapter
    steps = [step for _, job_steps, _ in planned for step in job_steps]
    shares = [seconds * len(step.frames) / sum(len(s.frames) for s in job_steps)
              for _, job_steps, seconds in planned for step in job_steps]
    if len(planned) > 1:
        try:
            encoded = encode_batch(adapter, steps, shares)
        except Exception:
            encoded = None
        if encoded is not None:
            for job, job_steps, _ in planned:
                job.encoded, encoded = encoded[:len(job_steps)], encoded[len(job_steps):]
            return
    start = 0
    for job, job_steps, _ in planned:
        try:
            job.encoded = encode_batch(adapter, job_steps, shares[start:start + len(job_steps)])
        except Exception as error:
            job.error = error
        start += len(job_steps)


class StepScheduler:
    """Batches the steps of streams pushed from different threads (see the module doc).

    ``batched_steps``: language-model forwards that stepped more than one stream; ``batched_rows``: the stream
    steps taken in them."""

    def __init__(self, follow_up: Callable[[list[StepJob]], None] | None = None):
        """follow_up: called with each batch once its steps ran, before its callers are let go (the streams'
        watches are evaluated there, `statekv.api.watch.evaluate_due`)."""
        self.batcher = StepBatcher()
        self.follow_up = follow_up
        self.changed = threading.Condition()
        self.queue: list[StepJob] = []
        self.running = False

    @property
    def batched_steps(self) -> int:
        return self.batcher.batched_steps

    @property
    def batched_rows(self) -> int:
        return self.batcher.batched_rows

    @property
    def batch_sizes(self):
        """Language-model forwards by the stream steps each took (a `collections.Counter`)."""
        return self.batcher.batch_sizes

    def run(self, jobs: Sequence[StepJob]) -> None:
        """Queue ``jobs`` and return once each is done (its ``error`` set if it failed), batched with whatever
        other threads queue meanwhile; their ``after`` calls are the caller's to make (`StepJob.tell`). A stopping
        signal waits for the call to end (`whole`): a stop raised while this thread holds the queue's condition
        would leave it unreleased, or another caller's job unfinished."""
        with whole(), self.changed:
            self.queue.extend(jobs)
            while not all(job.done for job in jobs):
                if self.running:
                    self.changed.wait()
                    continue
                self.running = True
                batch, self.queue = self.queue, []
                self.changed.release()
                try:
                    self.run_batch(batch)
                finally:
                    self.changed.acquire()
                    self.running = False
                    self.changed.notify_all()

    def run_batch(self, batch: list[StepJob]) -> None:
        """Stream ``batch`` on this thread (one job: exactly the single-video path)."""
        try:
            stream_jobs(batch, self.batcher)
            if self.follow_up is not None:
                self.follow_up(batch)
        except BaseException as error:  # an interrupt in this thread: the other callers must not wait forever
            for job in batch:
                if not job.done and job.error is None:
                    job.error = StateKVError(f"{job.video.name}: its step was interrupted ({type(error).__name__})")
            raise
        finally:
            for job in batch:
                job.done = True

    def forget(self, video: Any) -> None:
        """``video`` closed: drop the batches recorded with it."""
        for prefill in video.engines:
            self.release(prefill)

    def release(self, prefill: Any) -> None:
        """One engine (`statekv.core.StreamingPrefill`) closed: drop the batches recorded with it."""
        self.batcher.forget(prefill)
