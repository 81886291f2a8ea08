"""The page's parts that are not its layout: its script, the note that shows a failure in place, the page's events
made readable (`readable_events`), and the small conversions it shows values with."""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any

from .answer_notes import read_count, read_frames
from .errors import ServiceError

THUMBNAIL_WIDTH = 320
LOGGED_URL_CHARACTERS = 300
SHOWN_ID_CHARACTERS = 40  # a stream's id is 27
LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # (JSON.stringify escapes lone ones alone)
log = logging.getLogger("statekv.serve")

# The page's only script: the browser's memory of the key and the open stream, and the camera, which is asked
# for before any stream is made; it posts one JPEG per second to the stream and reports any refusal.
PAGE_SCRIPT = """
<style>
@media (max-width: 767px) {  /* a phone: the stream list above the open stream, rows of fields wrapped */
  .statekv-columns { flex-direction: column !important; flex-wrap: nowrap !important; align-items: stretch; }
  .statekv-columns > * { width: 100% !important; }
  .statekv-wraps { flex-wrap: wrap !important; }
  .statekv-wraps > .statekv-choice, .statekv-wraps > .statekv-watch-question { min-width: 45%; }
}
.statekv-title { overflow-wrap: anywhere; min-width: 0; }
</style>
<script>
// NiceGUI never sends a value of 1 MB or more (the server kept the one sent before, and asked it): a longer one is
// cut to 100,000 characters, over every limit of the page, so its note says it is too long
window.addEventListener('input', event => {
  const field = event.target;
  if ((field instanceof HTMLInputElement || field instanceof HTMLTextAreaElement) && field.value.length > 100000)
    field.value = field.value.slice(0, 100000);
}, true);
window.statekvPage = {
  remembered() {
    return {key: localStorage.getItem('statekv-key') || '', stream: localStorage.getItem('statekv-stream') || ''};
  },
  remember(key, stream) {
    if (key === null) localStorage.removeItem('statekv-key'); else if (key) localStorage.setItem('statekv-key', key);
    if (stream) localStorage.setItem('statekv-stream', stream); else localStorage.removeItem('statekv-stream');
    const address = new URL(window.location.href);
    address.searchParams.delete('key');
    if (stream) address.searchParams.set('stream', stream); else address.searchParams.delete('stream');
    window.history.replaceState(null, '', address.toString());
  },
};
// the uploaders' add buttons are named by their icon's ligature ("add_box"): named for a screen reader instead
window.statekvUploadLabels = [['statekv-upload-new', 'open a video file (a new stream)'],
                              ['statekv-upload-more', 'add a video to this stream']];
new MutationObserver(() => {
  for (const [name, label] of window.statekvUploadLabels)
    document.querySelectorAll(`.${name} .q-uploader__header .q-btn`).forEach(button => {
      if (button.getAttribute('aria-label') !== label) button.setAttribute('aria-label', label);
    });
}).observe(document.documentElement, {childList: true, subtree: true});
window.statekvCamera = {  // one capture at a time: each open or stop starts a new generation, and what an older
  timer: null, media: null, generation: 0,  // one finds or sends later (a camera granted, a frame's reply) is let go
  async open() {
    this.stop();
    const mine = this.generation;
    let media;
    try {
      if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia)
        throw new Error('this browser offers no camera to this page (it needs https or localhost)');
      media = await navigator.mediaDevices.getUserMedia({video: true});
    } catch (error) {
      if (mine === this.generation)
        emitEvent('statekv-camera', {ok: false, message: `no camera: ${error.message || error.name}`});
      return;
    }
    if (mine !== this.generation) { media.getTracks().forEach(track => track.stop()); return; }
    this.media = media;
    emitEvent('statekv-camera', {ok: true});
  },
  async start(streamId, key) {
    clearInterval(this.timer);
    const mine = this.generation, video = document.getElementById('statekv-camera');
    video.srcObject = this.media; await video.play();
    const canvas = document.createElement('canvas'), began = performance.now();
    this.timer = setInterval(() => {
      canvas.width = video.videoWidth; canvas.height = video.videoHeight;
      canvas.getContext('2d').drawImage(video, 0, 0);
      const t = (performance.now() - began) / 1000;
      canvas.toBlob(async blob => {
        if (mine !== this.generation) return;
        try {
          const reply = await fetch(`/v1/streams/${streamId}/frames?t=${t.toFixed(3)}`, {method: 'POST',
            headers: {'Authorization': `Bearer ${key}`, 'Content-Type': 'image/jpeg'}, body: blob});
          if (!reply.ok) {
            const body = await reply.json().catch(() => ({}));
            throw new Error((body.error && body.error.message) || `HTTP ${reply.status}`);
          }
        } catch (error) {
          if (mine !== this.generation) return;
          this.stop();
          emitEvent('statekv-camera', {ok: false, message: `the camera stopped: ${error.message}`});
        }
      }, 'image/jpeg', 0.85);
    }, 1000);
  },
  stop() {
    this.generation += 1;
    clearInterval(this.timer); this.timer = null;
    if (this.media) this.media.getTracks().forEach(track => track.stop());
    this.media = null;
  },
};
</script>
"""


