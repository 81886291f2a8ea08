"""Open a video source and read its frames lazily, in one forward pass.

`open_video` accepts a video file (decoded with PyAV), a folder of images, a sequence of PIL images or
RGB arrays, or a numpy array ``[N, H, W, 3]`` uint8. Every source becomes a `Video`: metadata up front,
frames on demand. Frames are yielded as `Frame` objects whose ``image`` is an RGB uint8 numpy array
``[H, W, 3]``; only the frame being yielded is held, so memory does not grow with the video's length.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import av
import numpy as np
from av.stream import Disposition
from PIL import Image

from .continuity import Continuous
from .images import decode_image, readable_rgb_image
from .orientation import AS_STORED, Turn, display_turn
from ..errors import FrameDecodeError, VideoError, VideoNotFoundError
from ..settings.values import HIGHEST_FPS, printable
from .sampling import sample_at_rate, source_frame_indices, uniform_frame_indices

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})
MP4_SUFFIXES = frozenset({".mp4", ".m4v", ".mov"})  # an index written at the end: a cut file has none
log = logging.getLogger("statekv.video")
GAP_FRAMES_SEEN = 8  # frames whose spacing tells a file's usual gap before a hole in it is said
GAP_TIMES = 4  # a hole: a gap this many times the usual one (and over GAP_SECONDS)
GAP_SECONDS = 1.0
COUNT_AGREES = 0.01  # a stream's frame count agrees with its duration at its rate within this share (and a frame)
DEFAULT_IMAGE_FPS = 1.0  # image sources carry no timing; frames are taken as 1 s apart unless told


@dataclass(frozen=True, eq=False)
class Frame:
    """One decoded frame.

    index: position of the frame among all frames of the source (0-based).
    timestamp: seconds since the start of the source (from ``pts * time_base`` for files).
    image: RGB uint8 array ``[H, W, 3]``.
    """

    index: int
    timestamp: float
    image: np.ndarray


class _PendingFrame(NamedTuple):
    """A frame whose position is known but whose pixels are converted only if it is kept."""

    index: int
    timestamp: float
    load: Callable[[], np.ndarray]

    def materialize(self, video_name: str) -> Frame:
        try:
            return Frame(self.index, self.timestamp, self.load())
        except FrameDecodeError:
            raise
        except VideoError as error:  # e.g. an unreadable image in the middle of a folder
            raise FrameDecodeError(f"{video_name}: frame {self.index} (at {self.timestamp:.2f} s) cannot be read: "
                                   f"{error}", index=self.index, timestamp=self.timestamp) from None


class Video(ABC):
    """A video opened for lazy reading.

    Attributes: ``name`` (for messages), ``num_frames``, ``fps`` (average frame rate), ``duration``
    (seconds), ``width`` and ``height`` (of the first frame, pixels), ``content_end`` (seconds: where the packets of
    every stream of a file end, when a demux pass read them all; None otherwise), ``variable_rate`` (a file whose
    frames are not evenly spaced: in an MP4 or MOV, which gives its frame count, its average rate and its frames' own
    rate differ; in a file read by a demux pass, its frames' typical and average gaps).
    Each reading method starts a new single forward pass over the source and returns a generator.
    """

    name: str
    num_frames: int
    fps: float
    duration: float
    width: int
    height: int
    content_end: float | None = None
    variable_rate: bool = False

    @abstractmethod
    def _pending_frames(self) -> Iterator[_PendingFrame]:
        """Every frame of the source, in order, without converting pixels."""

    def frames(self) -> Iterator[Frame]:
        """Every frame, in order."""
        for pending in self._every_pending_frame():
            yield pending.materialize(self.name)

    def _every_pending_frame(self) -> Iterator[_PendingFrame]:
        """`_pending_frames`, raising `FrameDecodeError` if the source ends before its ``num_frames``."""
        decoded = 0
        for pending in self._pending_frames():
            decoded += 1
            yield pending
        if decoded < self.num_frames:
            raise self._truncated(decoded)

    def sample_indices(self, *, max_fps: float = 1.0, max_frames: int = 512, protocol: bool = False) -> list[int]:
        """The frame indices `sample` yields (see `source_frame_indices`; ``protocol``: `uniform_frame_indices`): at a
        ``variable_rate`` the most it yields, its frames then chosen by time."""
        rule = uniform_frame_indices if protocol else source_frame_indices
        return rule(self.num_frames, self.fps, max_fps=max_fps, max_frames=max_frames)

    def sample(self, *, max_fps: float = 1.0, max_frames: int = 512, protocol: bool = False) -> Iterator[Frame]:
        """At most ``max_fps`` frames per second, at most ``max_frames``: every frame at most once, the last one
        included at or above the source's rate (`source_frame_indices`; at a ``variable_rate`` its indices taken as
        times at the average rate, so the video is sampled evenly in time: `_sample_at_times`); ``protocol=True``:
        the benchmarks' published rule (`uniform_frame_indices`, by index, which may repeat a frame), for
        evaluations."""
        if self.variable_rate and not protocol and max_fps < self.fps:  # (at or above its rate: every frame)
            indices = self.sample_indices(max_fps=max_fps, max_frames=max_frames)
            yield from self._sample_at_times([index / self.fps for index in indices])
            return
        wanted = iter(self.sample_indices(max_fps=max_fps, max_frames=max_frames, protocol=protocol))
        next_index = next(wanted)
        decoded = 0
        for pending in self._pending_frames():
            decoded += 1
            if pending.index != next_index:
                continue
            frame = pending.materialize(self.name)
            while next_index == pending.index:  # an index repeats when max_fps reaches the video's rate
                yield frame
                next_index = next(wanted, None)
            del frame  # release it before decoding on: at most one frame is alive
            if next_index is None:
                return  # nothing more to keep: stop decoding
        raise self._truncated(decoded)

    def _sample_at_times(self, times: list[float]) -> Iterator[Frame]:
        """For each of ``times`` (increasing, seconds from the first frame) the frame on screen then: the last one
        at or before it (at a constant rate the frame of index ``time * fps`` itself). A frame is kept once, however
        many times it is on screen for (where frames are sparser than the times)."""
        close = 0.05 / self.fps  # a frame's time as its container rounds it
        wanted = iter(times)
        target = next(wanted)
        decoded, shown, kept, origin = 0, None, None, None
        for pending in self._pending_frames():
            decoded += 1
            origin = pending.timestamp if origin is None else origin
            while target is not None and shown is not None and pending.timestamp - origin > target + close:
                if kept is not shown:  # the frame before this one was on screen at the target
                    kept = shown
                    yield shown.materialize(self.name)
                target = next(wanted, None)
            if target is None:
                return
            shown = pending  # not yet materialized: kept only if a target falls in its time on screen
        if decoded < self.num_frames:
            raise self._truncated(decoded)
        if shown is not None and kept is not shown:  # the times left fall on the last frame
            yield shown.materialize(self.name)

    def sample_at_rate(self, fps: float) -> Iterator[Frame]:
        """Frames at a fixed rate, as a live stream would deliver them (see `sample_at_rate`)."""
        for pending in sample_at_rate(self._every_pending_frame(), fps):
            yield pending.materialize(self.name)

    def _truncated(self, decoded: int) -> FrameDecodeError:
        timestamp = decoded / self.fps
        return FrameDecodeError(
            f"{self.name}: frame {decoded} (at about {timestamp:.2f} s) cannot be decoded: decoding stopped after "
            f"{decoded} of {self.num_frames} frames (truncated or corrupt?)", index=decoded, timestamp=timestamp,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, num_frames={self.num_frames}, fps={self.fps:.3f}, "
            f"duration={self.duration:.3f}, size={self.width}x{self.height})"
        )


class FileVideo(Video):
    """A video file decoded with PyAV, one forward pass per reading (no seeking, no frame kept), each frame turned
    upright as its display matrix asks (``turn``, a `statekv.video.orientation.Turn`; ``width`` and ``height`` are
    as shown).

    ``num_frames`` is the stream's own count when the container stores one (MP4 / MOV sample tables are exact,
    also at a variable frame rate) and its duration at its rate agrees; otherwise (Matroska, WebM, some AVI, an MP4
    whose edit list hides frames it keeps) the packets shown are counted in one demux pass, which reads the file but
    decodes nothing. ``fps`` is the stream's average rate; timestamps are ``(pts - start_time) * time_base``, so
    variable frame rates keep their true times, made continuous where they start again (`Continuous`: MPEG-TS parts
    joined end to end). A cover picture attached to an audio file is no video stream. A file that ends before its
    reported count raises `VideoError` when the reading gets there.
    """

    def __init__(self, path: Path):
        self.path = path
        self.name = printable(path)
        self._frame_rate: float | None = None  # measured by a demux pass, when the container gives no count
        self._uneven = False  # the same pass found its frames' times unevenly spaced
        self._frames_end: float | None = None  # the same pass found where its frames end (seconds from the first)
        self._restarts = 0  # the same pass found its frames' times going back this often (parts joined end to end)
        self.hole: tuple[float, float] | None = None  # the first hole in its frames' times a reading found (`Holes`)
        with self._open() as container:
            stream = self._video_stream(container)
            self._stream_index = stream.index
            self._time_base = stream.time_base or Fraction(1, 1)
            self._start_pts = stream.start_time or 0
            self.width = stream.codec_context.width
            self.height = stream.codec_context.height
            self.num_frames = self._frame_count(container, stream)
            if self.num_frames == 0:
                raise VideoError(f"{self.name}: the video stream has no frames")
            duration = self._reported_duration(container, stream)
            start = (container.start_time or 0) / av.time_base
            if self.content_end is not None and duration and abs(duration - start - self.content_end) < 1.0 < start:
                duration = self.content_end  # a header giving where the content ends, not how long it is
            if self._restarts:  # a header timing its first part only
                duration = self.content_end
                log.warning("%s: its timestamps start again %d times (parts joined end to end): read as one video of "
                            "%.2f s, each part timed after the one before", self.name, self._restarts, duration)
            self.fps = self._average_rate(stream, duration)
            timed = self._frame_rate
            if timed and not 0.9 < self.fps / timed < 1.1:  # a rate the demuxer guessed (Matroska without a frame
                self.fps = timed  # duration: 24) that the frames' own times deny
            self.duration = duration if duration else self.num_frames / self.fps
            # frames not evenly spaced: the average rate is not the rate a frame's own duration gives (a container
            # without a frame count has neither but guesses: there the spacing of its frames' times tells)
            own = None if self._frame_rate else stream.base_rate or stream.guessed_rate
            self.variable_rate = self._uneven or bool(own) and not 0.95 < self.fps / float(own) < 1.05
            if self.variable_rate and own and stream.codec_context.has_b_frames:
                self._time_by_frames(container, stream)
        self.turn = self._first_turn()
        if self.turn.sideways:
            self.width, self.height = self.height, self.width

    def _open(self) -> Any:
        try:
            return av.open(str(self.path))
        except av.FFmpegError as error:
            cut = isinstance(error, av.error.InvalidDataError) and self.path.suffix.lower() in MP4_SUFFIXES
            hint = "; an MP4 cut short before its index was written, or still being written, reads so" if cut else ""
            raise VideoError(f"{self.name}: not a readable video file ({_short(error)}{hint})") from None

    def _video_stream(self, container: Any) -> Any:
        """The first video stream that is not a still picture attached to the file (an audio file's cover art)."""
        moving = [stream for stream in container.streams.video if not stream.disposition & Disposition.attached_pic]
        if not moving:
            raise VideoError(f"{self.name}: the file has no video stream (or no index of its streams: an MP4 cut "
                             "short before its index was written reads so)")
        stream = moving[0]
        if stream.codec_context is None:  # a codec no decoder here knows: a damaged header, say
            raise VideoError(f"{self.name}: not a readable video file (its video stream's codec is unknown)")
        return stream

    def _first_turn(self) -> Turn:
        """How the first frame is shown, and so every frame: a display matrix belongs to the file's video track
        (as stored when the frame cannot be decoded: the reading says so when it gets there). Read once, as a
        frame's side data holds its frame in a reference cycle that only the collector frees."""
        with self._open() as container:
            frames = container.decode(container.streams[self._stream_index])
            try:
                return display_turn(next(frames))
            except (av.FFmpegError, StopIteration):
                return AS_STORED
            finally:
                frames.close()

    def _time_by_frames(self, container: Any, stream: Any) -> None:
        """An MP4 or MOV header times its stream to its last decoding time: with B-frames at a variable rate, that
        is frames before its last one is shown (seconds before, after a slow stretch), so sampling by it never reached
        the last seconds. Its frames' own times, from a demux pass (`_count_packets`), say where they end."""
        self._count_packets(container, stream)
        if self._frames_end is not None and self._frames_end > self.duration:
            self.duration = self._frames_end
            self.fps = self.num_frames / self.duration

    def _frame_count(self, container: Any, stream: Any) -> int:
        """The stream's own count when it agrees with its duration at its average rate, else its packets counted
        (`_count_packets`): an MP4 trimmed by an edit list (``ffmpeg -ss 1 -c copy``, a phone's trim) keeps in its
        sample table the frames it no longer shows."""
        count, rate, duration = stream.frames, stream.average_rate, stream.duration
        if count and rate and duration and stream.time_base:
            shown = float(duration * stream.time_base * rate)
            if abs(count - shown) > max(1.0, COUNT_AGREES * count):
                return self._count_packets(container, stream)
        return count or self._count_packets(container, stream)

    def _count_packets(self, container: Any, stream: Any) -> int:
        """The video stream's packets, counted in one demux pass of every stream (those its container marks as not
        shown left out), which also finds where the file's content ends (`content_end`: a header's duration may count
        an audio stream longer than the video). Times that start again are made continuous (`Continuous`, from
        each stream's decoding times)."""
        count, end, frames_end, shown, timelines = 0, None, None, [], {}
        period = 1 / float(stream.average_rate or stream.guessed_rate or 1)
        try:
            for packet in container.demux():
                if not packet.size or packet.is_discard:
                    continue
                count += packet.stream.index == stream.index
                at = packet.pts if packet.pts is not None else packet.dts
                if at is not None and packet.time_base:
                    timeline = timelines.setdefault(packet.stream.index, Continuous())
                    order = None if packet.dts is None else float(packet.dts * packet.time_base)
                    lasts = float((packet.duration or 0) * packet.time_base)
                    offset = timeline.shift(order, lasts or period * (packet.stream.index == stream.index))
                    ends = float((at + (packet.duration or 0)) * packet.time_base) + offset
                    end = ends if end is None else max(end, ends)
                    if packet.stream.index == stream.index:
                        shown.append(float(at * packet.time_base) + offset)
                        frames_end = ends if frames_end is None else max(frames_end, ends)
        except av.FFmpegError as error:
            raise VideoError(f"{self.name}: cannot read packets ({_short(error)})") from None
        if end is not None:
            self.content_end = end - (container.start_time or 0) / av.time_base
        self._restarts = timelines[stream.index].restarts if stream.index in timelines else 0
        if frames_end is not None:
            self._frames_end = frames_end - float((stream.start_time or 0) * (stream.time_base or 0))
        shown.sort()  # packets come in decoding order
        if count > 1 and len(shown) > 1 and shown[-1] > shown[0]:
            self._frame_rate = (count - 1) / (shown[-1] - shown[0])  # what the frames' own times say
            self._uneven = _uneven(shown, float(stream.time_base or 0))
        return count

    @staticmethod
    def _reported_duration(container: Any, stream: Any) -> float | None:
        if stream.duration:
            return float(stream.duration * stream.time_base)
        if container.duration:
            return container.duration / av.time_base
        return None

    def _average_rate(self, stream: Any, duration: float | None) -> float:
        rate = stream.average_rate or stream.guessed_rate
        if rate:
            return float(rate)
        if duration:
            return self.num_frames / duration
        raise VideoError(f"{self.name}: the frame rate cannot be determined")

    def _timestamp(self, frame: Any, index: int) -> float:
        if frame.pts is None:
            return index / self.fps
        return float((frame.pts - self._start_pts) * self._time_base)

    def _shown(self, frame: Any) -> np.ndarray:
        return self.turn.apply(frame.to_ndarray(format="rgb24"))

    def _pending_frames(self) -> Iterator[_PendingFrame]:
        index, timestamp, continuous = -1, -1 / self.fps, Continuous()
        with self._open() as container:
            stream = container.streams[self._stream_index]
            stream.thread_type = "AUTO"
            holes = Holes(self)
            try:
                for index, frame in enumerate(container.decode(stream)):
                    timestamp = continuous(self._timestamp(frame, index), 1 / self.fps)
                    holes.check(timestamp)
                    yield _PendingFrame(index, timestamp, partial(self._shown, frame))
            except av.FFmpegError as error:
                failed, at = index + 1, timestamp + 1 / self.fps  # the frame after the last good one
                raise FrameDecodeError(
                    f"{self.name}: frame {failed} (at about {at:.2f} s) cannot be decoded: decoding failed after "
                    f"{failed} frames ({_short(error)}; truncated or corrupt?)", index=failed, timestamp=at,
                ) from None


class ImageSequenceVideo(Video):
    """Frames held as images (files, PIL images or arrays), spaced ``1 / fps`` seconds apart."""

    def __init__(self, items: Sequence[Any], load: Callable[[Any], np.ndarray], *, fps: float, name: str):
        if not len(items):
            raise VideoError(f"{name}: the video has no frames")
        if not 0 < fps <= HIGHEST_FPS:  # an infinite rate would put every frame at 0 s
            raise VideoError(f"{name}: fps must be a number above 0 and at most {HIGHEST_FPS:g}, got {fps}")
        self._items = items
        self._load = load
        self.name = name
        self.num_frames = len(items)
        self.fps = float(fps)
        self.duration = self.num_frames / self.fps
        self.height, self.width = load(items[0]).shape[:2]

    def _pending_frames(self) -> Iterator[_PendingFrame]:
        for index, item in enumerate(self._items):
            yield _PendingFrame(index, index / self.fps, partial(self._load, item))


class Holes:
    """Says once for a file (``video.hole``, the first found), in the log, where its frames leave a hole far longer
    than their usual gap: a damaged stretch the decoder skipped without an error (its demuxer found the next whole
    packet), or a picture that did not change in a screen recording. Its frames go on as they are."""

    def __init__(self, video: Any):
        self.video, self.first, self.last, self.usual = video, [], None, None

    def check(self, timestamp: float) -> None:
        last, self.last = self.last, timestamp
        if self.video.hole is not None:
            return
        if self.usual is None:
            self.first.append(timestamp)
            if len(self.first) > GAP_FRAMES_SEEN:  # the usual gap, from the file's first frames
                gaps = [b - a for a, b in zip(self.first, self.first[1:])]
                self.usual = max(statistics.median(gaps), 1e-3)  # (first frames sharing a time: no zero gap)
                self.first = []
            return
        if timestamp - last > max(GAP_SECONDS, GAP_TIMES * self.usual):
            self.video.hole = (last, timestamp)
            log.warning("%s: no frame between %.2f s and %.2f s, where its frames come every %.2f s: a damaged "
                        "stretch its decoder skipped, or a picture that did not change (later holes are not said)",
                        self.video.name, last, timestamp, self.usual)


def _uneven(times: list[float], tick: float) -> bool:
    """Whether frames shown at ``times`` (sorted, seconds) are unevenly spaced: their typical gap (the median) and
    their average one differ by more than 5%, or than a gap's rounding to its container's ``tick`` can make them."""
    gaps = sorted(later - earlier for earlier, later in zip(times, times[1:]))
    typical, average = gaps[len(gaps) // 2], (times[-1] - times[0]) / len(gaps)
    return abs(typical - average) > max(0.05 * average, 1.5 * tick)


def cut_short(video: Any, frames_end: float, max_fps: float) -> float | None:
    """Where ``video`` ends when that is well before the duration its header gives (a file cut short, or still being
    written), else None: where its content ends (`Video.content_end`, when known: an audio stream running on past
    the video is no cut), else ``frames_end``, where its frames end, more than a second and two ticks of ``max_fps``
    before."""
    duration, content = getattr(video, "duration", None), getattr(video, "content_end", None)
    end = frames_end if content is None else content
    return end if duration and end < duration - 1.0 - 2.0 / max_fps else None


def open_video(source: Any, *, fps: float | None = None) -> Video:
    """Open a video source for lazy reading.

    source: a video file path; a folder of images (read in natural sort order, so ``frame_2`` comes before
        ``frame_10``); a sequence of PIL images or RGB uint8 arrays ``[H, W, 3]``; a numpy array
        ``[N, H, W, 3]`` uint8; or an already opened `Video` (returned as is).
    fps: frame rate of an image source (default 1.0), which sets its timestamps. Files use their own.

    Raises `VideoNotFoundError` for a missing path and `VideoError` for any source that cannot be read.
    """
    if isinstance(source, Video):
        return source
    if isinstance(source, (str, os.PathLike)):
        text = os.fsdecode(os.fspath(source))
        if not text.strip():  # Path("") would be the current folder
            raise VideoError("the video path is empty; give a video file or a folder of images")
        path = Path(text)
        if "\0" in text:
            raise VideoError(f"{_shown(path)!r}: a path holds no NUL character")
        try:
            os.stat(path)
        except FileNotFoundError:
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", text):  # a URL: its '//' would read as one '/'
                raise VideoNotFoundError(f"{text[:200]}: URLs are not read; download the file and give its path, "
                                         "or a file:// URL's path") from None
            if path.is_symlink():
                raise VideoNotFoundError(f"{_shown(path)}: a broken link (to {_shown(Path(os.readlink(path)))}, "
                                         "which does not exist)") from None
            raise VideoNotFoundError(f"{_shown(path)}: no such file or folder") from None
        except OSError as error:  # a name too long, a symbolic link loop, a folder that cannot be entered
            raise VideoError(f"{_shown(path)}: {error.strerror or type(error).__name__}") from None
        if path.is_dir():
            return _open_image_folder(path, fps=fps if fps is not None else DEFAULT_IMAGE_FPS)
        _check_regular_file(path)
        if fps is not None:
            raise VideoError(f"{_shown(path)}: fps= applies to image sources only; a video file has its own timestamps")
        return FileVideo(path)
    fps = fps if fps is not None else DEFAULT_IMAGE_FPS
    if isinstance(source, np.ndarray):
        if source.ndim != 4 or source.shape[-1] != 3 or source.dtype != np.uint8 or 0 in source.shape[1:3]:
            raise VideoError(f"array video must be uint8 [N, H, W, 3] with frames of at least one pixel, got "
                             f"{source.dtype} {list(source.shape)}")
        return ImageSequenceVideo(source, np.asarray, fps=fps, name=f"array[{source.shape[0]}]")
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        return ImageSequenceVideo(source, _image_to_rgb_array, fps=fps, name=f"images[{len(source)}]")
    raise VideoError(f"unsupported video source of type {type(source).__name__}")


def _shown(path: Path) -> str:
    """``path`` as a message shows it: on one line (`printable`), a very long one cut in its middle."""
    text = printable(path)
    return text if len(text) <= 200 else f"{text[:120]}...{text[-60:]} ({len(text)} characters)"


def _open_image_folder(folder: Path, *, fps: float) -> ImageSequenceVideo:
    try:
        paths = sorted(
            (p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")),
            key=_natural_key,
        )
    except OSError as error:
        raise VideoError(f"{_shown(folder)}: cannot list the folder ({error.strerror or error})") from None
    if not paths:
        extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise VideoError(f"{folder}: folder holds no images ({extensions})")
    for path in paths:
        _check_regular_file(path)
    return ImageSequenceVideo(paths, _read_image_file, fps=fps, name=printable(folder))


def _check_regular_file(path: Path) -> None:
    """Refuse a folder, a broken link, a named pipe, a device or a socket (reading one of the last three would wait
    for ever or never end)."""
    if not path.is_file():
        kind = ("a folder" if path.is_dir() else "a broken link" if path.is_symlink() and not path.exists()
                else "a named pipe, device or socket")
        raise VideoError(f"{_shown(path)}: not a regular file ({kind}); give a video file or a folder of images")


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", path.name)]


def _read_image_file(path: Path) -> np.ndarray:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise VideoError(f"{_shown(path)}: not a readable image ({error.strerror or error})") from None
    return decode_image(data, name=printable(path))


def _image_to_rgb_array(image: Any) -> np.ndarray:
    if isinstance(image, Image.Image):
        return readable_rgb_image(image, VideoError)
    if (isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 3 and image.dtype == np.uint8
            and 0 not in image.shape):
        return image
    shape = getattr(image, "shape", None)
    raise VideoError(f"frames must be PIL images or uint8 [H, W, 3] arrays, got {type(image).__name__}"
                     + (f" {shape}" if shape else ""))


def _short(error: Exception) -> str:
    """An FFmpeg error without the file name PyAV appends (the message names the file already)."""
    return getattr(error, "strerror", None) or str(error)
