"""`PlacingRequests`: a replica's record of the requests that may have placed a stream on it, for the routers.

A router counts a stream it sent to a replica until that replica's report counts it (`StreamRouter.load`). A report
taken at a time cannot tell the router which of its requests it counts: one that came in before the report but took
the stream after it is in neither. So each replica lists, by Ray Serve's internal request id, the requests that may
have placed a stream (a new stream; one about a stream it did not hold as it came) once each has ended, and a
router stops counting a request once its replica lists it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .router import PLACING_SECONDS, scope_target

ENDED_KEPT = 4096  # requests remembered, at most


class PlacingRequests:
    """An ASGI app wrapping ``app``: notes each request that may place a stream here as it ends. ``held``: whether
    this replica holds a stream (by its id) as a request about it comes in."""

    def __init__(self, app: Any, held: Callable[[str], bool]):
        self.app, self.held = app, held
        self.ended: deque[tuple[float, str]] = deque(maxlen=ENDED_KEPT)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = self._placing(scope) if scope.get("type") == "http" else None
        try:
            await self.app(scope, receive, send)
        finally:
            if request:
                self.ended.append((time.time(), request))

    def recent(self) -> list[str]:
        """The requests that ended within the time a router counts one."""
        oldest = time.time() - PLACING_SECONDS
        return [request for when, request in list(self.ended) if when > oldest]

    def _placing(self, scope: dict[str, Any]) -> str | None:
        """The request's internal id if it may place a stream here; None otherwise."""
        from ray.serve.context import _get_serve_request_context

        context = _get_serve_request_context()
        kind, stream_id = scope_target(scope.get("path", ""), scope.get("method", ""), context.multiplexed_model_id)
        if kind == "create" or (kind == "stream" and not self.held(stream_id)):
            return context._internal_request_id or None
        return None
