"""Several streams of one `VideoQA` stepped together: one vision-tower call for all their frames, one language
model forward per round of their steps (`statekv.core.batching`).

`StepScheduler` (owned by each `VideoQA`, ``qa.step_scheduler``) batches `Stream.push` calls that arrive from
different threads: a pushing thread queues its stream's steps; the thread that finds no batch running leads,
takes every queued job and streams them together, and each caller gets its own result or error in its own
thread. With one pushing thread a job runs exactly as it did before (`EncodedVideo.append_steps`).
`push_together` is `VideoQA.push_many`: frames for several streams, stepped together explicitly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .core.batching import StepBatcher, StepRequest
from .encoded import EncodedVideo
from .errors import InputError, StateKVError
from .overlap import EncodedStep, encode_batch
from .video import Frame


@dataclass
class StepJob:
    """One stream's steps to stream (each a list of frames); ``error`` is set if they failed (the steps before
    the failure stay streamed: ``video.stats.chunks`` counts them)."""

    video: EncodedVideo
    groups: list[list[Frame]]
    error: BaseException | None = None
    done: bool = False
    encoded: list[EncodedStep] = field(default_factory=list)
    chunks_before: int = 0  # the stream's steps before this job


def stream_jobs(jobs: Sequence[StepJob], batcher: StepBatcher) -> None:
    """Stream every job's steps: frames prepared per stream, vision-encoded in one call for all streams (each
    stream on its own if that call fails), then rounds of one step per stream through ``batcher``. A job that
    fails stops there with its ``error``; the others go on."""
    live = []
    for job in jobs:
        started = time.perf_counter()
        try:
            steps, state = [], job.video.state
            for frames in job.groups:
                steps.append(job.video.adapter.prepare_frames(frames, state))
                state = state.updated(steps[-1].state_update)
        except Exception as error:
            job.error = error
            continue
        job.video._step_started = started
        live.append((job, steps, time.perf_counter() - started))
    _encode_vision(live)
    live = [(job, 0) for job, _, _ in live if job.error is None]
    while live:
        started = time.perf_counter()
        requests, chunks = [], []
        for job, index in list(live):
            video, encoded = job.video, job.encoded[index]
            try:
                chunk = video.adapter.features_chunk(encoded.step, encoded.features, video.state)
            except Exception as error:
                job.error = error
                live.remove((job, index))
                continue
            chunks.append(chunk)
            requests.append(StepRequest(video.prefill, chunk.inputs_embeds, chunk.position_ids,
                                        forward_kwargs=dict(chunk.forward_kwargs),
                                        durable_record=video.durable_record(chunk)))
        outcomes = batcher.step(requests)
        finished = time.perf_counter()
        following = []
        for (job, index), chunk, outcome in zip(live, chunks, outcomes):
            if isinstance(outcome, Exception):
                job.error = outcome
                continue
            job.video._chunk_streamed(chunk)
            job.video._record_step_times(job.encoded[index], chunk, started, finished,
                                         vision_batch=getattr(job.video, "vision_batch", 1))
            if index + 1 < len(job.encoded):
                following.append((job, index + 1))
        live = following


def _encode_vision(live: list[tuple[StepJob, list, float]]) -> None:
    """Every live job's steps through the vision tower in one call; if it fails, each job's alone (so a frame
    the tower refuses fails only its stream)."""
    if not live:
        return
    adapter = live[0][0].video.adapter
    steps = [step for _, job_steps, _ in live for step in job_steps]
    shares = [seconds * len(step.frames) / sum(len(s.frames) for s in job_steps)
              for _, job_steps, seconds in live for step in job_steps]
    if len(live) > 1:
        try:
            encoded = encode_batch(adapter, steps, shares)
        except Exception:
            encoded = None
        if encoded is not None:
            for job, job_steps, _ in live:
                job.encoded, encoded = encoded[:len(job_steps)], encoded[len(job_steps):]
            return
    start = 0
    for job, job_steps, _ in live:
        try:
            job.encoded = encode_batch(adapter, job_steps, shares[start:start + len(job_steps)])
        except Exception as error:
            job.error = error
        start += len(job_steps)


class StepScheduler:
    """Batches the steps of streams pushed from different threads (see the module doc).

    ``batched_steps``: language-model forwards that stepped more than one stream; ``batched_rows``: the stream
    steps taken in them."""

    def __init__(self):
        self.batcher = StepBatcher()
        self._changed = threading.Condition()
        self._queue: list[StepJob] = []
        self._running = False

    @property
    def batched_steps(self) -> int:
        return self.batcher.batched_steps

    @property
    def batched_rows(self) -> int:
        return self.batcher.batched_rows

    def stream(self, video: EncodedVideo, groups: list[list[Frame]]) -> None:
        """Stream ``groups`` (lists of frames, one per step) for ``video``, batched with whatever other threads
        queue meanwhile; returns when they are streamed, or raises this stream's error in this thread."""
        job = StepJob(video, groups)
        self.run([job])
        if job.error is not None:
            raise job.error

    def run(self, jobs: Sequence[StepJob]) -> None:
        """Queue ``jobs`` and return once each is done (its ``error`` set if it failed)."""
        with self._changed:
            self._queue.extend(jobs)
            while not all(job.done for job in jobs):
                if self._running:
                    self._changed.wait()
                    continue
                self._running = True
                batch, self._queue = self._queue, []
                self._changed.release()
                try:
                    self._run_batch(batch)
                finally:
                    self._changed.acquire()
                    self._running = False
                    self._changed.notify_all()

    def _run_batch(self, batch: list[StepJob]) -> None:
        try:
            if len(batch) == 1:
                job = batch[0]  # alone: exactly the single-stream path
                try:
                    job.video._append_steps(job.groups, vision_batch=getattr(job.video, "vision_batch", 1))
                except Exception as error:
                    job.error = error
            else:
                stream_jobs(batch, self.batcher)
        except BaseException as error:  # an interrupt in this thread: the other callers must not wait forever
            for job in batch:
                if not job.done and job.error is None:
                    job.error = StateKVError(f"{job.video.name}: its step was interrupted ({type(error).__name__})")
            raise
        finally:
            for job in batch:
                job.done = True

    def forget(self, video: EncodedVideo) -> None:
        """``video`` closed: drop the batches recorded with it."""
        self.batcher.forget(video.prefill)


