"""Whether the Triton kernels can run here, decided without importing Triton needlessly."""

from __future__ import annotations

import importlib
import os

import torch

from statekv.errors import StateKVError

_TRUTHY = {"1", "true", "on", "yes"}


class TritonUnavailableError(StateKVError, RuntimeError):
    """The Triton kernels cannot run in this process (e.g. TRITON_INTERPRET=1 came after Triton was imported)."""


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels with NumPy on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


def triton_available() -> bool:
    """True when Triton imports and there is something to run it on (CUDA or the interpreter)."""
    if not (interpreter_requested() or torch.cuda.is_available()):
        return False
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True
