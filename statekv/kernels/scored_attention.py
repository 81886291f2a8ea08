"""Launcher of the two-pass scored-attention kernel (imports Triton; load it lazily)."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .availability import TritonUnavailableError
from .flash_forward import flash_forward_kernel
from .key_mass import key_mass_kernel

LOG2_E = 1.4426950408889634


def _interpreting() -> bool:
    """Whether Triton interprets kernels in this process.

    ``triton.jit`` chooses between compiling and interpreting when a function is defined, Triton's own
    ``triton.language`` helpers included, so it is fixed by ``TRITON_INTERPRET`` at Triton's first import.
    """
    return isinstance(tl.zeros, InterpretedFunction)


def scored_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run both passes on validated inputs; see :func:`statekv.kernels.triton_scored_attention`.

    Shapes: q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]`` (any strides) -> out ``[B, Tq, Hq, D]``
    in q's dtype and key_scores ``[B, Hkv, Tk]`` float32.
    """
    interpreting = _interpreting()
    if q.device.type != "cuda" and not interpreting:
        raise TritonUnavailableError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so it cannot interpret kernels in this "
            "process; set it before anything imports Triton (torch and transformers may)"
        )
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, k_len = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads

    out = torch.empty((batch, q_len, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_q_heads, q_len), dtype=torch.float32, device=q.device)
    key_scores = torch.empty((batch, num_kv_heads, k_len), dtype=torch.float32, device=q.device)

    shape_args = dict(
        q_len=q_len,
        k_len=k_len,
        qk_scale_log2=scale * LOG2_E,
        TQ_BUCKET=triton.next_power_of_2(q_len),
        TK_BUCKET=triton.next_power_of_2(k_len),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST_DOT=interpreting and q.dtype == torch.bfloat16,
        # fp32 inputs must not be rounded to TF32 (1e-5 agreement); 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    device_guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device_guard:
        flash_forward_kernel[lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), batch * num_q_heads)](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            num_q_heads, group_size, **shape_args,
        )
        key_mass_kernel[lambda meta: (triton.cdiv(k_len, meta["BLOCK_N"]), batch * num_kv_heads)](
            q, k, lse, key_scores,
            *q.stride(), *k.stride(),
            num_kv_heads, group_size, **shape_args,
        )
    return out, key_scores
