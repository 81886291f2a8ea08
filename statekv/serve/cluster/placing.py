"""What a replica tells the routers of the requests that may have placed a stream on it (`PlacingLog`, kept by the
`RecordPlacing` middleware of its app).

A router counts a stream it sent to a replica until that replica's report counts it (`StreamRouter.load`). A report
taken at a time cannot tell the router which of its requests it counts: one that came in before the report but took
the stream after it is in neither. So each replica lists, by Ray Serve's internal request id, the requests that may
have placed a stream (a new stream; one about a stream it did not hold as it came) once each has answered (its
stream is held by then, or it never will be), and the streams it holds; a router stops counting a request once its
replica lists it, or the stream it was about."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .router import PLACING_SECONDS, scope_target

ANSWERED_KEPT = 4096  # requests remembered, at most (beyond: a router counts one a while longer)


class PlacingLog:
    """The requests that may have placed a stream here, by internal request id, as each began to answer."""

    def __init__(self) -> None:
        self.answered: deque[tuple[float, str]] = deque(maxlen=ANSWERED_KEPT)

    def note(self, request: str) -> None:
        self.answered.append((time.time(), request))

    def recent(self) -> list[str]:
        """The requests that answered within the time a router counts one."""
        oldest = time.time() - PLACING_SECONDS
        return [request for when, request in list(self.answered) if when > oldest]


class RecordPlacing:
    """ASGI middleware: notes in ``log`` each HTTP request that may place a stream here as its response starts (or
    as it ends, if it never answers). ``held``: whether this replica holds a stream (by id) as a request comes in."""

    def __init__(self, app: Any, log: PlacingLog, held: Callable[[str], bool]):
        self.app, self.log, self.held = app, log, held

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = self._placing(scope) if scope.get("type") == "http" else None
        if not request:
            await self.app(scope, receive, send)
            return
        noted = False

        async def answering(message: dict[str, Any]) -> None:
            nonlocal noted
            if message.get("type") == "http.response.start" and not noted:
                noted = True
                self.log.note(request)
            await send(message)

        try:
            await self.app(scope, receive, answering)
        finally:
            if not noted:
                self.log.note(request)

    def _placing(self, scope: dict[str, Any]) -> str | None:
        """The request's internal id if it may place a stream here; None otherwise."""
        from ray import serve

        kind, stream_id = scope_target(scope.get("path", ""), scope.get("method", ""), serve.get_multiplexed_model_id())
        if kind == "create" or (kind == "stream" and not self.held(stream_id)):
            return internal_request_id() or None
        return None


def internal_request_id() -> str:
    """Ray Serve's internal id of the request being handled, the one its routers see
    (`PendingRequest.metadata.internal_request_id`). Ray Serve has no public accessor for it (its public
    ``request_id`` is the client's ``x-request-id`` when one is sent, so two requests may share it); this reads its
    request context, the one place statekv does (Ray is pinned; `tests/test_serve_ray.py` checks the ids a real
    deployment reports)."""
    from ray.serve import context

    return getattr(context._get_serve_request_context(), "_internal_request_id", "")
