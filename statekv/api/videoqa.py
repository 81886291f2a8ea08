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

import difflib
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from ..builtin import resolve_model
from ..core import CarryPolicy
from ..settings.engine import EngineSettings, check_disk_tier_room
from .encoded import EncodedVideo
from .stats import ProgressCallback, progress_reporter
from ..errors import CacheLimitError, ConfigurationError, FrameDecodeError, InputError, StateKVError
from ..settings.methods import DEFAULT_RETRIEVAL, MethodSettings, method, method_names, retrieval_rule
from ..models import VideoAdapter, load_adapter
from ..steps.jobs import StepScheduler
from ..settings.options import DEFAULT_RESERVE_TOKENS, ModelOptions
from ..steps.overlap import check_vision_batch, default_vision_batch, overlapped_steps
from .asking import ask_together
from .pushing import catch_up_streams, push_together
from .recent import RecentFrames
from .stream import Stream, check_making
from .watch import evaluate_due
from ..settings.values import check_bool, check_int, check_number, check_question, format_bytes, shown, torch_dtype
from ..video import open_video

OPTION_NAMES = tuple(field.name for field in fields(ModelOptions))  # its settings: not its ClassVars (SETTINGS...)


def make_policy(method_name: str, *, budget: int = MethodSettings.budget, frames: int = MethodSettings.frames,
                sinks: int = MethodSettings.sinks, frames_per_step: int = 1) -> CarryPolicy:
    """The carry policy of a registered method (`statekv.settings.methods`), sized in tokens (``budget``) or frames
    (``frames``: recency windows are given in frames, as in the paper, and become ``ceil(frames /
    frames_per_step)`` streaming steps). Defaults are `MethodSettings`'."""
    policy = method(method_name).policy(MethodSettings(budget=budget, frames=frames, sinks=sinks), frames_per_step)
    if not isinstance(policy, CarryPolicy):  # a registered method's own function (a class not made, a name)
        raise ConfigurationError(f"method {method_name!r}: its policy function returned {type(policy).__name__}, "
                                 "not a CarryPolicy (e.g. StateKV(budget=settings.budget))")
    return policy


