"""Compile a tile of either pass for a GPU architecture without a GPU (imports Triton; load it lazily).

The kernel is specialised as a call with contiguous ``[B, H, T, D]`` tensors specialises it: pointers
16-byte aligned, head-dim strides the constant 1, other strides multiples of 16. Used to check the pruning's
estimates against what Triton really compiles (``tests/test_kernel_tuning.py``,
``benchmarks/kernel_resources.py``). Needs ``TRITON_INTERPRET`` unset when Triton was first imported.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .flash_forward import flash_forward_kernel
from .key_mass import key_mass_kernel
from .tuning import Tile, head_block

KERNELS = {"flash": flash_forward_kernel, "mass": key_mass_kernel}
_POINTERS = {"flash": ("Q", "K", "V", "Out"), "mass": ("Q", "K")}
_RESULTS = ("Lse", "Scores")  # fp32 buffers


def compile_tile(pass_name: str, tile: Tile, dtype: str, head_dim: int, arch: int):
    """Triton's compiled kernel of ``tile`` for ``dtype`` ("bf16", "fp16", "fp32") on ``sm_<arch>``
    (``.metadata.shared``: its shared memory in bytes; ``.asm["cubin"]``: the binary)."""
    kernel = KERNELS[pass_name]
    names = kernel.arg_names
    constants = {"HEAD_DIM": head_dim, "BLOCK_D": head_block(head_dim), "UPCAST_DOT": False,
                 "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "BLOCK_M": tile.block_m,
                 "BLOCK_N": tile.block_n}
    constants.update({name: 1 for name in names if name.startswith("stride_") and name.endswith("d")})
    signature, attrs = {}, {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in _POINTERS[pass_name] or name in _RESULTS:
            signature[name] = f"*{dtype}" if name in _POINTERS[pass_name] else "*fp32"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
