"""CUDA graphs of steady streaming steps: record the device work of a step once, replay it for every later step.

A steady step (see :meth:`TwoStateCache.is_steady`) reads and writes the same buffers with the same shapes
every time, and everything that differs from one step to the next (where the chunk goes, positions, the ring
slot) is advanced on the device by the step itself. Recording it once as a ``torch.cuda.CUDAGraph`` turns the
~1,300 kernel launches of an 8B model's step into one graph launch plus the copies of the step's inputs into
the graph's own input buffers.

Why a hand-held ``CUDAGraph`` rather than ``torch.compile(mode="reduce-overhead")``: the captured code is the
eager step itself, so a replay runs exactly the kernels an eager step runs (results identical by
construction); there is no compile time and no dependence on Dynamo tracing the model's remote code or the
carry policy. Under ``compile_step`` (`statekv.core.step.compiled`) the step's decoder is compiled in the warm-up
and the capture records Inductor's fused kernels (a capture that would recompile fails and is refused).

Safety: a signature (the step's input shapes, dtypes and non-tensor arguments, plus the cache's buffer layout)
is captured only after one eager step with that signature has run (lazy allocations, Triton autotuning and
cuBLAS set-up happen then, never inside a capture). A capture that fails, or whose policy read per-step host
values, is dropped with a one-line warning and that signature runs eagerly from then on.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


_recording = threading.RLock()
_depth = 0  # recordings entered by the thread holding `_recording`
_collecting = False  # whether garbage collection was on before the outermost of them


@contextmanager
def recording() -> Iterator[None]:
    """Held while a graph is recorded: one recording at a time in this process, and no garbage collection during
    it. Every recording shares torch's one capture stream, so a second one on another thread would fail both; and
    a collection inside a capture could free another graph's dead cycle, a release the capture forbids, which
    fails the capture (and refuses its signature for good). Dropping recorded graphs (`StepGraphs.clear`) waits for
    it too: a graph released during another's capture also frees cuBLAS workspaces of that capture stream."""
    global _depth, _collecting
    with _recording:
        if _depth == 0:
            _collecting = gc.isenabled()
            gc.disable()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0 and _collecting:
                gc.enable()


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list[Any]  # the flattened static inputs (tensors the graph reads)
    output: torch.Tensor


def signature(inputs: dict[str, Any]) -> tuple | None:
    """What a captured step is valid for: the tree of ``inputs`` with each tensor's shape, dtype, device and
    strides and each other leaf's value; None if some leaf cannot be compared (not hashable)."""
    leaves, spec = tree_flatten(inputs)
    parts: list[Hashable] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            parts.append(("value", type(leaf).__name__, leaf))
    return tuple(parts)


class StepGraphs:
    """The captured steady steps of one stream, keyed by :func:`signature`.

    Args:
        device_step: runs the device part of one step on ``inputs`` and returns its hidden states.
        host_dependent: tells, right after a capture, whether the captured step read per-step host values
            (then replaying it would be wrong).
        keep: how many signatures to keep captured (a stream sees a handful: chunk lengths change rarely).
    """

    def __init__(self, device_step: Callable[[dict[str, Any]], torch.Tensor], host_dependent: Callable[[], bool],
                 keep: int = 4):
        self.device_step, self.host_dependent, self.keep = device_step, host_dependent, keep
        self.captured: dict[tuple, _Captured] = {}
        self.warmed: set[tuple] = set()
        self.refused: set[tuple] = set()
        self.pool = None
        self.layout: Hashable = None
        self.replays = 0

    def run(self, inputs: dict[str, Any], layout: Hashable) -> torch.Tensor | None:
        """The step's hidden states from a graph replay, or None: run this step eagerly.

        ``layout`` identifies the buffers the step reads and writes; when it changes, every recording is
        dropped (its pointers are stale)."""
        if layout != self.layout:
            self.clear()
            self.layout = layout
        key = signature(inputs)
        if key is None or key in self.refused:
            return None
        captured = self.captured.get(key)
        if captured is None:
            if key not in self.warmed:
                self.warmed.add(key)  # the eager run of this step is the warm-up
                return None
            captured = self._capture(key, inputs)
            if captured is None:
                return None
        else:
            for static, leaf in zip(captured.inputs, tree_flatten(inputs)[0]):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()

    def clear(self) -> None:
        with _recording:  # not during a recording on another thread (`recording`)
            self.captured.clear()
        self.warmed.clear()

    def _capture(self, key: tuple, inputs: dict[str, Any]) -> _Captured | None:
        leaves, spec = tree_flatten(inputs)
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        graph = torch.cuda.CUDAGraph()
        if not self.captured:
            # a memory pool whose graphs are all gone was released: capturing into it again fails an assertion of
            # the caching allocator, so a first recording (or the first after `clear`) takes a pool of its own
            self.pool = torch.cuda.graph_pool_handle()
        try:
            torch.cuda.synchronize()
            # thread_local: the pipeline's vision thread keeps working on its own stream meanwhile;
            # fail_on_recompile: a compiled step (`statekv.core.step.compiled`) compiles in its warm-up, never here
            with recording(), torch.compiler.set_stance("fail_on_recompile"), \
                    torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = self.device_step(tree_unflatten(static, spec))
        except Exception as error:  # the step does something a graph cannot hold (a host sync, say)
            return self._refuse(key, f"capturing it failed: {str(error).splitlines()[0] if str(error) else error!r}")
        if self.host_dependent():
            return self._refuse(key, "its carry policy reads per-step host values (step, chunk_lengths, steps)")
        if len(self.captured) >= self.keep:
            self.captured.pop(next(iter(self.captured)))
        self.captured[key] = _Captured(graph, static, output)
        return self.captured[key]

    def _refuse(self, key: tuple, reason: str) -> None:
        self.refused.add(key)
        warnings.warn(f"statekv: this streaming step cannot be replayed as a CUDA graph ({reason}); "
                      "running it eagerly", RuntimeWarning, stacklevel=4)
        return None
