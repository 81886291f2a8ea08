"""The service's watches (`statekv.api.watch`): what a create body may say, what the state folder keeps of them,
and the hub every evaluation reports to: the metrics (evaluations and events counted) and the clients following a
stream's events (server-sent events at ``GET /v1/streams/{id}/events``).

A stream's watches live in its `Stream` (evaluated inside its pushes, on the model's thread) and in its record
(``watches``: each one's settings, clock and the events its last save does not hold; ``watch_order``: the order
they were opened in, the latest closed ones too; ``event_runs``: the runs its events were made in, one a start, as
their ids say: `new_run`), written when a watch is made or deleted and whenever the record is
(saves, answers). A restarted server reopens them from the save and the record (`recall`), over the stream as it was
brought back: a watch made after the stream's last save is reopened from its record all the same, one deleted after
it stays deleted, and a record written after the save is turned back to the frames the save holds (its later events
and evaluations go: the frames pushed again make them again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Container
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..api.encoded import METHOD_DEFAULT
from ..api.stream_file import read_metadata
from ..api.watch import DEFAULT_NEW_TOKENS as DEFAULT_WATCH_TOKENS
from ..api.watch import Watch, default_retrieve, holds_frames, open_watch, run_evaluations
from ..api.watch_saving import check_record, restore
from ..errors import InputError, StateKVError
from ..settings.methods import refuse_unread
from ..settings.values import is_finite_number
from .errors import ServiceError, StorageError
from .stream_settings import checked_retrieve, shown

log = logging.getLogger("statekv.serve")

WATCH_FIELDS = ("question", "every", "every_seconds", "max_new_tokens", "retrieve")
MAX_WATCH_TOKENS = 256
MAX_WATCHES = 16  # per stream
MAX_EVERY = 10**6
MAX_QUESTION_CHARS = 8000
QUEUED_EVENTS = 1000  # a follower that reads nothing for this many events is dropped
KEPT_RUNS = 64  # the latest runs of a stream's events its record keeps (`new_run`)


def watch_settings(body: dict[str, Any]) -> dict[str, Any]:
    """``question``, ``every`` (frames) or ``every_seconds`` (stream seconds), ``max_new_tokens`` and ``retrieve``
    (frames per layer each evaluation retrieves, null: none; absent, `METHOD_DEFAULT`: the stream's) from a create
    body, checked (a one-line 400 otherwise)."""
    unknown = sorted(set(body) - set(WATCH_FIELDS))
    if unknown:
        raise ServiceError(400, f"unknown watch field {shown(unknown[0])}; known: {', '.join(WATCH_FIELDS)}")
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ServiceError(400, "question must be a non-empty string")
    if len(question) > MAX_QUESTION_CHARS:
        raise ServiceError(413, f"the question is {len(question)} characters, over the limit of {MAX_QUESTION_CHARS}")
    every, seconds = body.get("every"), body.get("every_seconds")
    if every is None and seconds is None:
        raise ServiceError(400, "give every (frames between evaluations) or every_seconds (stream seconds)")
    if every is not None and seconds is not None:
        raise ServiceError(400, "give every or every_seconds, not both")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_EVERY):
        raise ServiceError(400, f"every must be a whole number of frames from 1 to {MAX_EVERY}, got {shown(every)}")
    if seconds is not None and (not is_finite_number(seconds) or seconds <= 0):
        raise ServiceError(400, f"every_seconds must be a positive number, got {shown(seconds)}")
    tokens = body.get("max_new_tokens", DEFAULT_WATCH_TOKENS)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_WATCH_TOKENS:
        raise ServiceError(400, f"max_new_tokens must be an integer from 1 to {MAX_WATCH_TOKENS}, got {shown(tokens)}")
    return {"question": question.strip(), "every": every,
            "every_seconds": None if seconds is None else float(seconds), "max_new_tokens": tokens,
            "retrieve": checked_retrieve(body)}


def described(watch: Watch) -> dict[str, Any]:
    """What ``GET /v1/streams/{id}/watches/{wid}`` answers: its ``id``, ``question``, ``every`` (and
    ``every_seconds``), ``max_new_tokens``, ``retrieve``, the latest ``answer``, ``evaluations``, ``error`` and its
    ``events`` (each ``frame``, ``seconds``, ``answer``)."""
    return {"id": watch.id, "object": "watch", "question": watch.question, "every": watch.every,
            "every_seconds": watch.every_seconds, "max_new_tokens": watch.max_new_tokens, "retrieve": watch.retrieve,
            "answer": watch.answer,
            "evaluations": watch.evaluations, "error": watch.error,
            "events": [event.to_dict() for event in watch.events]}


def find_watch(entry: Any, watch_id: str) -> Watch:
    """The stream's open watch ``watch_id``; 404 otherwise."""
    for watch in entry.stream.watches:
        if watch.id == watch_id:
            return watch
    raise ServiceError(404, f"stream {entry.id} has no watch {shown(watch_id)}")


def changing_watches(entry: Any) -> Any:
    """What opening or closing one of ``entry``'s watches waits for: the stream's lock (a push, hand-over or
    deletion under way ends first), except while a file is fed to it, which holds the lock to the feed's end. Then
    the change waits for nothing: the model's one thread runs it between two of the feed's pushes, and checks
    there that the stream is still here."""
    return contextlib.nullcontext() if entry.feeding else entry.lock


def open_on(entry: Any, settings: dict[str, Any], listener: Any) -> Watch:
    """Open a watch on ``entry``'s stream (on the model's thread), ``listener`` told of every evaluation from the
    first one, which answers at once from what the stream holds. A ``retrieve`` given is refused as a question's
    is under a method that retrieves nothing (400), and one too wide for the stream past its range (409), before
    the stream reaches its range too (`statekv.api.retrieved.fits_past_range`)."""
    stream = entry.stream
    if len(stream.watches) >= MAX_WATCHES:
        raise ServiceError(409, f"stream {entry.id} has its limit of {MAX_WATCHES} watches; delete one first")
    retrieve = settings["retrieve"]
    if retrieve is METHOD_DEFAULT:
        retrieve = default_retrieve(stream)
    else:  # before the stream has frames too: an evaluation would only fail
        refuse_unread(stream.qa.method, {"retrieve": retrieve})
    with stream.lock:
        if hasattr(stream, "start"):
            stream.start()
        stream.flush_complete_steps()  # as a question does: its first answer reads every complete step taken
        watch = open_watch(stream, settings["question"], evaluate_now=False, every=settings["every"],
                           every_seconds=settings["every_seconds"], max_new_tokens=settings["max_new_tokens"],
                           steer=stream.qa.steer, retrieve=retrieve)
        entry.opening.add(watch.id)  # before its first event: none of its events is in a backlog till recorded
        watch.subscribe(listener, getattr(listener, "failed", None))
        if holds_frames(stream):
            try:
                run_evaluations([watch], raise_errors=True)
            except BaseException:
                watch.close()
                entry.opening.discard(watch.id)
                raise
    return watch


def recall(entry: Any, record: dict[str, Any], listener: Any = None) -> None:
    """Reopen the watches ``record`` names on ``entry``'s stream as it was brought back (on the model's thread):
    those its saved file brought back already keep what it held, the others are reopened from the record, and
    any the record no longer names are closed. A watch whose record is malformed, or whose settings no watch opens
    with now, is left out (logged, naming it); the others are reopened. A malformed list leaves the stream without
    watches (logged)."""
    stream = entry.stream
    saved = record.get("watches")
    if not isinstance(saved, list):
        saved = []
    wanted = [data.get("id") for data in saved if isinstance(data, dict)]
    for watch in stream.watches:
        if watch.id not in wanted:
            watch.close()
    held = {watch.id for watch in stream.watches}
    for number, data in enumerate(saved):
        if not isinstance(data, dict) or data.get("id") in held:
            continue
        try:  # each alone: one that cannot be reopened (a setting refused since) never takes the others with it
            with stream.lock:
                restore(stream, [data], where=f"stream {entry.id}'s record")
        except StateKVError as error:
            reason = str(error).replace(f"stream {entry.id}'s record: watches[0]: ", "", 1)
            log.error("stream %s: its watch %s (watches[%d] of its record) cannot be reopened (%s); it is served "
                      "without it: open it again", entry.id, watch_id(data) or "without an id", number, reason)
    order = record.get("watch_order")
    if stream.watching is not None and isinstance(order, list) and all(isinstance(key, str) for key in order):
        stream.watching.placed_as(order)
    if listener is not None:
        for watch in stream.watches:
            watch.subscribe(listener, getattr(listener, "failed", None))


def with_saved_events(entry: Any, record: dict[str, Any], files: Any) -> dict[str, Any]:
    """``record`` (a stream's, as read) with the events its watches left to the stream's save (those it names in
    ``saved_watches``) put back into each such watch that ``entry``'s stream was brought back without (one its
    disk-tier file set lacks): those of the save's record of that watch up to the frames ``saved`` says it holds,
    read from the save's metadata in ``files`` (`StreamFiles`). Such a watch that the save does not hold was
    deleted before a later save (whose record was not written: a kill, a full disk) and stays deleted. Events the
    save cannot give back are logged as lost."""
    cut, listed, frames = record.get("saved_watches"), record.get("watches"), (record.get("saved") or {}).get("frames")
    if not isinstance(cut, list) or not isinstance(listed, list) or type(frames) is not int:
        return record
    held = {watch.id for watch in entry.stream.watches}
    wanted = {key for data in listed if (key := watch_id(data)) is not None and key in cut and key not in held
              and isinstance(data.get("events"), list)}
    if not wanted:
        return record
    why, saved = "it has no save", []
    if not entry.from_save:  # (brought back from its save, the stream holds every watch the save holds)
        try:
            with files.local_state(entry.id) as path:
                saved = None if path is None else read_metadata(path).get("watches") or []
        except (ServiceError, StorageError):  # the object store not answering now: a retry, never events lost
            raise
        except (StateKVError, OSError) as error:
            saved, why = None, f"its save cannot be read ({error})"
    earlier: dict[str, list] = {}
    for number, data in enumerate(saved if isinstance(saved, list) else []):
        if watch_id(data) in wanted:
            try:
                checked = check_record(data, f"its save's watches[{number}]")
            except InputError as error:
                saved, why = None, str(error)
            else:
                earlier[data["id"]] = [event for event in checked["events"] if event[0] <= frames]
    if saved is None:  # reopened from the record alone
        log.error("stream %s: %s; the events of watch(es) %s up to frame %d are lost", entry.id, why,
                  ", ".join(sorted(wanted)), frames)
        return record
    gone = wanted - set(earlier)
    if gone:
        log.info("stream %s: watch(es) %s, deleted before its last save, stay deleted", entry.id,
                 ", ".join(sorted(gone)))
    watches = [{**data, "events": earlier[data["id"]] + data["events"]} if watch_id(data) in earlier else data
               for data in listed if watch_id(data) not in gone]
    return {**record, "watches": watches}


def watch_id(data: Any) -> str | None:
    """The id a watch record names (None: none, or not a string)."""
    found = data.get("id") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None


def watch_order(stream: Any) -> list[str]:
    """What a stream's record keeps of the order its watches were opened in, open and closed (`Watches.places`), so
    a client following it again after a restart, its last event a watch's deleted before, is placed as before."""
    watching = getattr(stream, "watching", None)
    return [] if watching is None else list(dict(watching.places))


def followed_event(watch: Watch, event: Any) -> dict[str, Any]:
    """What a follower is sent of one of ``watch``'s events: ``{"watch", "question", "frame", "seconds",
    "answer"}``."""
    return {"watch": watch.id, "question": watch.question, **event.to_dict()}


def event_id(item: dict[str, Any], runs: list[dict[str, Any]] = ()) -> str:
    """A watch event's server-sent ``id``: its frame and its watch, ``"12.w_0123abcd"``, after the run it was made
    in when that is not the stream's first (`event_run`): ``"2:12.w_0123abcd"``. A client that follows again with it
    as ``Last-Event-ID`` (what a browser's ``EventSource`` sends when it reconnects) is first sent the kept events it
    missed (`missed_events`)."""
    run = event_run(runs, item["watch"], item["frame"])
    return f"{run}:{item['frame']}.{item['watch']}" if run else f"{item['frame']}.{item['watch']}"


def event_run(runs: list[dict[str, Any]], watch_id: str, frame: int) -> int:
    """The run an event of watch ``watch_id`` at ``frame`` was made in: the latest of ``runs`` (`new_run`) whose
    start the event comes after (past the watch's last event kept then; any event of a watch opened since), else 0.
    Ids ordered by run, frame and watch are ordered as the events were sent, across restarts."""
    for run in reversed(runs):
        if frame > run["cuts"].get(watch_id, -1):
            return run["run"]
    return 0


def new_run(recorded: Any, stream: Any) -> list[dict[str, Any]]:
    """The runs of a stream's events (``recorded``: its record's ``event_runs``) and one that starts now, the stream
    brought back by a start: after a kill, the frames it lost, pushed again (or others in their place), are
    evaluated again, and their events get ids (`event_id`) that none sent before the kill had, so a client that read
    those is sent these as new, and none it read twice. ``cuts``: each open watch's last event kept (0: none); its
    later events, and those of a watch opened since, are this run's. The latest `KEPT_RUNS`."""
    cuts = {watch.id: (watch.events[-1].frame if watch.events else 0) for watch in stream.watches}
    runs = [{"run": run["run"], "cuts": {key: frame for key, frame in run["cuts"].items() if key in cuts}}
            for run in kept_runs(recorded)]  # the closed watches' events are sent no more
    return [*runs, {"run": runs[-1]["run"] + 1 if runs else 1, "cuts": cuts}][-KEPT_RUNS:]


def kept_runs(recorded: Any) -> list[dict[str, Any]]:
    """The runs a record's ``event_runs`` names (`new_run`), those malformed left out: none unless in order."""
    runs = [run for run in recorded if _is_run(run)] if isinstance(recorded, list) else []
    return runs if [run["run"] for run in runs] == sorted({run["run"] for run in runs}) else []


def _is_run(run: Any) -> bool:
    return (isinstance(run, dict) and type(run.get("run")) is int and run["run"] > 0
            and isinstance(run.get("cuts"), dict)
            and all(isinstance(key, str) and type(frame) is int for key, frame in run["cuts"].items()))


def last_seen(value: str | None, name: str = "Last-Event-ID") -> tuple[int, int, str] | None:
    """The run, frame and watch of a ``Last-Event-ID`` header (an `event_id`; ``name``: where it was given), None
    without one; a one-line 400 for anything else."""
    if value is None or not value.strip():
        return None
    head, _, watch_id = value.strip().partition(".")
    run, _, frame = head.rpartition(":")
    if (not all(part.isascii() and part.isdigit() for part in (frame, run or "0")) or not watch_id
            or len(value) > 200):
        raise ServiceError(400, f"{name} must be the id of an event of this stream (frame.watch, as in "
                                f"'12.w_0123abcd', or run:frame.watch), got {shown(value[:80])}")
    return int(run or 0), int(frame), watch_id


def missed_events(stream: Any, after: tuple[int, int, str], runs: list[dict[str, Any]] = (),
                  opening: Container[str] = ()) -> list[dict[str, Any]]:
    """The kept events of ``stream``'s open watches that come after the event ``after`` (`last_seen`), oldest
    first, as they were sent: by run (``runs``: `event_run`), then frame, a frame's events in the order the watches
    were opened (`Watches.places`), one deleted since placed where it stood (after a restart too: `watch_order`). A
    client that saw an event of a watch the stream does not know (closed before the latest
    `statekv.api.watch.KEPT_PLACES`, or never its own) is sent every event of that frame again. A watch in
    ``opening`` (its record not written yet: its live events are held back till it is, `HeldEvents`), or closed
    meanwhile, is left out."""
    run, frame, watch_id = after
    watching = stream.watching
    if watching is None:
        return []
    places = dict(watching.places)  # as they stand now: the model's thread may open or close one meanwhile
    cut = (run, frame, places.get(watch_id, -1))
    missed = []
    for watch in list(watching.open):
        events = list(watch.events)  # before it is checked: one opened adds itself to ``opening`` before any event
        if watch.id in places and watch.id not in opening and not watch.closed:
            missed += [((event_run(runs, watch.id, event.frame), event.frame, places[watch.id]),
                        followed_event(watch, event)) for event in events]
    return [item for key, item in sorted(missed, key=lambda pair: pair[0]) if key > cut]


class FeedEnd:
    """What ends the feed of a client following a stream that is no longer served here (`WatchHub.end`): the
    message of the feed's last event."""

    def __init__(self, message: str):
        self.message = message


class Follower:
    """One client following a stream's watch events: a queue on its event loop, filled from the model's thread."""

    def __init__(self, stream_id: str, loop: asyncio.AbstractEventLoop):
        self.stream_id, self.loop = stream_id, loop
        self.queue: asyncio.Queue[dict | FeedEnd | None] = asyncio.Queue(QUEUED_EVENTS)
        self.dropped = False

    def put(self, item: dict | FeedEnd | None) -> None:
        """Queue an event, or the end of the feed (a `FeedEnd`, or None: the server is stopping). A client that
        fell `QUEUED_EVENTS` behind is ``dropped``; the end of its feed is queued all the same, in place of the
        events it would not be sent, so it is told why its feed ended (a stream deleted is not followed again)."""
        def offer() -> None:
            try:
                self.queue.put_nowait(item)
            except asyncio.QueueFull:
                self.dropped = True
                if isinstance(item, dict):
                    return
                while not self.queue.empty():
                    self.queue.get_nowait()
                self.queue.put_nowait(item)

        self.loop.call_soon_threadsafe(offer)


class HeldEvents:
    """A new watch's listener (`WatchHub.listener`) whose calls wait until the watch is recorded (`release`: then
    made in order, and every later one at once), or go with it (`drop`): no follower is sent an event of a watch
    the server answered was not opened, or that a restart would not bring back. What it counts (``counted``: its
    evaluations, which the model ran whatever becomes of the watch) and its ``failed`` wait for nothing."""

    def __init__(self, listener: Any):
        self.counted = getattr(listener, "counted", None)
        self.listener = listener if self.counted is None else listener.sent
        self.failed, self.lock = getattr(listener, "failed", None), threading.Lock()
        self.held: list[tuple[Watch, Any]] | None = []  # None once released
        self.dropped = False

    def __call__(self, watch: Watch, event: Any) -> None:
        if self.counted is not None:
            self.counted(watch, event)
        with self.lock:  # one released meanwhile makes its held calls first: this one waits for them
            if self.dropped:
                return
            if self.held is not None:
                self.held.append((watch, event))
                return
        self.listener(watch, event)

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held or [], None
            for watch, event in held:
                self.listener(watch, event)

    def drop(self) -> None:
        with self.lock:
            self.held, self.dropped = [], True


class WatchHub:
    """Every watch evaluation of a server reports here: counted (``statekv_watch_evaluations_total``, and
    ``statekv_watch_events_total`` for those whose answer changed, ``statekv_watch_failures_total`` for those that
    failed) and handed to the clients following its stream (``statekv_watch_followers`` of them);
    ``statekv_watches_failing``: the open watches whose last evaluation failed, read from ``failing`` when scraped."""

    def __init__(self, registry: CollectorRegistry, failing: Callable[[], int] = lambda: 0):
        self.evaluations = Counter("statekv_watch_evaluations", "watch evaluations (standing questions answered)",
                                   registry=registry)
        self.events = Counter("statekv_watch_events", "watch events: evaluations whose answer changed",
                              registry=registry)
        self.failures = Counter("statekv_watch_failures", "watch evaluations that failed (the watch's error says "
                                "why)", registry=registry)
        self.followers: dict[str, set[Follower]] = {}
        self.lock = threading.Lock()
        self.closed = False
        Gauge("statekv_watch_followers", "clients following watch events", registry=registry).set_function(
            lambda: sum(len(group) for group in list(self.followers.values())))
        Gauge("statekv_watches_failing", "open watches whose last evaluation failed (their error says why)",
              registry=registry).set_function(lambda: float(failing()))

    def listener(self, stream_id: str):
        """What a watch of stream ``stream_id`` calls after each evaluation (`Watch.subscribe`): it is ``counted``,
        then its event ``sent`` to the stream's followers; its ``failed``, after each that failed."""

        def counted(watch: Watch, event: Any) -> None:
            self.evaluations.inc()
            if event is not None:
                self.events.inc()

        def sent(watch: Watch, event: Any) -> None:
            if event is None:
                return
            with self.lock:
                followers = list(self.followers.get(stream_id, ()))
            for follower in followers:
                follower.put(followed_event(watch, event))

        def heard(watch: Watch, event: Any) -> None:
            counted(watch, event)
            sent(watch, event)

        heard.failed = lambda watch, error: self.failures.inc()
        heard.counted, heard.sent = counted, sent  # apart: a new watch's sends wait for its record (`HeldEvents`)
        return heard

    def follow(self, stream_id: str) -> Follower:
        """A client following stream ``stream_id``'s events; its queue's ``None`` ends its feed (`close`)."""
        follower = Follower(stream_id, asyncio.get_running_loop())
        with self.lock:
            self.followers.setdefault(stream_id, set()).add(follower)
            if self.closed:
                follower.put(None)
        return follower

    def end(self, stream_id: str, message: str) -> None:
        """End the feeds of the clients following stream ``stream_id``, no longer served here (deleted, or moved
        to another replica), with an ``error`` event saying ``message``."""
        with self.lock:
            followers = self.followers.pop(stream_id, set())
        for follower in followers:
            follower.put(FeedEnd(message))

    def close(self) -> None:
        """End every client's feed, and every later one's at once: the server is stopping."""
        with self.lock:
            self.closed = True
            followers = [follower for group in self.followers.values() for follower in group]
        for follower in followers:
            follower.put(None)

    def leave(self, follower: Follower) -> None:
        with self.lock:
            followers = self.followers.get(follower.stream_id)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    self.followers.pop(follower.stream_id, None)
