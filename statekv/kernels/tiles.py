"""Tile helpers shared by the two scored-attention passes (inlined into the kernels)."""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, zero-filling out-of-range rows/columns; unchecked axes skip the mask."""
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def matmul(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32 on the tiles' own dtype.

    UPCAST is set only under the interpreter for bfloat16, which it stores as raw uint16 and cannot
    multiply; on a GPU the operands stay 16-bit and go to the tensor cores as they are.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)
