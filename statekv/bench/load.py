"""The load of one run: N cameras pushing frames in real time, questions arriving per stream, open loop.

Requests are sent at their scheduled times whether or not others returned (open-loop arrivals, as `vllm bench
serve` sends its requests): cameras never wait for each other, and a question is sent at its time whatever is under
way, so a server that falls behind is seen falling behind, never given time to catch up. Camera ``i`` starts at a
random phase inside one frame period and captures frame ``k`` at ``start + phase + k / fps``; like a camera's
uploader, it sends its frames in order, one at a time: each at its capture time, or as soon as the one before it is
answered if that is later (a camera's frames never overtake each other, which the server would refuse), so a
camera the server cannot keep up with falls further behind with every frame, and its lag (answer time minus
capture time) grows. Questions arrive per stream with gamma-distributed gaps of mean ``1 / question_rate``
(``burstiness`` 1: a Poisson process; below 1 burstier, above 1 more regular, vLLM's convention), each stream's
process stationary (already running when the clock starts: ``question_rate`` questions a second on average,
whatever the burstiness; `first_arrival`).

Each stream is made with ``POST /v1/streams`` (every pushed frame kept, no horizon: a camera that never ends) and
primed with ``warm_frames`` frames before the clock starts (a camera that has been live a while: its carried state
full, so its steps are the steady ones that batch; and no question finds it empty); frames go to
``POST /v1/streams/{id}/frames`` as JPEG bodies at their stream time; questions to ``POST /v1/streams/{id}/ask``
with ``"stream": true`` (or the OpenAI-compatible ``POST /v1/chat/completions``), whose streamed pieces of text
time the answer (`read_answer`): the first marks the time to first token, the gaps between them the inter-token
latency. Streams are deleted after the run. Making a stream and deleting one are bounded
(``SETUP_SECONDS``, ``DELETE_SECONDS``): a server that hangs is said, never waited on for good.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StateKVError

SETUP_SECONDS = 60.0  # making a stream: no model step, so a server slower than this is stuck
DELETE_SECONDS = 300.0  # deleting one waits for the steps a server far behind still has queued for it


class LoadError(StateKVError):
    """The load could not be run at all (the server unreachable, refusing the key)."""

    kind = "load"


@dataclass(frozen=True)
class LoadSettings:
    """What one run sends. ``route``: ``ask`` (the stream route) or ``chat`` (OpenAI-compatible). ``drain``: seconds
    past the run's end (its duration after its start) to wait for requests still under way (then they count as
    failed).
    ``warm_frames``: frames each stream is pushed, unmeasured, before the clock starts."""

    fps: float = 1.0
    duration: float = 30.0
    question_rate: float = 0.1
    burstiness: float = 1.0
    question: str = "What is shown now?"
    max_new_tokens: int = 8
    route: str = "ask"
    drain: float = 30.0
    seed: int = 0
    timeout: float = 600.0
    warm_frames: int = 16


@dataclass
class Request:
    """One request of a run: ``kind`` ``frame`` or ``question``, the stream (camera) it belongs to, when it was due
    and sent, when its first answer token came (questions) and when it finished (``perf_counter`` seconds);
    ``error``: why it failed (None: it succeeded); ``given_up``: when it was given up at the drain's end. A
    streamed answer's ``chunks``: when each of its pieces of text came (the first is ``first_token``); ``tokens``:
    the tokens the server says it generated (its ``usage.completion_tokens``; None when it did not say)."""

    kind: str
    stream: int
    due: float
    sent: float | None = None
    first_token: float | None = None
    done: float | None = None
    error: str | None = None
    given_up: float | None = None  # still out (or not yet sent) when the drain ended: its lag was at least this
    chunks: list[float] = field(default_factory=list)
    tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None


@dataclass
class Run:
    """What a run of ``streams`` cameras measured: every request, and when the clock started; ``undeleted``: why
    streams of the run could not be deleted after it (they would share the server with the next run); ``refused``:
    the streams the server would not make as it held its limit of streams (429); ``unmade``: those whose creation
    failed otherwise (an error, no answer in time)."""

    streams: int
    start: float
    requests: list[Request] = field(default_factory=list)
    setup_failures: list[str] = field(default_factory=list)
    undeleted: list[str] = field(default_factory=list)
    refused: int = 0
    unmade: int = 0


def schedule(streams: int, settings: LoadSettings, start: float) -> list[Request]:
    """Every request of a run, due times in order: frames at each camera's rate from its phase, questions as each
    stream's stationary renewal process of gamma gaps (shape ``burstiness``, mean ``1 / question_rate``)."""
    rng = np.random.default_rng(settings.seed)
    period, end = 1.0 / settings.fps, start + settings.duration
    requests = []
    for stream in range(streams):
        phase = rng.uniform(0.0, period)
        count = math.floor(settings.duration * settings.fps)
        requests += [Request("frame", stream, start + phase + k * period) for k in range(count)]
        if settings.question_rate > 0:
            scale = 1.0 / (settings.question_rate * settings.burstiness)
            due = start + first_arrival(rng, settings.burstiness, scale)
            while due < end:
                requests.append(Request("question", stream, due))
                due += rng.gamma(settings.burstiness, scale)
    return sorted(requests, key=lambda request: request.due)


