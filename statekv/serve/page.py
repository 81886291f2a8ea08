"""The page at ``/`` (served under ``/ui/``), built with NiceGUI (Vue + Quasar components driven from Python).

The key comes from ``?key=`` (the address the server prints) or is typed in; the browser remembers it. The
key's streams are listed (frames, age, state): open one to feed it more or ask it, delete one. A video file or
the camera starts a new stream. The open stream shows its feeding progress, its current frame, what it holds
and a chart of its carried state against the tokens it has seen; each answer comes with the stream time and
frames it refers to, the frames it read and how long it took. For the built-in model, which answers only multiple
choice, the page says so and offers the options A-D (`page_watches.ChoicesForm`). The stream's watches are listed
with their latest answers and can be added or deleted there; a timeline draws the frames each answer read and
where each watch's answer changed. The open stream's id is kept in the address (``?stream=``), so a
reload or a restarted server lands back on it. Every failure is shown beside what caused it and stays until
dismissed; the page checks questions exactly as the API does. A question asked in a tab that is gone (closed, or
not back within ``RECONNECT_SECONDS`` of losing its connection) stops, as one over HTTP stops once its client
disconnects: between two tokens, or before it begins if it is still waiting for the model.

The page works on the same `StreamRegistry` as the API; the camera's frames are posted to the API itself
(``POST /v1/streams/{id}/frames``) by a few lines of script, since no component captures the camera.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import warnings
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from ..errors import StateKVError
from .errors import ServiceError
from .page_parts import (PAGE_SCRIPT, ErrorNote, HiddenKeys, age_text, busy_feeding, discard, jpeg_data_url,
                         js_literal, lost_text, read_text, readable_events, rejected_text, shown_id)
from .feeding import frames_at_rate
from .page_watches import ChoicesForm, WatchPanel, timeline_height, timeline_options, timeline_rows
from .routes import MAX_QUESTION_CHARS, question_settings
from .sse import TokenStreamer

log = logging.getLogger("statekv.serve")
MAX_UPLOAD_BYTES = 512 * 2**20
PAGE_NEW_TOKENS = 16
REFRESH_SECONDS = 0.5
CHART_POINTS = 500
RECONNECT_SECONDS = 10.0  # a tab that lost its connection is kept this long for it to come back
RESTORE_SECONDS = 10.0  # how long a tab that just loaded may take to say what it remembers
ACCEPTED = "video/*,.mp4,.m4v,.mov,.mkv,.webm,.avi,.ts,.m2ts,.mts,.3gp,.flv,.wmv,.mpg,.mpeg,.ogv"  # by type or
# name: some browsers give no type for Matroska or transport streams (the server's decoding decides in the end)


def mount_page(app: FastAPI, service: Any) -> None:
    from nicegui import ui

    @ui.page("/", title="statekv")
    def index() -> None:
        ui.add_body_html(PAGE_SCRIPT)
        StreamPage(service, service.uploads).build()

    nicegui_log = logging.getLogger("nicegui")
    if not any(isinstance(each, HiddenKeys) for each in nicegui_log.filters):
        nicegui_log.addFilter(HiddenKeys())
    # at start NiceGUI looks for the server among all live objects, touching torch's deprecated ones too
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op", category=FutureWarning)
    ui.run_with(app, mount_path="/ui", title="statekv", show_welcome_message=False,
                reconnect_timeout=RECONNECT_SECONDS, storage_secret=None)
    readable_events()


class StreamPage:
    """One browser tab: its key, the stream it has open, and the elements that show them."""

    def __init__(self, service: Any, uploads: Path):
        self.service, self.registry, self.uploads = service, service.registry, uploads
        self.key, self.owner = "", None
        self.entry = None
        self.shown: dict[str, Any] = {}  # what the elements last showed, so a refresh changes only what changed
        self.rows: dict[str, Any] = {}
        self.answering: set[TokenStreamer] = set()  # the tab's questions under way, stopped once it is gone
        self.camera_stream: str | None = None  # the stream the tab's camera feeds
        self.adding_to = None  # the open stream as a file added to it began to upload (not the open one by its end)

    # -- layout ----------------------------------------------------------------------------------------------
    def build(self) -> None:
        from nicegui import ui

        ui.on("statekv-camera", self.on_camera)
        # not on_disconnect: a connection that drops and comes back (within the reconnect timeout) keeps its tab
        ui.context.client.on_delete(self.leave)
        with ui.column().classes("w-full max-w-6xl mx-auto gap-3 p-4"):
            with ui.row().classes("w-full items-center gap-4"):
                ui.label("statekv: ask a live video").classes("text-h5")
                ui.space()
                self.key_input = ui.input("API key", password=True, password_toggle_button=True).props(
                    "dense outlined").classes("w-80 statekv-key").on("keydown.enter", self.use_key)
                ui.button("use key", on_click=self.use_key).props("outline")
                self.key_status = ui.label("").classes("text-caption statekv-key-status")
            self.key_error = ErrorNote("key")
            with ui.row().classes("w-full items-start no-wrap gap-6 statekv-columns"):
                with ui.column().classes("w-80 shrink-0 gap-2 statekv-sidebar"):
                    self.build_sources()
                    ui.label("Your streams").classes("text-subtitle1 mt-2")
                    self.list_box = ui.column().classes("w-full gap-1 statekv-streams")
                    self.list_empty = ui.label("none yet").classes("text-caption text-grey-7")
                with ui.column().classes("grow gap-3 min-w-0"):
                    self.placeholder = ui.label(
                        "No stream open: enter your key, then open a video file or the camera, or open one of "
                        "your streams.").classes("text-body1 text-grey-8 statekv-status")
                    self.panel = ui.column().classes("w-full gap-3 statekv-panel")
                    with self.panel:
                        self.build_panel()
                    self.panel.set_visibility(False)
        self.set_enabled(False)
        ui.timer(REFRESH_SECONDS, self.refresh)
        ui.timer(0, self.restore, once=True)

    def build_sources(self) -> None:
        from nicegui import ui

        ui.label("New stream").classes("text-subtitle1")
        self.new_upload = self.uploader("a video file", self.on_new_upload, "new")
        self.new_upload_error = ErrorNote("upload")
        self.camera_button = ui.button("from the camera", icon="videocam", on_click=self.open_camera).props(
            "outline").classes("w-full")
        self.camera_error = ErrorNote("camera")

    def uploader(self, label: str, handler, name: str):
        from nicegui import ui

        upload = ui.upload(label=label, auto_upload=True, max_file_size=MAX_UPLOAD_BYTES, on_upload=handler).props(
            f'accept="{ACCEPTED}" flat bordered').classes(f"w-full statekv-upload-{name}")
        upload.on("rejected", lambda event: self.on_rejected(event, name),
                  js_handler="(entries) => emit(entries.map(e => ({name: e.file.name, type: e.file.type, "
                             "size: e.file.size, why: e.failedPropValidation})))")
        return upload

    def build_panel(self) -> None:
        from nicegui import ui

        with ui.row().classes("w-full items-center gap-3"):
            self.title = ui.label("").classes("text-h6 statekv-title")
            self.state_badge = ui.badge("").classes("statekv-state")
            ui.space()
            self.stop_camera_button = ui.button("stop camera", icon="stop", on_click=self.stop_camera).props("outline")
            self.stop_camera_button.set_visibility(False)
        with ui.row().classes("w-full items-start no-wrap gap-4 statekv-wraps"):
            with ui.column().classes("shrink-0 gap-1"):
                self.frame = ui.image("").classes("w-80 rounded bg-grey-3 statekv-frame").props(
                    'fit=contain no-spinner no-transition ratio=1.333')
                ui.html('<video id="statekv-camera" muted playsinline style="display:none"></video>', sanitize=False)
                self.frame_caption = ui.label("no frame yet").classes("text-caption text-grey-7 statekv-frame-caption")
            with ui.column().classes("grow gap-2 min-w-0"):
                self.stats = ui.label("").classes("text-body2 statekv-stats")
                self.lost = ui.label("").classes("text-body2 text-warning statekv-lost")
                self.progress_box = ui.column().classes("w-full gap-1")
                with self.progress_box:
                    self.progress_label = ui.label("").classes("text-body2 statekv-progress")
                    self.progress = ui.linear_progress(value=0, show_value=False).props("rounded size=10px")
                    ui.button("stop feeding", icon="stop", on_click=self.stop_feed).props("outline dense").classes(
                        "self-start statekv-stop-feed")
                self.feed_error = ErrorNote("feed", on_dismiss=self.dismiss_feed_error)  # forgotten on the server too
                self.more_upload = self.uploader("add a video to this stream", self.on_more_upload, "more")
                self.more_upload.on_begin_upload(self.more_begins)
                self.more_upload_error = ErrorNote("more")
        self.chart = ui.echart({
            "animation": False, "tooltip": {"trigger": "axis"}, "grid": {"left": 60, "right": 20, "top": 35, "bottom": 45},
            "legend": {"top": 0, "data": ["carried state", "every token (full attention)"]},
            "xAxis": {"type": "value", "name": "tokens seen", "nameLocation": "middle", "nameGap": 28, "min": 0},
            "yAxis": {"type": "value", "name": "tokens a new frame attends to", "nameLocation": "middle",
                      "nameGap": 42, "min": 0},
            "series": [{"name": "carried state", "type": "line", "data": [], "showSymbol": False},
                       {"name": "every token (full attention)", "type": "line", "data": [], "showSymbol": False,
                        "lineStyle": {"type": "dashed"}}],
        }).classes("w-full h-64 statekv-chart")
        self.choices = ChoicesForm(self.service.config.options.model)
        with ui.row().classes("w-full items-start no-wrap gap-2"):
            limit = f"over the limit of {MAX_QUESTION_CHARS} characters" + (
                " with the options A-D" if self.choices.shown else "")
            self.question = ui.textarea("Question", placeholder=self.choices.example, validation={
                limit: lambda text: len(self.choices.compose(text or "")) <= MAX_QUESTION_CHARS,
            }).props('autogrow outlined counter input-style="max-height: 12rem; overflow-y: auto"').classes(
                "grow statekv-question")
            self.ask_button = ui.button("Ask", on_click=self.ask).classes("mt-2 statekv-ask")
        self.asking = ui.row().classes("items-center gap-2 statekv-asking")
        with self.asking:
            ui.spinner(size="sm")
            ui.label("answering…").classes("text-body2")
        self.asking.set_visibility(False)
        self.ask_error = ErrorNote("ask")
        self.answers = ui.column().classes("w-full gap-2 statekv-answers")
        self.watch_panel = WatchPanel(self, self.choices)
        self.timeline = ui.echart(timeline_options()).classes("w-full h-56 statekv-timeline")

    # -- the key ---------------------------------------------------------------------------------------------
    async def restore(self) -> None:
        """On load: the key from ``?key=`` or the browser's memory, and the stream from ``?stream=`` or it."""
        from nicegui import ui

        try:
            remembered = await ui.run_javascript("statekvPage.remembered()", timeout=RESTORE_SECONDS) or {}
            query = await ui.run_javascript("Object.fromEntries(new URLSearchParams(window.location.search))",
                                            timeout=RESTORE_SECONDS) or {}
        except TimeoutError:  # the tab closed or reloaded at once (its key is entered again), or a link this slow
            log.info("a page did not say what it remembered within %g s", RESTORE_SECONDS)
            return
        key = query.get("key") or remembered.get("key") or ""
        if key:
            self.key_input.set_value(key)
            await self.use_key()
        stream_id = query.get("stream") or remembered.get("stream")
        if self.owner and stream_id:
            try:
                self.open(await self.registry.find(self.owner, stream_id))
            except ServiceError:
                self.close(f"The stream {shown_id(stream_id)} you had open was deleted (or belongs to another key).")

    async def use_key(self) -> None:
        key = (self.key_input.value or "").strip()
        owner = self.service.keys.owner(key)
        if owner is None:
            self.key, self.owner = "", None
            self.key_error.show("unknown API key: use the key the server printed (or one given with --api-key)"
                                if key else "enter the API key the server printed")
            self.key_status.set_text("")
            self.set_enabled(False)
            self.close(forget=False)  # a stale ?key= must not make the browser forget the stream it had open
            return
        changed = owner != self.owner
        self.key, self.owner = key, owner
        self.key_error.clear()
        self.key_status.set_text("key accepted")
        self.set_enabled(True)
        if changed:
            self.close()
        self.remember()
        self.refresh_list()

    def set_enabled(self, enabled: bool) -> None:
        for element in (self.new_upload, self.camera_button, self.more_upload, self.ask_button):
            element.set_enabled(enabled)

    def remember(self) -> None:
        from nicegui import ui

        stream = self.entry.id if self.entry is not None else ""
        ui.run_javascript(f"statekvPage.remember({js_literal(self.key)}, {js_literal(stream)})")

    # -- streams ---------------------------------------------------------------------------------------------
    def open(self, entry) -> None:
        self.entry = entry
        self.shown = {}
        self.answers.clear()
        self.ask_error.clear()
        self.more_upload_error.clear()
        self.watch_panel.error.clear()
        self.title.set_text(entry.name)
        self.stop_camera_button.set_visibility(entry.id == self.camera_stream)
        self.panel.set_visibility(True)
        self.placeholder.set_visibility(False)
        self.remember()
        self.refresh()

    async def open_listed(self, listed) -> None:
        """Open a stream of the list (when replicas share the state folder, it is brought to this one first)."""
        try:
            self.open(await self.registry.find(self.owner, listed.id))
        except StateKVError as failure:
            self.close(self.service.public(str(failure)))

    def close(self, note: str | None = None, forget: bool = True) -> None:
        self.entry = None
        self.shown = {}
        self.panel.set_visibility(False)
        self.placeholder.set_text(note or "No stream open: open a video file or the camera, or one of your streams.")
        self.placeholder.set_visibility(True)
        if forget:
            self.remember()

    async def delete(self, entry) -> None:
        from nicegui import ui

        with ui.dialog() as dialog, ui.card():
            ui.label(f"Delete the stream {entry.name} ({entry.frames} frames) and its saved state?")
            with ui.row():
                ui.button("delete it", on_click=lambda: dialog.submit(True)).props("color=negative")
                ui.button("keep it", on_click=lambda: dialog.submit(False)).props("flat")
        if not await dialog:
            return
        if entry.id == self.camera_stream:
            self.stop_camera()
        if self.entry is not None and self.entry.id == entry.id:
            self.close(f"The stream {entry.name} was deleted.")
        if not entry.deleted:
            try:
                await self.registry.delete(entry)
            except StateKVError as failure:
                self.close(self.service.public(str(failure)))
        self.refresh_list()

    async def create(self, name: str, error: ErrorNote):
        try:
            if self.owner is None:
                raise ServiceError(401, "enter a valid API key first")
            return await self.registry.create(self.owner, {"name": name[:200]})
        except StateKVError as failure:
            error.show(self.service.public(str(failure)))
            return None

    # -- feeding a file --------------------------------------------------------------------------------------
    def on_rejected(self, event, name: str) -> None:
        error = self.new_upload_error if name == "new" else self.more_upload_error
        error.show(rejected_text(event.args, MAX_UPLOAD_BYTES))

    async def on_new_upload(self, event) -> None:
        await self.feed_upload(event, None, self.new_upload_error, self.new_upload)

    def more_begins(self) -> None:
        self.adding_to = self.entry

    async def on_more_upload(self, event) -> None:
        """Into the stream open as the file began to upload, though another was opened while it uploaded."""
        entry, self.adding_to = self.adding_to or self.entry, None
        await self.feed_upload(event, entry, self.more_upload_error, self.more_upload)

    async def feed_upload(self, event, entry, error: ErrorNote, upload) -> None:
        """Check the file, then feed it into ``entry`` (None: a new stream named after it) in the background."""
        name = event.file.name
        upload.reset()
        path = self.uploads / f"{secrets.token_hex(8)}{Path(name).suffix[:8]}"
        try:
            try:
                self.uploads.mkdir(parents=True, exist_ok=True)
                await event.file.save(path)
            except OSError as failure:  # a full or read-only state folder
                raise ServiceError(503, f"cannot keep the uploaded {name} in {self.uploads}: "
                                   f"{failure.strerror or failure}") from None
            video = await self.registry.feeds.open_source(path, name)
            rate = entry.max_fps if entry is not None else self.service.config.default_max_fps
            # the same file (name and size) again after its feed was cut: what the stream holds of it is not fed twice
            size = path.stat().st_size
            skip = entry.feed.rest_of(name, size, entry.stream.frames) if entry is not None and entry.feed else 0
            frames = frames_at_rate(video, rate) - skip
            horizon = entry.horizon_frames if entry is not None else self.registry.settings.default_horizon_frames
            room = None if horizon is None else horizon - (entry.stream.frames if entry is not None else 0)
            if room is not None and frames > room:  # None: no horizon, any length
                raise ServiceError(409, f"{name} gives about {frames} frames at {rate or video.fps:g} per second, more than the "
                                   f"{room} {'left in this stream' if entry else 'a stream of this model holds'}")
            if entry is not None and entry.feeding:
                raise busy_feeding(entry)
        except StateKVError as failure:
            discard(path)
            self.refused(error, entry, name, failure)
            return
        if entry is None:
            entry = await self.create(name, error)
            if entry is None:
                discard(path)
                return
            self.open(entry)
        elif entry is self.entry:
            self.open(entry)
        asyncio.create_task(self.feed(entry, path, name, video, skip, size, error))

    def refused(self, error: ErrorNote, entry, name: str, failure: StateKVError) -> None:
        message = self.service.public(str(failure))
        error.show(message if entry is None or entry is self.entry else
                   f"{name} was not added to {entry.name}: {message}")

    async def feed(self, entry, path: Path, name: str, video, skip: int, size: int, error: ErrorNote) -> None:
        before = entry.feed
        try:
            await self.registry.feeds.feed(entry, path, None, shown=name, video=video, skip=skip, resumable=False,
                                           size=size)
        except StateKVError as failure:  # kept in entry.feed, shown by every tab that has the stream open
            log.info("page feed of %s into %s stopped: %s", name, entry.id, failure)
            if entry.feed is before and not error.box.is_deleted:  # refused before it began (another tab's feed
                with error.box:  # began as this one was checked, say): this tab alone is told
                    self.refused(error, entry, name, busy_feeding(entry) if entry.feeding else failure)
        finally:
            discard(path)

    async def stop_feed(self) -> None:
        """Stop the open stream's feed after its frame (`FileFeeds.stop`): its note says how far it got."""
        entry = self.entry
        if entry is not None and entry.feeding:
            with contextlib.suppress(StateKVError):  # it ended by itself meanwhile
                await self.registry.feeds.stop(entry)

    async def dismiss_feed_error(self) -> None:
        entry = self.entry
        if entry is not None:
            self.registry.dismiss(entry)
            await entry.keep_record(self.registry.files, "a dismissed feed error")  # not shown again after a restart

    # -- the camera ------------------------------------------------------------------------------------------
    def open_camera(self) -> None:
        from nicegui import ui

        self.camera_error.clear()
        ui.run_javascript("statekvCamera.open()")  # answers with a statekv-camera event

    async def on_camera(self, event) -> None:
        from nicegui import ui

        if not event.args.get("ok"):
            self.camera_error.show(str(event.args.get("message", "the camera failed"))[:300])
            self.camera_stream = None
            self.stop_camera_button.set_visibility(False)
            return
        entry = await self.create("camera", self.camera_error)
        if entry is None:
            ui.run_javascript("statekvCamera.stop()")
            self.camera_stream = None  # the capture that fed it stopped when this one opened
            return
        self.camera_stream = entry.id
        self.open(entry)
        ui.run_javascript(f"statekvCamera.start({js_literal(entry.id)}, {js_literal(self.key)})")

    def stop_camera(self) -> None:
        from nicegui import ui

        ui.run_javascript("statekvCamera.stop()")
        self.camera_stream = None
        self.stop_camera_button.set_visibility(False)

    # -- asking ----------------------------------------------------------------------------------------------
    async def ask(self) -> None:
        entry = self.entry
        if entry is None:
            return
        self.ask_button.props("loading")
        self.ask_button.set_enabled(False)
        self.asking.set_visibility(True)
        streamer = TokenStreamer(self.service.qa.adapter.tokenizer, asyncio.get_running_loop(), whole=True)
        self.answering.add(streamer)
        failure = None
        try:
            question, max_new, retrieve = question_settings({"question": self.choices.compose(self.question.value or ""),
                                                              "max_new_tokens": PAGE_NEW_TOKENS})
            async with self.service.ask_slots.hold():
                result = await self.registry.ask(entry, question, max_new, retrieve, streamer)
            self.service.answered("page", result["latency"])
        except StateKVError as error:
            failure = error
        finally:
            self.answering.discard(streamer)
            self.ask_button.props(remove="loading")
            self.ask_button.set_enabled(self.owner is not None)
            self.asking.set_visibility(False)
        if streamer.gone.is_set():
            return  # the tab is gone: nothing to show it on (an answer it stopped is counted as stopped, not given)
        if failure is not None:
            self.ask_error.show(self.service.public(str(failure)))
        self.refresh()

    def leave(self) -> None:
        """The tab is gone for good: its questions stop, at their next token or before they begin."""
        for streamer in self.answering:
            streamer.gone.set()

    # -- showing ---------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        if self.owner is None:
            return
        self.refresh_list()
        entry = self.entry
        if entry is None:
            return
        if entry.deleted:
            self.close(f"The stream {entry.name} was deleted.")
            return
        if entry.moved:
            self.close(f"The stream {entry.name} moved to another replica: open it again from the list.")
            return
        info = entry.describe()
        self.show("state", info["state"], lambda state: self.state_badge.set_text(state))
        seconds = "no frame yet" if info["seconds"] is None else f"stream time {info['seconds']:.1f} s"
        waiting = f" (and {info['pending']} waiting to be encoded)" if info["pending"] else ""
        self.show("stats", (f"{info['frames']} frames{waiting} · {seconds} · {info['tokens']} tokens seen · carried "
                            f"state {info['carried']} tokens · detailed cache {info['cache_bytes'] / 2**20:.2f} MiB"),
                  self.stats.set_text)
        lost = info["lost"]
        self.show("lost", (lost, info["resume_from"], info["resume_after_seconds"]),  # it names where to push next
                  lambda _: (self.lost.set_text(lost_text(lost, info)), self.lost.set_visibility(bool(lost))))
        self.show_feed(info["feed"], entry.feed.skip if entry.feed is not None else 0)
        at = entry.last_frame_at
        self.show("frame", (info["frames"], at and at["pushed"]), lambda _: self.show_frame(entry, info))
        self.show("chart", len(entry.history) and entry.history[-1]["tokens"], lambda _: self.show_chart(entry))
        self.show("answers", (len(entry.answers), id(entry.answers[-1]) if entry.answers else 0),
                  lambda _: self.show_answers(entry))
        self.watch_panel.refresh(entry)
        self.show("timeline", (info["frames"], len(entry.answers), id(entry.answers[-1]) if entry.answers else 0,
                               tuple((w.id, len(w.events)) for w in entry.stream.watches)),
                  lambda _: self.show_timeline(entry))

    def show_timeline(self, entry) -> None:
        rows, read, events = timeline_rows(entry)
        self.timeline.options["xAxis"]["max"] = max(entry.stream.frames - 1, 1)  # the whole stream, so far
        self.timeline.options["yAxis"]["data"] = rows
        self.timeline.options["series"][0]["data"] = read
        self.timeline.options["series"][1]["data"] = events
        self.timeline.style(f"height: {timeline_height(len(rows))}px")
        self.timeline.update()

    def show(self, what: str, value: Any, update) -> None:
        if self.shown.get(what, object()) != value:
            self.shown[what] = value
            update(value)

    def show_feed(self, feed: dict | None, skip: int) -> None:
        running = bool(feed and feed["running"])
        self.progress_box.set_visibility(running)
        if running:
            total = feed["total"]
            held = f" (its first {skip} the stream holds already: skipped)" if skip else ""
            self.progress_label.set_text(f"feeding {feed['source']}: {feed['offered']} of "
                                         f"{total if total is not None else '?'} frames{held}")
            self.progress.set_value(min(1.0, feed["offered"] / total) if total else 0)
        error = feed["error"] if feed and not running else None
        if error and self.shown.get("feed_error") != error:
            self.feed_error.show(f"feeding {feed['source']} stopped: {error}")
        elif not error and self.feed_error.message:
            self.feed_error.clear()
        self.shown["feed_error"] = error

    def show_frame(self, entry, info: dict) -> None:
        image = entry.last_frame
        if image is None:
            self.frame.set_source("")
            self.frame_caption.set_text("no frame yet" if not info["frames"] else
                                        f"{info['frames']} frames held; the next one pushed shows here")
            return
        self.frame.set_source(jpeg_data_url(image))
        at = entry.last_frame_at
        if at is None:  # a record written before frames' places were kept
            when = "" if info["seconds"] is None else f" at {info['seconds']:.1f} s"
            self.frame_caption.set_text(f"frame {info['frames']}{when}")
            return
        when = "" if at["seconds"] is None else f" at {at['seconds']:.1f} s"
        waits = ", waiting to be encoded" if at["index"] > info["frames"] else ""
        self.frame_caption.set_text(f"frame {at['index']}{when}{waits}")

    def show_chart(self, entry) -> None:
        points = entry.history[-CHART_POINTS:]
        self.chart.options["series"][0]["data"] = [[point["tokens"], point["carried"]] for point in points]
        self.chart.options["series"][1]["data"] = [[point["tokens"], point["tokens"]] for point in points]
        self.chart.update()

    def show_answers(self, entry) -> None:
        from nicegui import ui

        self.answers.clear()
        with self.answers:
            for answer in reversed(entry.answers):
                when = "no frame" if answer["seconds"] is None else f"{answer['seconds']:.1f} s"
                with ui.card().classes("w-full statekv-answer-card").props("flat bordered"):
                    ui.label(answer["question"]).classes("text-body2 text-grey-8 whitespace-pre-wrap "
                                                         "statekv-answer-question")
                    ui.label(answer["answer"] or "(an empty answer)").classes("text-body1 statekv-answer")
                    ui.label(f"at {when} ({answer['frames']} frames) · answered in {answer['latency']:.2f} s").classes(
                        "text-caption text-grey-7 statekv-answer-time")
                    ui.label(read_text(answer)).classes("text-caption text-grey-7 statekv-answer-read")

    def refresh_list(self) -> None:
        from nicegui import ui

        entries = self.registry.owned(self.owner) if self.owner else []
        ids = [entry.id for entry in entries]
        if self.shown.get("list") != ids:
            self.shown["list"] = ids
            self.list_box.clear()
            self.rows = {}
            with self.list_box:
                for entry in entries:
                    with ui.card().classes(f"w-full p-2 statekv-stream statekv-stream-{entry.id}").props(
                            "flat bordered") as card:
                        with ui.row().classes("w-full items-center no-wrap gap-1"):
                            name = ui.label(entry.name).classes("grow text-body2 ellipsis statekv-stream-name")
                            ui.button(icon="open_in_new", on_click=lambda e=entry: self.open_listed(e)).props(
                                "flat dense round size=sm aria-label=open").tooltip("open")
                            ui.button(icon="delete", on_click=lambda e=entry: self.delete(e)).props(
                                "flat dense round size=sm aria-label=delete").tooltip("delete")
                        line = ui.label("").classes("text-caption text-grey-7 statekv-stream-line")
                    self.rows[entry.id] = (card, name, line)
        self.list_empty.set_visibility(not entries)
        now = time.time()
        for entry in entries:
            card, _, line = self.rows[entry.id]
            line.set_text(f"{entry.frames} frames · {age_text(now - entry.created)} · {entry.state}")
            card.classes(add="bg-blue-1" if entry is self.entry else "", remove="" if entry is self.entry else "bg-blue-1")
