"""A video encoded through the model: its detailed cache, its prompt state, what it cost, and answering from it.

`VideoQA.encode` makes one for a video file; `VideoQA.stream` makes a `Stream` (a subclass fed frame by frame).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .core import Retrieval, StreamingPrefill
from .core.positions import choose_positions
from .core.retrieval import DEFAULT_RETRIEVAL, retrieval_rule
from .errors import HorizonError, InputError
from .generation_args import check_generation_arguments
from .models import LayoutState, VideoAdapter
from .overlap import EncodedStep, encode_batch
from .values import check_int
from .video import Frame

ProgressCallback = Callable[[int, int | None], None]  # (frames done, frames planned or None)
TIMES_KEPT = 10_000  # per-frame times EncodingStats keeps (the latest; older ones are summed)
METHOD_DEFAULT = object()  # ask(retrieve=...) not given: the VideoQA's setting


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
    cache_bytes: memory held by the detailed cache (keys and values, all layers, wherever they are stored).
    peak_cache_device_bytes: the most cache the engine held on the model's device at once (carried state, the
        detailed cache unless offloaded, what answering brought there), encoding and questions included.
    peak_memory_bytes: peak accelerator memory while encoding (``None`` on CPU).
    evicted_frames: frames whose detailed cache was given up under ``max_cache_bytes`` (answers no longer see
        them; see `statekv.core.limits`).
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
    ``unseen_fraction``; ``retrieved_frames``: frames per layer it was answered from (None: the whole cache);
    ``context``: what it read, ``"whole"`` (the whole detailed cache) or ``"retrieved"`` (retrieved frames: asked
    for, or under bounded positions because the whole cache does not fit in the model's range)."""

    frames: int
    evicted_frames: int
    unseen_fraction: float
    retrieved_frames: int | None
    context: str = "whole"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EncodedVideo:
    """A video streamed through the model: its detailed cache, its prompt state and its stats.

    Making one streams nothing: `start` streams the adapter's prompt prefix (`VideoQA.encode` and
    `VideoQA.stream` return videos already started; the streaming calls and `ask` start one that is not yet).
    Read ``state`` to lay out a step only after `start`.

    ``ask`` decodes from the detailed cache without changing it, so any number of questions can be asked.
    """

    def __init__(self, qa: Any, horizon: int | None, *, num_frames: int | None = None, fps: float | None = None,
                 name: str = "video", prefix_tokens: int | None = None, kv_cache_dtype: str | None = None,
                 disk_tier: Any = None):
        """prefix_tokens: given when resuming a stream whose prompt prefix was already streamed (then `start`
        has nothing to stream); None: `start` streams the adapter's prefix. kv_cache_dtype: how the detailed
        cache is stored (see `VideoQA.stream`). disk_tier: the file set a resumed disk-tier stream continues in
        (`statekv.core.disk.DiskTier`)."""
        self.qa = qa
        self.adapter: VideoAdapter = qa.adapter
        self.name = name
        self.horizon = horizon
        self.state: LayoutState = self.adapter.start(num_frames, fps)
        prefix = self.adapter.prefix(self.state) if prefix_tokens is None else None
        self.prefix_tokens = prefix.num_tokens if prefix is not None else prefix_tokens or 0
        policy = qa.policy.for_prefix(self.prefix_tokens)
        self.prefill = StreamingPrefill(self.adapter.model, policy, attention=qa.attention, horizon=horizon,
                                        offload=qa.offload, cuda_graph=qa.cuda_graph,
                                        kv_cache_dtype=kv_cache_dtype or getattr(qa, "kv_cache_dtype", None),
                                        offload_dir=getattr(qa, "offload_dir", None),
                                        cache_limit=getattr(qa, "cache_limit", None),
                                        protect_tokens=max(self.prefix_tokens, policy.sink_tokens), name=name,
                                        disk_tier=disk_tier, positions=choose_positions(
                                            getattr(qa, "positions", None),
                                            self.adapter.model.config.get_text_config(), horizon))
        self.stats = EncodingStats()
        self.step_frames: list[int] = []  # frames of each step streamed (0 for the prompt prefix)
        self.answer_info: AnswerInfo | None = None  # what the last answer could see
        self._evictions_counted = 0  # of prefill.evictions, the steps already in stats.evicted_frames
        self._step_started = time.perf_counter()  # when the step being encoded began (for frame_seconds)
        self._device = self.adapter.device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._prefix = prefix  # streamed by start()

    @property
    def started(self) -> bool:
        """Whether the prompt prefix is streamed (or there was none to stream)."""
        return self._prefix is None

    def start(self) -> "EncodedVideo":
        """Stream the prompt prefix, once (later calls do nothing); returns the video itself."""
        if self._prefix is not None:
            self._stream_chunk(self._prefix)
            self._prefix = None
        return self

    # -- answering --------------------------------------------------------------------------------------
    def ask(self, question: str, *, max_new_tokens: int = 64, retrieve: int | None | object = METHOD_DEFAULT,
            retrieval: str | None = None, **generate_kwargs: Any) -> str:
        """Answer ``question`` from everything encoded so far (greedy unless ``generate_kwargs`` say otherwise).

        retrieve: answer from the ``retrieve`` frames per layer that best match the question (plus the prompt
            prefix and any sinks) instead of the whole detailed cache; None: the whole cache; by default, the
            VideoQA's setting (the method's own for ``rekv``).
        retrieval: the rule that picks the frames (``attention``, ``rekv``, ``recent``; see
            `statekv.core.retrieval`); None: the VideoQA's.
        """
        tokens = self.ask_tokens(question, max_new_tokens=max_new_tokens, retrieve=retrieve, retrieval=retrieval,
                                 **generate_kwargs)
        return self.adapter.decode(tokens)

    def ask_tokens(self, question: str, *, max_new_tokens: int = 64, retrieve: int | None | object = METHOD_DEFAULT,
                   retrieval: str | None = None, **generate_kwargs: Any) -> torch.Tensor:
        """As `ask`, but return the answer's token ids ``[1, N]`` (what ``generate`` produced, undecoded)."""
        self.prefill.check_open()
        self.start()
        if self.state.frames == 0:
            raise InputError(f"{self.name}: no frame has been encoded yet")
        prompt = self._question_ids(question)
        check_int(max_new_tokens, "max_new_tokens")
        rule = retrieval
        retrieval = self.retrieval(self.qa.retrieve if retrieve is METHOD_DEFAULT else retrieve, retrieval)
        plan = self.prefill.question_plan(prompt.shape[1] + max_new_tokens, retrieval)  # bounded positions only
        if plan is not None and not plan.whole and retrieval is None:  # the whole cache does not fit the range
            retrieval = self.retrieval(plan.retrieve * self.adapter.frames_per_step, rule)
        room = None if plan is not None else self.horizon - self.prefill.seen_tokens
        if room is not None and prompt.shape[1] + max_new_tokens > room:
            raise HorizonError(
                f"the question ({prompt.shape[1]} tokens) and answer ({max_new_tokens}) do not fit in the "
                f"{room} tokens left before the RoPE horizon; create the VideoQA with a larger reserve_tokens"
            )
        check_generation_arguments(generate_kwargs, getattr(self.adapter.model, "generation_config", None))
        try:
            answer = self.adapter.generate(self.prefill, self.state, prompt, max_new_tokens=max_new_tokens,
                                           retrieve=retrieval, **generate_kwargs)
        except (ValueError, TypeError) as error:
            if not generate_kwargs or isinstance(error, InputError):
                raise
            # transformers refuses a combination the checks above do not know (e.g. a flag needing another)
            raise InputError(f"ask(): generate refused {', '.join(generate_kwargs)}: "
                             f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}"
                             ) from None
        self.stats.peak_cache_device_bytes = self.prefill.stats.peak_device_bytes
        evicted = self.stats.evicted_frames
        self.answer_info = AnswerInfo(frames=self.frames, evicted_frames=evicted,
                                      unseen_fraction=evicted / self.frames if self.frames else 0.0,
                                      retrieved_frames=None if retrieval is None else
                                      retrieval.steps * self.adapter.frames_per_step,
                                      context="whole" if retrieval is None else "retrieved")
        return answer

    def retrieval(self, frames: int | None, rule: str | None = None) -> Retrieval | None:
        """How a question retrieving ``frames`` frames per layer by ``rule`` (None: the VideoQA's) is answered
        (None: from the whole cache).

        The prompt prefix and the policy's sinks are always kept; frames become steps (two per step for
        Qwen3-VL)."""
        if frames is None:
            return None
        check_int(frames, "retrieve (frames per layer)")
        chosen = retrieval_rule(getattr(self.qa, "retrieval", DEFAULT_RETRIEVAL) if rule is None else rule)
        keep = max(self.prefix_tokens, self.prefill.policy.sink_tokens)
        return Retrieval(math.ceil(frames / self.adapter.frames_per_step), keep_tokens=keep, rule=chosen)

    @property
    def tokens(self) -> int:
        return self.prefill.seen_tokens

    @property
    def frames(self) -> int:
        return self.state.frames

    def close(self) -> None:
        """Release the caches and give the model back its own RoPE."""
        self.prefill.close()

    def __enter__(self) -> "EncodedVideo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, frames={self.frames}, tokens={self.tokens}, "
                f"carried={self.stats.carried_tokens})")

    # -- streaming --------------------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, frames: Sequence[Frame]) -> None:
        """Stream one step's frames (at most ``frames_per_step``) on this thread."""
        self.append_steps([frames], vision_batch=len(frames))

    @torch.no_grad()
    def append_steps(self, groups: Sequence[Sequence[Frame]], *, vision_batch: int) -> None:
        """Stream several steps on this thread, their frames vision-encoded in one call (``vision_batch``: the
        batch size asked for, for the stats). A failure leaves the steps before it streamed (``stats.chunks``
        tells how many)."""
        self.start()
        started = time.perf_counter()
        steps, state = [], self.state
        for frames in groups:
            steps.append(self.adapter.prepare_frames(frames, state))
            state = state.updated(steps[-1].state_update)
        prepared = time.perf_counter()
        shares = [(prepared - started) * len(step.frames) / sum(len(s.frames) for s in steps) for step in steps]
        self._step_started = started
        for encoded in encode_batch(self.adapter, steps, shares):
            self._stream_encoded(encoded, vision_batch=vision_batch)

    @torch.no_grad()
    def stream_steps(self, steps: Iterable[EncodedStep], *, vision_batch: int,
                     on_step: Callable[[], None] | None = None) -> None:
        """Stream steps already vision-encoded elsewhere (`statekv.overlap.overlapped_steps`), in order; each
        frame's time runs from when the previous step finished (the first: from this call). ``on_step`` is
        called after each step (for progress)."""
        self.start()
        self._step_started = time.perf_counter()
        for encoded in steps:
            self._stream_encoded(encoded, vision_batch=vision_batch)
            if on_step is not None:
                on_step()

    @torch.no_grad()
    def stream_chunk(self, chunk) -> None:
        """Stream one chunk already laid out by the adapter (`VideoAdapter.features_chunk` or ``prefix``; lay
        it out from ``state`` after `start`)."""
        self.start()
        self._stream_chunk(chunk)

    # the names these had before they were public
    _append = append
    _append_steps = append_steps

    def _stream_encoded(self, encoded: EncodedStep, *, vision_batch: int) -> None:
        """Lay out one vision-encoded step and stream it through the language model, timing each stage (the
        language model's time includes the layout: token ids, embeddings, positions)."""
        started = time.perf_counter()
        chunk = self.adapter.features_chunk(encoded.step, encoded.features, self.state)
        self._stream_chunk(chunk)
        self._record_step_times(encoded, chunk, started, time.perf_counter(), vision_batch=vision_batch)

    def _record_step_times(self, encoded: EncodedStep, chunk, started: float, finished: float, *,
                           vision_batch: int) -> None:
        """Each stage's time per frame of a step streamed from ``started`` (its layout) to ``finished``."""
        stats = self.stats
        per_frame = 1 / chunk.frames
        stats.frame_seconds.extend([(finished - self._step_started) * per_frame] * chunk.frames)
        stats.decode_seconds.extend([encoded.decode_seconds * per_frame] * chunk.frames)
        stats.vision_seconds.extend([encoded.vision_seconds * per_frame] * chunk.frames)
        stats.language_seconds.extend([(finished - started) * per_frame] * chunk.frames)
        stats.trim()
        stats.vision_batch = vision_batch
        self._step_started = finished

    @torch.no_grad()
    def _stream_chunk(self, chunk) -> None:
        self.prefill.step(chunk.inputs_embeds, chunk.position_ids, durable_record=self.durable_record(chunk),
                          **chunk.forward_kwargs)
        self._chunk_streamed(chunk)

    def durable_record(self, chunk) -> dict[str, Any] | None:
        """What the disk tier journals with ``chunk``'s step (None: not on the disk tier)."""
        return None if self.prefill.disk is None else self._durable_record(self.state.after(chunk), chunk)

    def _chunk_streamed(self, chunk) -> None:
        """Bookkeeping after ``chunk`` went through the language model (here or in a batch of streams)."""
        self.state = self.state.after(chunk)
        self.step_frames.append(chunk.frames)
        stats = self.stats
        evicted = self.prefill.evictions[self._evictions_counted:]
        if evicted:  # only the steps evicted since: a long capped stream never walks its history per step
            stats.evicted_frames += sum(self.step_frames[s] for s in evicted)
            self._evictions_counted += len(evicted)
        stats.chunks += 1
        stats.tokens = self.prefill.seen_tokens
        stats.frames += chunk.frames
        engine = self.prefill.stats
        stats.carried_tokens = engine.max_carried_tokens
        stats.cache_bytes = engine.detailed_bytes
        stats.peak_cache_device_bytes = engine.peak_device_bytes
        if self._device.type == "cuda":
            stats.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self._device))

    def _durable_record(self, after: LayoutState, chunk) -> dict[str, Any]:
        """What the disk tier journals with a step so the stream can resume after it: the layout state once the
        step is streamed and its frame count."""
        return {"state": after.to_dict(), "frames": chunk.frames}

    def _question_ids(self, question: str) -> torch.Tensor:
        if not isinstance(question, str) or not question.strip():
            raise InputError("the question is empty")
        return self.adapter.question_ids(question, self.state)


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
