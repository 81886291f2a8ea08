"""`VideoQA.push_many`: one frame to each of several streams of one `VideoQA`, their steps taken together; and
`VideoQA.catch_up_many`: their successors' backlogs replayed together.

Each stream takes the steps of `Stream.push` (`offer`, its ready steps as a job, `settle`, `accept`), holding its
lock; the jobs of every stream whose frame completes a step (or a vision batch) go to the `VideoQA`'s step
scheduler at once, so they share one vision-tower call and batched language-model forwards
(`statekv.steps.jobs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InputError
from ..steps.jobs import StepScheduler, catch_up_together
from ..stopping import whole
from .stream import Stream


def push_together(scheduler: StepScheduler, items: Sequence[Any], *, return_exceptions: bool = False) -> list:
    """Push ``(stream, frame, seconds)`` items; streams whose frame completes a step (or a vision batch) step
    together. Returns, per item, whether its frame was kept, or (``return_exceptions``) the error that item
    raised; otherwise the first error is raised after every other item was pushed."""
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


def catch_up_streams(streams: Sequence[Stream], steps: int | None = None) -> int:
    """`VideoQA.catch_up_many`: each stream's lock held (taken in one order for every caller), their successors
    replay their backlogs together (`statekv.steps.jobs.catch_up_together`); the steps replayed."""
    with whole(), torch.no_grad(), locked_in_order(streams) as ordered:
        return catch_up_together(ordered, steps)


@contextlib.contextmanager
def locked_in_order(streams: Sequence[Stream]):
    """Hold the locks of ``streams`` (each once), taken in one order for every caller, so no two callers wait on
    each other's locks; yields the streams in that order."""
    ordered = sorted({id(stream): stream for stream in streams}.values(), key=id)
    with contextlib.ExitStack() as held:
        for stream in ordered:
            held.enter_context(stream.lock)
        yield ordered


def _checked_item(item: Any) -> tuple:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3) or not isinstance(item[0], Stream):
        raise InputError("push_many takes (stream, frame, seconds) items (seconds may be None, or left out for a "
                         f"Frame), got {type(item).__name__}")
    stream, frame, seconds = (*item, None) if len(item) == 2 else item
    return stream, frame, seconds


def _push_wave(scheduler: StepScheduler, items, wave: list[int], results: list) -> None:
    # a stopping signal waits for every stream's push of this wave
    with whole(), locked_in_order([items[index][0] for index in wave]):
        _push_streams(scheduler, items, wave, results)


def _push_streams(scheduler: StepScheduler, items, wave: list[int], results: list) -> None:
    offers, jobs = {}, []
    for index in wave:
        stream, frame, seconds = items[index]
        try:
            stream.prefill.check_open()
            offers[index] = stream.offer(frame, seconds)
        except Exception as error:
            results[index] = error
            continue
        if offers[index].ready:
            jobs.append((index, stream.pending_job()))
    try:
        scheduler.run([job for _, job in jobs])
    except BaseException as error:  # the batch failed as a whole: streamed or waiting frames are taken
        for index, job in jobs:
            job.video.settle(job, failed=True, offered=True)
        streamed = {index for index, job in jobs if job.streamed == len(job.groups)}
        for index, offer in offers.items():
            if index in streamed or not offer.ready:
                items[index][0].accept(offer)
        if not isinstance(error, Exception):
            raise  # an interrupt stops every caller
        stepped = {index for index, _ in jobs}
        for index, offer in offers.items():  # the error is each stepped item's own, as a bad frame's is
            results[index] = error if index in stepped else offer.kept
        return
    failed = {}
    for index, job in jobs:
        job.video.settle(job, failed=job.error is not None, offered=True)
        if job.error is not None:
            failed[index] = job.error
    streamed = {index for index, job in jobs if job.streamed == len(job.groups)}
    for index, offer in offers.items():
        if index in failed:
            results[index] = failed[index]
            if index in streamed:  # its frame streamed before the error (a watch's follow-up, a handover)
                items[index][0].accept(offer)
            continue
        items[index][0].accept(offer)
        results[index] = offer.kept
    for _, job in jobs:  # with every stream of the wave settled: a listener sees its frame pushed once
        job.tell()