class ErrorNote:
    """A failure shown beside what caused it, until its close button is pressed (or it is replaced).
    ``on_dismiss``: called when the person dismisses it."""

    def __init__(self, name: str, on_dismiss=None):
        from nicegui import ui

        self.on_dismiss = on_dismiss
        with ui.row().classes(f"w-full items-start no-wrap gap-2 rounded p-2 bg-red-1 text-negative statekv-error "
                              f"statekv-error-{name}") as self.box:
            ui.icon("error_outline").classes("mt-0.5")
            self.label = ui.label("").classes("grow text-body2 statekv-error-message")
            ui.button(icon="close", on_click=self.dismiss).props("flat dense round size=sm aria-label=dismiss")
        self.box.set_visibility(False)

    def show(self, message: str) -> None:
        from nicegui import ui

        self.label.set_text(message)
        self.box.set_visibility(True)
        # in view, wherever the page was scrolled to (below a long question, say), once it is drawn
        ui.run_javascript(f"(() => {{ let tries = 0; const go = () => {{ const note = document.getElementById("
                          f"'c{self.box.id}'); if (note && note.offsetParent !== null) note.scrollIntoView("
                          "{block: 'center'}); else if (tries++ < 100) setTimeout(go, 50); }; go(); })()")

    def clear(self) -> None:
        self.label.set_text("")
        self.box.set_visibility(False)

    async def dismiss(self) -> None:
        self.clear()
        if self.on_dismiss is not None:
            result = self.on_dismiss()
            if inspect.isawaitable(result):
                await result

    @property
    def message(self) -> str:
        return self.label.text if self.box.visible else ""


def age_text(seconds: float) -> str:
    """A stream's age for its line in the list: ``just made``, ``5 min old``, ``2 h old``, ``3 days old``."""
    if seconds < 60:
        return "just made"
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if unit == 'day' and count > 1 else ''} old"
    return "just made"


def jpeg_data_url(image: Any) -> str:
    """A small JPEG of an RGB uint8 frame ``[H, W, 3]`` as a data URL."""
    from PIL import Image

    picture = Image.fromarray(image)
    if picture.width > THUMBNAIL_WIDTH:
        picture = picture.resize((THUMBNAIL_WIDTH, max(1, round(picture.height * THUMBNAIL_WIDTH / picture.width))))
    buffer = io.BytesIO()
    picture.convert("RGB").save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def read_text(answer: dict) -> str:
    """What an answer read, for its card: the frames it retrieved, or every frame the stream held."""
    frames, count = read_frames(answer), read_count(answer)
    if frames is None:
        held = answer.get("frames") or 0
        return f"read every frame held ({held})"
    shown = ", ".join(str(frame) for frame in itertools.islice(frames, 12)) + (" …" if count > 12 else "")
    return f"read {count} frame{'s' * (count != 1)}: {shown}"