class VideoQA:
    """A video VLM with a carry policy, ready to encode videos and answer questions about them.

    Args:
        adapter: the model family adapter (see `statekv.models`); `from_pretrained` picks it.
        policy: the carry rule (`make_policy` builds the registered methods' own).
        engine: the engine's settings every video and stream of this VideoQA streams with
            (`statekv.settings.engine.EngineSettings`: the attention backend, ``offload`` (CPU memory, or
            ``"disk"``: an append-only, memory-mapped file set per video or stream under ``offload_dir``, which
            `Stream.load` resumes after a crash), ``max_cache_bytes`` and ``cache_limit`` (a cap on each detailed
            cache and what happens at it: ``refuse``, ``evict-oldest``, ``evict-least-attended``),
            ``kv_cache_dtype`` (``"int8"``/``"int4"``: stored quantized), ``cuda_graph``, ``compile_step``,
            ``positions``: ``"stream"`` or ``"bounded"`` RoPE positions, None: ``stream`` where a video's or stream's
            horizon fits the model's range, else ``bounded``, so a stream without a horizon is bounded; see
            `statekv.core.positions.placing`); ``bounded_layout`` (where bounded positions put the carried state:
            None or ``"handover"``, a stream's default, own-then-cache until a successor in cache order replays
            the stream and takes over past the range, `statekv.api.handover`;
            ``"own-then-cache"``, ``"cache"``, ``"grouped"``); ``question_span`` (past the range, the positions a
            question's retrieved frames are spread over by their time; 0: packed before the prompt);
            ``engine_changes`` change settings of it by name (``VideoQA(adapter, policy, offload=True)``).
        reserve_tokens: tokens kept after the video for the question and the answer. With them the planned
            length (the RoPE horizon) is known before the first frame, as dynamic RoPE scaling requires.
        method: the method's registered name (for reports; default: the policy's class name).
        vision_batch: frames per vision-tower call when encoding a video (``None``: 16 on CUDA, 4 on CPU; see
            `statekv.steps.overlap`). Batched vision gives the per-frame features up to float rounding.
        retrieve: frames per layer each question is answered from by default (None: the whole detailed cache).
        retrieval: the rule that picks them by default (``attention``, ``rekv``, ``recent``; see
            `statekv.core.answering.retrieval`).
        steer: whether a stream's watches steer what it carries by default (`Stream.watch`).
    """

    def __init__(self, adapter: VideoAdapter, policy: CarryPolicy, engine: EngineSettings | None = None, *,
                 reserve_tokens: int = DEFAULT_RESERVE_TOKENS, method: str | None = None,
                 vision_batch: int | None = None, retrieve: int | None = None, retrieval: str = DEFAULT_RETRIEVAL,
                 steer: bool = True, **engine_changes: Any):
        if not isinstance(adapter, VideoAdapter):  # a checkpoint's name goes to `from_pretrained`
            raise ConfigurationError(f"VideoQA takes a model family adapter (statekv.models.load_adapter), got "
                                     f"{type(adapter).__name__}; VideoQA.from_pretrained(name) loads a checkpoint")
        if not isinstance(policy, CarryPolicy):
            raise ConfigurationError(f"policy must be a CarryPolicy (FullAttention, Recency, StateKV...; "
                                     f"make_policy(name) builds a method's), got {type(policy).__name__}")
        self.adapter = adapter
        self.policy = policy
        self.engine = EngineSettings.of(engine, **engine_changes)
        if self.engine.offload == "disk":  # where its streams' file sets go, their successors' inside theirs
            check_disk_tier_room(self.engine.offload_dir, "offload_dir")
        self.reserve_tokens = check_int(reserve_tokens, "reserve_tokens")
        self.method = method or type(policy).__name__
        self.vision_batch = (default_vision_batch(adapter.device) if vision_batch is None
                             else check_vision_batch(vision_batch))
        self.retrieve = None if retrieve is None else check_int(retrieve, "retrieve (frames per layer)")
        self.retrieval = retrieval_rule(retrieval).name
        self.steer = check_bool(steer, "steer")
        self.options: ModelOptions | None = None  # set by from_options
        # batches the steps of this VideoQA's streams pushed at once, then evaluates their watches due
        self.step_scheduler = StepScheduler(follow_up=evaluate_due)
        self.question_batch_sizes: Counter = Counter()  # questions answered by `ask_many`, by the batch each took

    @classmethod
    def from_pretrained(cls, model: str | Path, **options: Any) -> "VideoQA":
        """Load ``model`` (a checkpoint folder or hub id) under a method; ``options`` are `ModelOptions`
        fields (method, budget, frames, sinks, retrieve, retrieval, layout, attention, dtype, device, offload,
        kv_cache_dtype, offload_dir, max_cache_bytes, cache_limit, reserve_tokens, trust_remote_code, cuda_graph,
        compile_step, positions, bounded_layout, question_span, vision_batch); anything else goes to the model's
        own ``from_pretrained``.

        method: ``statekv`` (carry the top-``budget`` tokens per layer and KV head), ``full`` (exact, O(N²)),
            ``recency`` (carry the last ``frames`` frames), ``rekv`` (sinks + last frames, questions answered
            from retrieved frames), ``keynorm``, or any method registered in `statekv.settings.methods`. A setting
            the method never reads (``window`` under ``statekv``, ``retrieve`` under ``simplestream``) is refused in
            one line (`statekv.settings.methods.refuse_unread`).
        """
        if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
            raise ConfigurationError(f"model must be a checkpoint folder or hub id, got {shown(model)}")
        known = set(OPTION_NAMES) - {"model"}
        model_kwargs = {name: value for name, value in options.items() if name not in known}
        settings = {name: value for name, value in options.items() if name in known}
        return cls.from_options(ModelOptions.given(model=str(model), **settings), **model_kwargs)

    @classmethod
    def from_options(cls, options: ModelOptions, **model_kwargs: Any) -> "VideoQA":
        """Load the model ``options`` name and set up its method (every option is checked before loading)."""
        if options.model is None:
            raise ConfigurationError("no model given: pass a checkpoint folder or hub id")
        device = options.device if options.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        checkpoint, layout = resolve_model(options.model, options.layout)
        try:
            adapter = load_adapter(checkpoint, layout=layout, dtype=resolve_dtype(options.dtype),
                                   device=device, trust_remote_code=options.trust_remote_code, **model_kwargs)
        except TypeError as error:  # a misspelt option reaches the model's from_pretrained, which refuses it
            refused = [name for name in model_kwargs if f"'{name}'" in str(error)]
            if not refused or "unexpected keyword argument" not in str(error):
                raise
            close = difflib.get_close_matches(refused[0], OPTION_NAMES, n=1, cutoff=0.8)
            raise ConfigurationError(f"unknown option {refused[0]!r}: "
                                     + (f"did you mean {close[0]}? " if close else "")
                                     + f"not a statekv option ({', '.join(OPTION_NAMES)}), and the model's "
                                     "from_pretrained does not take it") from None
        return cls.with_adapter(adapter, options)

    @classmethod
    def with_adapter(cls, adapter: VideoAdapter, options: ModelOptions) -> "VideoQA":
        """A VideoQA over an adapter already loaded (several methods can share one model)."""
        spec = options.spec
        qa = cls(adapter, spec.policy(options.settings, adapter.frames_per_step), options.engine,
                 reserve_tokens=options.reserve_tokens, method=options.method, vision_batch=options.vision_batch,
                 retrieve=options.retrieve_frames, retrieval=options.retrieval_rule, steer=options.steer)
        qa.options = options
        return qa

    def with_options(self, **changes: Any) -> "VideoQA":
        """This VideoQA's model under other settings (another method, budget...), without loading it again."""
        base = self.options or ModelOptions(method=self.method if self.method in method_names() else "statekv")
        unknown = sorted(set(changes) - set(OPTION_NAMES) - {"model"})
        if unknown:
            known = ", ".join(name for name in OPTION_NAMES if name != "model")
            raise ConfigurationError(f"unknown option {unknown[0]!r} for with_options; known: {known}")
        return VideoQA.with_adapter(self.adapter, replace(base, **changes))

    @property
    def recent_window(self) -> int | None:
        """N when the method answers from its last N frames alone (``simplestream``: `statekv.api.recent`), else
        None."""
        spec = method(self.method) if self.method in method_names() else None
        if spec is None or not spec.recent_window:
            return None
        return (self.options.settings if self.options is not None else MethodSettings()).window

    def encode(self, source: Any, *, max_fps: float = 1.0, max_frames: int = 512,
               progress: ProgressCallback | bool = False, vision_batch: int | None = None,
               reserve_tokens: int | None = None, protocol: bool = False) -> EncodedVideo | RecentFrames:
        """Sample ``source`` (at most ``max_fps`` frames per second, at most ``max_frames``, every frame at most
        once, the last one included at or above the source's rate) and stream it through the model one chunk at
        a time. protocol: True samples by the benchmarks' published rule instead (which may repeat a frame; what
        ``statekv eval`` uses, see docs/evaluation.md).

        Frames are decoded on a background thread and vision-encoded in batches of ``vision_batch`` frames
        (default: this VideoQA's) on another, ahead of the language model (see `statekv.steps.overlap`).

        source: a video file, a folder of images, a list of PIL images or RGB arrays, an array ``[N, H, W, 3]``.
        progress: True for a progress bar (frames per second and each stage's time per frame), or a callback
            ``(frames done, frames planned)`` (an error it raises ends the encoding, which is closed).
            reserve_tokens: room for questions and answers after this video (default: the VideoQA's).

        Raises `statekv.video.FrameDecodeError` when a frame in the middle cannot be decoded; its ``encoded``
        holds every frame before it, encoded, and can still be asked. Under ``max_cache_bytes`` with
        ``cache_limit="refuse"``, encoding stops at the first frame that would take the detailed cache past the
        cap: a `statekv.errors.CacheLimitError` whose ``encoded`` answers from every frame before it (its
        ``stats.frames`` says how many; None when not even the prompt fits).

        Under ``simplestream`` the sampled frames are read and only the last N kept: a `RecentFrames`.
        """
        _check_sampling(max_fps, max_frames)
        vision_batch = self.vision_batch if vision_batch is None else check_vision_batch(vision_batch)
        video = open_video(source)
        check_bool(protocol, "protocol")
        if self.recent_window is not None:
            recent = RecentFrames(self, self.recent_window, name=video.name, reserve_tokens=reserve_tokens)
            recent.push_many(video.sample(max_fps=max_fps, max_frames=max_frames, protocol=protocol))
            return recent
        num_frames = len(video.sample_indices(max_fps=max_fps, max_frames=max_frames, protocol=protocol))
        sampling_rate = num_frames / video.duration if video.duration > 0 else max_fps  # after the frame cap
        horizon = self.horizon_for(num_frames, (video.height, video.width), reserve_tokens)
        encoded = EncodedVideo(self, horizon, num_frames=num_frames, fps=min(max_fps, sampling_rate),
                               name=video.name, reserve_tokens=reserve_tokens)
        frames = video.sample(max_fps=max_fps, max_frames=max_frames, protocol=protocol)
        try:
            encoded.start()
            with progress_reporter(progress, num_frames, video.name, encoded.stats) as report, \
                    overlapped_steps(self.adapter, frames, encoded.state, vision_batch=vision_batch) as steps:
                encoded.stream_steps(steps, vision_batch=vision_batch,
                                     on_step=lambda: report(encoded.frames, num_frames))
        except FrameDecodeError as error:
            error.encoded = encoded
            error.args = (f"{error}; the {encoded.frames} sampled frames before it are encoded "
                          "(the error's .encoded answers from them)",)
            raise
        except CacheLimitError as error:
            error.args = (_cache_full(encoded, num_frames, error),)
            if encoded.started:
                error.encoded = encoded
            else:  # not even the prompt fit: nothing to ask, nothing left holding its files
                encoded.close()
            raise
        except BaseException:  # a stop, a progress callback's error...: no one gets the encoding, so it is let go
            encoded.close()
            raise
        return encoded

    def answer(self, source: Any, question: str | Sequence[str], *, max_fps: float = 1.0, max_frames: int = 512,
               **ask_kwargs: Any) -> str | list[str]:
        """Encode ``source`` and answer ``question`` (or each of a list of questions) from that one encoding."""
        one = isinstance(question, (str, bytes, bytearray)) or not isinstance(question, Iterable)
        questions = [check_question(question)] if one else list(question)
        if not questions:
            raise InputError("no question given")
        for text in questions:
            check_question(text)
        with self.encode(source, max_fps=max_fps, max_frames=max_frames) as video:
            answers = [video.ask(text, **ask_kwargs) for text in questions]
        return answers[0] if isinstance(question, str) else answers

    def stream(self, horizon_frames: int | None = None, *, max_fps: float | None = None, name: str = "stream",
               vision_batch: int = 1, reserve_tokens: int | None = None,
               kv_cache_dtype: str | None = None, stream_id: str | None = None,
               owner: str | None = None) -> Stream | RecentFrames:
        """A live stream: `Stream.push` frames as they arrive, ask any time. Under ``simplestream``: a
        `RecentFrames`, which keeps the last N frames and no cache.

        horizon_frames: the most frames it will take (its positions are then the stream's where they fit the
            model's range); None: no horizon, the stream never ends (bounded positions: every position kept
            inside the model's trained range, see `statekv.core.positions.placing`).

        max_fps: keep at most this many pushed frames per second of stream time (``None``: keep every frame).
        vision_batch: frames vision-encoded together (default 1: each frame is encoded as it is pushed; with
            more, a frame waits for at most one batch, and `Stream.ask` first encodes every complete step).
        reserve_tokens: room for questions and answers after the stream (default: the VideoQA's).
        kv_cache_dtype: how the stream stores its detailed cache, ``"int8"``, ``"int4"`` or ``"auto"`` (the
            model's dtype) (default: the VideoQA's).
        stream_id, owner: who the stream is (default: a new random id, no owner), recorded in its saved file and
            disk-tier file set; `Stream.load` refuses a file of another id or owner when given them.
        """
        engine = self.engine if kv_cache_dtype is None else self.engine.with_changes(kv_cache_dtype=kv_cache_dtype)
        if self.recent_window is not None:  # no horizon, steps or files, but a bad value is refused all the same
            check_making(horizon_frames, vision_batch, stream_id, owner)
            return RecentFrames(self, self.recent_window, max_fps=max_fps, name=name, reserve_tokens=reserve_tokens,
                                engine=engine)
        stream = Stream(self, horizon_frames, max_fps=max_fps, name=name, vision_batch=vision_batch,
                        reserve_tokens=reserve_tokens, engine=engine, stream_id=stream_id, owner=owner)
        try:
            return stream.start()
        except BaseException:  # nothing half made is left holding its files
            stream.close()
            raise

    def push_many(self, items: Sequence[tuple[Stream, Any, float | None]], *,
                  return_exceptions: bool = False) -> list[bool | Exception]:
        """Push one frame to each of several streams of this VideoQA and step them together: one vision-tower
        call for their frames, one batched language-model forward for their steady steps (`statekv.core.step.batching`).

        items: ``(stream, frame, seconds)`` as `Stream.push` takes them (a stream may appear more than once: its
            frames go in order). Returns per item whether its frame was kept. A stream that fails (a bad frame)
            fails alone: the others are pushed, then the first error is raised (or, with
            ``return_exceptions=True``, returned in that item's place).

        Each stream ends exactly as if its frames had been pushed alone (in float32, the same carried positions
        and answers; hidden states within float rounding).
        """
        check_bool(return_exceptions, "return_exceptions")
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise InputError(f"push_many takes a list of (stream, frame, seconds) items, got {type(items).__name__}")
        items = list(items)  # a generator is checked as a list is, before anything is pushed
        for item in items:
            stream = item[0] if isinstance(item, (tuple, list)) and item else None
            if isinstance(stream, (Stream, RecentFrames)) and stream.qa is not self:
                raise InputError(f"push_many: {stream.name} belongs to another VideoQA")
        recent = [i for i, item in enumerate(items) if isinstance(item, (tuple, list)) and item
                  and isinstance(item[0], RecentFrames)]
        if not recent:
            return push_together(self.step_scheduler, items, return_exceptions=return_exceptions)
        results: list[bool | Exception] = [False] * len(items)  # a simplestream stream encodes nothing: push alone
        for i in recent:
            try:
                results[i] = items[i][0].push(*items[i][1:])
            except StateKVError as error:
                results[i] = error
        others = [i for i in range(len(items)) if i not in set(recent)]
        for i, result in zip(others, push_together(self.step_scheduler, [items[i] for i in others],
                                                   return_exceptions=True), strict=True):
            results[i] = result
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    def catch_up_many(self, streams: Sequence[Stream], steps: int | None = None) -> int:
        """`Stream.catch_up` for several streams of this VideoQA at once: their successors replay their backlogs
        (all of each, or its first ``steps``) in waves of one step per stream, each wave batched as pushes are
        (`statekv.core.step.batching`). Each stream ends as if caught up alone (`statekv.api.handover`). Returns
        the steps replayed; a closed stream is refused in one line before any is. A step a successor's disk tier
        refused (or its backlog file unreadable now, or memory short) puts that stream's replay off: the others' go on, then `statekv.steps.jobs.ReplayPutOff` (an
        `OutputError`) names it, with the steps replayed."""
        if isinstance(streams, (str, bytes)) or not isinstance(streams, Iterable):
            raise InputError(f"catch_up_many takes a list of streams, got {type(streams).__name__}")
        streams = list(streams)
        for stream in streams:
            if not isinstance(stream, Stream):
                raise InputError(f"catch_up_many takes streams, got {type(stream).__name__}")
            if stream.qa is not self:
                raise InputError(f"catch_up_many: {stream.name} belongs to another VideoQA")
        if steps is not None:
            check_int(steps, "steps", minimum=1)
        return catch_up_streams(streams, steps)

    def ask_many(self, items: Sequence[tuple], *, return_exceptions: bool = False) -> list[str | Exception]:
        """Answer a question of each of several streams of this VideoQA together: the questions whose shapes allow
        it as the rows of one batch (one forward for all their prompts, each over its own stream's context, then one
        per answer token: `statekv.core.answering.together`), the others alone (sampling, a generation setting
        that changes greedy decoding, a stream that keeps no cache).

        items: ``(stream, question)`` or ``(stream, question, ask_kwargs)``, ``ask_kwargs`` what `Stream.ask` takes
            (a stream may appear more than once). Returns the answers in order. A question that fails (an empty
            question, one too long for its stream) fails alone: the others are answered, then the first error is
            raised (or, with ``return_exceptions=True``, returned in that item's place).

        Each answer is exactly the one its question gets asked alone (the same tokens; logits within float
        rounding). ``question_batch_sizes`` counts the batches by the questions each answered.
        """
        check_bool(return_exceptions, "return_exceptions")
        items = list(items) if isinstance(items, Iterable) and not isinstance(items, (str, bytes)) else items
        answers = ask_together(self, items, return_exceptions=return_exceptions)
        return [answer if isinstance(answer, BaseException) else self.adapter.decode(answer) for answer in answers]

    def ask_tokens_many(self, items: Sequence[tuple], *, return_exceptions: bool = False
                        ) -> list[torch.Tensor | Exception]:
        """As `ask_many`, but each answer's token ids ``[1, N]`` (as `Stream.ask_tokens`)."""
        check_bool(return_exceptions, "return_exceptions")
        return ask_together(self, items, return_exceptions=return_exceptions)

    def horizon_for(self, num_frames: int | None, frame_size: tuple[int, int] | None = None,
                    reserve_tokens: int | None = None) -> int | None:
        """The planned length in tokens for ``num_frames`` sampled frames (of ``frame_size`` (height, width),
        if known) plus the reserve (default: the VideoQA's); None for no horizon."""
        reserve = self.reserve_tokens if reserve_tokens is None else check_int(reserve_tokens, "reserve_tokens")
        if num_frames is None:
            return None
        check_int(num_frames, "num_frames", minimum=0)
        return self.adapter.max_video_tokens(num_frames, frame_size=frame_size) + reserve

    def __repr__(self) -> str:
        return (f"VideoQA({self.adapter.family}, layout={self.adapter.layout!r}, policy={self.policy}, "
                f"attention={self.engine.attention!r})")


