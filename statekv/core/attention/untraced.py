"""The engine's own work inside a compiled step, kept out of what Dynamo traces (`statekv.core.step.compiled`).

In a step through a compiled decoder, the model's code between the cache's calls is traced and fused; the
cache's calls (`StreamingLayer.update`, `BatchLayer.update`: staging the chunk; `TwoStateCache.attend`, through
the engine's attention function: scoring, the carried state's selection) run as Dynamo-skipped calls, so they do
exactly what an eager step does, and nothing of the cache's state (its buffers' sizes, the carried length) becomes
a guard that would recompile the decoder as a stream grows.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import torch

from .thread_value import ThreadValue

_untraced = ThreadValue(False)
Result = TypeVar("Result")


def engine_untraced() -> AbstractContextManager[None]:
    """Inside the block (in this thread), :func:`engine_call` makes its calls ones Dynamo does not trace."""
    return _untraced.set(True)


def engine_call(function: Callable[..., Result], *args, **kwargs) -> Result:
    """``function(*args, **kwargs)``: a call Dynamo skips inside :func:`engine_untraced`, else a plain call."""
    if _untraced.get():
        return _skipped(function, *args, **kwargs)
    return function(*args, **kwargs)


@torch.compiler.disable
def _skipped(function: Callable[..., Result], *args, **kwargs) -> Result:
    return function(*args, **kwargs)
