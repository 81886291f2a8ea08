"""Limits on what one request may bring or hold: body size, decoded image size, questions at once."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import Request
from starlette.requests import ClientDisconnect

from .errors import ServiceError

IMAGE_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG"}
MAX_JSON_DEPTH = 64  # no request field nests nearly so deep; a body nested near the parser's own limit left the
# checks no room to name its bad value (a 500 RecursionError)


def media_type(request: Request) -> str:
    """The request's Content-Type without its parameters, cut short for messages (no type it is compared with is
    that long)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind if len(kind) <= 80 else kind[:77] + "..."  # a header has no length limit under httptools


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ServiceError(400, "malformed Content-Length")
        if int(declared) > limit:
            raise ServiceError(413, f"request body of {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ServiceError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # as a client gone mid-answer: counted, not a server fault
        raise ServiceError(499, "the client went away before its request body was whole") from None
    return b"".join(chunks)


async def read_json(request: Request, limit: int, *, optional: bool = False) -> dict[str, Any]:
    """A JSON object body (``application/json``), or a one-line 400/413/415. ``optional``: an empty body, of any
    Content-Type or none, is read as ``{}`` (every field it could hold is optional); a required body of another
    type is refused before it is read."""
    kind = media_type(request)
    if not optional and kind != "application/json":
        raise ServiceError(415, f"expected Content-Type application/json, got {kind or 'none'}")
    body = await read_body(request, limit)
    if optional and not body.strip():  # curl -d '' and urllib send an empty form
        return {}
    if kind != "application/json":
        raise ServiceError(415, f"expected Content-Type application/json, got {kind or 'none'}")
    try:
        document = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise ServiceError(400, f"malformed JSON body: {str(error).splitlines()[0]}") from None
    except RecursionError:
        raise ServiceError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(document, dict):
        raise ServiceError(400, "the JSON body must be an object")
    if json_depth(document) > MAX_JSON_DEPTH:
        raise ServiceError(400, f"malformed JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    try:  # JSON may escape half a character (\ud800), which no text holds: a name, a question, an answer
        json.dumps(document, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ServiceError(400, "malformed JSON body: it escapes a lone surrogate (\\ud800 to \\udfff), which is "
                                "half of a character") from None
    return document


def json_depth(document: Any) -> int:
    """How deeply ``document``'s objects and arrays nest (an object of scalars: 1), counted a level at a time
    without recursion, never past ``MAX_JSON_DEPTH + 1``."""
    depth, level = 0, [document]
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return depth


def decode_image(data: bytes, content_type: str, max_pixels: int) -> np.ndarray:
    """A JPEG or PNG body -> RGB uint8 ``[H, W, 3]``, decoded whole (`statekv.video.decode_image`: a PNG whose
    header promises more rows than its data holds is refused); 415 for another format, 413 over ``max_pixels``,
    400 for a body that cannot be decoded whole."""
    from ..video import ImageError, decode_image as decode_whole

    expected = IMAGE_TYPES.get(content_type)
    if expected is None:
        raise ServiceError(415, f"a frame is image/jpeg or image/png, got {content_type or 'no Content-Type'}")
    if not data:
        raise ServiceError(400, "empty image body")
    try:
        return decode_whole(data, formats=(expected,), max_pixels=max_pixels, name=f"the {content_type} body")
    except ImageError as error:
        status = {"format": 415, "size": 413}.get(error.reason, 400)
        message = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the body", str(error))  # PIL names its in-memory file
        raise ServiceError(status, f"{message} ({len(data)} bytes)" if status == 400 else message) from None


class Slots:
    """At most ``limit`` holders at once; one more is refused with 429 and ``Retry-After``."""

    def __init__(self, limit: int, what: str, retry_after: int = 1):
        self.limit, self.what, self.retry_after = limit, what, retry_after
        self.held = 0

    def check(self) -> None:
        """Refuse (429) when every slot is held."""
        if self.held >= self.limit:
            raise ServiceError(429, f"too many {self.what} at once (limit {self.limit}); retry shortly",
                               headers={"Retry-After": str(self.retry_after)})

    def take(self) -> Callable[[], None]:
        """Check (429) and hold a slot now; returns what gives it back (once, however often it is called). For a
        response that streams: taken before it starts, given back when it ends (`sse.EventStream`)."""
        self.check()
        self.held += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self.held -= 1

        return give_back

    @asynccontextmanager
    async def hold(self):
        self.check()
        async with self.occupy():
            yield

    @asynccontextmanager
    async def occupy(self):
        """Hold a slot without the check (`hold` checks first, with no pause in between)."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
