"""Errors the service answers with: a status, a one-line message, and any headers (Retry-After)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from ..errors import HorizonError, OutputError, QuestionTooLong, StateKVError


class ServiceError(StateKVError):
    """A request the service refuses: ``status`` (HTTP), a one-line message, optional ``headers``."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.kind = kind or _KINDS.get(status, "invalid_request_error")


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
          415: "unsupported_media_type", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def status_of(error: StateKVError) -> int:
    """The HTTP status an error is answered with, on a route or in an event stream alike: its own (`ServiceError`),
    503 for the server's own files (`OutputError`), 413 for a question and answer too long for the room the stream
    keeps for them (`QuestionTooLong`), 409 for anything else the stream cannot take (`HorizonError`), else 400."""
    if isinstance(error, ServiceError):
        return error.status
    if isinstance(error, QuestionTooLong):
        return 413
    return 503 if isinstance(error, OutputError) else 409 if isinstance(error, HorizonError) else 400


def kind_of(error: StateKVError) -> str:
    """The OpenAI error type of ``error`` (see `status_of`)."""
    return error.kind if isinstance(error, ServiceError) else _KINDS.get(status_of(error), "invalid_request_error")


class StorageError(OSError):
    """Where streams are kept (an object store) refused or failed a request: ``strerror`` is one line saying which
    and why. Answered 503 (retry) wherever it reaches a route."""

    def __init__(self, message: str):
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:
        return self.strerror


def error_body(message: str, kind: str, status: int) -> dict:
    """The JSON body of every error (OpenAI's shape, so its clients read it): one line of message."""
    line = (message.strip().splitlines() or [kind])[0]
    return {"error": {"message": line, "type": kind, "code": status}}


def failure_body(error: Exception, public: Callable[[str], str], where: str) -> dict:
    """The error body of ``error``, met once an event stream at ``where`` has begun (its status can no longer be
    the response's): what a route would answer, a statekv error's own, a store's 503, else a 500 whose details go
    to the server log."""
    if isinstance(error, StateKVError):
        return error_body(public(str(error)), kind_of(error), status_of(error))
    if isinstance(error, StorageError):
        return error_body(f"{error.strerror}; retry shortly", "server_error", 503)
    logging.getLogger("statekv.serve").error("internal error on %s", where, exc_info=error)
    return error_body(f"internal error ({type(error).__name__}); the server log has the details", "server_error", 500)


def public_message(message: str, replacements: dict[str, str]) -> str:
    """``message`` with each server path in ``replacements`` replaced by what a client may see (a file's name,
    a path relative to the folder it was given under); longer paths first, so a folder never cuts a file's."""
    for path in sorted(replacements, key=len, reverse=True):
        if path:
            message = message.replace(path, replacements[path])
    return message


def reason_of(error: BaseException) -> str:
    """A one-line reason of ``error`` (a stream that could not be loaded or saved): its first line, or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
