"""SimpleStream's way of answering: keep only a stream's last N frames and answer each question from a fresh
encoding of those frames and the prompt by the unmodified model, nothing else (Shen et al., "A Simple Baseline
for Streaming Video Understanding", 2026).

`VideoQA.stream` and `VideoQA.encode` return a `RecentFrames` under a method registered with ``recent_window``
(``method="simplestream"``, N = ``window``, 4 by default). Nothing is encoded while frames arrive, and nothing of
one question's encoding is kept for the next: what the model attends to when it answers is exactly the prompt
prefix, the N frames (numbered from the first of them, as a clip of N frames would be) and the question, in
the model's own video layout, under full attention. A stream holds N frames of pixels, whatever its length.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from .encoded import METHOD_DEFAULT, EncodedVideo
from .stats import AnswerInfo, EncodingStats
from .stream import check_max_fps, checked_timestamp
from ..errors import InputError, StateKVError
from ..stopping import whole
from ..settings.methods import refuse_unread
from ..settings.values import check_int, is_finite_number, shown
from ..video import Frame
from ..video.images import rgb_frame
from ..video.sampling import tick
from .watch import DEFAULT_NEW_TOKENS as DEFAULT_WATCH_TOKENS, Watch, open_watch, run_on_cadence


class RecentFrames:
    """The last ``window`` frames pushed, answered from afresh (see the module docstring). Create it with
    `VideoQA.stream` (or `VideoQA.encode`, which pushes a video's sampled frames) under ``simplestream``.

    Attributes like `Stream`'s: ``name``, ``max_fps``, ``pushed`` (frames offered), ``frames`` (frames kept so
    far), ``stats`` (frames counted; no cache is held, so its cache sizes stay 0), ``answer_info`` (what the last
    answer saw), ``horizon`` (the planned length of one question's encoding, in tokens), ``read_tokens`` (the
    tokens the last answer read: its frames' and its question's).
    """

    def __init__(self, qa: Any, window: int, *, max_fps: float | None = None, name: str = "stream",
                 reserve_tokens: int | None = None, engine: Any = None):
        self.qa = qa
        self.engine = qa.engine if engine is None else engine  # its questions' encodings' (kv_cache_dtype...)
        self.window = check_int(window, "window (the last N frames a question sees)")
        self.max_fps = check_max_fps(max_fps)
        self.name = name
        self.reserve_tokens = reserve_tokens
        self.horizon = qa.horizon_for(self.window, reserve_tokens=reserve_tokens)
        self.recent: deque[Frame] = deque(maxlen=self.window)
        self.stats = EncodingStats()
        self.answer_info: AnswerInfo | None = None
        self.read_tokens = 0
        self.pushed = 0
        self.pending: list[Frame] = []  # nothing ever waits to be encoded (`Stream`'s attribute)
        self._next_tick = 0
        self._last_timestamp: float | None = None
        self._closed = False
        self.lock = threading.RLock()  # a watch's evaluation takes turns with pushes from other threads
        self.watching = None  # its watches (`statekv.api.watch.Watches`), once one is opened

    # -- pushing ----------------------------------------------------------------------------------------
    def push(self, image: Any, timestamp: float | None = None) -> bool:
        """Offer one frame (an RGB uint8 array ``[H, W, 3]``, a PIL image or a `Frame`); return whether it was
        kept (``max_fps`` drops frames between its ticks, as `Stream.push` does). Only the last ``window`` kept
        frames are held."""
        self._check_open()
        if isinstance(image, Frame):
            timestamp = image.timestamp if timestamp is None else timestamp
            image = image.image
        pixels = rgb_frame(image, copy=True)
        with whole(), self.lock:  # the frame is taken with its counts, or not at all; never while a watch reads
            self._check_open()  # checked again in turn: closed, or pushed to at a later time, by another thread
            timestamp = checked_timestamp(timestamp, self._last_timestamp, self.max_fps)
            self.pushed += 1
            self._last_timestamp = timestamp
            if self.max_fps is not None:
                reached = tick(timestamp, self.max_fps)
                if reached < self._next_tick:
                    return False
                self._next_tick = reached + 1
            self.recent.append(Frame(self.stats.frames, timestamp, pixels))
            self.stats.frames += 1
        if self.watching is not None:  # its due watches answer from the frames it now holds
            with self.lock:
                # the last frame's time: another thread's push may have come in between the two turns
                seconds = self.encoded_timestamp
                self.watching.seconds = seconds
                run_on_cadence([watch for watch in self.watching.open if watch.due(self.frames, seconds)])
        return True

    @property
    def encoded_timestamp(self) -> float | None:
        """The time of the last frame it holds (None: none yet, or none since it went on from counts)."""
        return self.recent[-1].timestamp if self.recent else None

    def continue_from(self, pushed: int, frames: int, seconds: float | None) -> None:
        """Go on from a stream of which only the counts were kept (a service's record of it: its frames are not
        saved): ``pushed`` frames offered, ``frames`` kept, the last offered at ``seconds``. Its window starts
        empty; the next frame is numbered and timed after those, as if the stream had never stopped."""
        with self.lock:
            if self.pushed:
                raise StateKVError(f"{self.name}: only a stream nothing was pushed to can go on from another's counts")
            check_int(pushed, "pushed", minimum=0, error=InputError)
            check_int(frames, "frames", minimum=0, maximum=pushed, error=InputError)
            if (seconds is None) != (pushed == 0) or seconds is not None and not (
                    is_finite_number(seconds) and seconds >= 0):
                raise InputError(f"{self.name}: {pushed} frames pushed, the last at {shown(seconds)} s, is not a "
                                 "stream")
            self.pushed, self.stats.frames, self._last_timestamp = pushed, frames, seconds
            if self.max_fps is not None and seconds is not None:
                self._next_tick = tick(seconds, self.max_fps) + 1

    def push_many(self, frames: Any) -> int:
        """Push ``(image, timestamp)`` pairs or `Frame` objects in order; return how many were kept."""
        return sum(self.push(item) if isinstance(item, Frame) else self.push(*item) for item in frames)

    def flush(self) -> None:
        """Nothing waits to be encoded (kept for `Stream`'s interface)."""

    def flush_complete_steps(self) -> None:
        """Nothing waits to be encoded (kept for `Stream`'s interface)."""

    # -- watching ---------------------------------------------------------------------------------------
    def watch(self, question: str, every: int | None = None, *, every_seconds: float | None = None,
              max_new_tokens: int = DEFAULT_WATCH_TOKENS, retrieve: int | None = None, retrieval: str | None = None,
              steer: bool | None = None) -> Watch:
        """As `Stream.watch`; each evaluation answers the question from the last ``window`` frames afresh, as `ask`
        does (nothing is carried, so nothing is steered)."""
        refuse_unread(self.qa.method, {"retrieve": retrieve})
        with self.lock:
            self._check_open()  # in turn: a close may have come first
            return open_watch(self, question, every=every, every_seconds=every_seconds,
                              max_new_tokens=max_new_tokens, retrieve=retrieve, retrieval=retrieval,
                          steer=self.qa.steer if steer is None else steer)

    @property
    def watches(self) -> list[Watch]:
        """The open watches, oldest first."""
        return [] if self.watching is None else list(self.watching.open)

    @property
    def last_timestamp(self) -> float | None:
        """The stream time of the last frame pushed (None before the first)."""
        return self._last_timestamp

    # -- answering --------------------------------------------------------------------------------------
    def ask(self, question: str, **ask_kwargs: Any) -> str:
        """Answer ``question`` from the last ``window`` frames alone, all of them (`EncodedVideo.ask`'s options but
        ``retrieve``, refused: this method retrieves nothing)."""
        return self.qa.adapter.decode(self.ask_tokens(question, **ask_kwargs))

    @torch.no_grad()
    def ask_tokens(self, question: str, **ask_kwargs: Any) -> torch.Tensor:
        """As `ask`, but return the answer's token ids ``[1, N]``."""
        retrieve = ask_kwargs.get("retrieve", METHOD_DEFAULT)  # retrieval= is checked by name, as when none retrieves
        refuse_unread(self.qa.method, {"retrieve": None if retrieve is METHOD_DEFAULT else retrieve})
        with self.lock:  # the window as it stands, whatever other threads push meanwhile
            self._check_open()  # in turn: a close may have come first
            window = list(self.recent)
        if not window:
            raise InputError(f"{self.name}: no frame has been pushed yet" if not self.frames else
                             f"{self.name}: no frame has been pushed since it went on from its counts (a simplestream "
                             "stream's frames are not kept); push one")
        rate = self.max_fps or 1.0
        frames = [Frame(index, index / rate, frame.image) for index, frame in enumerate(window)]
        height, width = frames[0].image.shape[:2]
        per_step = self.qa.adapter.frames_per_step
        with EncodedVideo(self.qa, self.qa.horizon_for(len(frames), (height, width), self.reserve_tokens),
                          num_frames=len(frames), fps=rate, name=self.name, engine=self.clip_engine) as clip:
            clip.append_steps([frames[i:i + per_step] for i in range(0, len(frames), per_step)],
                              vision_batch=len(frames))
            tokens = clip.ask_tokens(question, **ask_kwargs)
            self.read_tokens = clip.tokens + int(self.qa.adapter.question_ids(question, clip.state).shape[1])
            self.horizon = clip.horizon
            self.stats.peak_cache_device_bytes = max(self.stats.peak_cache_device_bytes,
                                                     clip.stats.peak_cache_device_bytes)
            # the frames it read: its window's, numbered as the stream kept them
            self.answer_info = replace(clip.answer_info, read_frames=tuple(frame.index for frame in window))
        return tokens

    @property
    def clip_engine(self) -> Any:
        """The engine settings a question's encoding runs with: the VideoQA's, but never on the disk tier (a file
        set per question, thrown away after it, would only be left behind: nothing resumes it), whose cache is
        then kept in host memory instead, and never under a cache cap (a service's, for its cached streams),
        which would refuse the question's own window however often it is asked; the window bounds it."""
        engine = self.engine
        if engine.max_cache_bytes is not None:
            engine = engine.with_changes(max_cache_bytes=None, cache_limit="refuse")
        return engine.with_changes(offload=True, offload_dir=None) if engine.offload == "disk" else engine

    # -- the rest of a stream's surface ---------------------------------------------------------------
    @property
    def frames(self) -> int:
        return self.stats.frames

    @property
    def held_frames(self) -> int:
        """The frames a question would read now: the window's (none after `continue_from`, until one is pushed)."""
        return len(self.recent)

    @property
    def tokens(self) -> int:
        """Tokens held between questions: none."""
        return 0

    @property
    def adapter(self) -> Any:
        return self.qa.adapter

    @property
    def held_bytes(self) -> int:
        """Bytes held between questions: the pixels of the last ``window`` frames."""
        return sum(frame.image.nbytes for frame in self.recent)

    keeps_cache = False  # nothing to save: a service keeps such a stream's record alone

    def save(self, path: Any) -> None:
        raise StateKVError(f"{self.name}: a simplestream stream holds only its last {self.window} frames; there is "
                           "no cache to save")

    def close(self) -> None:
        with self.lock:  # after a push under way, never in the middle of one
            for watch in self.watches:
                watch.close()
            self.recent.clear()
            self._closed = True

    def __enter__(self) -> "RecentFrames":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RecentFrames({self.name!r}, window={self.window}, frames={self.frames})"

    def _check_open(self) -> None:
        if self._closed:
            raise InputError(f"{self.name}: the stream is closed")
