"""The FastAPI application: the model, its worker, the streams, the routes, errors as one-line JSON, and the
saving loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..core.disk.open_files import raise_open_files_limit
from ..errors import ConfigurationError, OutputError, StateKVError
from . import openai, routes, watch_routes
from .auth import KeyRing
from .config import ServeConfig
from .errors import ServiceError, StorageError, error_body, kind_of, status_of
from .limits import Slots
from .metrics import Metrics
from .registry import StreamRegistry
from .store import UPLOADS, StreamFiles, check_state_folder
from .watches import WatchHub
from .worker import ModelExecutor, ModelWorker

log = logging.getLogger("statekv.serve")
SAVE_CHECK_SECONDS = 1.0


class Hosting:
    """How a server holds its streams: alone over its state folder (this class: every stream loaded at start), or
    as one replica of several sharing the folder (`statekv.serve.cluster.hosting.ReplicaHosting`)."""

    replica: str | None = None  # this server's name among replicas (None: alone)

    def open(self, config: ServeConfig) -> KeyRing:
        """Check where the streams are kept (one line if it cannot be used) and that an accepted key owns each
        of them (`check_owners`), before the model loads; returns the keys accepted."""
        if config.state_dir is None:  # its streams, keys and the page's uploads are all kept there
            raise ConfigurationError("a server alone needs a state folder (ServeConfig.state_dir); None is only for "
                                     "replicas on Ray that keep everything in an object store (--ray with --store)")
        check_state_folder(config.state_dir)
        keys = KeyRing.for_folder(config.state_dir, config.api_keys)
        check_owners(config, keys)
        return keys

    def registry(self, config: ServeConfig, qa: Any, worker: ModelExecutor) -> StreamRegistry:
        return StreamRegistry(config, qa, worker)

    async def run(self, service: "Service") -> None:
        """Work that runs beside the server for its whole life (cancelled at shutdown)."""

    def uploads(self, config: ServeConfig) -> Path:
        """Where the page keeps a file being uploaded until it is fed: the state folder's ``uploads/`` (swept as
        the server starts, `StreamFiles.sweep_partials`; a replica's: `statekv.serve.cluster.uploads`)."""
        return Path(config.state_dir) / UPLOADS

    def exposition(self, service: "Service") -> bytes:
        """What ``GET /metrics`` answers."""
        return service.metrics.exposition()

    def close(self, service: "Service") -> None:
        """At shutdown, once every stream is saved."""


class Service:
    """Everything the routes share."""

    def __init__(self, config: ServeConfig, qa: Any, worker: ModelExecutor, keys: KeyRing | None = None,
                 hosting: Hosting | None = None):
        self.config, self.qa, self.worker = config, qa, worker
        self.hosting = hosting or Hosting()
        self.keys = keys or KeyRing.for_folder(config.state_dir, config.api_keys)
        self.model_id = config.options.model or "statekv"
        self.started = int(time.time())
        self.registry = self.hosting.registry(config, qa, worker)
        self.metrics = Metrics(lambda: len(self.registry.entries), self.registry.cache_bytes,
                               self.registry.settings.batched_steps, self.registry.settings.batch_sizes,
                               self.registry.settings.question_batch_sizes,
                               lambda: getattr(self.worker, "quiet_catch_up_steps", 0), self.unsaved,
                               lambda: len(self.registry.damaged), lambda: getattr(self.worker, "queued", 0))
        self.registry.metrics = self.metrics
        self.watch_hub = WatchHub(self.metrics.registry, self.failing_watches)
        self.registry.watch_listener = self.watch_hub.listener  # watches brought back with a stream report here
        self.registry.end_watch_feeds = self.watch_hub.end
        self.ask_slots = Slots(config.max_asks, "questions")
        self.follow_slots = Slots(config.max_followers, "clients following watch events", retry_after=5)

    def unsaved(self) -> int:
        """The streams whose last save failed (`StreamRegistry.note_save_failure`)."""
        return sum(1 for entry in list(self.registry.entries.values()) if entry.save_error is not None)

    def failing_watches(self) -> int:
        """The open watches of the streams held here whose last evaluation failed (their ``error``)."""
        return sum(1 for entry in list(self.registry.entries.values())
                   for watch in getattr(entry.stream, "watches", ()) if watch.error is not None)

    @property
    def uploads(self) -> Path:
        """Where the page keeps a file being uploaded until it is fed (`Hosting.uploads`)."""
        return self.hosting.uploads(self.config)

    def answered(self, route: str, seconds: float) -> None:
        """Count a question answered through ``route`` (``ask``, ``chat`` or ``page``) and its latency."""
        self.metrics.asks.labels(route).inc()
        self.metrics.ask_seconds.observe(seconds)

    def public(self, message: str) -> str:
        """A message as a client may see it (`ServeConfig.public`)."""
        return self.config.public(message)


