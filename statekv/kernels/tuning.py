"""Autotuning space of the two scored-attention passes.

Tiles are (BLOCK_M queries, BLOCK_N keys, warps, pipeline stages). The autotune key buckets
``Tq`` and ``Tk`` to powers of two, so a stream whose carried state grows frame by frame retunes a
handful of times, not once per length. Under the interpreter every space collapses to one tile:
there is nothing to tune and the tests stay quick.
"""

from __future__ import annotations

import triton

from .availability import interpreter_requested

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
FLASH_FORWARD_TILES = (
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 32, 4, 4),
    (64, 32, 4, 2),
    (64, 64, 8, 2),
    (16, 64, 4, 3),
    (16, 128, 4, 3),
)
KEY_MASS_TILES = (
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (32, 64, 4, 3),
    (32, 128, 4, 3),
    (64, 32, 4, 2),
    (32, 64, 4, 2),
    (16, 64, 4, 2),
    (16, 32, 4, 2),
)
INTERPRETER_TILE = (32, 64, 4, 1)  # BLOCK_M != BLOCK_N, so a swapped index cannot pass unnoticed

AUTOTUNE_KEY = ["TQ_BUCKET", "TK_BUCKET", "HEAD_DIM"]  # dtypes are added to the key by Triton


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


def tile_configs(tiles: tuple[tuple[int, int, int, int], ...]) -> list[triton.Config]:
    """The autotune configs for ``tiles``; a single small one when Triton interprets."""
    if interpreter_requested():
        return [_config(*INTERPRETER_TILE)]
    return [_config(*tile) for tile in tiles]


def prune_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles that are mostly padding for this shape or too large for wide heads."""
    args = {**named_args, **kwargs}
    q_bucket, k_bucket = args["TQ_BUCKET"], args["TK_BUCKET"]
    row_bytes = args["BLOCK_D"] * args["Q"].element_size()

    def suits(config: triton.Config) -> bool:
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        if block_m > max(16, q_bucket) or block_n > max(32, k_bucket):
            return False
        # Rows wider than 128 bf16 values (D = 256, or fp32 with D > 64) inflate every tile: keep register
        # and shared-memory use bounded (e.g. fp32, D = 128, 128x64x3 stages needs ~230 KB of shared memory).
        return row_bytes <= 256 or (block_m * block_n <= 64 * 64 and config.num_stages <= 2)

    kept = [config for config in configs if suits(config)]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
