"""The watch API: standing questions about a stream (`statekv.serve.watches`), thin routes over the app's `Service`.

``POST /v1/streams/{id}/watches`` ``{"question", "every", "max_new_tokens", "retrieve"}`` (or
``"every_seconds"``) -> 201 ``{"id"}``; ``GET /v1/streams/{id}/watches`` lists them;
``GET /v1/streams/{id}/watches/{wid}`` -> ``{"question", "every", "retrieve", "events": [{"frame", "seconds",
"answer"}], ...}``; ``DELETE`` it; ``GET /v1/streams/{id}/events``: every
watch event of the stream as server-sent events (``event: watch``, ``data: {"watch", "question", "frame",
"seconds", "answer"}``, ``id: {frame}.{watch}``, or ``{run}:{frame}.{watch}`` once a restart brought it back:
`event_id`), a comment every `KEEPALIVE_SECONDS` in between, until the client leaves, the stream is deleted or the
server stops (`statekv.serve.server.AppServer`). A client that follows again with the last id it read as
``Last-Event-ID`` (or ``?last_event_id=``, for a first connection that cannot set headers) is first sent the kept
events it missed, read and written off the event loop and sent a part at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from ..errors import StateKVError
from .errors import ServiceError
from .healing import check_here
from .limits import read_json
from .routes import Served
from .sse import EventStream
from .watches import (FeedEnd, HeldEvents, changing_watches, described, event_id, find_watch, last_seen,
                      missed_events, open_on, watch_settings)

log = logging.getLogger("statekv.serve")
T = TypeVar("T")
KEEPALIVE_SECONDS = 15.0
BACKLOG_EVENTS = 500  # the missed events sent together; the event loop serves others between two such parts

router = APIRouter()


@router.post("/v1/streams/{stream_id}/watches", status_code=201)
async def create_watch(stream_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    watch = await open_recorded(service, entry, watch_settings(await read_json(request, service.config.max_body_bytes)))
    return {"id": watch.id}


async def open_recorded(service: Any, entry: Any, settings: dict[str, Any]) -> Any:
    """Open a watch on ``entry``'s stream (from the API or the page) and record it: its first answer is a question,
    so it takes one of ``--max-asks`` meanwhile (429 when none is free), and a watch a restart would not bring back
    (its record cannot be written, or is written no more: the stopping server closed the stream; nor was one naming
    it written by another change meanwhile) is closed again (503), every record left without it
    (`StreamEntry.write_record`'s ``opening``). A client gone meanwhile leaves it opened and recorded, or closed,
    never halfway (`settled`)."""
    listener = HeldEvents(service.watch_hub.listener(entry.id))  # none sent before the watch is recorded

    def unopened(watch: Any) -> None:
        listener.drop()
        watch.close()  # no record names it, nor will one (`opening`) till it closes
        entry.left(watch.id)
        entry.opening.discard(watch.id)  # closed first: a backlog read meanwhile leaves it out all the same

    def recorded_now(watch: Any) -> None:
        entry.opening.discard(watch.id)  # first: a follower whose backlog left it out is sent its held events
        listener.release()

    def made() -> Any:
        # on the model's thread, whole (a record write waits for no model work): no push of a feed runs between the
        # watch's first evaluation, its record and the release of its held events, which are queued to the
        # followers before any later frame's, so a feed's event ids only grow
        check_here(entry)  # deleted, moved or damaged while the request waited
        watch = open_on(entry, settings, listener)
        try:
            written = entry.write_record(service.registry.files, None, watch.id)
        except Exception as error:
            if watch.id in entry.recorded_watches:  # a record written meanwhile (an answer, a save) holds it
                log.warning("the record of stream %s naming its new watch %s was written by another change, though "
                            "its own write failed (%s): the watch stands", entry.id, watch.id, error)
            else:
                unopened(watch)
                if not isinstance(error, (OSError, StateKVError)):
                    raise
                raise _unrecorded_watch(service, entry, error, "a new watch", "it was not opened") from None
        else:
            if not written and watch.id not in entry.recorded_watches:  # no record is written any more, none names it
                unopened(watch)
                check_here(entry)  # deleted or moved meanwhile
                raise ServiceError(503, "the server is stopping: a new watch cannot be recorded; it was not opened: "
                                   "open it again once the server is back", headers={"Retry-After": "10"})
        recorded_now(watch)
        return watch

    async with service.ask_slots.hold(), changing_watches(entry):
        check_here(entry)
        return await settled(service.worker.run(made))


async def close_recorded(service: Any, entry: Any, watch: Any) -> None:
    """Close ``watch`` of ``entry``'s stream (from the API or the page) once the stream's record, written without
    it, is on the disk; a deletion a restart would undo (the record cannot be written, or is written no more: the
    server stopping closed the stream) leaves the watch open as it was, in memory and on disk (503). Called with
    the stream's watches held (`changing_watches`): a hand-over waiting for them moves the stream with the record
    written here. A client gone meanwhile leaves the watch closed once its record is written, never open in memory
    alone (`settled`)."""
    async def closed() -> None:
        try:
            written = await asyncio.to_thread(entry.write_record, service.registry.files, watch.id)
        except (OSError, StateKVError) as error:
            raise _unrecorded_watch(service, entry, error, f"the deletion of watch {watch.id}",
                                    "it was not deleted") from None
        if not written:  # no record is written any more: its last one names the watch
            check_here(entry)  # deleted or moved meanwhile
            raise ServiceError(503, f"the server is stopping: the deletion of watch {watch.id} cannot be recorded; "
                               "it was not deleted: delete it again once the server is back",
                               headers={"Retry-After": "10"})
        await service.worker.run(watch.close)
        entry.left(watch.id)

    await settled(closed())


async def settled(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even when the caller is cancelled meanwhile (its client gone), then raise that
    cancellation (``work``'s own refusal, then, goes with it: logged where it is made; any other error is logged
    here, with its traceback, as no request reports it): a change to a stream's watches is never left halfway, its
    record saying one thing and its memory another."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        error = None if task.cancelled() else task.exception()  # retrieved: not logged as never retrieved
        if error is not None and not isinstance(error, StateKVError):
            log.error("a change to a stream's watches, its client gone, failed: %s", error, exc_info=error)
        raise asyncio.CancelledError
    return task.result()


def _unrecorded_watch(service: Any, entry: Any, error: BaseException, what: str, outcome: str) -> ServiceError:
    """The 503 of a change to ``entry``'s watches whose record could not be written (``error``), logged."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else service.public(str(error))
    log.error("cannot record %s of stream %s: %s; %s", what, entry.id, error, outcome)
    return ServiceError(503, f"cannot record {what} in the state folder ({reason}); {outcome}",
                        headers={"Retry-After": "5"})


@router.get("/v1/streams/{stream_id}/watches")
async def list_watches(stream_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    return {"object": "list", "data": [described(watch) for watch in entry.stream.watches]}


@router.get("/v1/streams/{stream_id}/watches/{watch_id}")
async def get_watch(stream_id: str, watch_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    return described(find_watch(entry, watch_id))


@router.delete("/v1/streams/{stream_id}/watches/{watch_id}")
async def delete_watch(stream_id: str, watch_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    find_watch(entry, watch_id)  # a 404 before waiting for the stream
    async with changing_watches(entry):
        check_here(entry)
        watch = find_watch(entry, watch_id)  # again: a delete that waited for the lock may have closed it
        await close_recorded(service, entry, watch)
    return {"id": watch_id, "object": "watch", "deleted": True}


@router.get("/v1/streams/{stream_id}/events")
async def follow_events(stream_id: str, request: Request, service: Served) -> EventStream:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    after = last_seen(*_resumed_from(request))
    release = service.follow_slots.take()  # refused here (429), before the events start; held till they end
    hub = service.watch_hub
    follower = hub.follow(entry.id)  # before the kept events are read: none falls between the two

    def left() -> None:  # however the response ends, also if its events never started
        release()
        hub.leave(follower)

    response = EventStream(_events(entry, follower, hub, request, after, service.registry.files), left)
    response.headers["Cache-Control"] = "no-cache"
    return response


def _resumed_from(request: Request) -> tuple[str | None, str]:
    """The last event id a client read and where it was given: its ``Last-Event-ID`` header, else its
    ``last_event_id`` query parameter. The header wins: an ``EventSource`` opened on a URL naming an id reconnects
    to that URL with the newer id it read since as the header."""
    queried = request.query_params.getlist("last_event_id")
    if len(queried) > 1:
        raise ServiceError(400, f"last_event_id is given {len(queried)} times; give it once")
    header = request.headers.get("last-event-id")
    if header is not None and header.strip():
        return header, "Last-Event-ID"
    return (queried[0] if queried else None), "last_event_id"


async def _events(entry, follower, hub, request: Request, after: tuple[int, int, str] | None, files: Any) -> Any:
    try:
        yield ": following the watches of stream " + entry.id + "\n\n"
        resent: set[str] = set()  # also queued if made while they were read
        if after is not None:
            # a long history's backlog is gathered and written off the event loop, others answered meanwhile
            parts, resent = await run_in_threadpool(_backlog, entry, after)
            if parts and (unrecorded := await _unrecorded(entry, files)) is not None:
                yield _feed_end(unrecorded)
                return
            for part in parts:
                yield part
                await asyncio.sleep(0)  # a reader that keeps up never makes a write wait: let others in between
        while True:
            try:
                item = await asyncio.wait_for(follower.queue.get(), KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                item = _gone(entry)  # its end may have been sent before this client followed
                if item is None:
                    yield ": still here\n\n"
                    continue
            if isinstance(item, dict) and (unrecorded := await _unrecorded(entry, files)) is not None:
                item = unrecorded
            if isinstance(item, FeedEnd):
                yield _feed_end(item)
                return
            if item is None or hub.closed:  # the server is stopping (its None may not have fit a full queue)
                return
            if follower.dropped:
                message = "this client fell too far behind the stream's events; follow again"
                yield "event: error\ndata: " + json.dumps({"error": {"message": message}}) + "\n\n"
                return
            if resent and event_id(item, entry.event_runs) in resent:
                continue
            yield _watch_event(item, entry.event_runs)
    finally:
        hub.leave(follower)


async def _unrecorded(entry: Any, files: Any) -> FeedEnd | None:
    """None once the run of events this start began (`statekv.serve.watches.new_run`) is in the stream's record,
    written now if it is not; else why the feed ends: an id of that run sent now could be sent again for another
    event, after a kill, by a start that found no record of it."""
    if not entry.run_unrecorded:
        return None
    await entry.keep_record(files, "the run of its watch events")
    if not entry.run_unrecorded:
        return None
    reason = (entry.record_failure or {}).get("reason", "it cannot be written")
    return FeedEnd(f"cannot record this run of stream {entry.id}'s watch events in the state folder ({reason}); "
                   "they are kept: follow again, with the last id read, once it can be written")


def _feed_end(end: FeedEnd) -> str:
    return "event: error\ndata: " + json.dumps({"error": {"message": end.message}}) + "\n\n"


def _backlog(entry: Any, after: tuple[int, int, str]) -> tuple[list[str], set[str]]:
    """The events a follower of ``entry``'s stream missed since ``after`` (`missed_events`): their server-sent text
    in parts of `BACKLOG_EVENTS`, oldest first, and their ids."""
    runs = entry.event_runs
    missed = missed_events(entry.stream, after, runs, entry.opening)
    parts = ["".join(_watch_event(item, runs) for item in missed[start:start + BACKLOG_EVENTS])
             for start in range(0, len(missed), BACKLOG_EVENTS)]
    return parts, {event_id(item, runs) for item in missed}


def _watch_event(item: dict, runs: list) -> str:
    return "event: watch\nid: " + event_id(item, runs) + "\ndata: " + json.dumps(item) + "\n\n"


def _gone(entry: Any) -> FeedEnd | None:
    """Why a followed stream is no longer served here, if it is not."""
    if entry.quarantined is not None:
        return FeedEnd(f"stream {entry.id} is damaged ({entry.quarantined}); it is no longer served")
    if entry.deleted:
        return FeedEnd(f"stream {entry.id} was deleted")
    if entry.moved:
        return FeedEnd(f"stream {entry.id} moved to another replica; follow its events again")
    return None
