"""Where model work runs: every push, encode, question and save of the server's models runs on one thread, in
arrival order, so concurrent requests never step a model at once. Pushes are the exception that proves it:
pushes queued while the thread is busy are taken together, and the streams of one `VideoQA` among them step
together (`VideoQA.push_many`: one vision call, batched language-model steps). Streams that push one frame after
another (a client sending frames, a file being fed) have one push in flight each, so they would take turns
rather than meet: a drain that lacks a stream which pushed within the last `ACTIVE_SECONDS` waits up to
`GATHER_SECONDS` for its next push."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
ACTIVE_SECONDS = 0.25  # a stream that pushed this recently is expected to push again
GATHER_SECONDS = 0.005  # the longest a drain waits for such a stream's next push


class ModelExecutor(Protocol):
    """What the service needs from whatever runs model work."""

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``work(*args, **kwargs)`` with the model to itself; return its result or raise its error."""

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """The same from a thread that is not the event loop's (startup, shutdown)."""

    def close(self) -> None: ...


@dataclass
class _Push:
    stream: Any
    image: Any
    seconds: float | None
    before: Callable[[], Any]
    after: Callable[[Any, bool], Any]
    future: Future = field(default_factory=Future)
    context: Any = None


class ModelWorker:
    """One thread for all model work, first come first served; pushes that wait together step together.

    ``batches``: times the thread took more than one queued push at once."""

    def __init__(self, gather_seconds: float = GATHER_SECONDS):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="statekv-model")
        self.queued = 0
        self.batches = 0
        self.gather_seconds = gather_seconds
        self._pushes: list[_Push] = []
        self._drain_queued = False
        self._arrived = threading.Condition()
        self._last_push: dict[int, float] = {}  # id(stream) -> when its last push arrived

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.queued += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(work, *args, **kwargs))
        finally:
            self.queued -= 1

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(work, *args, **kwargs).result()

    async def push(self, stream: Any, image: Any, seconds: float | None, *, before: Callable[[], Any],
                   after: Callable[[Any, bool], T]) -> T:
        """Push a frame to ``stream`` on the model's thread, with the pushes that wait with it: ``before()`` runs
        first (its error fails this push only), then the push, then ``after(before's result, kept)``, whose
        result is returned."""
        push = _Push(stream, image, seconds, before, after)
        with self._arrived:
            self._pushes.append(push)
            self._last_push[id(stream)] = time.monotonic()
            self._arrived.notify_all()
            if not self._drain_queued:  # one queued drain takes every push that arrives until it starts
                self._drain_queued = True
                self._pool.submit(self._drain)
        self.queued += 1
        try:
            return await asyncio.wrap_future(push.future)
        finally:
            self.queued -= 1

    def _gathered(self) -> list[_Push]:
        """The pushes waiting, once every recently active stream has one or `gather_seconds` have passed."""
        with self._arrived:
            deadline = time.monotonic() + self.gather_seconds
            while True:
                now = time.monotonic()
                for key in [key for key, when in self._last_push.items() if now - when >= ACTIVE_SECONDS]:
                    del self._last_push[key]
                if set(self._last_push) <= {id(push.stream) for push in self._pushes} or now >= deadline:
                    break
                self._arrived.wait(deadline - now)
            pushes, self._pushes, self._drain_queued = self._pushes, [], False
        return pushes

    def _drain(self) -> None:
        pushes = self._gathered()
        if len(pushes) > 1:
            self.batches += 1
        ready: dict[int, list[_Push]] = {}
        for push in pushes:
            try:
                push.context = push.before()
            except BaseException as error:
                push.future.set_exception(error)
                continue
            ready.setdefault(id(push.stream.qa), []).append(push)
        for group in ready.values():
            qa = group[0].stream.qa
            try:
                results = qa.push_many([(push.stream, push.image, push.seconds) for push in group],
                                       return_exceptions=True)
            except BaseException as error:
                results = [error] * len(group)
            for push, result in zip(group, results):
                if isinstance(result, BaseException):
                    push.future.set_exception(result)
                    continue
                try:
                    push.future.set_result(push.after(push.context, result))
                except BaseException as error:
                    push.future.set_exception(error)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
