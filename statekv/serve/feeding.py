"""Video files fed into served streams: the feeds themselves (`FileFeeds`: decoding a file into its stream, stopping
one as asked or all at the server's stop), a feed's progress (`Feed`), how many frames a file gives at the stream's
rate (`frames_at_rate`) and where a feed that skips the frames a cut one pushed places the rest (`resumed_shift`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, OutputError, StateKVError
from .bringing_back import BROUGHT_BACK, UNFORCED, to_bring_back
from .errors import ServiceError, public_message, reason_of, status_of

STOP_POLL_SECONDS = 0.05


@dataclass
class Feed:
    """A video file being fed into a stream: how far it got (``total``: the frames it should give at the
    stream's rate, estimated from its length) and, once it stopped early, why."""

    source: str
    total: int | None
    offered: int = 0
    kept: int = 0
    skipped: int = 0
    running: bool = True
    error: str | None = None  # why it stopped before the file's end
    stopping: bool = False  # asked to stop (`FileFeeds.stop`): it ends after the frame it is pushing
    stopped: bool = False  # stopped as asked, its frames saved: not failed
    resumable: bool = True  # False: the page's (its file is gone once it stops; its record names a cut feed)
    # a page's feed, to tell what the stream holds of its file once it is cut (None: a record written before):
    skip: int = 0  # the file's first frames it skipped
    held_before: int | None = None  # the stream's frames before the file's first (those it skipped included)
    size: int | None = None  # the file's bytes
    counted: bool = True  # ``offered`` counts what it fed (False: recalled from a record written while it ran)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "total": self.total, "offered": self.offered, "kept": self.kept,
                "running": self.running, "stopped": self.stopped, "error": self.error}

    def recorded(self) -> dict[str, Any]:
        return {**self.describe(), "skip": self.skip, "held_before": self.held_before, "size": self.size}

    def rest_of(self, name: str, size: int, frames: int) -> int:
        """The frames to skip of the file ``name`` of ``size`` bytes, fed again into the stream this feed was cut
        in, which holds ``frames``: those the stream holds of it (0 for another file, or a feed not cut short)."""
        if self.running or not self.error or (name, size) != (self.source, self.size) or self.held_before is None:
            return 0
        if self.counted:  # (frames pushed into the stream since are none of the file's)
            return self.skip + self.offered
        return max(0, frames - self.held_before)


def frames_at_rate(video: Any, max_fps: float | None) -> int:
    """About how many frames a video file gives at ``max_fps`` (None: all), from its length: one per tick."""
    if max_fps is None:
        return video.num_frames
    return max(1, min(video.num_frames, math.ceil(video.duration * max_fps - 1e-9)))


def resumed_shift(last: float | None, start: float | None, first: float, last_skipped: float | None) -> float:
    """What a feed adds to its file's timestamps: ``start`` (given) places its first frame pushed (file time
    ``first``) there; else a feed that skipped frames goes on as the feed cut short after ``last_skipped`` placed
    them (the stream's ``last`` frame being that one; on a stream holding no frame, at the file's own times, where
    a feed from its first frame puts them)."""
    if start is not None:
        return start - first if last_skipped is not None else start
    if last is not None:
        return last - last_skipped
    return 0.0


def unforced_feed(error: StateKVError, shown: str, before: int, resumable: bool) -> ServiceError | None:
    """The 503 of a feed of ``shown`` whose push met a failed force (``error``, which tells a push's client to push
    its frame again), saying how a feed goes on: fed again from the frames of the file the stream holds once
    brought back, its resume_from less ``before`` (its pushed frames before the file's first); None for another
    error."""
    message = str(error)
    if not isinstance(error, ServiceError) or not message.endswith(BROUGHT_BACK):
        return None
    then = (f"then send {{\"source\": {json.dumps(shown)}, \"skip\": N}} to go on, N being its resume_from less "
            f"{before} (the frames of {shown} it holds), and again if that answers 409" if resumable else
            "then add the same file to this stream again to feed the rest")
    return ServiceError(error.status, f"{message.removesuffix(BROUGHT_BACK)}{UNFORCED}; {then}",
                        headers=error.headers)


