"""Input checks for the scored-attention kernel; plain PyTorch, so they never need Triton."""

from __future__ import annotations

import math

import torch

from statekv.errors import InputError

from .availability import interpreter_requested

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256


class ScoredAttentionInputError(InputError):
    """The tensors given to the scored-attention kernel do not satisfy its contract."""


def validate_scored_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> None:
    """Raise :class:`ScoredAttentionInputError` naming the first violated requirement.

    Expected: ``q [B, Hq, Tq, D]``, ``k`` and ``v [B, Hkv, Tk, D]``, ``Hq % Hkv == 0``,
    ``1 <= Tq <= Tk``, ``D <= 256``, one supported dtype and one device, which is CUDA unless
    the Triton interpreter is requested.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ScoredAttentionInputError(f"{name} must be a 4-D tensor [B, H, T, D], got {shape}")
    if k.shape != v.shape:
        raise ScoredAttentionInputError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    batch, num_q_heads, q_len, head_dim = q.shape
    k_batch, num_kv_heads, k_len, k_head_dim = k.shape
    if batch != k_batch or head_dim != k_head_dim:
        raise ScoredAttentionInputError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim"
        )
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ScoredAttentionInputError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if num_q_heads % num_kv_heads != 0:
        raise ScoredAttentionInputError(
            f"query heads ({num_q_heads}) are not a multiple of KV heads ({num_kv_heads})"
        )
    if q_len > k_len:
        raise ScoredAttentionInputError(
            f"more queries than keys (Tq={q_len} > Tk={k_len}): the keys must end with the chunk itself"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ScoredAttentionInputError(f"head dim {head_dim} exceeds the kernel's maximum {MAX_HEAD_DIM}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ScoredAttentionInputError(f"unsupported dtype {q.dtype}; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ScoredAttentionInputError(f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ScoredAttentionInputError(f"devices differ: q {q.device}, k {k.device}, v {v.device}")
    if q.device.type != "cuda" and not interpreter_requested():
        raise ScoredAttentionInputError(
            f"tensors are on {q.device.type}; the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to interpret it on the CPU)"
        )
    if not math.isfinite(float(scale)):
        raise ScoredAttentionInputError(f"scale must be a finite number, got {scale}")
