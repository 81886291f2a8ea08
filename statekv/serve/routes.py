"""The stream API: /health, /v1/streams (create, list, stats, delete), frames and questions. Each route is a thin
layer over the app's `Service` (its `StreamRegistry` above all): it reads the request, checks what is HTTP's to
check, and answers."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from ..settings.values import LARGEST_INT
from .errors import ServiceError, failure_body
from .healing import check_can_ask
from .limits import IMAGE_TYPES, decode_image, media_type, read_body, read_json
from .media import resolve_source
from .sse import EventStream, TokenStreamer, event
from .stream_settings import checked_retrieve, shown

DISCONNECT_CHECK_SECONDS = 0.5  # how often a reply waiting for its answer looks for its client

DEFAULT_NEW_TOKENS = 64
MAX_NEW_TOKENS = 1024
MAX_QUESTION_CHARS = 8000


def question_settings(body: dict[str, Any]) -> tuple[str, int, Any]:
    """(question, max_new_tokens, retrieve) from an ask body, checked."""
    question = body.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ServiceError(400, "question must be a non-empty string")
    if len(question) > MAX_QUESTION_CHARS:
        raise ServiceError(413, f"the question is {len(question)} characters, over the limit of {MAX_QUESTION_CHARS}")
    max_new = body.get("max_new_tokens", DEFAULT_NEW_TOKENS)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= MAX_NEW_TOKENS:
        raise ServiceError(400, f"max_new_tokens must be an integer from 1 to {MAX_NEW_TOKENS}, got {shown(max_new)}")
    return question.strip(), max_new, checked_retrieve(body)


router = APIRouter()


def service_of(request: Request) -> Any:
    """The app's `Service` (what every route works through)."""
    return request.app.state.service


Served = Annotated[Any, Depends(service_of)]


@router.get("/health")
async def health(service: Served) -> dict:
    replica = service.hosting.replica
    return {"status": "ok", "model": service.model_id, "streams": len(service.registry.entries),
            "queued": getattr(service.worker, "queued", 0), "unsaved": service.unsaved(),
            **({"replica": replica} if replica else {})}


@router.post("/v1/streams", status_code=201)
async def create_stream(request: Request, service: Served) -> dict:
    owner = service.keys.require(request)
    body = await read_json(request, service.config.max_body_bytes, optional=True)
    entry = await service.registry.create(owner, body)
    return entry.describe()


@router.get("/v1/streams")
async def list_streams(request: Request, service: Served) -> dict:
    owner = service.keys.require(request)
    return {"object": "list", "data": [entry.describe() for entry in service.registry.owned(owner)]}


@router.get("/v1/streams/{stream_id}")
async def stream_stats(stream_id: str, request: Request, service: Served) -> dict:
    return (await service.registry.find(service.keys.require(request), stream_id)).describe()


