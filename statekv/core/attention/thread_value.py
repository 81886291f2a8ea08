"""A value each thread sets for the calls it makes inside a block (`ThreadValue`): which stream's cache the
engine's attention serves, which frozen RoPE the rotary modules use, whether the engine's calls are untraced."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ThreadValue:
    """``default`` in every thread, except inside a block of :meth:`set` in the thread that entered it."""

    def __init__(self, default: Any = None):
        self.default = default
        self._local = threading.local()

    def get(self) -> Any:
        return getattr(self._local, "value", self.default)

    @contextmanager
    def set(self, value: Any) -> Iterator[None]:
        """``value`` for this thread inside the block; what it was before, after (blocks nest)."""
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
