"""VideoQA: load a video VLM once, encode a video once, answer any number of questions about it.

    qa = statekv.VideoQA.from_pretrained("OpenGVLab/InternVL3-1B-hf", method="statekv", budget=4096)
    video = qa.encode("talk.mp4", max_fps=1, max_frames=512)     # frames stream through the model one by one
    video.ask("What is written on the whiteboard?")
    video.ask("Who speaks first?")                                # same encoding, unchanged by the first question
    video.stats                                                   # frames, tokens, carried size, seconds, memory

The model family is found from the checkpoint's ``model_type`` (see `statekv.models`). Every sampled frame is
decoded, preprocessed, vision-encoded and streamed through the language model as it is read, so memory does
not grow with the video's length beyond the detailed cache that answers are decoded from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .core import (
    CarryPolicy,
    ConfigurationError,
    FullAttention,
    HorizonError,
    InputError,
    Recency,
    StateKV,
    StreamingPrefill,
)
from .models import LayoutState, VideoAdapter, load_adapter
from .overlap import EncodedStep, check_vision_batch, default_vision_batch, encode_batch, overlapped_steps
from .video import Frame, FrameDecodeError, open_video

METHODS = ("statekv", "full", "recency")
DEFAULT_RESERVE_TOKENS = 1024  # room for the question and the answer after the video (sets the RoPE horizon)

ProgressCallback = Callable[[int, int | None], None]  # (frames done, frames planned or None)


def make_policy(method: str, *, budget: int = 4096, frames: int = 16, frames_per_chunk: int = 1) -> CarryPolicy:
    """The carry policy of ``method``: ``statekv`` (top-``budget`` tokens), ``full`` or ``recency`` (``frames``).

    Recency windows are given in frames, as in the paper (R = 16), and converted to streaming steps for
    families that put several frames in one step.
    """
    if method == "statekv":
        return StateKV(budget=budget)
    if method == "full":
        return FullAttention()
    if method == "recency":
        if isinstance(frames, bool) or not isinstance(frames, int) or frames <= 0:
            raise ConfigurationError(f"the recency window must be a positive number of frames, got {frames!r}")
        return Recency(frames=math.ceil(frames / frames_per_chunk))
    raise ConfigurationError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


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
    cache_bytes: memory held by the detailed cache (keys and values, all layers).
    peak_memory_bytes: peak accelerator memory while encoding (``None`` on CPU).
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
    peak_memory_bytes: int | None = None

    @property
    def seconds(self) -> float:
        return float(sum(self.frame_seconds))

    @property
    def mean_frame_seconds(self) -> float:
        return self.seconds / len(self.frame_seconds) if self.frame_seconds else 0.0

    @property
    def frames_per_second(self) -> float:
        return len(self.frame_seconds) / self.seconds if self.seconds > 0 else 0.0

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


class EncodedVideo:
    """A video streamed through the model: its detailed cache, its prompt state and its stats.

    ``ask`` decodes from the detailed cache without changing it, so any number of questions can be asked.
    """

    def __init__(self, qa: "VideoQA", horizon: int, *, num_frames: int | None = None, fps: float | None = None,
                 name: str = "video", stream_prefix: bool = True):
        self.qa = qa
        self.adapter: VideoAdapter = qa.adapter
        self.name = name
        self.horizon = horizon
        self.prefill = StreamingPrefill(self.adapter.model, qa.policy, attention=qa.attention, horizon=horizon,
                                        offload=qa.offload, cuda_graph=qa.cuda_graph)
        self.state: LayoutState = self.adapter.start(num_frames, fps)
        self.stats = EncodingStats()
        self._step_started = time.perf_counter()  # when the step being encoded began (for frame_seconds)
        self._device = self.adapter.device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        prefix = self.adapter.prefix(self.state) if stream_prefix else None
        if prefix is not None:
            self._stream_chunk(prefix)

    # -- answering --------------------------------------------------------------------------------------
    def ask(self, question: str, *, max_new_tokens: int = 64, **generate_kwargs: Any) -> str:
        """Answer ``question`` from everything encoded so far (greedy unless ``generate_kwargs`` say otherwise)."""
        return self.adapter.decode(self.ask_tokens(question, max_new_tokens=max_new_tokens, **generate_kwargs))

    def ask_tokens(self, question: str, *, max_new_tokens: int = 64, **generate_kwargs: Any) -> torch.Tensor:
        """As `ask`, but return the answer's token ids ``[1, N]`` (what ``generate`` produced, undecoded)."""
        if self.state.frames == 0:
            raise InputError(f"{self.name}: no frame has been encoded yet")
        prompt = self._question_ids(question)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        room = self.horizon - self.prefill.seen_tokens
        if prompt.shape[1] + max_new_tokens > room:
            raise HorizonError(
                f"the question ({prompt.shape[1]} tokens) and answer ({max_new_tokens}) do not fit in the "
                f"{room} tokens left before the RoPE horizon; create the VideoQA with a larger reserve_tokens"
            )
        return self.adapter.generate(self.prefill, self.state, prompt, max_new_tokens=max_new_tokens,
                                     **generate_kwargs)

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
    def _append(self, frames: Sequence[Frame]) -> None:
        """Stream one step's frames (at most ``frames_per_chunk``) on this thread."""
        self._append_steps([frames], vision_batch=len(frames))

    @torch.no_grad()
    def _append_steps(self, groups: Sequence[Sequence[Frame]], *, vision_batch: int) -> None:
        """Stream several steps on this thread, their frames vision-encoded in one call (``vision_batch``: the
        batch size asked for, for the stats). A failure leaves the steps before it streamed (``stats.chunks``
        tells how many)."""
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

    def _stream_encoded(self, encoded: EncodedStep, *, vision_batch: int) -> None:
        """Lay out one vision-encoded step and stream it through the language model, timing each stage (the
        language model's time includes the layout: token ids, embeddings, positions)."""
        started = time.perf_counter()
        chunk = self.adapter.features_chunk(encoded.step, encoded.features, self.state)
        self._stream_chunk(chunk)
        finished = time.perf_counter()
        stats = self.stats
        per_frame = 1 / chunk.frames
        stats.frame_seconds.extend([(finished - self._step_started) * per_frame] * chunk.frames)
        stats.decode_seconds.extend([encoded.decode_seconds * per_frame] * chunk.frames)
        stats.vision_seconds.extend([encoded.vision_seconds * per_frame] * chunk.frames)
        stats.language_seconds.extend([(finished - started) * per_frame] * chunk.frames)
        stats.vision_batch = vision_batch
        self._step_started = finished

    @torch.no_grad()
    def _stream_chunk(self, chunk) -> None:
        self.prefill.step(chunk.inputs_embeds, chunk.position_ids, **chunk.forward_kwargs)
        self.state = self.state.after(chunk)
        stats = self.stats
        stats.chunks += 1
        stats.tokens = self.prefill.seen_tokens
        stats.frames += chunk.frames
        stats.carried_tokens = max(layer.carried_length for layer in self.prefill.cache.layers)
        stats.cache_bytes = _cache_bytes(self.prefill)
        if self._device.type == "cuda":
            stats.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self._device))

    def _question_ids(self, question: str) -> torch.Tensor:
        if not isinstance(question, str) or not question.strip():
            raise InputError("the question is empty")
        return self.adapter.question_ids(question, self.state)


