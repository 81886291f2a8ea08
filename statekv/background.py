"""Stages on background threads, connected by bounded queues, that never outlive their pipeline.

    with ThreadStages("statekv-encode") as stages:
        decoded = stages.add(decode_work, None, maxsize=8, name="decode")       # work(None, emit)
        encoded = stages.add(vision_work, decoded, maxsize=4, name="vision")    # work(upstream iterator, emit)
        for item in encoded:                                                     # consumed on the caller's thread
            ...

Each stage runs ``work(upstream, emit)`` on its own daemon thread; ``emit`` blocks while the stage's queue is
full, so memory is bounded by the queue sizes. An exception in a stage travels down the queues, behind every
item emitted before it, and is raised again by whoever reads that point: a failure at frame k surfaces after
the frames before k have been consumed. Leaving the ``with`` block (normally, on an exception, or on Ctrl-C
in the caller) stops every stage and joins its thread before returning: blocked ``emit`` and upstream reads
wake within `POLL_SECONDS`; a stage busy with one item finishes that item first.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .stopping import whole

POLL_SECONDS = 0.05  # how often a blocked stage looks whether the pipeline was stopped

Emit = Callable[[Any], None]
Work = Callable[[Iterator[Any] | None, Emit], None]


class _Stopped(Exception):
    """Raised inside a stage's thread to unwind it when the pipeline is stopped."""


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class ThreadStages:
    """A chain of background stages (see the module docstring). Use it as a context manager."""

    def __init__(self, name: str):
        self.name = name
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, work: Work, upstream: Iterator[Any] | None, *, maxsize: int, name: str) -> Iterator[Any]:
        """Start ``work(upstream, emit)`` on a new thread; return the iterator over what it emits.

        upstream: the iterator returned by an earlier `add` (read only by this stage), or None.
        """
        if self._stop.is_set():
            raise RuntimeError(f"{self.name}: the stages were stopped")
        items: queue.Queue = queue.Queue(maxsize=max(1, maxsize))

        def run() -> None:
            try:
                work(upstream, lambda item: self._put(items, item))
            except _Stopped:
                return
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
                self._put(items, _Failure(error), final=True)
                return
            self._put(items, _END, final=True)

        thread = threading.Thread(target=run, name=f"{self.name}-{name}", daemon=True)
        with whole():  # a stop asked while the thread starts is raised once it has: `close` joins only started ones
            thread.start()
            self._threads.append(thread)
        return self._read(items)

    def close(self) -> None:
        """Stop every stage and wait for its thread to end."""
        self._stop.set()
        for thread in self._threads:
            thread.join()

    @property
    def alive(self) -> int:
        """How many of the stages' threads are still running."""
        return sum(thread.is_alive() for thread in self._threads)

    def __enter__(self) -> "ThreadStages":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------------
    def _put(self, items: queue.Queue, item: Any, *, final: bool = False) -> None:
        while True:
            try:
                items.put(item, timeout=POLL_SECONDS)
                return
            except queue.Full:
                if self._stop.is_set():
                    if final:
                        return
                    raise _Stopped from None

    def _read(self, items: queue.Queue) -> Iterator[Any]:
        while True:
            try:
                item = items.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self._stop.is_set():
                    continue
                if threading.current_thread() in self._threads:
                    raise _Stopped from None
                raise RuntimeError(f"{self.name}: read after the stages were stopped") from None
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
