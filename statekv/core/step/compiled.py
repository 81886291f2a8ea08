"""Steady streaming steps through a decoder compiled by ``torch.compile`` (the ``compile_step`` setting).

A streaming step of an 8B decoder is a thousand small kernels besides its matmuls (RMS norms, RoPE, SiLU and
its product, residual adds), each launched and each reading and writing its tensors once. A CUDA graph removes
their launch cost but not their memory traffic; Inductor fuses them. What is compiled is the model's own code
between the cache's calls: staging the chunk and the engine's attention (scoring, the carried state's selection)
are calls Dynamo skips (`statekv.core.attention.untraced`), so they run the eager step's code, on inputs that
differ from the eager step's by rounding.

Only steady steps run compiled (`TwoStateCache.is_steady`: the same shapes at every step), on their first steady
step, which is also the eager warm-up a CUDA graph records after (`statekv.core.step.graphs`): the graph then replays
the fused kernels. Inductor's own CUDA graphs are not used (``mode="default"``): the engine records its own.
Dynamo guards each layer's index, so a decoder holds one compiled entry per layer and step shape (a frame's token
count, how many streams step together); the limit on entries is raised to fit while a step runs.

Results equal the eager step's up to rounding, not bit for bit (fused kernels keep intermediates in another
precision and sum in another order; near-ties in the attention mass can then carry another token), so it is off
by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

from ..attention.untraced import engine_untraced

ENTRIES_PER_LAYER = 8  # step shapes a process may compile per layer (batch sizes, frame lengths)


def compiled(decoder: torch.nn.Module) -> Callable[..., object]:
    """``decoder``'s forward through ``torch.compile``, for steady steps (the module itself is not changed: its
    other calls, such as answering a question, stay eager). Dynamo keeps its compiled code per code object, so
    every stream of the same decoder class shares it. Where compiling fails (no C compiler, an op Inductor
    cannot lower), Dynamo logs why and runs that code eagerly: a stream never fails for want of a compiler."""
    forward = torch.compile(decoder, mode="default", fullgraph=False, dynamic=False)
    entries = ENTRIES_PER_LAYER * max(1, decoder.config.num_hidden_layers)
    # one patch object, entered at every step: each new one would leave a context variable behind per call
    step_config = torch._dynamo.config.patch(suppress_errors=True, recompile_limit=entries,
                                             accumulated_recompile_limit=max(256, 4 * entries))

    def step(**inputs: object) -> object:
        with engine_untraced(), step_config:
            return forward(**inputs)

    return step
