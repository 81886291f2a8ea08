"""What a stream's record keeps for the page besides its state: the chart's history, the last frame (a small
JPEG) and a file being fed into the stream (`feeding.Feed`), so a restarted server shows them again
(`StreamEntry.record`, `StreamRegistry.restore_one`)."""

from __future__ import annotations

import base64
import io
import logging
from typing import Any

import numpy as np

from ..settings.values import is_finite_number
from .feeding import Feed

log = logging.getLogger("statekv.serve")

HISTORY = 2000  # the history points a stream keeps, in memory and in its record, so a restart keeps them all
FRAME_WIDTH = 320  # the last frame is kept at most this wide
HISTORY_FIELDS = ("seconds", "frames", "tokens", "carried", "cache_bytes")


def page_fields(entry: Any) -> dict[str, Any]:
    """``{"history": [...], "last_frame": base64 JPEG or None, "feed": ...}`` of ``entry`` (``feed``: a page's
    feed under way or stopped on an error, so a restart cannot hide that its file did not all go in)."""
    feed = entry.feed
    kept = feed is not None and not feed.resumable and (feed.running or feed.error)
    return {"history": entry.history[-HISTORY:], "last_frame": _jpeg(entry.last_frame),
            "last_frame_at": getattr(entry, "last_frame_at", None), "feed": feed.recorded() if kept else None}


def recall_page(entry: Any, record: dict[str, Any]) -> None:
    """Give ``entry`` the history and last frame its ``record`` kept (what cannot be read is left out, logged),
    but for the points of frames its stream came back without: a record is also written between two saves (an
    answer, a watch), so after a kill it may be ahead of the save the stream resumed from, and then the last frame
    it shows is one of those lost (one that waited to be encoded, a Qwen3-VL frame without its partner, adds no
    point: its ``last_frame_at`` tells)."""
    history = record.get("history")
    points = [point for point in history if _point(point)] if isinstance(history, list) else []
    held = [point for point in points if point["frames"] <= entry.stream.frames]
    if isinstance(history, list):
        entry.history = held[-HISTORY:]
    _recall_feed(entry, record.get("feed"))
    frame, at = record.get("last_frame"), _frame_at(record.get("last_frame_at"))
    if at is not None and at["pushed"] > entry.stream.pushed:
        return
    if isinstance(frame, str) and len(held) == len(points):
        try:
            from PIL import Image

            entry.last_frame = np.asarray(Image.open(io.BytesIO(base64.b64decode(frame, validate=True))).convert("RGB"))
            entry.last_frame_at = at
        except Exception as error:  # noqa: BLE001 -- a picture that cannot be read is only a picture not shown
            log.error("stream %s: its record's last frame cannot be read (%s)", entry.id, error)


def _recall_feed(entry: Any, feed: Any) -> None:
    """A page's feed the record names as under way (the server stopped during it) or failed: shown as stopped."""
    if not isinstance(feed, dict) or not isinstance(feed.get("source"), str):
        return
    counts = {name: feed.get(name) if isinstance(feed.get(name), int) and not isinstance(feed.get(name), bool)
              else None for name in ("total", "offered", "kept", "skip", "held_before", "size")}
    total, offered, held_before, skip = counts["total"], counts["offered"] or 0, counts["held_before"], counts["skip"]
    error = feed.get("error") if isinstance(feed.get("error"), str) else None
    if feed.get("running") is True and (total is None or offered < total):
        frames = "?" if total is None else total + (skip or 0)  # the file's, skipped ones too
        error = (f"the server stopped during it, and the stream holds the first "
                 f"{max(0, entry.stream.frames - held_before)} of its {frames} frames: add the same file to this "
                 "stream again to feed the rest" if held_before is not None else
                 f"the server stopped after {offered} of its {frames} frames; adding the file again feeds it from "
                 "its start")
    if error:
        entry.feed = Feed(feed["source"], total, offered=offered, kept=counts["kept"] or 0, running=False,
                          error=error, resumable=False, skip=skip or 0, held_before=held_before, size=counts["size"],
                          stopped=feed.get("stopped") is True and feed.get("running") is not True,
                          counted=feed.get("running") is not True)


def _frame_at(at: Any) -> dict[str, Any] | None:
    """A record's ``last_frame_at`` (`StreamEntry.last_frame_at`), or None where it is missing or cannot be read."""
    if not isinstance(at, dict) or not all(type(at.get(name)) is int and at[name] >= 1 for name in ("index", "pushed")):
        return None
    seconds = at.get("seconds")
    return {"index": at["index"], "pushed": at["pushed"], "seconds": seconds if is_finite_number(seconds) else None}


def _point(point: Any) -> bool:
    return isinstance(point, dict) and all(
        (value := point.get(name)) is None and name == "seconds"
        or is_finite_number(value)
        for name in HISTORY_FIELDS)


def _jpeg(image: Any) -> str | None:
    if image is None:
        return None
    from PIL import Image

    picture = Image.fromarray(np.asarray(image))
    if picture.width > FRAME_WIDTH:
        picture = picture.resize((FRAME_WIDTH, max(1, round(picture.height * FRAME_WIDTH / picture.width))))
    buffer = io.BytesIO()
    picture.convert("RGB").save(buffer, format="JPEG", quality=80)
    return base64.b64encode(buffer.getvalue()).decode()
