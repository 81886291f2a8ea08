"""Callbacks that do not keep their owner alive. An engine hands its parts callbacks into itself (a cache its
layers, a stream its durability); strong ones would make cycles that only Python's cyclic collector frees, so a
closed stream's cache (gigabytes on a GPU) would stay until a full collection, which a long-running server seldom
makes."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(owner: Any, function: Callable[..., Any], default: Any = None) -> Callable[..., Any]:
    """``function(owner, *args)`` as a callable that holds ``owner`` weakly: once it is gone, ``default``."""
    held = weakref.ref(owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        alive = held()
        return default if alive is None else function(alive, *args, **kwargs)
    return call
