"""Triton kernels for StateKV (GPU).

Importing this package never imports Triton: the kernels are compiled on the first call. On a
machine without CUDA they run only under Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the tests exercise them on CPU.
"""

from __future__ import annotations

import torch

from .availability import TritonUnavailableError, interpreter_requested, triton_available
from .validation import ScoredAttentionInputError, validate_scored_attention_inputs

__all__ = [
    "ScoredAttentionInputError",
    "TritonUnavailableError",
    "interpreter_requested",
    "triton_available",
    "triton_scored_attention",
]


def triton_scored_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and per-key attention mass in two tiled passes, never forming Q·Kᵀ.

    Args:
        q: ``[B, Hq, Tq, D]`` queries of one chunk (bf16, fp16 or fp32; any strides).
        k, v: ``[B, Hkv, Tk, D]`` keys/values, ``Hq = Hkv * G``; query head ``h`` reads KV head
            ``h // G``. The first ``Tk - Tq`` keys are carried and visible to every query; the
            last ``Tq`` are the chunk itself, causal (query ``i`` sees chunk keys ``0..i``).
        scale: multiplier of ``q·k`` before the softmax (usually ``D ** -0.5``).

    Returns:
        ``out``: ``[B, Tq, Hq, D]`` in ``q.dtype`` (transformers' attention-function layout);
        ``key_scores``: ``[B, Hkv, Tk]`` float32, softmax probability summed over the ``Tq``
        queries and the ``G`` query heads of each KV group (each row sums to ``Tq * G``).

    Raises:
        ScoredAttentionInputError: on inconsistent shapes, dtypes or devices, ``Tq > Tk``,
            ``Hq`` not a multiple of ``Hkv``, ``D > 256``, or tensors that are not on CUDA
            while the interpreter is not requested.
        TritonUnavailableError: CPU tensors, but Triton was imported before ``TRITON_INTERPRET=1``.
    """
    validate_scored_attention_inputs(q, k, v, scale)
    launcher = _LAUNCHER or _load_launcher()
    return launcher(q, k, v, scale=float(scale))


_LAUNCHER = None


def _load_launcher():
    """The launcher module imports Triton: only when the kernel is first used."""
    global _LAUNCHER
    from .scored_attention import scored_attention

    _LAUNCHER = scored_attention
    return scored_attention
