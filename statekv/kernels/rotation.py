"""RoPE rotation of stored keys by a number of positions per key, in one pass: each key is read once and written
once, its angles computed in registers (the eager rotation writes the float32 halves, the angles, their cosines
and sines and four products to memory first). A placed step rotates every carried key of every layer
(`statekv.core.positions.rotation.place_carried`), so on a large model this pass is most of what bounded
positions add to a step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .availability import interpreter_requested

ROWS = 64  # keys per program


@triton.jit
def rotate_kernel(Keys, Delta, Frequencies, Out, size, half,
                  stride_key_head, stride_key_row, stride_delta_head, stride_out_head, stride_out_row,
                  HALF_BLOCK: tl.constexpr, ROWS: tl.constexpr, PRECISE: tl.constexpr):
    """Rotates the keys ``[rows, 2 * half]`` of one head (rotate-half layout) by ``Delta`` ``[rows]`` positions."""
    head = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, HALF_BLOCK)
    row_ok = rows < size
    column_ok = columns < half
    ok = row_ok[:, None] & column_ok[None, :]
    turns = tl.load(Delta + head * stride_delta_head + rows, mask=row_ok, other=0).to(tl.float32)
    angles = turns[:, None] * tl.load(Frequencies + columns, mask=column_ok, other=0.0)[None, :]
    if PRECISE:  # CUDA's own cosf and sinf, as torch's; the interpreter has no libdevice
        cos, sin = libdevice.cos(angles), libdevice.sin(angles)
    else:
        cos, sin = tl.cos(angles), tl.sin(angles)
    source = Keys + head * stride_key_head + rows[:, None] * stride_key_row + columns[None, :]
    first = tl.load(source, mask=ok, other=0.0).to(tl.float32)
    second = tl.load(source + half, mask=ok, other=0.0).to(tl.float32)
    target = Out + head * stride_out_head + rows[:, None] * stride_out_row + columns[None, :]
    tl.store(target, (first * cos - second * sin).to(Out.dtype.element_ty), mask=ok)
    tl.store(target + half, (second * cos + first * sin).to(Out.dtype.element_ty), mask=ok)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor) -> bool:
    """``keys`` ``[..., N, D]`` rotated by ``delta`` ``[..., N]`` positions into ``out`` (``keys``' shape and
    dtype), as `statekv.core.positions.rotation.rotate` does, with ``inv_freq`` ``[R / 2]`` float32 on the keys'
    device. False, with nothing written, where the layout does not suit the kernel (a key's dims not contiguous,
    or leading dims that do not flatten into one); the caller rotates those itself."""
    size, dim = keys.shape[-2:]
    half = inv_freq.shape[0]
    if keys.numel() == 0:
        return True
    if keys.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    try:
        source, target = keys.view(-1, size, dim), out.view(-1, size, dim)
    except RuntimeError:
        return False
    turns = delta.expand(*keys.shape[:-1]).reshape(-1, size)
    if turns.stride(-1) != 1:
        turns = turns.contiguous()
    heads = source.shape[0]
    rotate_kernel[(heads, triton.cdiv(size, ROWS))](
        source, turns, inv_freq, target, size, half,
        source.stride(0), source.stride(1), turns.stride(0), target.stride(0), target.stride(1),
        HALF_BLOCK=triton.next_power_of_2(half), ROWS=ROWS, PRECISE=not interpreter_requested())
    if 2 * half < dim:
        out[..., 2 * half:] = keys[..., 2 * half:]
    return True