@router.get("/v1/streams/{stream_id}/history")
async def stream_history(stream_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    return {"id": entry.id, "history": list(entry.history)}


@router.delete("/v1/streams/{stream_id}")
async def delete_stream(stream_id: str, request: Request, service: Served) -> dict:
    await service.registry.remove(service.keys.require(request), stream_id)
    return {"id": stream_id, "object": "stream", "deleted": True}


@router.post("/v1/streams/{stream_id}/frames")
async def push_frames(stream_id: str, request: Request, service: Served) -> dict:
    registry, config = service.registry, service.config
    entry = await registry.find(service.keys.require(request), stream_id)
    kind = media_type(request)
    if kind == "application/json":
        if request.query_params:  # ?t= is an image's: a feed placed otherwise than asked is never silent
            raise ServiceError(400, f"a JSON frames body takes no query parameters (got "
                                    f"{shown(next(iter(request.query_params)))}); give its time as \"t\" in the body")
        body = await read_json(request, config.max_body_bytes)
        unknown = sorted(set(body) - {"source", "t", "skip"})
        if unknown or "source" not in body:
            raise ServiceError(400, "a JSON frames body is {\"source\": PATH} (and optionally \"t\": the "
                               "stream time of its first frame, and \"skip\": how many of its first frames to "
                               "leave out)")
        skip = body.get("skip", 0)
        if not isinstance(skip, int) or isinstance(skip, bool) or not 0 <= skip <= LARGEST_INT:
            raise ServiceError(400, f"skip must be a whole number of frames from 0 to {LARGEST_INT:,}; got "
                                    f"{shown(skip)}")
        if isinstance(body.get("t"), str):
            raise ServiceError(400, f"t must be a number of seconds in a JSON body, got {shown(body['t'])}")
        start = _seconds(body.get("t"))
        path = resolve_source(config.media_root, body["source"])
        fed = await registry.feeds.feed(entry, path, start, shown=body["source"], skip=skip)
        return {**fed, **entry.describe()}
    if kind not in IMAGE_TYPES:
        raise ServiceError(415, f"frames are image/jpeg or image/png bodies, or application/json "
                                f"{{\"source\": PATH}}; got {kind or 'no Content-Type'}")
    seconds = _image_time(request)
    data = await read_body(request, config.max_body_bytes)
    image = decode_image(data, kind, config.max_image_pixels)
    kept = await registry.push(entry, image, seconds)
    return {"kept": kept, **entry.describe()}


@router.delete("/v1/streams/{stream_id}/feed")
async def stop_feed(stream_id: str, request: Request, service: Served) -> dict:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    return {**await service.registry.feeds.stop(entry), "id": stream_id, "object": "feed"}


@router.post("/v1/streams/{stream_id}/ask")
async def ask(stream_id: str, request: Request, service: Served) -> Response:
    entry = await service.registry.find(service.keys.require(request), stream_id)
    body = await read_json(request, service.config.max_body_bytes)
    stream_answer = body.pop("stream", False)
    if stream_answer is not None and not isinstance(stream_answer, bool):  # null: not streamed, as the chat takes it
        raise ServiceError(400, f"stream must be true or false, got {shown(stream_answer)}")
    unknown = sorted(set(body) - {"question", "max_new_tokens", "retrieve"})
    if unknown:
        raise ServiceError(400, f"unknown ask field {shown(unknown[0])}; known: question, max_new_tokens, retrieve, "
                           "stream")
    question, max_new, retrieve = question_settings(body)
    if not stream_answer:
        async with service.ask_slots.hold():
            streamer = TokenStreamer(entry.stream.adapter.tokenizer, asyncio.get_running_loop(), whole=True)
            answer = await whole_answer(request, streamer,
                                        service.registry.ask(entry, question, max_new, retrieve, streamer))
            service.answered("ask", answer["latency"])
        return JSONResponse(answer)
    check_can_ask(entry)  # refused with its status, before the event stream starts
    release = service.ask_slots.take()  # refused here (429), before the event stream starts; held till it ends
    try:
        streamer = TokenStreamer(entry.stream.adapter.tokenizer, asyncio.get_running_loop(),
                                 service.metrics.first_token_seconds.observe)
        task = await begin_answer(request, streamer,
                                  service.registry.ask(entry, question, max_new, retrieve, streamer))
    except BaseException:
        release()
        raise
    return EventStream(_sse_answer(service, request, entry, streamer, task), release, streamer, service.metrics)


async def _sse_answer(service, request: Request, entry, streamer: TokenStreamer, task: asyncio.Future) -> Any:
    async for piece in pieces_until(streamer, task):
        yield event({"token": piece})
    answer, failure = await streamed_outcome(service, request, task, f"the streamed answer of stream {entry.id}")
    if failure is not None:
        yield event(failure, "error")
        return
    service.answered("ask", answer["latency"])
    yield event(answer, "answer")


async def streamed_outcome(service: Any, request: Request, task: asyncio.Future,
                           where: str) -> tuple[Any, dict | None]:
    """A streamed answer's result, or the error body its last event sends (counted in `statekv_errors_total` under
    ``request``'s route): its events have begun, so every failure is an event, never the reply's status. ``where``:
    the answer, for the log."""
    try:
        return await task, None
    except Exception as error:  # noqa: BLE001 -- every failure, as said
        failure = failure_body(error, service.public, where)
        service.metrics.error(failure["error"]["code"], request.scope)
        return None, failure


async def begin_answer(request: Request, streamer: TokenStreamer, work: Any) -> asyncio.Future:
    """Start an answer given token by token (``work``: its coroutine, answering through ``streamer``) and wait
    until its generation begins, so that a question refused or failing before then (too long for its stream, its
    stream damaged meanwhile, a video that does not decode) is answered with its own status rather than a 200 and
    an error event. A client gone meanwhile stops it. Returns the answer's task."""
    task = answer_task(work)
    begun = asyncio.ensure_future(streamer.begun.wait())
    try:
        await _while_client_waits(request, streamer, {begun, task})
        if not begun.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    except BaseException:
        streamer.gone.set()
        raise
    finally:
        begun.cancel()
    return task


async def whole_answer(request: Request, streamer: TokenStreamer, work: Any) -> Any:
    """The result of an answer given whole (``work``: its coroutine, answering through ``streamer``); a client gone
    before it is whole stops it (`answering.ClientLeft`)."""
    task = answer_task(work)
    try:
        await _while_client_waits(request, streamer, {task})
    except BaseException:
        streamer.gone.set()
        raise
    return task.result()


async def _while_client_waits(request: Request, streamer: TokenStreamer, waits: set) -> None:
    """Wait for the first of ``waits`` to be done; a client gone meanwhile stops the answer (at its next check;
    its reply goes nowhere)."""
    while not any(wait.done() for wait in waits):
        await asyncio.wait(waits, timeout=DISCONNECT_CHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        if not any(wait.done() for wait in waits) and not streamer.gone.is_set() and await request.is_disconnected():
            streamer.gone.set()


def answer_task(work: Any) -> asyncio.Future:
    """Run an answer's coroutine as a task whose failure is never left unread (its client may be gone)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return task


async def pieces_until(streamer: TokenStreamer, task: asyncio.Future):
    """The streamer's pieces, stopping also when the task fails before generating (no end() then). A wait cut
    short (its client went away) leaves no task waiting for a piece that may never come (an answer stopped
    before its first token ends no streamer)."""
    while True:
        getter = asyncio.ensure_future(streamer.queue.get())
        try:
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter in done:
            piece = getter.result()
            if piece is None:
                return
            yield piece
        else:
            while not streamer.queue.empty():
                piece = streamer.queue.get_nowait()
                if piece is None:
                    return
                yield piece
            return


def _image_time(request: Request) -> float | None:
    """An image's ``?t=`` seconds (None: not given); a 400 for another parameter or a repeated one."""
    names = [name for name, _ in request.query_params.multi_items()]
    if names not in ([], ["t"]):
        odd = next((name for name in names if name != "t"), None)
        raise ServiceError(400, f"unknown query parameter {shown(odd)}; an image takes t (seconds)" if odd
                           else "t is given more than once; give an image's time once")
    return _seconds(request.query_params.get("t"))


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ServiceError(400, f"t must be seconds since the stream began, got {shown(value)}") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ServiceError(400, f"t must be a finite number of seconds >= 0, got {shown(value)}")
    return seconds
