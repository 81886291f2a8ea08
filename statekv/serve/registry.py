"""The streams a server holds, who owns each, and keeping them on disk.

Layout of ``--state-dir``: ``streams/ID.json`` (id, owner digest, settings, what was last saved), written before
the stream's creation is answered, and ``streams/ID.safetensors``, the stream in the verified saved-stream format
(`statekv.Stream.save`), replaced atomically. A stream is saved after ``save_every_frames`` unsaved frames or
``save_every_seconds`` with unsaved frames, when a file source has been fed in full, and on shutdown. A restarted
server loads every stream back; one whose file cannot be loaded starts again empty, its file kept aside.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StateKVError
from ..stream import Stream
from .config import ServeConfig
from .errors import ServiceError
from .metrics import Metrics
from .worker import ModelExecutor

log = logging.getLogger("statekv.serve")

METHOD_FIELDS = ("method", "budget", "frames", "sinks", "retrieve")
STREAM_FIELDS = METHOD_FIELDS + ("horizon_frames", "max_fps", "name")
_ID = re.compile(r"^st_[0-9a-f]{24}$")
HISTORY = 2000  # points of a stream's history kept for the page


@dataclass
class StreamEntry:
    """One stream: its owner (a key digest), settings, the live `Stream`, and what is on disk."""

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
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    feeding: bool = False
    deleted: bool = False

    @property
    def dirty(self) -> bool:
        return self.stream.pushed != self.saved["pushed"]

    def describe(self) -> dict[str, Any]:
        stream, stats = self.stream, self.stream.stats
        return {"id": self.id, "object": "stream", "name": self.name, "created": int(self.created),
                "settings": self.settings, "horizon_frames": self.horizon_frames, "max_fps": self.max_fps,
                "frames": stream.frames, "pushed": stream.pushed, "pending": len(stream.pending),
                "seconds": self.last_seconds, "tokens": stream.tokens, "carried": stats.carried_tokens,
                "cache_bytes": stats.cache_bytes, "encode_seconds": stats.seconds, "feeding": self.feeding,
                "saved": dict(self.saved), "resume_from": stream.pushed, "resume_after_seconds": self.last_seconds}


class StreamRegistry:
    def __init__(self, config: ServeConfig, qa: Any, worker: ModelExecutor, metrics: Metrics | None = None):
        self.config, self.qa, self.worker, self.metrics = config, qa, worker, metrics
        self.folder = Path(config.state_dir) / "streams"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, StreamEntry] = {}
        self._models: dict[tuple, Any] = {}
        self._default_horizon: int | None = None

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
            raise ServiceError(400, f"horizon_frames must be a positive integer or null (no horizon), got {horizon!r}")
        max_fps = body.get("max_fps", self.config.default_max_fps)
        if max_fps is not None and (isinstance(max_fps, bool) or not isinstance(max_fps, (int, float))
                                    or not math.isfinite(max_fps) or max_fps <= 0):
            raise ServiceError(400, f"max_fps must be a positive number or null, got {max_fps!r}")
        name = body.get("name", "stream")
        if not isinstance(name, str) or len(name) > 200:
            raise ServiceError(400, "name must be a string of at most 200 characters")
        return settings, horizon, None if max_fps is None else float(max_fps), name

    @property
    def default_horizon_frames(self) -> int | None:
        """``default_horizon_frames`` (None: no horizon), or fewer when the model's RoPE cannot hold that many."""
        if self.config.default_horizon_frames is None:
            return None
        if self._default_horizon is None:
            from ..core.rope import rope_capacity

            wanted = self.config.default_horizon_frames
            capacity = rope_capacity(self.qa.adapter.model.config.get_text_config())
            low, high = 1, wanted
            if capacity is not None and self.qa.horizon_for(wanted) > capacity:
                while low < high:  # the most frames whose horizon fits
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if self.qa.horizon_for(middle) <= capacity else (low, middle - 1)
                wanted = low
            self._default_horizon = wanted
        return self._default_horizon

    # -- lookup --------------------------------------------------------------------------------------------
    def get(self, owner: str, stream_id: str) -> StreamEntry:
        """The caller's stream; 404 for an unknown id and for another key's (which must not be told apart)."""
        entry = self.entries.get(stream_id) if isinstance(stream_id, str) and _ID.match(stream_id) else None
        if entry is None or entry.owner != owner or entry.deleted:
            raise ServiceError(404, f"no stream {str(stream_id)[:80]!r}")
        return entry

    def owned(self, owner: str) -> list[StreamEntry]:
        return [entry for entry in self.entries.values() if entry.owner == owner and not entry.deleted]

    def cache_bytes(self) -> int:
        return sum(entry.stream.stats.cache_bytes for entry in list(self.entries.values()))

    # -- creating and deleting -----------------------------------------------------------------------------
    async def create(self, owner: str, body: dict[str, Any]) -> StreamEntry:
        settings, horizon, max_fps, name = self.check_settings(body)
        if len(self.entries) >= self.config.max_streams:
            raise ServiceError(429, f"the server holds its limit of {self.config.max_streams} streams; delete one "
                               "or retry later", headers={"Retry-After": "30"})
        stream_id = f"st_{secrets.token_hex(12)}"
        qa = self.qa_for(settings)
        stream = await self.worker.run(qa.stream, horizon, max_fps=max_fps, name=name)
        entry = StreamEntry(stream_id, owner, settings, horizon, max_fps, name, time.time(), stream)
        try:
            self._write_record(entry)  # the creation is durable before it is answered
        except OSError as error:
            await self.worker.run(stream.close)
            raise ServiceError(503, f"cannot record the stream in the state folder: {error}") from None
        self.entries[stream_id] = entry
        return entry

    async def delete(self, entry: StreamEntry) -> None:
        entry.deleted = True
        async with entry.lock:
            self.entries.pop(entry.id, None)
            await self.worker.run(entry.stream.close)
            for path in (self._record(entry.id), self._state(entry.id)):
                path.unlink(missing_ok=True)

    # -- model work ----------------------------------------------------------------------------------------
    def push_now(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame (on the model's thread); save when enough frames are unsaved."""
        frames = self._before_push(entry)
        return self._after_push(entry, seconds, frames, entry.stream.push(image, seconds))

    def _before_push(self, entry: StreamEntry) -> int:
        if entry.deleted:
            raise ServiceError(404, f"no stream {entry.id!r}")
        return entry.stream.frames

    def _after_push(self, entry: StreamEntry, seconds: float | None, frames: int, kept: bool) -> bool:
        entry.last_seconds = seconds if seconds is not None else _next_time(entry)
        for _ in range(entry.stream.frames - frames):
            if self.metrics:
                self.metrics.frame_done()
        if kept:
            stats = entry.stream.stats
            entry.history.append({"seconds": entry.last_seconds, "frames": entry.stream.frames,
                                  "carried": stats.carried_tokens, "cache_bytes": stats.cache_bytes})
            del entry.history[:-HISTORY]
        if entry.stream.pushed - entry.saved["pushed"] >= self.config.save_every_frames:
            self.save_now(entry)
        return kept

    async def push(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame; on a worker that batches pushes (`ModelWorker.push`), with the other streams' pushes
        waiting meanwhile."""
        async with entry.lock:
            batched = getattr(self.worker, "push", None)
            if batched is None:
                return await self.worker.run(self.push_now, entry, image, seconds)
            return await batched(entry.stream, image, seconds, before=lambda: self._before_push(entry),
                                 after=lambda frames, kept: self._after_push(entry, seconds, frames, kept))

    def batched_steps(self) -> int:
        """Language-model forwards that stepped several streams together, over the server's models."""
        models = [self.qa, *list(self._models.values())]
        return sum(getattr(getattr(qa, "step_scheduler", None), "batched_steps", 0) for qa in models)

    async def feed(self, entry: StreamEntry, path: Path, start: float | None) -> dict[str, Any]:
        """Push every frame of a video file (sampled at the stream's max_fps), then save. Frames are timed from
        ``start`` (default: just after the stream's last frame)."""
        from ..video import open_video

        video = await self.worker.run(open_video, str(path))
        rate = entry.max_fps or (video.fps if getattr(video, "fps", None) else 1.0)
        async with entry.lock:
            if start is None:
                start = 0.0 if entry.last_seconds is None else entry.last_seconds + 1.0 / rate
            entry.feeding, kept, offered = True, 0, 0
            try:
                frames = iter(video.sample_at_rate(rate))
                while True:
                    frame = await self.worker.run(next, frames, None)
                    if frame is None:
                        break
                    kept += await self.worker.run(self.push_now, entry, frame.image, start + frame.timestamp)
                    offered += 1
                await self.worker.run(self.save_now, entry)
            finally:
                entry.feeding = False
        return {"source": path.name, "offered": offered, "kept": kept}

    async def ask(self, entry: StreamEntry, question: Any, max_new_tokens: int, retrieve: Any,
                  streamer: Any = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "retrieve": retrieve}
        if streamer is not None:
            kwargs["streamer"] = streamer
        return await self.worker.run(self._ask_now, entry, question, kwargs)

    @staticmethod
    def _ask_now(entry: StreamEntry, question: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The answer with the frames and the stream time it refers to (read on the model's thread, before any
        later push)."""
        answer = entry.stream.ask(question, **kwargs)
        return {"answer": answer, "frames": entry.stream.frames, "seconds": entry.last_seconds, "id": entry.id}

    # -- saving --------------------------------------------------------------------------------------------
    def save_now(self, entry: StreamEntry) -> None:
        """Save the stream (on the model's thread) and note what was saved in its record."""
        if entry.deleted or not entry.dirty and self._state(entry.id).exists():
            return
        entry.stream.save(self._state(entry.id))
        entry.saved = {"pushed": entry.stream.pushed, "frames": entry.stream.frames, "seconds": entry.last_seconds}
        entry.saved_at = time.monotonic()
        self._write_record(entry)

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

    def restore(self) -> int:
        """Load every stream recorded in the state folder (at startup); returns how many."""
        for record in sorted(self.folder.glob("st_*.json")):
            try:
                data = json.loads(record.read_text())
                entry = self.worker.run_blocking(self._restore_one, data)
            except (OSError, ValueError, KeyError, TypeError, StateKVError) as error:
                log.error("cannot restore %s: %s", record.name, error)
                continue
            self.entries[entry.id] = entry
        return len(self.entries)

    def _restore_one(self, data: dict[str, Any]) -> StreamEntry:
        qa = self.qa_for(data["settings"])
        state, stream = self._state(data["id"]), None
        saved = {"pushed": 0, "frames": 0, "seconds": None}
        if state.exists():
            try:
                stream = Stream.load(state, qa)
                recorded = data.get("saved") or {}
                saved = {"pushed": stream.pushed, "frames": stream.frames,
                         "seconds": recorded.get("seconds") if recorded.get("pushed") == stream.pushed else None}
            except StateKVError as error:
                aside = state.with_name(f"{state.name}.unreadable-{int(time.time())}")
                os.replace(state, aside)
                log.error("stream %s could not be loaded (%s); it starts again empty, its file kept as %s",
                          data["id"], error, aside.name)
        if stream is None:
            stream = qa.stream(data["horizon_frames"], max_fps=data["max_fps"], name=data["name"])
        entry = StreamEntry(data["id"], data["owner"], data["settings"], data["horizon_frames"], data["max_fps"],
                            data["name"], data["created"], stream, last_seconds=saved["seconds"], saved=saved)
        return entry

    # -- files ---------------------------------------------------------------------------------------------
    def _record(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.json"

    def _state(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.safetensors"

    def _write_record(self, entry: StreamEntry) -> None:
        record = {"id": entry.id, "owner": entry.owner, "settings": entry.settings,
                  "horizon_frames": entry.horizon_frames, "max_fps": entry.max_fps, "name": entry.name,
                  "created": entry.created, "saved": entry.saved}
        _write_atomic(self._record(entry.id), json.dumps(record, indent=1).encode())


def _next_time(entry: StreamEntry) -> float:
    step = 1.0 / entry.max_fps if entry.max_fps else 1.0
    return 0.0 if entry.last_seconds is None else entry.last_seconds + step


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