def first_arrival(rng: np.random.Generator, shape: float, scale: float) -> float:
    """Seconds from the clock's start to a stream's first question, its gaps gamma (``shape``, ``scale``) and its
    process taken as already running (stationary): then a run of D seconds asks ``D / (shape * scale)`` questions
    on average whatever the shape; a process begun at a question asks more in bursts (shape below 1) and fewer when
    regular. The stationary wait is a gap drawn by its length (gamma of shape + 1) times a uniform."""
    if shape == 1.0:  # Poisson: the wait is a gap itself (memoryless), drawn as it always was, so seeds keep
        return float(rng.gamma(1.0, scale))  # the schedules of runs already reported
    return float(rng.uniform() * rng.gamma(shape + 1.0, scale))


async def run_load(url: str, key: str, streams: int, settings: LoadSettings, frames: Callable[[int], list[bytes]],
                   progress: Callable[..., None] | None = None,
                   ready: Callable[[], Any] | None = None) -> Run:
    """Run ``streams`` cameras against the server at ``url`` for ``settings.duration`` seconds (see the module
    doc); ``frames(camera)``: the JPEG bodies camera ``camera`` loops over. ``progress(run, now)`` is called about
    every second, and once more with ``final=True`` when the run ends; ``ready()``, on a thread, once the streams
    are made and warmed up, before the clock starts."""
    import contextlib

    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with contextlib.AsyncExitStack() as clients:
        # a client per camera: a pool's every request scans its connections, so one pool for all would cost
        # the load generator time growing with the requests under way, and make it late
        client = [await clients.enter_async_context(httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits,
            timeout=httpx.Timeout(settings.timeout, connect=30.0))) for _ in range(streams)]
        ids: list[str | None] = [None] * streams  # each stream's id once made: deleted whatever happens next
        run = None
        try:
            made = await asyncio.gather(*(_create(client[stream], stream, frames(stream), settings, ids)
                                          for stream in range(streams)), return_exceptions=True)
            failed = [error for error in made if isinstance(error, BaseException)]
            if failed:  # every creation has ended: none is made after the deletions below
                raise failed[0]
            unready = {stream for stream, (_, error, _) in enumerate(made) if error is not None}
            if ready is not None:
                await asyncio.to_thread(ready)
            start = time.perf_counter() + 0.5
            run = Run(streams, start, schedule(streams, settings, start),
                      [error for _, error, _ in made if error is not None],
                      refused=sum(at_limit for _, _, at_limit in made),
                      unmade=sum(ids[stream] is None and error is not None and not at_limit
                                 for stream, (_, error, at_limit) in enumerate(made)))
            for request in run.requests:
                if request.stream in unready:
                    request.error = "its stream could not be made or warmed up"
            await _send_all(client, run, ids, settings, frames, progress)
        finally:
            deleted = await asyncio.gather(*(client[stream].delete(f"/v1/streams/{stream_id}",
                                                                   timeout=DELETE_SECONDS)
                                             for stream, stream_id in enumerate(ids) if stream_id),
                                           return_exceptions=True)
            if run is not None:
                run.undeleted = [f"{type(reply).__name__}: {reply}" if isinstance(reply, BaseException) else
                                 f"HTTP {reply.status_code}: {_message(reply)}" for reply in deleted
                                 if isinstance(reply, BaseException) or reply.status_code not in (200, 404)]
    return run