def _cache_full(encoded: EncodedVideo, num_frames: int, error: CacheLimitError) -> str:
    """The one line saying where ``max_cache_bytes`` stopped `VideoQA.encode` and what of the video it holds."""
    cap = f"max_cache_bytes={format_bytes(encoded.engine.max_cache_bytes)}"
    if not encoded.started:
        return f"{encoded.name}: the detailed cache cannot hold even the prompt ({cap}): nothing was encoded"
    at = f"frame {encoded.frames + 1} of {num_frames}"
    if encoded.engine.cache_limit != "refuse":  # a frame too large even with every other one evicted
        return f"{error}; encoding stopped at {at} (what the cache still holds can be asked about)"
    if not encoded.frames:
        return (f"{encoded.name}: the detailed cache is full at {at} ({cap}): no frame fit under it, so there is "
                "nothing to ask about")
    held = f"the first {encoded.frames} frames are" if encoded.frames > 1 else "the first frame is"
    return (f"{encoded.name}: the detailed cache is full at {at} ({cap}): encoding stopped; {held} encoded and can "
            "be asked about")


def _check_sampling(max_fps: float, max_frames: int) -> None:
    check_number(max_fps, "max_fps", error=InputError)
    check_int(max_frames, "max_frames", error=InputError)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/``"auto"`` (the checkpoint's dtype), a torch dtype, or its name (``"bfloat16"``)."""
    return torch_dtype(dtype)
