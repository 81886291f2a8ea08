"""A sampled video's steps with decoding, vision and the language model overlapped.

    decode thread   reads the frames, groups them into steps, preprocesses each (adapter.prepare_frames)
    vision thread   gathers steps into batches of `vision_batch` frames: one vision-tower call per batch
                    (adapter.encode_vision); on CUDA on a stream of its own, so it overlaps the language model
    caller          lays each step out and streams it through the language model, one step at a time

Batches are fixed by the frame order alone (steps ``0..k-1``, ``k..2k-1``, ...), never by timing, so an
encoding is the same from run to run. Both queues hold at most `QUEUED_BATCHES` batches, so memory does not grow
with the video. A frame that cannot be decoded raises its error only after every step before it has been
vision-encoded and handed to the caller (see `statekv.background`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..models import LayoutState, PreparedFrames, VideoAdapter, VisualFeatures
from ..background import ThreadStages
from ..settings.values import check_int
from ..video import Frame

QUEUED_BATCHES = 2  # batches each queue may hold ahead of its consumer
# Frames per vision-tower call on CUDA: batching amortizes the per-call cost (see benchmarks/pipeline_overlap.py).
CUDA_VISION_BATCH = 16
CPU_VISION_BATCH = 4  # on CPU, larger batches gain little and only delay the first frame


@dataclass
class EncodedStep:
    """One step ready for the language model.

    step: its preprocessed frames. features: its visual tokens (and DeepStack features).
    decode_seconds: reading and preprocessing its frames. vision_seconds: its share of its batch's vision call.
    """

    step: PreparedFrames
    features: VisualFeatures
    decode_seconds: float
    vision_seconds: float


def default_vision_batch(device: torch.device | str) -> int:
    """Frames per vision-tower call when none is given: `CUDA_VISION_BATCH` on CUDA, else `CPU_VISION_BATCH`."""
    return CUDA_VISION_BATCH if torch.device(device).type == "cuda" else CPU_VISION_BATCH


def check_vision_batch(vision_batch: object) -> int:
    """``vision_batch`` if it is a positive integer; a one-line `ConfigurationError` otherwise."""
    return check_int(vision_batch, "vision_batch")


def steps_per_batch(vision_batch: int, frames_per_step: int) -> int:
    """Steps per vision-tower call: ``vision_batch`` frames, at least one step (Qwen3-VL steps are 2 frames)."""
    return max(1, vision_batch // frames_per_step)


def encode_batch(adapter: VideoAdapter, steps: Sequence[PreparedFrames], decode_seconds: Sequence[float]
                 ) -> list[EncodedStep]:
    """One vision-tower call for ``steps``, timed, its time shared among the steps by their frames."""
    started = time.perf_counter()
    features = adapter.encode_vision(steps)
    _wait_for(features)
    seconds = time.perf_counter() - started
    frames = sum(len(step.frames) for step in steps)
    return [EncodedStep(step, feature, decode, seconds * len(step.frames) / frames)
            for step, feature, decode in zip(steps, features, decode_seconds)]


@contextlib.contextmanager
def overlapped_steps(adapter: VideoAdapter, frames: Iterable[Frame], state: LayoutState, *,
                     vision_batch: int) -> Iterator[Iterator[EncodedStep]]:
    """``with overlapped_steps(...) as steps: for encoded in steps: ...``: the steps of ``frames`` (grouped by
    ``adapter.frames_per_step``, the first following ``state``), vision-encoded ahead of the caller.

    Leaving the block stops and joins both threads, also on an exception or Ctrl-C in the caller.
    """
    batch_steps = steps_per_batch(check_vision_batch(vision_batch), adapter.frames_per_step)
    with ThreadStages("statekv-encode") as stages:
        prepared = stages.add(partial(_decode_stage, adapter, frames, state), None,
                              maxsize=QUEUED_BATCHES * batch_steps, name="decode")
        encoded = stages.add(partial(_vision_stage, adapter, batch_steps), prepared,
                             maxsize=QUEUED_BATCHES * batch_steps, name="vision")
        yield _claimed(encoded)


# -- stages -----------------------------------------------------------------------------------------------
def _decode_stage(adapter: VideoAdapter, frames: Iterable[Frame], state: LayoutState, _upstream, emit) -> None:
    source = iter(frames)
    try:
        while True:
            started = time.perf_counter()
            group = [frame for _, frame in zip(range(adapter.frames_per_step), source)]
            if not group:
                return
            step = adapter.prepare_frames(group, state)
            state = state.updated(step.state_update)  # e.g. the resolution the first step fixed
            emit((step, time.perf_counter() - started))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # a generator over a file releases its decoder here, on this thread


def _vision_stage(adapter: VideoAdapter, batch_steps: int, upstream: Iterator, emit) -> None:
    batch: list[tuple[PreparedFrames, float]] = []

    def flush() -> None:
        steps, decode_seconds = zip(*batch)
        batch.clear()
        for encoded in encode_batch(adapter, steps, decode_seconds):
            emit(encoded)

    with torch.no_grad(), _vision_stream(adapter.device):
        try:
            for item in upstream:
                batch.append(item)
                if len(batch) == batch_steps:
                    flush()
        except Exception:
            if batch:
                flush()  # the steps decoded before a failure still reach the language model
            raise
        if batch:
            flush()


# -- CUDA streams -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _vision_stream(device: torch.device):
    """On CUDA, make this thread's kernels go to a stream of its own (else a no-op)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def _tensors(features: VisualFeatures) -> list[torch.Tensor]:
    return [features.embeds, *features.deepstack]


def _wait_for(features: Sequence[VisualFeatures]) -> None:
    """Block until the vision stream has finished ``features`` (so the caller may read them on its stream)."""
    first = features[0].embeds if features else None
    if first is not None and first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()


def _claimed(encoded: Iterator[EncodedStep]) -> Iterator[EncodedStep]:
    """The caller's side: features made on the vision stream are used on the caller's stream, so the caching
    allocator must not hand their memory to a later vision batch before the caller's kernels have read them."""
    for item in encoded:
        for tensor in _tensors(item.features):
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
        yield item
