"""Steady streaming steps through a decoder compiled by ``torch.compile`` (the ``compile_step`` setting).

A streaming step of an 8B decoder is a thousand small kernels besides its matmuls (RMS norms, RoPE, SiLU and
its product, residual adds), each launched and each reading and writing its tensors once. A CUDA graph removes
their launch cost but not their memory traffic; Inductor fuses them. What is compiled is the model's own code
between attentions: the engine's attention (`statekv.core.model_attention`) is a call Dynamo does not trace, so
the scoring kernels, the carried state's selection and the step's bookkeeping run exactly as in an eager step.

Only steady steps run compiled (`TwoStateCache.is_steady`: the same shapes at every step), so a stream compiles
once per step shape (a frame's token count, how many streams step together), on its first steady step, which
is also the eager warm-up a CUDA graph records after (`statekv.core.graphs`): the graph then replays the fused
kernels. Inductor's own CUDA graphs are not used (``mode="default"``), since the engine records its own.

Results equal the eager step's up to rounding, not bit for bit (fused kernels keep intermediates in another
precision and sum in another order), so it is off by default. Compiling takes seconds for a small decoder and
about a minute for an 8B one, once per process and step shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

from .model_attention import untraced_attention


def compiled(decoder: torch.nn.Module) -> Callable[..., object]:
    """``decoder``'s forward through ``torch.compile``, for steady steps (the module itself is not changed: its
    other calls, such as answering a question, stay eager). Dynamo keeps its compiled code per code object, so
    every stream of the same decoder class shares it. Where compiling fails (no C compiler, an op Inductor
    cannot lower), Dynamo logs why and runs that code eagerly: a stream never fails for want of a compiler."""
    forward = torch.compile(decoder, mode="default", fullgraph=False, dynamic=False)

    def step(**inputs: object) -> object:
        with untraced_attention(), torch._dynamo.config.patch(suppress_errors=True):
            return forward(**inputs)

    return step