async def _create(client, stream: int, shown: list[bytes], settings: LoadSettings,
                  ids: list[str | None]) -> tuple[str | None, str | None, bool]:
    """Make camera ``stream``'s stream (its id into ``ids``) and push its warm-up frames (stream times ``0, 1 / fps,
    ...``): ``(id, None, False)``, or ``(id or None, why, whether the server refused it at its stream limit)``."""
    import httpx

    try:
        reply = await client.post("/v1/streams", json={"name": f"camera-{stream}", "max_fps": None},
                                  timeout=SETUP_SECONDS)
        if reply.status_code == 401:
            raise LoadError(f"the server refused the API key ({_message(reply)})")
        if reply.status_code != 201:
            return None, f"HTTP {reply.status_code}: {_message(reply)}", reply.status_code == 429
        stream_id = ids[stream] = reply.json()["id"]
        for index in range(max(1, settings.warm_frames)):
            pushed = await client.post(f"/v1/streams/{stream_id}/frames", params={"t": f"{index / settings.fps:.6f}"},
                                       content=shown[index % len(shown)], headers={"Content-Type": "image/jpeg"})
            if pushed.status_code != 200:
                return stream_id, f"HTTP {pushed.status_code}: {_message(pushed)}", False
        return stream_id, None, False
    except httpx.HTTPError as error:
        return None, f"{type(error).__name__}: {error}", False


async def _send_all(client: list, run: Run, ids: list[str | None], settings: LoadSettings,
                    frames: Callable[[int], list[bytes]], progress) -> None:
    """Send every request (see the module doc), then wait for those under way up to ``settings.drain`` seconds past
    the last due time; the ones still out then fail."""
    reporter = asyncio.ensure_future(_report(run, progress)) if progress else None
    live = [request for request in run.requests if request.error is None]
    cameras = [asyncio.ensure_future(_camera(client[stream], ids[stream], frames(stream), settings,
                                             [r for r in live if r.stream == stream and r.kind == "frame"]))
               for stream in range(run.streams)]
    questions = []
    try:
        for request in (r for r in live if r.kind == "question"):
            delay = request.due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            questions.append(asyncio.ensure_future(_ask(client[request.stream], request, ids[request.stream],
                                                        settings)))
        last_due = run.requests[-1].due if run.requests else run.start
        end = max(run.start + settings.duration, last_due)  # the run's end: its last request is due before it
        remaining = max(0.0, end + settings.drain - time.perf_counter())
        tasks = cameras + questions
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        given_up = time.perf_counter()
        for request in run.requests:
            if request.error is None and request.done is None:
                request.given_up = given_up
                request.error = (f"not answered {settings.drain:g} s after the run" if request.sent is not None else
                                 f"not sent: its camera was still behind {settings.drain:g} s after the run")
    finally:
        for task in cameras + questions:
            task.cancel()
        if reporter is not None:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
            progress(run, time.perf_counter(), final=True)  # the run's last line, everything counted


