"""What encoding a video cost and what an answer could see (`EncodedVideo.stats`, `EncodedVideo.answer_info`),
and the progress a long encoding reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIMES_KEPT = 10_000  # per-frame times EncodingStats keeps (the latest; older ones are summed)

ProgressCallback = Callable[[int, int | None], None]  # (frames done, frames planned or None)


@dataclass
class EncodingStats:
    """What encoding a video cost.

    frames: sampled frames streamed. tokens: tokens streamed (the detailed cache's length). chunks: steps.
    carried_tokens: the largest carried state over layers and KV heads after the last step.
    frame_seconds: wall time per frame: the time from one step's end to the next's divided by its frames, so
        they add up to the encoding's wall time (stages overlap, so this is the slowest stage's pace).
    decode_seconds, vision_seconds, language_seconds: per frame, the time each stage spent on it: reading and
        preprocessing; its share of its vision-tower batch; its share of its step's layout (ids, embeddings,
        positions) and language-model forward. On CUDA, vision is timed to the end of its kernels, the language
        model as its step returns.
    vision_batch: frames per vision-tower call asked for (``None`` before any frame).
    cache_bytes: memory held by the detailed cache (keys and values, all layers, wherever they are stored), with,
        under the handover layout, the successor's (`statekv.api.handover`) and its backlog.
    peak_cache_device_bytes: the most cache the engines held on the model's device at once (carried state, the
        detailed cache unless offloaded, what answering brought there, a successor's backlog unless offloaded),
        encoding and questions included.
    peak_memory_bytes: peak accelerator memory while encoding (``None`` on CPU).
    evicted_frames: frames whose detailed cache was given up under ``max_cache_bytes`` (answers no longer see
        them; see `statekv.core.storage.limits`).
    earlier_seconds, earlier_frames: the wall time and count of frames whose per-frame times were dropped: the
        lists keep the last `TIMES_KEPT` to `2 * TIMES_KEPT` frames, so a stream that never ends keeps a bounded
        record (``seconds`` and the means still count every frame).
    """

    frames: int = 0
    tokens: int = 0
    chunks: int = 0
    carried_tokens: int = 0
    frame_seconds: list[float] = field(default_factory=list)
    decode_seconds: list[float] = field(default_factory=list)
    vision_seconds: list[float] = field(default_factory=list)
    language_seconds: list[float] = field(default_factory=list)
    vision_batch: int | None = None
    cache_bytes: int = 0
    peak_cache_device_bytes: int = 0
    peak_memory_bytes: int | None = None
    evicted_frames: int = 0
    earlier_seconds: float = 0.0
    earlier_frames: int = 0

    @property
    def seconds(self) -> float:
        return float(sum(self.frame_seconds)) + self.earlier_seconds

    @property
    def mean_frame_seconds(self) -> float:
        timed = len(self.frame_seconds) + self.earlier_frames
        return self.seconds / timed if timed else 0.0

    @property
    def frames_per_second(self) -> float:
        return (len(self.frame_seconds) + self.earlier_frames) / self.seconds if self.seconds > 0 else 0.0

    def __repr__(self) -> str:
        """The counts and sizes, and the per-frame times as their mean (a long stream keeps thousands of them)."""
        shown = [f"{name}={getattr(self, name)!r}" for name in (
            "frames", "tokens", "chunks", "carried_tokens", "vision_batch", "cache_bytes", "peak_cache_device_bytes",
            "peak_memory_bytes", "evicted_frames")]
        return f"EncodingStats({', '.join(shown)}, mean_frame_seconds={self.mean_frame_seconds:.6f})"

    def trim(self) -> None:
        """Keep the last `TIMES_KEPT` frames' times once twice as many are held (their sum kept)."""
        dropped = len(self.frame_seconds) - TIMES_KEPT
        if dropped < TIMES_KEPT:
            return
        self.earlier_seconds += float(sum(self.frame_seconds[:dropped]))
        self.earlier_frames += dropped
        for times in (self.frame_seconds, self.decode_seconds, self.vision_seconds, self.language_seconds):
            del times[:dropped]

    def stage_seconds(self) -> dict[str, float]:
        """Mean seconds per frame of each stage: ``{"decode": ..., "vision": ..., "language": ...}``."""
        stages = {"decode": self.decode_seconds, "vision": self.vision_seconds, "language": self.language_seconds}
        return {name: sum(values) / len(values) if values else 0.0 for name, values in stages.items()}

    def summary(self) -> str:
        """Lines for people: throughput, the stages' time per frame, memory."""
        stages = self.stage_seconds()
        lines = [f"encoded {self.frames} frames ({self.tokens} tokens, {self.chunks} steps) in {self.seconds:.2f} s: "
                 f"{self.frames_per_second:.1f} frames/s, {1e3 * self.mean_frame_seconds:.1f} ms per frame",
                 "per frame: " + ", ".join(f"{name} {1e3 * value:.1f} ms" for name, value in stages.items())
                 + (f" (vision in batches of {self.vision_batch} frames)" if self.vision_batch else ""),
                 f"carried {self.carried_tokens} tokens; detailed cache {self.cache_bytes / 2**20:.1f} MiB"
                 + ("" if self.peak_memory_bytes is None else
                    f"; peak accelerator memory {self.peak_memory_bytes / 2**30:.2f} GiB")]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds, "mean_frame_seconds": self.mean_frame_seconds,
                "frames_per_second": self.frames_per_second,
                "mean_stage_seconds": self.stage_seconds()}


@dataclass(frozen=True)
class AnswerInfo:
    """What an answer could see (`EncodedVideo.answer_info` after `ask`): the ``frames`` encoded, the
    ``evicted_frames`` among them it could no longer see (given up under ``max_cache_bytes``) and their share
    ``unseen_fraction``; ``retrieved_frames``: the most frames any one layer read from the steps its retrieval
    chose, besides the steps kept whole (the prompt prefix and sinks): ``retrieve``'s worth of steps, fewer when
    fewer are held or a chosen step holds fewer frames (Qwen3-VL's last step of an odd frame count) (None: the
    whole cache);
    ``context``: what it read, ``"whole"`` (the whole detailed cache) or ``"retrieved"`` (retrieved frames: asked
    for, or under bounded positions because the whole cache does not fit in the model's range); ``read_frames``:
    with retrieval, the frames (0-based, in the order they were encoded) some layer read, None otherwise (every
    frame held)."""

    frames: int
    evicted_frames: int
    unseen_fraction: float
    retrieved_frames: int | None
    context: str = "whole"
    read_frames: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)




class progress_reporter:
    """A context manager yielding ``report(done, planned)``: a tqdm bar, a user callback, or nothing.

    The bar shows frames per second (tqdm's rate) and, after it, each stage's time per frame from ``stats``.
    """

    def __init__(self, progress: ProgressCallback | bool, total: int | None, name: str,
                 stats: EncodingStats | None = None):
        self.progress, self.total, self.name, self.stats = progress, total, name, stats
        self.bar = None

    def __enter__(self) -> ProgressCallback:
        if callable(self.progress):
            return self.progress
        if not self.progress:
            return lambda done, planned: None
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, desc=Path(self.name).name, unit="frame", leave=False)

        def report(done: int, planned: int | None) -> None:
            if self.stats is not None:
                stages = self.stats.stage_seconds()
                self.bar.set_postfix_str(" ".join(f"{name} {1e3 * seconds:.0f}ms" for name, seconds in stages.items())
                                         + " per frame", refresh=False)
            self.bar.update(done - self.bar.n)

        return report

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