def rejected_text(files: Any, limit: int) -> str:
    """Why the uploader refused ``files`` (its ``rejected`` event's: name, type, size and why), over ``limit`` bytes
    or not a video."""
    reasons = []
    for file in (files if isinstance(files, list) else [])[:3]:
        if file.get("why") == "max-file-size":
            reasons.append(f"{file.get('name')} is {file.get('size', 0) / 2**20:.0f} MiB, over the limit of "
                           f"{limit // 2**20} MiB")
        else:
            reasons.append(f"{file.get('name')} is not a video ({file.get('type') or 'unknown type'}); "
                           "open a video file (MP4, WebM, MKV, MOV...)")
    return "; ".join(reasons) or "the file was refused"


def lost_text(lost: dict | None, info: dict) -> str:
    """What a start brought a stream back without (``lost`` of its ``info``, `entries.lost_at_start`), for its panel."""
    if not lost:
        return ""
    answers = lost.get("answers") or 0
    over = (f"; {answers} answer{'s' * (answers != 1)} below {'was' if answers == 1 else 'were'} given over frames "
            "it no longer holds" if answers else "")
    after = info.get("resume_after_seconds")
    when = "" if after is None else f", after {after:.1f} s"
    pushed = max(lost["pushed"], lost["frames"])  # an earlier statekv's record tells its loss in frames alone
    return (f"The server stopped before saving this stream's last frames: it came back without the last {pushed} "
            f"frame{'s' * (pushed != 1)} pushed ({lost['frames']} of them encoded){over}. The next frame to push is "
            f"index {info.get('resume_from')}{when}.")


def readable_events() -> None:
    """Have NiceGUI read every page event's arguments: JSON holding a lone surrogate (half of a UTF-16 pair, as
    some clipboards paste) is rewritten with U+FFFD in its place, where NiceGUI's reader refused the whole event with
    a traceback (a question typed so was read as empty); arguments that are not JSON drop their event, in one
    line."""
    from nicegui import core

    handlers = core.sio.handlers.get("/", {})
    handler = handlers.get("event")
    if handler is None or getattr(handler, "readable", False):
        return

    def on_event(sid: str, message: Any) -> Any:
        args = message.get("args") if isinstance(message, dict) else None
        if isinstance(args, list) and any(isinstance(arg, str) and LONE_SURROGATE.search(arg) for arg in args):
            try:
                message["args"] = [json.dumps(_well_formed(json.loads(arg))) if isinstance(arg, str) else arg
                                   for arg in args]
            except ValueError as error:
                log.info("a page sent an event that is not JSON (%s): dropped", error)
                return None
        return handler(sid, message)

    on_event.readable = True
    core.sio.on("event", on_event)


def _well_formed(value: Any) -> Any:
    """``value`` (read from JSON) with every lone surrogate in its strings replaced by U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_well_formed(each) for each in value]
    if isinstance(value, dict):
        return {_well_formed(key): _well_formed(each) for key, each in value.items()}
    return value


def shown_id(stream_id: str) -> str:
    """A stream id from the address or the browser's memory, for a note: a long one cut short, its length named."""
    if len(stream_id) <= SHOWN_ID_CHARACTERS:
        return stream_id
    return f"{stream_id[:SHOWN_ID_CHARACTERS]}... ({len(stream_id):,} characters)"


def busy_feeding(entry: Any) -> ServiceError:
    """The refusal of a file added to ``entry`` (a `StreamEntry`) while another is fed into it."""
    return ServiceError(409, f"this stream is being fed {entry.feed.source}; wait until it is done, or stop it")


def discard(path: Path) -> None:
    """Remove an upload's file, if it is there (the folder it was to be kept in may be missing or not a folder)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def js_literal(text: str | None) -> str:
    """A Python string as a JavaScript literal."""
    return "null" if text is None else json.dumps(text)


class HiddenKeys(logging.Filter):
    """NiceGUI logs the whole URL of a page path it does not know: a page opened with ``?key=`` (a stale bookmark, a
    typo) would put that key in the server's log, and any client could write lines of any length there."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = re.sub(r"([?&]key=)[^&#\s]*", r"\1(hidden)", message, flags=re.IGNORECASE)
        if hidden != message or len(hidden) > LOGGED_URL_CHARACTERS:
            record.msg, record.args = hidden[:LOGGED_URL_CHARACTERS] + ("..." if len(hidden) > LOGGED_URL_CHARACTERS
                                                                         else ""), ()
        return True