def push_together(scheduler: StepScheduler, items: Sequence[Any], *, return_exceptions: bool = False) -> list:
    """`VideoQA.push_many`: push ``(stream, frame, seconds)`` items; streams whose frame completes a step (or a
    vision batch) step together. Returns, per item, whether its frame was kept, or (``return_exceptions``) the
    error that item raised; otherwise the first error is raised after every other item was pushed."""
    items = [_checked_item(item) for item in items]
    results: list[Any] = [None] * len(items)
    remaining = list(range(len(items)))
    while remaining:  # waves: each stream's first remaining frame
        wave, seen, later = [], set(), []
        for index in remaining:
            stream = items[index][0]
            (later if id(stream) in seen else wave).append(index)
            seen.add(id(stream))
        _push_wave(scheduler, items, wave, results)
        remaining = later
    if not return_exceptions:
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return results


def _checked_item(item: Any) -> tuple:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3) or not hasattr(item[0], "_offer"):
        raise InputError("push_many takes (stream, frame, seconds) items (seconds may be None, or left out for a "
                         f"Frame), got {type(item).__name__}")
    stream, frame, seconds = (*item, None) if len(item) == 2 else item
    return stream, frame, seconds


def _push_wave(scheduler: StepScheduler, items, wave: list[int], results: list) -> None:
    streams = sorted({id(items[index][0]): items[index][0] for index in wave}.values(), key=id)
    for stream in streams:  # one order for every caller: no two callers wait on each other's locks
        stream._lock.acquire()
    try:
        offers, jobs = {}, []
        for index in wave:
            stream, frame, seconds = items[index]
            try:
                stream.prefill.check_open()
                offers[index] = stream._offer(frame, seconds)
            except Exception as error:
                results[index] = error
                continue
            if offers[index][2]:
                jobs.append((index, _pending_job(stream)))
        scheduler.run([job for _, job in jobs])
        failed = {}
        for index, job in jobs:
            stream = job.video
            streamed = sum(len(group) for group in job.groups[:_streamed(job)])
            stream.pending = stream.pending[streamed:]
            if job.error is not None:
                stream.pending.pop()  # as a failed push: the frame is not taken
                failed[index] = job.error
        for index, offer in offers.items():
            if index in failed:
                results[index] = failed[index]
                continue
            kept, timestamp, _ = offer
            items[index][0]._accepted(kept, timestamp)
            results[index] = kept
    finally:
        for stream in streams:
            stream._lock.release()


def _pending_job(stream) -> StepJob:
    per_step = stream.adapter.frames_per_step
    groups = [stream.pending[start:start + per_step] for start in range(0, len(stream.pending), per_step)]
    stream.streaming_groups(groups)
    return StepJob(stream, groups, chunks_before=stream.stats.chunks)


def _streamed(job: StepJob) -> int:
    return job.video.stats.chunks - job.chunks_before
