"""The streams a server holds, who owns each, what each is doing, and keeping them on disk (`store.StreamFiles`).

A stream is saved once it holds ``save_every_frames`` unsaved frames (before its next push, so a save that fails
refuses that push and changes nothing), after ``save_every_seconds`` with unsaved frames, when a file source has
been fed in full, and on shutdown. A restarted server loads every stream back; one whose record, save or disk-tier
file set cannot be loaded is quarantined (`DamagedStream`: listed as damaged, never served, its files kept) and the
others are served. Why is noted in the state folder's ``quarantine/`` (`store.StreamFiles.write_note`), so every
server sharing the folder lists it; a disk-tier file set that cannot be resumed is moved there whole, and its
stream stays quarantined until it is deleted (DELETE removes the moved files too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HorizonError, InputError, StateKVError
from ..api.stream import Stream
from ..core.disk import LOCK
from ..locks import FileLock
from .config import ServeConfig
from .errors import ServiceError, public_message
from .metrics import Metrics
from .sse import ClientGone
from .store import STREAM_ID, StreamFiles
from .page_record import page_fields, recall_page
from .watches import recall, watch_records
from .worker import ModelExecutor

log = logging.getLogger("statekv.serve")

METHOD_FIELDS = ("method", "budget", "frames", "sinks", "retrieve")
STREAM_FIELDS = METHOD_FIELDS + ("horizon_frames", "max_fps", "name")
HISTORY = 2000  # points of a stream's history kept for the page
ANSWERS = 50  # a stream's last answers, kept in its record


@dataclass
class Feed:
    """A video file being fed into a stream: how far it got (``total``: the frames it should give at the
    stream's rate, estimated from its length) and, once it stopped early, why."""

    source: str
    total: int | None
    offered: int = 0
    kept: int = 0
    running: bool = True
    error: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "total": self.total, "offered": self.offered, "kept": self.kept,
                "running": self.running, "error": self.error}


@dataclass
class StreamEntry:
    """One stream: its owner (a key digest), settings, the live `Stream`, what is on disk, what it is doing."""

    id: str
    owner: str
    settings: dict[str, Any]
    horizon_frames: int | None
    max_fps: float | None
    name: str
    created: float
    stream: Stream
    last_seconds: float | None = None
    saved: dict[str, Any] = field(default_factory=lambda: {"pushed": 0, "frames": 0, "seconds": None})
    saved_at: float = field(default_factory=time.monotonic)
    history: list[dict[str, float]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    feed: Feed | None = None
    last_frame: Any = None  # the last kept frame (RGB uint8 [H, W, 3]), for the page
    updated: float | None = None  # when a frame last arrived (unix time)
    deleted: bool = False
    moved: bool = False  # let go to another replica sharing the state folder
    replica: str | None = None  # the replica holding it, when several share the state folder
    owned: bool = True  # its files name its id and owner (False: brought back from files saved before they did)

    @property
    def frames(self) -> int:
        return self.stream.frames

    @property
    def dirty(self) -> bool:
        return self.stream.pushed != self.saved["pushed"]

    @property
    def feeding(self) -> bool:
        return self.feed is not None and self.feed.running

    @property
    def state(self) -> str:
        """``feeding``, ``failed`` (its last feed stopped on an error), ``empty`` (no frame yet) or ``ready``."""
        if self.feeding:
            return "feeding"
        if self.feed is not None and self.feed.error:
            return "failed"
        return "ready" if self.stream.frames else "empty"

    def describe(self) -> dict[str, Any]:
        stream, stats = self.stream, self.stream.stats
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created),
                "updated": None if self.updated is None else int(self.updated), "state": self.state,
                "settings": self.settings, "horizon_frames": self.horizon_frames, "max_fps": self.max_fps,
                "frames": stream.frames, "pushed": stream.pushed, "pending": len(stream.pending),
                "seconds": self.last_seconds, "tokens": stream.tokens, "carried": stats.carried_tokens,
                "cache_bytes": stats.cache_bytes, "encode_seconds": stats.seconds, "feeding": self.feeding,
                "feed": None if self.feed is None else self.feed.describe(), "saved": dict(self.saved),
                "resume_from": stream.pushed, "resume_after_seconds": self.last_seconds,
                **({"replica": self.replica} if self.replica else {})}

    @property
    def tier(self) -> Path | None:
        """The folder of its disk-tier file set (None: it keeps its detailed cache elsewhere)."""
        folder = getattr(getattr(self.stream, "durability", None), "folder", None)  # RecentFrames keeps no cache
        return None if folder is None else Path(folder)

    def record(self) -> dict[str, Any]:
        """What the state folder keeps of it (besides the saved stream itself). ``owned``: its saved files and
        file set name its id and owner (checked when they are loaded; records written before hold no ``owned``)."""
        tier = self.tier
        return {"id": self.id, "owner": self.owner, "settings": self.settings, "horizon_frames": self.horizon_frames,
                "max_fps": self.max_fps, "name": self.name, "created": self.created, "saved": self.saved,
                "answers": self.answers, "owned": self.owned, "tier": None if tier is None else tier.name,
                "watches": watch_records(self.stream), **page_fields(self)}