def check_owners(config: ServeConfig, keys: KeyRing, files: Any = None) -> None:
    """Refuse to start over streams that no accepted key owns (nobody could reach or delete them), unless
    ``config.drop_unowned_streams`` says to delete them. ``files``: where the streams are (default: the state
    folder's `StreamFiles`)."""
    files = files or StreamFiles(config.state_dir)
    unowned = {owner: count for owner, count in files.owners().items() if owner not in keys.owners}
    if not unowned:
        return
    count = sum(unowned.values())
    place = f"the state folder {config.state_dir}" if config.state_dir is not None else \
        f"the object store {files.store.url}"
    if not config.drop_unowned_streams:
        raise ConfigurationError(
            f"{place} holds {count} stream{'s' * (count > 1)} of "
            f"{'a key' if len(unowned) == 1 else f'{len(unowned)} keys'} this server was not given; pass "
            f"{'it' if len(unowned) == 1 else 'them'} with --api-key (repeatable, or STATEKV_API_KEYS), or start "
            "with --drop-unowned-streams to delete those streams")
    for _, record in files.records():
        if isinstance(record, dict) and record["owner"] in unowned:
            files.claim(record["id"])  # a replica's files are written under the stream's lease
            files.remove(record["id"])
    log.warning("deleted %d streams no accepted key owned (--drop-unowned-streams)", count)


def create_app(config: ServeConfig, qa: Any = None, worker: ModelExecutor | None = None,
               hosting: Hosting | None = None) -> FastAPI:
    """Load the model (unless ``qa`` is given), bring back the streams kept in the state folder, and build the
    app. Model work runs on ``worker`` (default: one `ModelWorker` thread); ``hosting``: how the streams are held
    (default: alone, `Hosting`)."""
    hosting = hosting or Hosting()
    raise_open_files_limit()
    keys = hosting.open(config)  # before the model loads: a refusal costs nothing
    if qa is None:
        from ..api.videoqa import VideoQA

        qa = VideoQA.from_options(config.options)
    service = Service(config, qa, worker or ModelWorker(quiet_catch_up=config.quiet_catch_up), keys, hosting)
    restored = service.registry.restore(keys.owners)
    if restored:
        log.info("restored %d streams from %s", restored, config.state_dir)
    if service.registry.damaged:
        log.error("%d damaged streams quarantined (listed as damaged, not served, their files kept): %s",
                  len(service.registry.damaged), ", ".join(sorted(service.registry.damaged)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        beside = [asyncio.create_task(_save_loop(service)), asyncio.create_task(service.hosting.run(service))]
        try:
            yield
        finally:
            for task in beside:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.to_thread(service.registry.save_all)
            await asyncio.to_thread(service.registry.close_all)  # their files' locks go with them
            service.hosting.close(service)
            service.worker.close()

    app = FastAPI(title="statekv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    _error_handlers(app, service)
    app.include_router(routes.router)
    app.include_router(watch_routes.router)
    app.include_router(openai.router)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(service.hosting.exposition, service),
                        media_type="text/plain; version=0.0.4")

    if config.page:
        from .page import mount_page

        mount_page(app, service)

        @app.get("/", include_in_schema=False)
        async def root(request: Request) -> RedirectResponse:
            query = f"?{request.url.query}" if request.url.query else ""
            return RedirectResponse(f"/ui/{query}", status_code=307)

    return app


async def _save_loop(service: Service) -> None:
    while True:
        await asyncio.sleep(SAVE_CHECK_SECONDS)
        try:
            await service.registry.save_due()
        except Exception:  # the loop must outlive one bad save; the error is logged
            log.exception("saving streams failed")


def _error_handlers(app: FastAPI, service: Service) -> None:
    def answer(request: Request, status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
        service.metrics.error(status, request.scope)
        return JSONResponse(error_body(service.public(message), kind, status), status_code=status, headers=headers)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return answer(request, error.status, str(error), error.kind, error.headers)

    @app.exception_handler(StorageError)
    async def storage_error(request: Request, error: StorageError) -> JSONResponse:
        return answer(request, 503, f"{error.strerror}; retry shortly", "server_error", {"Retry-After": "2"})

    @app.exception_handler(StateKVError)
    async def statekv_error(request: Request, error: StateKVError) -> JSONResponse:
        if isinstance(error, OutputError):  # the server's own files (a disk tier it cannot write), not the request
            return answer(request, 503, str(error), "server_error", {"Retry-After": "5"})
        return answer(request, status_of(error), str(error), kind_of(error))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = (error.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return answer(request, 400, f"invalid request: {where} {first.get('msg', '')}".strip(), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "request refused"
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return answer(request, error.status_code, message, "invalid_request_error", getattr(error, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> JSONResponse:
        # the page's file uploads read their bodies themselves (NiceGUI): a tab reloaded or closed mid-upload
        return answer(request, 499, "the client went away before its request body was whole", "invalid_request_error")

    def internal(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=error)
        return answer(request, 500, f"internal error ({type(error).__name__}); the server log has the details",
                      "server_error")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return internal(request, error)

    app.add_middleware(UnexpectedErrors, answer=internal)


class UnexpectedErrors:
    """Answers an error no handler took with its JSON 500 here, inside Starlette's outermost middleware, which would
    answer it and raise it again: uvicorn then dropped the connection, and a client's next request on it failed. An
    error after the response began (a streamed answer) still goes on up."""

    def __init__(self, app: Any, answer: Any):
        self.app, self.answer = app, answer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:
            if started:
                raise
            await self.answer(Request(scope), error)(scope, receive, send)