class VideoQA:
    """A video VLM with a carry policy, ready to encode videos and answer questions about them.

    Args:
        adapter: the model family adapter (see `statekv.models`); `from_pretrained` picks it.
        policy: the carry rule (`make_policy` builds the paper's three).
        attention: scoring backend: ``auto`` (Triton on CUDA, else chunked), ``eager``, ``chunked``, ``triton``.
        reserve_tokens: tokens kept after the video for the question and the answer. With them the planned
            length (the RoPE horizon) is known before the first frame, as dynamic RoPE scaling requires.
        offload: keep each video's detailed cache in CPU memory while it streams (accelerator memory then stays
            constant as the video grows); it is copied back to the model's device to answer.
        cuda_graph: on CUDA, replay each steady streaming step from a CUDA graph (see `StreamingPrefill`).
        vision_batch: frames per vision-tower call when encoding a video (``None``: 16 on CUDA, 4 on CPU; see
            `statekv.overlap`). Batched vision gives the per-frame features up to float rounding.
    """

    def __init__(self, adapter: VideoAdapter, policy: CarryPolicy, *, attention: str = "auto",
                 reserve_tokens: int = DEFAULT_RESERVE_TOKENS, method: str | None = None, offload: bool = False,
                 cuda_graph: bool = True, vision_batch: int | None = None):
        if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or reserve_tokens <= 0:
            raise ConfigurationError(f"reserve_tokens must be a positive integer, got {reserve_tokens!r}")
        self.vision_batch = (default_vision_batch(adapter.device) if vision_batch is None
                             else check_vision_batch(vision_batch))
        self.adapter = adapter
        self.policy = policy
        self.attention = attention
        self.reserve_tokens = reserve_tokens
        self.method = method or type(policy).__name__
        self.offload = offload
        self.cuda_graph = cuda_graph

    @classmethod
    def from_pretrained(cls, model: str | Path, *, method: str = "statekv", budget: int = 4096, frames: int = 16,
                        layout: str | None = None, attention: str = "auto", dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, trust_remote_code: bool = False,
                        reserve_tokens: int = DEFAULT_RESERVE_TOKENS, offload: bool = False,
                        cuda_graph: bool = True, vision_batch: int | None = None,
                        **model_kwargs: Any) -> "VideoQA":
        """Load ``model`` (a checkpoint folder or hub id) and set up ``method``.

        method: ``statekv`` (carry the top-``budget`` tokens per layer and KV head), ``full`` (exact, O(N²)) or
            ``recency`` (carry the last ``frames`` frames, ReKV). layout: the family's prompt layout (default:
            the paper's). dtype: e.g. ``"bfloat16"`` (default: the checkpoint's). device: default CUDA when
            available, else CPU. vision_batch: frames per vision-tower call (default: 16 on CUDA, 4 on CPU).
        """
        if method not in METHODS:
            raise ConfigurationError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        make_policy(method, budget=budget, frames=frames)  # validate before the (slow) load
        if vision_batch is not None:
            check_vision_batch(vision_batch)
        device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        adapter = load_adapter(model, layout=layout, dtype=resolve_dtype(dtype), device=device,
                               trust_remote_code=trust_remote_code, **model_kwargs)
        policy = make_policy(method, budget=budget, frames=frames, frames_per_chunk=adapter.frames_per_chunk)
        return cls(adapter, policy, attention=attention, reserve_tokens=reserve_tokens, method=method,
                   offload=offload, cuda_graph=cuda_graph, vision_batch=vision_batch)

    def encode(self, source: Any, *, max_fps: float = 1.0, max_frames: int = 512,
               progress: ProgressCallback | bool = False, vision_batch: int | None = None) -> EncodedVideo:
        """Sample ``source`` by the paper's rule (at most ``max_fps`` frames per second, at most ``max_frames``)
        and stream it through the model one chunk at a time.

        Frames are decoded on a background thread and vision-encoded in batches of ``vision_batch`` frames
        (default: this VideoQA's) on another, ahead of the language model (see `statekv.overlap`).

        source: a video file, a folder of images, a list of PIL images or RGB arrays, an array ``[N, H, W, 3]``.
        progress: True for a progress bar (frames per second and each stage's time per frame), or a callback
            ``(frames done, frames planned)``.

        Raises `statekv.video.FrameDecodeError` when a frame in the middle cannot be decoded; its ``encoded``
        holds every frame before it, encoded, and can still be asked.
        """
        _check_sampling(max_fps, max_frames)
        vision_batch = self.vision_batch if vision_batch is None else check_vision_batch(vision_batch)
        video = open_video(source)
        num_frames = len(video.sample_indices(max_fps=max_fps, max_frames=max_frames))
        sampling_rate = num_frames / video.duration if video.duration > 0 else max_fps  # after the frame cap
        horizon = self.horizon_for(num_frames, (video.height, video.width))
        encoded = EncodedVideo(self, horizon, num_frames=num_frames, fps=min(max_fps, sampling_rate), name=video.name)
        frames = video.sample(max_fps=max_fps, max_frames=max_frames)
        try:
            with _progress(progress, num_frames, video.name, encoded.stats) as report, \
                    overlapped_steps(self.adapter, frames, encoded.state, vision_batch=vision_batch) as steps:
                encoded._step_started = time.perf_counter()
                for step in steps:
                    encoded._stream_encoded(step, vision_batch=vision_batch)
                    report(encoded.frames, num_frames)
        except FrameDecodeError as error:
            error.encoded = encoded
            error.args = (f"{error}; the {encoded.frames} sampled frames before it are encoded "
                          "(the error's .encoded answers from them)",)
            raise
        return encoded

    def answer(self, source: Any, question: str | Sequence[str], *, max_fps: float = 1.0, max_frames: int = 512,
               **ask_kwargs: Any) -> str | list[str]:
        """Encode ``source`` and answer ``question`` (or each of a list of questions) from that one encoding."""
        questions = [question] if isinstance(question, str) else list(question)
        if not questions:
            raise InputError("no question given")
        for text in questions:
            if not isinstance(text, str) or not text.strip():
                raise InputError("the question is empty")
        with self.encode(source, max_fps=max_fps, max_frames=max_frames) as video:
            answers = [video.ask(text, **ask_kwargs) for text in questions]
        return answers[0] if isinstance(question, str) else answers

    def stream(self, horizon_frames: int, *, max_fps: float | None = None, name: str = "stream",
               vision_batch: int = 1) -> "Stream":
        """A live stream of at most ``horizon_frames`` frames: `Stream.push` frames as they arrive, ask any time.

        max_fps: keep at most this many pushed frames per second of stream time (``None``: keep every frame).
        vision_batch: frames vision-encoded together (default 1: each frame is encoded as it is pushed; with
            more, a frame waits for at most one batch, and `Stream.ask` first encodes every complete step).
        """
        from .stream import Stream

        return Stream(self, horizon_frames, max_fps=max_fps, name=name, vision_batch=vision_batch)

    def horizon_for(self, num_frames: int, frame_size: tuple[int, int] | None = None) -> int:
        """The planned length in tokens for ``num_frames`` sampled frames (of ``frame_size`` (height, width),
        if known) plus the reserve."""
        return self.adapter.max_video_tokens(num_frames, frame_size=frame_size) + self.reserve_tokens

    def __repr__(self) -> str:
        return (f"VideoQA({self.adapter.family}, layout={self.adapter.layout!r}, policy={self.policy}, "
                f"attention={self.attention!r})")


def _check_sampling(max_fps: float, max_frames: int) -> None:
    if isinstance(max_fps, bool) or not isinstance(max_fps, (int, float)) or not max_fps > 0:
        raise InputError(f"max_fps must be > 0, got {max_fps!r}")
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames <= 0:
        raise InputError(f"max_frames must be a positive integer, got {max_frames!r}")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/``"auto"`` (the checkpoint's dtype), a torch dtype, or its name (``"bfloat16"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ConfigurationError(f"unknown dtype {dtype!r}; use e.g. bfloat16, float16 or float32")
    return resolved


def _cache_bytes(prefill: StreamingPrefill) -> int:
    total = 0
    for layer in prefill.cache.layers:
        for tensor in (layer.detailed.keys, layer.detailed.values):
            if tensor is not None:
                total += tensor.element_size() * tensor.numel()
    return total


class _progress:
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
