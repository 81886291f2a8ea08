"""The page at ``/`` (served under ``/ui/``), built with NiceGUI (Vue + Quasar components driven from Python):
open a video file or the browser's camera, watch frames go in, ask at any moment, see each answer with the stream
time it refers to, and what the carried state holds over time. The key comes from ``?key=`` (the address the
server prints) or is typed in.

The page works on the same `StreamRegistry` as the API; the camera's frames are posted to the API itself
(``POST /v1/streams/{id}/frames``) by a few lines of script, since no component captures the camera.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from ..api.encoded import METHOD_DEFAULT
from ..errors import StateKVError
from .errors import ServiceError

log = logging.getLogger("statekv.serve")
MAX_UPLOAD_BYTES = 512 * 2**20
PAGE_NEW_TOKENS = 16

# Captures the camera into the <video> element and posts one JPEG per second to the stream (the page's only script).
CAMERA_SCRIPT = """
<script>
window.statekvCamera = {
  timer: null, media: null,
  async start(streamId, key) {
    const video = document.getElementById('statekv-camera');
    this.media = await navigator.mediaDevices.getUserMedia({video: true});
    video.srcObject = this.media; await video.play();
    const canvas = document.createElement('canvas'), began = performance.now();
    this.timer = setInterval(() => {
      canvas.width = video.videoWidth; canvas.height = video.videoHeight;
      canvas.getContext('2d').drawImage(video, 0, 0);
      const t = (performance.now() - began) / 1000;
      canvas.toBlob(blob => fetch(`/v1/streams/${streamId}/frames?t=${t.toFixed(3)}`, {method: 'POST',
        headers: {'Authorization': `Bearer ${key}`, 'Content-Type': 'image/jpeg'}, body: blob}), 'image/jpeg', 0.85);
    }, 1000);
  },
  stop() {
    clearInterval(this.timer); this.timer = null;
    if (this.media) this.media.getTracks().forEach(track => track.stop());
  },
};
</script>
"""


def mount_page(app: FastAPI, service: Any) -> None:
    from nicegui import ui

    uploads = Path(service.config.state_dir) / "uploads"

    @ui.page("/", title="statekv")
    def index(request: Request) -> None:
        ui.add_body_html(CAMERA_SCRIPT)
        current: dict[str, Any] = {"entry": None, "key": request.query_params.get("key", "")}

        def owner() -> str:
            found = service.keys.owner(key.value.strip())
            if found is None:
                raise ServiceError(401, "enter a valid API key (the server prints an address with one)")
            return found

        async def new_stream(name: str):
            if current["entry"] is not None:
                stop_camera()
            current["entry"] = await service.registry.create(owner(), {"name": name[:200]})
            answers.clear()
            return current["entry"]

        async def on_upload(event) -> None:
            try:
                entry = await new_stream(event.file.name)
                uploads.mkdir(parents=True, exist_ok=True)
                path = uploads / f"{entry.id}-{secrets.token_hex(4)}{Path(event.file.name).suffix[:8]}"
                await event.file.save(path)
            except StateKVError as error:
                ui.notify(str(error), type="negative")
                return
            status.set_text(f"stream {entry.id}: feeding {event.file.name}")
            asyncio.create_task(feed(entry, path, event.file.name))

        async def feed(entry, path: Path, name: str) -> None:
            try:
                fed = await service.registry.feed(entry, path, None)
                status.set_text(f"stream {entry.id}: {fed['kept']} frames of {name} fed and saved")
            except StateKVError as error:
                log.warning("page upload %s: %s", path.name, error)
            finally:
                path.unlink(missing_ok=True)

        async def start_camera() -> None:
            try:
                entry = await new_stream("camera")
            except StateKVError as error:
                ui.notify(str(error), type="negative")
                return
            ui.run_javascript(f"statekvCamera.start({entry.id!r}, {key.value.strip()!r})")
            status.set_text(f"stream {entry.id}: camera")

        def stop_camera() -> None:
            ui.run_javascript("statekvCamera.stop()")

        async def ask() -> None:
            entry, text = current["entry"], question.value.strip()
            if entry is None or not text:
                ui.notify("start a stream and type a question first", type="warning")
                return
            try:
                async with service.ask_slots.hold():
                    result = await service.registry.ask(entry, text, PAGE_NEW_TOKENS, METHOD_DEFAULT)
            except StateKVError as error:
                ui.notify(str(error), type="negative")
                return
            when = "no frame" if result["seconds"] is None else f"{result['seconds']:.1f} s"
            with answers:
                with ui.card().classes("w-full").props("flat bordered"):
                    ui.label(f"at {when} ({result['frames']} frames): {text}").classes("text-caption statekv-answer-time")
                    ui.label(result["answer"]).classes("text-body1 statekv-answer")

        def refresh() -> None:
            entry = current["entry"]
            if entry is None:
                return
            info = entry.describe()
            seconds = "-" if info["seconds"] is None else f"{info['seconds']:.1f} s"
            stats.set_text(f"frames {info['frames']} | stream time {seconds} | tokens {info['tokens']} | carried "
                           f"{info['carried']} | cache {info['cache_bytes'] / 2**20:.1f} MiB"
                           + (" | feeding" if info["feeding"] else ""))
            points = entry.history[-500:]
            chart.options["xAxis"]["data"] = [round(point["seconds"], 1) for point in points]
            chart.options["series"][0]["data"] = [point["carried"] for point in points]
            chart.options["series"][1]["data"] = [point["frames"] for point in points]
            chart.update()

        with ui.column().classes("w-full max-w-5xl mx-auto gap-3 p-4"):
            ui.label("statekv: ask a live video").classes("text-h5")
            key = ui.input("API key", value=current["key"], password=True).classes("w-96")
            with ui.row().classes("items-start gap-6"):
                with ui.column():
                    ui.label("A video file").classes("text-subtitle2")
                    ui.upload(label="open a video", auto_upload=True, max_file_size=MAX_UPLOAD_BYTES,
                              on_upload=on_upload).props('accept="video/*" flat bordered').classes("w-72")
                with ui.column():
                    ui.label("Or the camera").classes("text-subtitle2")
                    ui.html('<video id="statekv-camera" muted playsinline style="width:288px;background:#eee"></video>',
                            sanitize=False)
                    with ui.row():
                        ui.button("start camera", on_click=start_camera)
                        ui.button("stop", on_click=stop_camera).props("outline")
            status = ui.label("no stream yet").classes("text-caption")
            stats = ui.label("").classes("text-body2 statekv-stats")
            chart = ui.echart({
                "tooltip": {"trigger": "axis"}, "legend": {"data": ["carried tokens", "frames"]},
                "xAxis": {"type": "category", "name": "stream time (s)", "data": []},
                "yAxis": {"type": "value"},
                "series": [{"name": "carried tokens", "type": "line", "data": [], "showSymbol": False},
                           {"name": "frames", "type": "line", "data": [], "showSymbol": False}],
            }).classes("w-full h-64")
            with ui.row().classes("w-full items-center"):
                question = ui.textarea("Question", placeholder="What colour was the triangle?").props(
                    "autogrow").classes("grow")
                ui.button("Ask", on_click=ask)
            answers = ui.column().classes("w-full gap-2")
        ui.timer(0.5, refresh)

    ui.run_with(app, mount_path="/ui", title="statekv", show_welcome_message=False, reconnect_timeout=10.0,
                storage_secret=None)