async def _camera(client, stream_id: str, shown: list[bytes], settings: LoadSettings, due: list[Request]) -> None:
    """One camera's frames, in order, one at a time: each at its capture time or once the one before is answered
    (stream times follow the warm-up's frames)."""
    for index, request in enumerate(due, start=max(1, settings.warm_frames)):
        delay = request.due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await _push(client, request, stream_id, shown[index % len(shown)], index / settings.fps)


async def _report(run: Run, progress) -> None:
    while True:
        await asyncio.sleep(1.0)
        progress(run, time.perf_counter())


async def _push(client, request: Request, stream_id: str, body: bytes, seconds: float) -> None:
    import httpx

    request.sent = time.perf_counter()
    try:
        reply = await client.post(f"/v1/streams/{stream_id}/frames", params={"t": f"{seconds:.6f}"}, content=body,
                                  headers={"Content-Type": "image/jpeg"})
        request.done = time.perf_counter()
        if reply.status_code != 200:
            request.error = f"HTTP {reply.status_code}: {_message(reply)}"
    except httpx.HTTPError as error:
        request.error = f"{type(error).__name__}: {error}"


async def _ask(client, request: Request, stream_id: str, settings: LoadSettings) -> None:
    """A streamed question, read by `read_answer`."""
    import httpx

    if settings.route == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": settings.question}],  # no model: the one served
                "max_tokens": settings.max_new_tokens, "stream": True, "stream_options": {"include_usage": True},
                "statekv": {"stream_id": stream_id}}
    else:
        path = f"/v1/streams/{stream_id}/ask"
        body = {"question": settings.question, "max_new_tokens": settings.max_new_tokens, "stream": True}
    request.sent = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                request.error = f"HTTP {reply.status_code}: {_message(reply)}"
                return
            await read_answer(request, reply.aiter_lines(), settings.route)
    except (httpx.HTTPError, ValueError) as error:
        request.error = f"{type(error).__name__}: {error}"


async def read_answer(request: Request, lines: AsyncIterator[str], route: str,
                      clock: Callable[[], float] = time.perf_counter) -> None:
    """Read a streamed answer's server-sent ``lines`` (``route`` ``ask``: ``token`` events then an ``answer``;
    ``chat``: ``chat.completion.chunk`` events then ``[DONE]``) into ``request``: when each piece of text came
    (``chunks``, by ``clock``; the first is ``first_token``), the tokens the server counted, when it ended
    (``done``), or why it failed (``error``: an error event, or an answer with no text). Raises ValueError for an
    event that is not JSON."""
    event = None
    async for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            event = None if not line else event
            continue
        data = line[5:].strip()
        if route == "chat":
            if data == "[DONE]":
                break
            chunk = _body(data)
            if "error" in chunk:
                request.error = _reason(chunk["error"], data)
                return
            request.tokens = _completion_tokens(chunk) or request.tokens
            if ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content"):
                request.chunks.append(clock())
        elif event == "error":
            request.error = _reason(_body(data).get("error"), data)
            return
        elif event == "answer":
            request.tokens = _completion_tokens(_body(data))
            break
        elif _body(data).get("token"):
            request.chunks.append(clock())
    request.done = clock()
    if not request.chunks:  # as vllm bench serve fails a response without output: no TTFT to measure
        request.error = "an empty answer: the server streamed no text"
        return
    request.first_token = request.chunks[0]


def _reason(error: Any, data: str) -> str:
    """Why an error event (``data``) says its request failed: its ``error``'s ``message`` (an object), the
    ``error`` itself (a string or anything else), else the whole event; at most 200 characters."""
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(data if error is None else error)[:200]


def _body(data: str) -> dict[str, Any]:
    """An event's JSON object; ValueError for anything else."""
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError(f"an event that is not a JSON object: {data[:80]}")
    return body


def _completion_tokens(body: dict[str, Any]) -> int | None:
    """The tokens an answer's ``usage`` says were generated, or None where it says none."""
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def _message(reply) -> str:
    """The one-line message of an error reply (the service's JSON error body), or its status text."""
    try:
        return str(reply.json()["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return reply.reason_phrase or "no message"
