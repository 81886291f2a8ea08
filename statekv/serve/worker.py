"""Where model work runs. Today every push, encode, question and save of one `VideoQA` runs on one thread, in
arrival order, so concurrent requests never step the model at once; a scheduler that batches streams' steps can
replace `ModelWorker` behind the same two methods."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

T = TypeVar("T")


class ModelExecutor(Protocol):
    """What the service needs from whatever runs model work."""

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``work(*args, **kwargs)`` with the model to itself; return its result or raise its error."""

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """The same from a thread that is not the event loop's (startup, shutdown)."""

    def close(self) -> None: ...


class ModelWorker:
    """One thread for all model work, first come first served."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="statekv-model")
        self.queued = 0

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.queued += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(work, *args, **kwargs))
        finally:
            self.queued -= 1

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(work, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
