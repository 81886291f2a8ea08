"""What a streaming step asks of the device, counted on any machine: ATen ops, host syncs, static arguments.

A GPU step is slow when it launches many small kernels, waits for the host (a sync), or cannot be recorded as
a CUDA graph because its arguments change from step to step. All three are visible in the ATen ops the step
dispatches, which :class:`OpTrace` records under a ``TorchDispatchMode`` on the CPU as well:

* compute ops: ops that are neither views nor bare allocations (each is at least one kernel launch on a GPU);
* host syncs: ops whose result the host must wait for on a GPU (``.item()``, ``nonzero``, boolean indexing...);
* the signature of each op (its name, every tensor argument's shape and dtype, every other argument's value,
  and the values of tensors made from host data): two steps with identical signatures can be replayed from one
  recording.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ALLOCATIONS = {"empty.memory_format", "empty_strided.default", "new_empty.default", "new_empty_strided.default",
               "empty_like.default", "lift_fresh.default"}
VIEW_LIKE = {"_unsafe_view.default", "detach.default", "alias.default"}
# Ops whose output size or value the host must know: on CUDA they wait for the device.
HOST_SYNCS = {"_local_scalar_dense.default", "nonzero.default", "masked_select.default", "equal.default",
              "is_nonzero.default", "unique.default", "_unique.default", "_unique2.default", "unique_dim.default",
              "unique_consecutive.default", "repeat_interleave.Tensor", "bincount.default", "allclose.default",
              "masked_scatter.default", "nonzero_numpy.default"}


def _describe(value) -> object:
    """A comparable description of one op argument (tensors by shape, dtype and device; scalars by value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in value.items())
    return value


class OpTrace(TorchDispatchMode):
    """Records the ATen ops dispatched while active (``with OpTrace() as trace: ...``).

    Attributes:
        ops: every op, as ``(name, described args, described kwargs)``.
        compute: names of the compute ops (not views, not allocations), in order.
        syncs: names of the ops that would make the host wait for a GPU.
        device_ops, device_compute: the ops and compute ops of the steps' device parts (what a CUDA graph
            records), under :func:`device_parts`; host_ops, host_compute: the others.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.compute: list[str] = []
        self.syncs: list[str] = []
        self.device_ops: list[tuple] = []
        self.device_compute: list[str] = []
        self.host_ops: list[tuple] = []
        self.host_compute: list[str] = []
        self.in_device_part = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname + "." + func._overloadname
        described = (name, _describe(args), _describe(kwargs))
        if name == "lift_fresh.default":  # a tensor made from host data: its values are part of the step
            described += (tuple(args[0].flatten().tolist()) if args[0].numel() <= 64 else "large",)
        self.ops.append(described)
        (self.device_ops if self.in_device_part else self.host_ops).append(described)
        if not (func.is_view or name in VIEW_LIKE or name in ALLOCATIONS):
            self.compute.append(name)
            (self.device_compute if self.in_device_part else self.host_compute).append(name)
        if name in HOST_SYNCS or _indexes_with_booleans(name, args):
            self.syncs.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        _tracing.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _tracing.remove(self)
        return super().__exit__(*exc)


_tracing: list[OpTrace] = []  # the traces entered, innermost last


@contextmanager
def device_parts():
    """While active, the ops a step dispatches inside its device part (`statekv.core.step.batching.device_step`: what
    a CUDA graph records and replays, for one stream, several or a pooled batch's rows) count as the device part of the innermost
    :class:`OpTrace` (``device_ops``, ``device_compute``); the rest of the step (its host part, and on a GPU the
    ops a replay runs outside its graph) as its host part."""
    from ..core.step import batching
    from ..core.stream import prefill

    def marking(original):
        def marked(*args, **kwargs):
            trace = _tracing[-1] if _tracing else None
            if trace is None or trace.in_device_part:
                return original(*args, **kwargs)
            trace.in_device_part = True
            try:
                return original(*args, **kwargs)
            finally:
                trace.in_device_part = False
        return marked

    original = batching.device_step
    batching.device_step = prefill.device_step = marking(original)
    try:
        yield
    finally:
        batching.device_step = prefill.device_step = original


def _indexes_with_booleans(name: str, args) -> bool:
    """``x[mask]`` and ``x[mask] = y`` with a boolean mask need the mask's nonzero count on the host."""
    if not name.startswith(("index.", "index_put")):
        return False
    leaves, _ = tree_flatten(list(args[1:2]))
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in leaves)