class FileFeeds:
    """The video files being fed into the streams of ``registry`` (a `StreamRegistry`), one feed per stream at a
    time, each holding its stream's lock while it pushes."""

    def __init__(self, registry: Any):
        self.registry = registry
        self.stopping = False  # the server is stopping: feeds end at their next frame (`stop_all`)

    async def open_source(self, path: Path, shown: str) -> Any:
        """Open a video file (off the model's thread); a one-line 400 naming it as ``shown`` if it is not one."""
        from ..video import open_video

        try:
            return await asyncio.to_thread(open_video, str(path))
        except StateKVError as error:
            raise ServiceError(400, public_message(str(error), {str(path): shown})) from None

    def stop_all(self) -> None:
        """The server is stopping: every feed ends after the frame it is pushing, answering with a one-line 503
        that says how to go on (``skip``), so its request ends before the server's graceful shutdown does."""
        self.stopping = True

    async def feed(self, entry: Any, path: Path, start: float | None, *, shown: str | None = None,
                   video: Any = None, skip: int = 0, resumable: bool = True, size: int | None = None) -> dict[str, Any]:
        """Push every frame of a video file (sampled at the stream's max_fps), then save. Frames are timed from
        ``start`` (default: just after the stream's last frame). ``shown``: the file's name in messages (never
        the server's path); ``video``: the file already opened with `open_source`; ``skip``: the file's first
        frames at the stream's rate that are not pushed (those a feed cut short pushed already: without
        ``start``, the rest go on as that feed would have placed them); ``resumable``: a stop's message may tell
        the client to send ``skip`` (not for a page's upload, which is gone by then); ``size``: the file's bytes.

        Frames are decoded off the model's thread and pushed as `push` pushes, so feeds and pushes of several
        streams step together. Progress and any error stay in ``entry.feed``."""
        registry = self.registry
        registry.placement.admit_push(entry)
        shown = shown or path.name
        if entry.feeding:  # before any wait: of two feeds arriving together, the second is refused
            raise ServiceError(409, f"stream {entry.id} is being fed {entry.feed.source} already")
        before = entry.feed  # shown, and stoppable, from here on: a long file takes a while to open
        entry.feed = feed = Feed(shown, None, resumable=resumable, skip=skip, size=size)
        try:
            await registry.heal(entry)  # the page feeds a stream it holds, not found again
            if video is None:
                video = await self.open_source(path, shown)
        except BaseException as error:
            # a stop waiting on it is told why, as a client may see it
            feed.running, feed.error = False, registry.config.public(str(error)) or type(error).__name__
            entry.feed = before  # the stream is as it was
            raise
        earlier = entry.stream.pushed - skip  # the stream's pushes before the file's first
        rate = entry.max_fps or (video.fps if getattr(video, "fps", None) else 1.0)
        feed.total, feed.held_before = max(0, frames_at_rate(video, entry.max_fps) - skip), entry.stream.frames - skip
        try:
            if not resumable:  # a page's: its record says it began, so a kill cannot hide what it did not feed
                await entry.keep_record(registry.files, "a page's feed")
            async with entry.lock:
                while entry.pushing:  # pushes queued before it: its frames go after theirs
                    await asyncio.sleep(STOP_POLL_SECONDS)
                feed.held_before, earlier = entry.stream.frames - skip, entry.stream.pushed - skip
                shift, last_skipped = None, None
                if start is None and not skip:
                    shift = 0.0 if entry.last_seconds is None else entry.last_seconds + 1.0 / rate
                frames = iter(video.frames() if entry.max_fps is None else video.sample_at_rate(rate))
                upcoming = asyncio.ensure_future(asyncio.to_thread(next, frames, None))
                try:
                    while (frame := await upcoming) is not None:
                        # the next frame decodes while this one is pushed, so its push follows at once
                        upcoming = asyncio.ensure_future(asyncio.to_thread(next, frames, None))
                        if entry.deleting.is_set():
                            raise ServiceError(404, f"stream {entry.id} was deleted while feeding {shown}")
                        if self.stopping or feed.stopping:
                            raise await self._stopped(entry, shown, feed.skipped + feed.offered, resumable)
                        if skip > feed.skipped:
                            feed.skipped, last_skipped = feed.skipped + 1, frame.timestamp
                            continue
                        if shift is None:
                            shift = resumed_shift(entry.last_seconds, start, frame.timestamp, last_skipped)
                        feed.kept += await registry.push_held(entry, frame.image, shift + frame.timestamp)
                        feed.offered += 1
                finally:
                    with contextlib.suppress(BaseException):
                        await upcoming  # never leave the decoder running on another thread
                if skip > feed.skipped:
                    raise InputError(f"skip {skip} is past the end of {shown}: it gives {feed.skipped} frames at the "
                                     f"stream's rate")
                feed.total = feed.offered
                unsaved = await self._save(entry)
                if unsaved is not None:
                    raise OutputError(f"{shown} was fed whole, but the stream could not be saved ({unsaved})")
        except StateKVError as raised:
            # deleted between its frames, or its push met the deletion ("no stream ...")
            error = ServiceError(404, f"stream {entry.id} was deleted while feeding {shown}") \
                if entry.deleting.is_set() else unforced_feed(raised, shown, earlier, resumable) or raised
            if feed.offered and error is raised and not (feed.stopped or self.stopping or
                                                         isinstance(error, OutputError) or to_bring_back(entry)):
                await self._save(entry)  # what it pushed before the failure is kept, as a stop keeps it
            feed.error = registry.config.public(public_message(str(error), {str(path): shown}))  # shown to its page too
            if isinstance(error, InputError) and not feed.offered:  # a request refused (a skip past the end): the
                entry.feed = before  # stream is as it was, not a failed feed
            status = status_of(error)
            headers = getattr(error, "headers", None) or ({"Retry-After": "5"} if status == 503 else None)
            raise ServiceError(status, f"{feed.error} ({feed.kept} frames fed)", headers=headers) from None
        except BaseException as error:
            feed.error = f"feeding stopped ({type(error).__name__}); {feed.kept} frames fed"
            raise
        finally:
            feed.running = False
            if not resumable:  # a page's: its record names how it ended (a restart shows it so)
                with contextlib.suppress(asyncio.CancelledError):
                    await entry.keep_record(registry.files, "the end of a page's feed")
        return {"source": shown, "offered": feed.offered, "kept": feed.kept}

    async def _save(self, entry: Any) -> str | None:
        """Save what a feed pushed into ``entry``; None, or why it could not be (a failed save as any other:
        `StreamRegistry.note_save_failure`)."""
        try:
            await self.registry.worker.run(self.registry.save_now, entry)
        except (StateKVError, OSError) as error:
            self.registry.note_save_failure(entry, error)
            return self.registry.config.public(reason_of(error))
        return None

    async def _stopped(self, entry: Any, shown: str, taken: int, resumable: bool) -> ServiceError:
        """The error of a feed stopped after ``taken`` of its file's frames, once what it pushed is saved: a 503 when
        the server's stop ended it (a save at shutdown may never come: a second Ctrl-C skips it), a 409 when it was
        asked to stop (`stop`)."""
        whole = entry.feed.total
        of = f"{taken} of its {whole + entry.feed.skip} frames" if whole is not None else f"{taken} of its frames"
        if self.stopping:
            status, headers, back = 503, {"Retry-After": "10"}, "once the server is back, "
            stopped = f"the server is stopping: feeding {shown} stopped after {of}"
        else:
            status, headers, back = 409, None, ""
            stopped = f"feeding {shown} was stopped as asked after {of}"
            entry.feed.stopped = True
        reason = await self._save(entry)
        if reason is not None:
            return ServiceError(status, f"{stopped}, which could not be saved ({reason}); {back}its resume_from says "
                                "what the stream holds", headers=headers)
        then = (f"send {{\"source\": {json.dumps(shown)}, \"skip\": {taken}}} to go on" if resumable else
                "add the same file to this stream again to feed the rest")
        return ServiceError(status, f"{stopped}, saved; {back}{then}", headers=headers)

    async def stop(self, entry: Any) -> dict[str, Any]:
        """Stop the feed under way into ``entry`` after the frame it is pushing, and wait until what it pushed is
        saved; its own request answers a 409 naming the ``skip`` that goes on. A 409 if no feed is under way."""
        feed = entry.feed
        if not entry.feeding:
            raise ServiceError(409, f"stream {entry.id} is not being fed")
        feed.stopping = True
        while feed.running:  # the feed ends at its next frame, once saved
            await asyncio.sleep(STOP_POLL_SECONDS)
        if not feed.stopped:  # it ended otherwise first: its file's end, an error, a deletion, the server's stop
            raise ServiceError(409, f"feeding {feed.source} ended before it could be stopped: "
                                    f"{feed.error or 'its file was fed whole'}")
        return {**feed.describe(), "skip": feed.skipped + feed.offered}