@dataclass
class DamagedStream:
    """A stream of the state folder that could not be brought back (its record, its save or its file set is
    damaged, or names another stream or owner): listed as ``damaged`` with the reason, never served, its files left
    where they are. ``owner``: None when the record names none that can be read (then every key sees it)."""

    id: str
    owner: str | None
    reason: str
    record: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False
    frames: int = 0
    state: str = "damaged"

    @property
    def name(self) -> str:
        name = self.record.get("name")
        return name if isinstance(name, str) else self.id

    @property
    def created(self) -> float:
        created = self.record.get("created")
        return float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created), "state": self.state,
                "damaged": self.reason, "frames": 0, "feeding": False, "feed": None}

    def note(self) -> dict[str, Any]:
        """What the state folder's quarantine keeps of it (`store.StreamFiles.write_note`)."""
        return {"id": self.id, "owner": self.owner, "reason": self.reason, "name": self.name, "created": self.created,
                "at": int(time.time())}


class Quarantined(InputError):
    """A stream whose disk-tier file set cannot be resumed: moved into the state folder's quarantine (then the
    stream is damaged until it is deleted), or left where it is when it cannot be moved (then it is tried again at
    the next start)."""


class StreamRegistry:
    """Every stream of one server: creating, finding (per owner), pushing, feeding files, asking, saving and
    bringing back. Model work goes through ``worker``; files through `StreamFiles`."""

    def __init__(self, config: ServeConfig, qa: Any, worker: ModelExecutor, metrics: Metrics | None = None,
                 files: StreamFiles | None = None):
        self.config, self.qa, self.worker, self.metrics = config, qa, worker, metrics
        self.files = files or StreamFiles(config.state_dir)
        self.entries: dict[str, StreamEntry] = {}
        self.damaged: dict[str, DamagedStream] = {}  # quarantined: listed, never served
        self.arriving = 0  # streams being made or taken here (counted against max_streams before they finish)
        self._models: dict[tuple, Any] = {}
        self._max_horizon: int | None = None
        self.watch_listener = None  # (stream id) -> what its watches report each evaluation to (`serve.watches`)

    # -- settings ------------------------------------------------------------------------------------------
    def qa_for(self, settings: dict[str, Any]) -> Any:
        """The VideoQA of a stream's method settings (the server's model, shared)."""
        key = tuple(sorted(settings.items()))
        if key not in self._models:
            self._models[key] = self.qa.with_options(**settings)
        return self._models[key]

    def check_settings(self, body: dict[str, Any]) -> tuple[dict[str, Any], int, float | None, str]:
        unknown = sorted(set(body) - set(STREAM_FIELDS))
        if unknown:
            raise ServiceError(400, f"unknown stream setting {unknown[0]!r}; known: {', '.join(STREAM_FIELDS)}")
        defaults = self.qa.options
        settings = {name: body.get(name, getattr(defaults, name)) for name in METHOD_FIELDS}
        defaults.with_changes(**settings)  # checks every value (a ConfigurationError names the bad one)
        horizon = body.get("horizon_frames", self.default_horizon_frames)
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int)
                                    or not 1 <= horizon <= 10**7):
            raise ServiceError(400, f"horizon_frames must be a positive integer or null (no horizon), got "
                               f"{_shown(horizon)}")
        if horizon is not None and self.qa.engine.positions == "stream" and horizon > self.max_horizon_frames:
            raise ServiceError(409, f"horizon_frames {horizon} is more than this model can hold at positions=stream: "
                               f"at most {self.max_horizon_frames} frames (its RoPE covers {self._rope_tokens()} "
                               f"tokens, {self.qa.reserve_tokens} of them kept for questions and answers); serve "
                               "with --positions bounded, or give no horizon")
        max_fps = body.get("max_fps", self.config.default_max_fps)
        if max_fps is not None and (isinstance(max_fps, bool) or not isinstance(max_fps, (int, float))
                                    or not math.isfinite(max_fps) or max_fps <= 0):
            raise ServiceError(400, f"max_fps must be a positive number or null, got {_shown(max_fps)}")
        name = body.get("name", "stream")
        if not isinstance(name, str) or len(name) > 200:
            raise ServiceError(400, "name must be a string of at most 200 characters")
        return settings, horizon, None if max_fps is None else float(max_fps), name

    @property
    def max_horizon_frames(self) -> int:
        """The most frames a stream's horizon may hold: those whose tokens (plus the reserve for questions) fit
        the model's RoPE (10**7 when it has no limit)."""
        if self._max_horizon is None:
            capacity, low, high = self._rope_tokens(), 0, 10**7
            if capacity is not None and self.qa.horizon_for(high) > capacity:
                while low < high:  # the most frames whose horizon fits
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if self.qa.horizon_for(middle) <= capacity else (low, middle - 1)
            self._max_horizon = max(high, 1)
        return self._max_horizon

    @property
    def default_horizon_frames(self) -> int | None:
        """``default_horizon_frames`` (None: no horizon, the stream never ends), or fewer when the model's RoPE
        cannot hold that many."""
        if self.config.default_horizon_frames is None:
            return None
        return min(self.config.default_horizon_frames, self.max_horizon_frames)

    def _rope_tokens(self) -> int | None:
        from ..core.rope import rope_capacity

        return rope_capacity(self.qa.adapter.model.config.get_text_config())

    # -- lookup --------------------------------------------------------------------------------------------
    def get(self, owner: str, stream_id: str) -> StreamEntry:
        """The caller's stream; 404 for an unknown id and for another key's (which must not be told apart)."""
        entry = self.entries.get(stream_id) if isinstance(stream_id, str) and STREAM_ID.match(stream_id) else None
        if entry is None and isinstance(stream_id, str):
            self.check_damaged(owner, stream_id)
        if entry is None or entry.owner != owner or entry.deleted:
            raise ServiceError(404, f"no stream {_shown(str(stream_id)[:80])}")
        return entry

    repair = "repair them and restart"  # how a damaged stream is brought back (a replica retries when asked)

    def check_damaged(self, owner: str, stream_id: str) -> None:
        """Refuse (409, one line) work on a quarantined stream the caller may see."""
        damaged = self.damaged.get(stream_id)
        if damaged is not None and damaged.owner in (owner, None):
            raise ServiceError(409, f"stream {stream_id} is damaged ({damaged.reason}); it is not served and its "
                               f"files are kept in the state folder: {self.repair}, or delete the stream")

    async def remove_damaged(self, owner: str, stream_id: str) -> bool:
        """Delete a quarantined stream of the caller's (its files too, those moved into the quarantine included:
        its owner asked); False when there is none. One whose record names no owner stays (409): nobody can be
        told apart as its owner."""
        if not isinstance(stream_id, str) or stream_id in self.entries:
            return False
        await self.look_for_damage(stream_id)
        damaged = self.damaged.get(stream_id)
        if damaged is None or damaged.owner not in (owner, None):
            return False
        if damaged.owner is None:
            raise ServiceError(409, f"stream {stream_id} is damaged and its record names no owner that can be read; "
                               f"remove its files from the state folder by hand: {', '.join(self.files.files_of(stream_id))}")
        await self.remove_files(stream_id)
        self.damaged.pop(stream_id, None)
        return True

    async def look_for_damage(self, stream_id: str) -> None:
        """Bring ``damaged`` up to date for one stream (one server alone knows it already: nothing to do)."""

    async def remove_files(self, stream_id: str) -> None:
        """Remove every file of a stream that is not held (a damaged one)."""
        await asyncio.to_thread(self.files.remove, stream_id)

    async def find(self, owner: str, stream_id: str) -> StreamEntry:
        """The caller's stream, as `get` (a registry that shares its state folder brings it here first)."""
        return self.get(owner, stream_id)

    async def remove(self, owner: str, stream_id: str) -> None:
        """Delete the caller's stream (``DELETE``): a damaged one, or one found damaged as it is brought here."""
        if await self.remove_damaged(owner, stream_id):
            return
        try:
            entry = await self.find(owner, stream_id)
        except ServiceError as error:
            if error.status == 409 and await self.remove_damaged(owner, stream_id):
                return
            raise
        await self.delete(entry)

    def owned(self, owner: str) -> list[StreamEntry]:
        """The owner's streams, newest first."""
        entries = [entry for entry in self.entries.values() if entry.owner == owner and not entry.deleted]
        return sorted(entries, key=lambda entry: entry.created, reverse=True) + [
            damaged for damaged in self.damaged.values() if damaged.owner in (owner, None)]

    def cache_bytes(self) -> int:
        return sum(entry.stream.stats.cache_bytes for entry in list(self.entries.values()))

    # -- creating and deleting -----------------------------------------------------------------------------
    async def create(self, owner: str, body: dict[str, Any]) -> StreamEntry:
        settings, horizon, max_fps, name = self.check_settings(body)
        # counted before the first await: creations arriving together cannot all pass the check
        if len(self.entries) + self.arriving >= self.config.max_streams:
            raise ServiceError(429, f"the server holds its limit of {self.config.max_streams} streams; delete one "
                               "or retry later", headers={"Retry-After": "30"})
        self.arriving += 1
        try:
            entry = await self._create(owner, settings, horizon, max_fps, name)
        finally:
            self.arriving -= 1
        self.entries[entry.id] = entry
        return entry

    async def _create(self, owner: str, settings: dict[str, Any], horizon: int | None, max_fps: float | None,
                      name: str) -> StreamEntry:
        stream_id = f"st_{secrets.token_hex(12)}"
        qa = self.qa_for(settings)
        stream = await self.worker.run(qa.stream, horizon, max_fps=max_fps, name=name, stream_id=stream_id,
                                       owner=owner)
        entry = StreamEntry(stream_id, owner, settings, horizon, max_fps, name, time.time(), stream)
        try:
            self.files.claim(stream_id)
            self.files.write_record(entry.record())  # the creation is durable before it is answered
        except (OSError, StateKVError) as error:
            await self.worker.run(stream.close)
            remove_tier(entry)
            self.files.release(stream_id)
            if isinstance(error, StateKVError):
                raise
            raise ServiceError(503, "cannot record the stream in the state folder "
                               f"({error.strerror or error}); no stream was made") from None
        return entry

    async def delete(self, entry: StreamEntry | DamagedStream) -> None:
        if isinstance(entry, DamagedStream):
            await self.remove_damaged(entry.owner or "", entry.id)
            return
        entry.deleted = True  # from here on `get` answers 404
        async with entry.lock:
            try:
                try:
                    await self.worker.run(entry.stream.close)
                except (OSError, StateKVError) as error:  # what it would have kept is being deleted anyway
                    log.warning("stream %s did not close cleanly (%s); its files are removed all the same",
                                entry.id, error)
                self.files.remove(entry.id)
                remove_tier(entry)  # every tier: the record, the save, the disk-tier file set
            finally:
                self.entries.pop(entry.id, None)

    def dismiss(self, entry: StreamEntry) -> None:
        """Forget why the stream's last feed failed (the page's "dismiss")."""
        if entry.feed is not None and not entry.feed.running:
            entry.feed = None

    # -- pushing -------------------------------------------------------------------------------------------
    async def push(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame. Pushes to several streams that wait together step together (`ModelWorker.push`)."""
        if entry.feeding:
            raise ServiceError(409, f"stream {entry.id} is being fed {entry.feed.source}; push after it is done")
        async with entry.lock:
            return await self._push_held(entry, image, seconds)

    async def _push_held(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        batched = getattr(self.worker, "push", None)
        if batched is None:
            return await self.worker.run(self.push_now, entry, image, seconds)
        return await batched(entry.stream, image, seconds, before=lambda: self._before_push(entry),
                             after=lambda frames, kept: self._after_push(entry, image, seconds, frames, kept))

    def push_now(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame (on the model's thread), first saving the stream when enough frames are unsaved."""
        frames = self._before_push(entry)
        return self._after_push(entry, image, seconds, frames, entry.stream.push(image, seconds))

    def _before_push(self, entry: StreamEntry) -> int:
        """Checks before a push, and the save that is due (before the push: a save that fails refuses the push,
        so the frame is not streamed and a retry does not stream it twice)."""
        _check_here(entry)
        if entry.stream.pushed - entry.saved["pushed"] >= self.config.save_every_frames:
            try:
                self.save_now(entry)
            except (OSError, StateKVError) as error:
                if isinstance(error, ServiceError) and error.status != 400:
                    raise
                why = str(error).split(";")[0] if isinstance(error, StateKVError) else \
                    f"cannot save the stream ({error.strerror or type(error).__name__})"
                unsaved = entry.stream.pushed - entry.saved["pushed"]
                log.error("cannot save stream %s before a push: %s", entry.id, error)
                raise ServiceError(503, f"{why}; this frame was not streamed and the stream is as it was: "
                                   f"{entry.stream.frames} frames ({unsaved} pushed since its last save, kept in "
                                   "memory only); push the frame again once the state folder can be written",
                                   headers={"Retry-After": "5"}) from None
        return entry.stream.frames

    def _after_push(self, entry: StreamEntry, image: Any, seconds: float | None, frames: int, kept: bool) -> bool:
        entry.last_seconds = seconds if seconds is not None else _next_time(entry)
        entry.updated = time.time()
        for _ in range(entry.stream.frames - frames):
            if self.metrics:
                self.metrics.frame_done()
        if kept:
            stats = entry.stream.stats
            entry.last_frame = image
            entry.history.append({"seconds": entry.last_seconds, "frames": entry.stream.frames,
                                  "tokens": entry.stream.tokens, "carried": stats.carried_tokens,
                                  "cache_bytes": stats.cache_bytes})
            del entry.history[:-HISTORY]
        return kept

    def batched_steps(self) -> int:
        """Language-model forwards that stepped several streams together, over the server's models."""
        models = [self.qa, *list(self._models.values())]
        return sum(getattr(getattr(qa, "step_scheduler", None), "batched_steps", 0) for qa in models)

    # -- feeding a file ------------------------------------------------------------------------------------
    async def open_source(self, path: Path, shown: str) -> Any:
        """Open a video file (off the model's thread); a one-line 400 naming it as ``shown`` if it is not one."""
        from ..video import open_video

        try:
            return await asyncio.to_thread(open_video, str(path))
        except StateKVError as error:
            raise ServiceError(400, public_message(str(error), {str(path): shown})) from None

    async def feed(self, entry: StreamEntry, path: Path, start: float | None, *, shown: str | None = None,
                   video: Any = None) -> dict[str, Any]:
        """Push every frame of a video file (sampled at the stream's max_fps), then save. Frames are timed from
        ``start`` (default: just after the stream's last frame). ``shown``: the file's name in messages (never
        the server's path); ``video``: the file already opened with `open_source`.

        Frames are decoded off the model's thread and pushed as `push` pushes, so feeds and pushes of several
        streams step together. Progress and any error stay in ``entry.feed``."""
        shown = shown or path.name
        if entry.feeding:
            raise ServiceError(409, f"stream {entry.id} is being fed {entry.feed.source} already")
        if video is None:
            video = await self.open_source(path, shown)
        rate = entry.max_fps or (video.fps if getattr(video, "fps", None) else 1.0)
        entry.feed = feed = Feed(shown, frames_at_rate(video, entry.max_fps))
        try:
            async with entry.lock:
                if start is None:
                    start = 0.0 if entry.last_seconds is None else entry.last_seconds + 1.0 / rate
                frames = iter(video.sample_at_rate(rate))
                upcoming = asyncio.ensure_future(asyncio.to_thread(next, frames, None))
                try:
                    while (frame := await upcoming) is not None:
                        # the next frame decodes while this one is pushed, so its push follows at once
                        upcoming = asyncio.ensure_future(asyncio.to_thread(next, frames, None))
                        feed.kept += await self._push_held(entry, frame.image, start + frame.timestamp)
                        feed.offered += 1
                finally:
                    with contextlib.suppress(BaseException):
                        await upcoming  # never leave the decoder running on another thread
                feed.total = feed.offered
                await self.worker.run(self.save_now, entry)
        except StateKVError as error:
            feed.error = public_message(str(error), {str(path): shown})
            status = getattr(error, "status", 409 if isinstance(error, HorizonError) else 400)
            raise ServiceError(status, f"{feed.error} ({feed.kept} frames fed)") from None
        except BaseException as error:
            feed.error = f"feeding stopped ({type(error).__name__}); {feed.kept} frames fed"
            raise
        finally:
            feed.running = False
        return {"source": shown, "offered": feed.offered, "kept": feed.kept}

    # -- asking --------------------------------------------------------------------------------------------
    async def ask(self, entry: StreamEntry, question: str, max_new_tokens: int, retrieve: Any,
                  streamer: Any = None) -> dict[str, Any]:
        """Answer from everything the stream holds; the result also names the frames and stream time it refers
        to, the tokens it read and wrote (``usage``) and how long it took (``latency``, queueing included)."""
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "retrieve": retrieve}
        if streamer is not None:
            kwargs.update(streamer_arguments(streamer))
        started = time.perf_counter()
        try:
            result = await self.worker.run(self._ask_now, entry, question, kwargs)
        except ClientLeft:
            if self.metrics:
                self.metrics.stopped.inc()
            raise
        result["latency"] = round(time.perf_counter() - started, 4)
        entry.answers.append({"question": question, "at": int(time.time()),
                              **{key: result[key] for key in ("answer", "frames", "seconds", "latency", "read_frames")}})
        del entry.answers[:-ANSWERS]
        if not entry.deleted:
            try:
                await asyncio.to_thread(self.files.write_record, entry.record())
            except (OSError, StateKVError) as error:  # the answer is given; only its note in the record is lost
                log.error("cannot record an answer of stream %s: %s", entry.id, error)
        return result

    @staticmethod
    def _ask_now(entry: StreamEntry, question: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The answer with the frames and the stream time it refers to (read on the model's thread, before any
        later push). A question that does not fit the room left in the stream's horizon is refused first."""
        _check_here(entry)
        stream = entry.stream
        if stream.frames == 0 and not stream.pending:
            raise ServiceError(409, "the stream has no frame yet: push frames (or feed a video) first")
        prompt = prompt_tokens(stream, question, kwargs["max_new_tokens"])
        check_still_there(kwargs.get("streamer"))
        tokens = stream.ask_tokens(question, **kwargs)
        check_still_there(kwargs.get("streamer"))
        completion = int(tokens.shape[1])
        context = stream.tokens + prompt
        read = stream.answer_info.read_frames if stream.answer_info is not None else None
        return {"answer": stream.adapter.decode(tokens), "frames": stream.frames, "seconds": entry.last_seconds,
                "id": entry.id, "read_frames": None if read is None else list(read),
                "usage": {"prompt_tokens": context, "completion_tokens": completion,
                          "total_tokens": context + completion}}

    # -- saving --------------------------------------------------------------------------------------------
    def save_now(self, entry: StreamEntry) -> None:
        """Save the stream (on the model's thread) and note what was saved in its record."""
        if entry.deleted or not entry.dirty and self.files.has_state(entry.id):
            return
        self.files.save_state(entry.id, entry.stream.save)
        entry.saved = {"pushed": entry.stream.pushed, "frames": entry.stream.frames, "seconds": entry.last_seconds}
        entry.saved_at = time.monotonic()
        self.files.write_record(entry.record())

    async def save_due(self) -> None:
        """Save every stream whose unsaved frames have waited ``save_every_seconds``."""
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if entry.dirty and not entry.deleted and now - entry.saved_at >= self.config.save_every_seconds:
                try:
                    await self.worker.run(self.save_now, entry)
                except StateKVError as error:
                    log.error("cannot save stream %s: %s", entry.id, error)

    def save_all(self) -> None:
        """Save every stream with unsaved frames (at shutdown, from outside the event loop)."""
        for entry in list(self.entries.values()):
            try:
                self.worker.run_blocking(self.save_now, entry)
            except StateKVError as error:
                log.error("cannot save stream %s: %s", entry.id, error)

    def close_all(self) -> None:
        """Close every stream (at shutdown, once saved): a disk-tier stream lets go of its file set's lock."""
        for entry in list(self.entries.values()):
            try:
                self.worker.run_blocking(entry.stream.close)
            except Exception as error:  # noqa: BLE001 -- shutting down: the others are closed still
                log.error("cannot close stream %s: %s", entry.id, error)

    def restore(self, owners: Any = None) -> int:
        """Load every stream recorded in the state folder (at startup); returns how many. ``owners``: load only
        streams of these owner digests (the others are left on disk untouched)."""
        for path, record in self.files.records():
            if isinstance(record, Exception):
                self.quarantine(path.stem, self.files.owner_named(path), unreadable(path, record), {})
                continue
            if owners is not None and record["owner"] not in owners:
                continue
            try:
                entry = self.worker.run_blocking(self.restore_one, record)
            except Exception as error:  # noqa: BLE001 -- whatever a damaged file raises, the others are served
                self.quarantine(record["id"], record["owner"], reason_of(error), record)
                continue
            self.entries[entry.id] = entry
        return len(self.entries)

    def damaged_stream(self, stream_id: str, owner: str | None, reason: str, record: dict[str, Any]) -> DamagedStream:
        """A quarantined stream, its reason one line that names no server path and no other stream."""
        reason = public_message(reason, {str(self.files.folder.resolve()) + "/": "", str(self.files.folder) + "/": ""})
        reason = reason.strip().splitlines()[0][:300] if reason.strip() else "unreadable"
        # another stream's id is not this stream's owner's to see
        reason = re.sub(r"(stream )?'?st_[0-9a-f]{24}'?", lambda m: m.group(0) if stream_id in m.group(0) else "another stream",
                        reason)
        return DamagedStream(stream_id, owner, reason, record)

    def quarantine(self, stream_id: str, owner: str | None, reason: str, record: dict[str, Any]) -> DamagedStream:
        """Quarantine a stream: logged, listed as damaged, and noted in the state folder (for every server that
        shares it)."""
        damaged = self.damaged_stream(stream_id, owner, reason, record)
        log.error("stream %s is damaged and quarantined (not served; its files are kept): %s", stream_id,
                  damaged.reason)
        self.damaged[stream_id] = damaged
        try:
            self.files.write_note(damaged.note())
        except (OSError, StateKVError) as error:  # it is quarantined here all the same
            log.error("cannot note stream %s's quarantine in the state folder: %s", stream_id, error)
        return damaged

    def restore_one(self, data: dict[str, Any]) -> StreamEntry:
        """Load one recorded stream: from its disk-tier file set when it has one (the same folder again, every
        push it journaled), else from its last save, else empty when it was never saved. A file that cannot be
        loaded, or names another stream or owner, raises (the stream is quarantined), as does a stream whose
        file set was moved into the quarantine (`Quarantined`); a quarantine note left from an earlier failure is
        removed once it loads."""
        moved = self.files.quarantined(data["id"])
        if moved:  # its journaled pushes are there, not in its save: never served without them
            note = self.files.read_note(data["id"])
            where = f"quarantine/{moved[-1]}"
            raise Quarantined(note["reason"] if note is not None and where in note["reason"] else
                              f"its disk-tier file set was moved to {where} in the state folder")
        qa = self.qa_for(data["settings"])
        ids = {"stream_id": data["id"], "owner": data["owner"]} if data.get("owned") else {}
        stream, saved = self._resume_tier(qa, data, ids), {"pushed": 0, "frames": 0, "seconds": None}
        if stream is None:
            with self.files.local_state(data["id"]) as state:
                stream = None if state is None else Stream.load(state, qa, **ids)
        if stream is not None:
            recorded = data.get("saved") or {}
            saved = {"pushed": stream.pushed, "frames": stream.frames,
                     "seconds": recorded.get("seconds") if recorded.get("pushed") == stream.pushed else None}
        else:
            stream = qa.stream(data["horizon_frames"], max_fps=data["max_fps"], name=data["name"], **ids)
        answers = [a for a in data.get("answers") or [] if isinstance(a, dict)][-ANSWERS:]
        entry = StreamEntry(data["id"], data["owner"], data["settings"], data["horizon_frames"], data["max_fps"],
                            data["name"], data["created"], stream, last_seconds=saved["seconds"], saved=saved,
                            answers=answers, owned=bool(data.get("owned")))
        recall(entry, data, None if self.watch_listener is None else self.watch_listener(entry.id))
        recall_page(entry, data)
        if entry.record()["tier"] != data.get("tier"):  # a new file set: the record names it from now on
            try:
                self.files.write_record(entry.record())
            except (OSError, StateKVError) as error:
                log.error("cannot record stream %s's new disk-tier folder: %s", entry.id, error)
        if self.files.read_note(entry.id) is not None:  # repaired since it was quarantined
            try:
                self.files.remove_note(entry.id)
            except (OSError, StateKVError) as error:
                log.error("cannot remove stream %s's quarantine note: %s", entry.id, error)
        self.damaged.pop(entry.id, None)
        return entry

    resume_tiers = True  # a replica sharing the folder loads from the save: its file sets are its own

    def _resume_tier(self, qa: Any, data: dict[str, Any], ids: dict[str, Any]) -> Stream | None:
        """The stream resumed in its own disk-tier file set, when its record names one that is there (None:
        none). A file set that cannot be resumed raises `Quarantined`, once it is moved into the state folder's
        quarantine (left where it is when another process holds it, or it cannot be moved): it holds the pushes
        since the last save, so the stream is not served from its save without them."""
        if not self.resume_tiers or not data.get("tier") or qa.engine.offload != "disk":
            return None
        root = Path(qa.engine.offload_dir)
        folder = root / data["tier"]
        if not folder.is_dir():
            return None
        try:
            return Stream.load(folder, qa, **ids)
        except Exception as error:  # noqa: BLE001 -- whatever a damaged file set raises, the stream is quarantined
            why = public_message(reason_of(error), {str(root.resolve()) + "/": "", str(root) + "/": ""})[:160]
            problem = f"its disk-tier file set {folder.name} cannot be resumed ({why})"
        try:
            lock = FileLock.acquire(folder / LOCK, what=f"the disk cache {folder.name}", error=InputError) \
                if (folder / LOCK).exists() else None
        except InputError:  # a live process holds it: not this server's to move
            raise Quarantined(f"{problem}; left where it is, since its lock cannot be taken (another process holds "
                              "it)") from None
        try:
            where = self.files.move_to_quarantine(data["id"], folder)
        except OSError as failure:
            raise Quarantined(f"{problem}; left where it is, since it cannot be moved into the state folder's "
                              f"quarantine ({failure.strerror or type(failure).__name__})") from None
        finally:
            if lock is not None:
                lock.release()
        raise Quarantined(f"{problem}; moved to {where} in the state folder")


def frames_at_rate(video: Any, max_fps: float | None) -> int:
    """About how many frames a video file gives at ``max_fps`` (None: all), from its length: one per tick."""
    if max_fps is None:
        return video.num_frames
    return max(1, min(video.num_frames, math.ceil(video.duration * max_fps - 1e-9)))


def prompt_tokens(video: Any, question: str, max_new_tokens: int) -> int:
    """The question's prompt length in tokens, refused (413) when it and the answer do not fit the room the
    video (an `EncodedVideo` or `Stream`) has left before its horizon (a stream without one: its reserve)."""
    prompt = int(video.adapter.question_ids(question, video.state).shape[1])
    room = video.horizon - video.tokens if video.horizon is not None else video.reserve_tokens
    if prompt + max_new_tokens > room:
        raise ServiceError(413, f"the question is {prompt} tokens and its answer up to {max_new_tokens}: more than "
                           f"the {room} tokens kept for them; ask a shorter question")
    return prompt


class ClientLeft(ServiceError):
    """The client that asked went away: its answer was stopped (between two tokens) and is not recorded."""

    def __init__(self, tokens: int):
        super().__init__(499, f"the answer was stopped after {tokens} tokens: its client went away")


def streamer_arguments(streamer: Any) -> dict[str, Any]:
    """``generate``'s arguments for answering token by token through ``streamer`` (a `sse.TokenStreamer`): the
    streamer, and a stop once its client has gone away."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    return {"streamer": streamer, "stopping_criteria": StoppingCriteriaList([ClientGone(streamer.gone)])}


def check_still_there(streamer: Any) -> None:
    """`ClientLeft` when the client answered through ``streamer`` has gone away."""
    if streamer is not None and streamer.gone.is_set():
        raise ClientLeft(streamer.tokens)


def remove_tier(entry: StreamEntry) -> None:
    """Remove a closed stream's disk-tier file set (if it has one)."""
    folder = entry.tier
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def unreadable(path: Path, error: Exception) -> str:
    """Why a stream whose record ``path`` cannot be read is damaged."""
    return f"its record {path.name} is unreadable: {error}"


def reason_of(error: BaseException) -> str:
    """A one-line reason for a stream that could not be loaded."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_here(entry: StreamEntry) -> None:
    """Refuse work on a stream deleted (404) or gone to another replica (503: the retry reaches it there) while
    the request waited."""
    if entry.deleted:
        raise ServiceError(404, f"no stream {entry.id!r}")
    if entry.moved:
        raise ServiceError(503, f"stream {entry.id} moved to another replica; retry", headers={"Retry-After": "1"})


def _next_time(entry: StreamEntry) -> float:
    step = 1.0 / entry.max_fps if entry.max_fps else 1.0
    return 0.0 if entry.last_seconds is None else entry.last_seconds + step


def _shown(value: Any) -> str:
    """A client's value in a message: as JSON would write it (no Python repr), cut short."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."
