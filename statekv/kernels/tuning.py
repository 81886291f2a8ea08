"""Which tiles the two scored-attention passes try, and how one is chosen (pure Python, no Triton).

A tile is (BLOCK_M queries, BLOCK_N keys, warps, pipeline stages). For a shape, `fitting_tiles` keeps the
tiles of a pass that are not mostly padding and that fit the device: their estimated shared memory within
the device's limit and their registers within a thread's budget (a tile that does not fit fails to launch;
one that spills is slow). At most `MAX_CANDIDATES` survive, in order of preference, so first-use tuning
benchmarks a handful per shape bucket. Shapes are bucketed (`shape_bucket`) so a stream whose carried state
grows frame by frame is tuned a few times in all, not once per length; `choose_tile` picks the fastest
candidate, skipping those that fail. Under Triton's interpreter every pass uses `INTERPRETER_TILE`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..errors import ConfigurationError


class Tile(NamedTuple):
    """One launch configuration of a pass."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# In order of preference (a tie in tuning keeps the earlier); both lists end with tiles that fit anywhere.
FLASH_FORWARD_TILES = (
    Tile(128, 64, 8, 3),
    Tile(128, 64, 4, 3),
    Tile(64, 64, 4, 3),
    Tile(64, 128, 4, 3),
    Tile(64, 32, 4, 2),
    Tile(16, 64, 4, 3),
    Tile(16, 32, 4, 2),
    Tile(16, 16, 4, 1),
)
KEY_MASS_TILES = (
    Tile(64, 64, 4, 3),
    Tile(128, 64, 8, 3),
    Tile(64, 128, 8, 3),
    Tile(32, 64, 4, 3),
    Tile(32, 32, 4, 2),
    Tile(16, 64, 4, 2),
    Tile(16, 32, 4, 2),
    Tile(16, 16, 4, 1),
)
PASSES = {"flash": FLASH_FORWARD_TILES, "mass": KEY_MASS_TILES}
INTERPRETER_TILE = Tile(32, 64, 4, 1)  # BLOCK_M != BLOCK_N, so a swapped index cannot pass unnoticed

MAX_CANDIDATES = 3  # tiles compiled and benchmarked per pass and shape bucket at first use
MAX_REGISTERS = 255  # 32-bit registers a thread can hold; beyond them the compiler spills
BASE_REGISTERS = 64  # what a thread holds besides its share of the tiles (fitted to compiled kernels)
Q_BUCKETS = (16, 64, 256)  # chunk lengths up to each, then "longer" (`LONGER`)
K_BUCKETS = (256, 1024, 4096, 16384)  # key counts up to each (powers of 4), then "longer"
LONGER = 1 << 30


def tile_candidates() -> int:
    """How many tiles first-use tuning tries per pass: ``STATEKV_TILE_CANDIDATES`` (1: one tile per pass
    compiled, for correctness checks that must not spend minutes tuning), else `MAX_CANDIDATES`."""
    text = os.environ.get("STATEKV_TILE_CANDIDATES", "").strip()
    if not text:
        return MAX_CANDIDATES
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # int() refuses digits such as '²'
        raise ConfigurationError(f"STATEKV_TILE_CANDIDATES must be a positive integer, got {text!r}")
    return int(text)


def head_block(head_dim: int) -> int:
    """BLOCK_D: the head dim padded to a power of two, at least 16 (``tl.dot`` needs 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def shape_bucket(q_len: int, k_len: int) -> tuple[int, int]:
    """The (queries, keys) bucket a shape is tuned for: the first bound of `Q_BUCKETS` / `K_BUCKETS` at or
    above it, else `LONGER`."""
    return (next((b for b in Q_BUCKETS if q_len <= b), LONGER), next((b for b in K_BUCKETS if k_len <= b), LONGER))


def shared_memory_bytes(tile: Tile, pass_name: str, head_dim: int, element_size: int) -> int:
    """An upper estimate of a tile's shared memory: the tile loaded once, the operand tiles the loop streams
    (once per pipeline stage), and a ``[BLOCK_M, BLOCK_N]`` fp32 scratch for layout conversions.

    flash: Q ``[M, D]`` once; K and V ``[N, D]`` per stage. mass: K ``[D, N]`` once; Q ``[M, D]`` per stage.
    Checked against what Triton compiles for sm_80 and sm_90 (benchmarks/kernel_resources.py, docs/kernel.md).
    """
    d = head_block(head_dim)
    m, n, stages = tile.block_m, tile.block_n, tile.num_stages
    if pass_name == "flash":
        operands = m * d + stages * 2 * n * d
    elif pass_name == "mass":
        operands = n * d + stages * m * d
    else:
        raise ValueError(f"unknown pass {pass_name!r}")
    return element_size * operands + 4 * m * n


def registers_per_thread(tile: Tile, pass_name: str, head_dim: int, element_size: int) -> int:
    """An estimate of the 32-bit registers one thread needs: `BASE_REGISTERS` for addresses, masks and loop
    state, plus its share of the fp32 scores and probabilities ``[M, N]``, the fp32 accumulator ``[M, D]`` and
    Q (flash), or the K tile and Q (mass); twice that share in fp32, whose IEEE dots run without tensor cores
    and keep their operands in registers. Above 255 the compiler spills to local memory. Fitted to the
    registers and spills of compiled kernels (docs/kernel.md)."""
    d = head_block(head_dim)
    m, n = tile.block_m, tile.block_n
    words = element_size / 4
    held = 2 * m * n + (m * d + words * m * d if pass_name == "flash" else words * (n * d + m * d))
    if element_size >= 4:
        held *= 2
    return BASE_REGISTERS + math.ceil(held / (32 * tile.num_warps))


def fitting_tiles(pass_name: str, *, q_len: int, k_len: int, head_dim: int, element_size: int,
                  shared_memory: int, tiles: Sequence[Tile] | None = None,
                  max_candidates: int = MAX_CANDIDATES) -> list[Tile]:
    """The tiles of ``pass_name`` ("flash" or "mass") worth trying for this shape on a device with
    ``shared_memory`` bytes per block: not mostly padding (BLOCK_M above the chunk length's bucket, BLOCK_N
    above the keys'), within the shared memory and register budgets, at most ``max_candidates``, in order.

    When no tile of the list fits, the single smallest tile that fits is returned; `ValueError` when even
    that does not (a head dim too wide for the device in this dtype).
    """
    tiles = PASSES[pass_name] if tiles is None else tiles
    q_bucket, k_bucket = shape_bucket(q_len, k_len)

    def fits(tile: Tile) -> bool:
        return (shared_memory_bytes(tile, pass_name, head_dim, element_size) <= shared_memory
                and registers_per_thread(tile, pass_name, head_dim, element_size) <= MAX_REGISTERS)

    def suits(tile: Tile) -> bool:
        return tile.block_m <= max(16, q_bucket) and tile.block_n <= max(32, k_bucket) and fits(tile)

    kept = [tile for tile in tiles if suits(tile)][:max_candidates]
    if kept:
        return kept
    smallest = sorted((tile for tile in tiles if fits(tile)),
                      key=lambda tile: shared_memory_bytes(tile, pass_name, head_dim, element_size))
    if smallest:
        return smallest[:1]
    need = min(shared_memory_bytes(tile, pass_name, head_dim, element_size) for tile in tiles)
    raise ValueError(f"head dim {head_dim} with {element_size}-byte elements needs at least {need} bytes of shared "
                     f"memory per block; this device has {shared_memory}")


def choose_tile(candidates: Sequence[Tile], bench: Callable[[Tile], float],
                failures: tuple[type[BaseException], ...] = ()) -> Tile:
    """The candidate with the smallest ``bench(tile)`` (any time unit; the earliest wins a tie).

    Every candidate is run, a lone one too, so a tile that cannot launch is never chosen: those raising one
    of ``failures`` (e.g. Triton's out-of-resources) are skipped; if all fail, the last failure is raised.
    """
    best, best_time, failure = None, math.inf, None
    for tile in candidates:
        try:
            seconds = bench(tile)
        except failures as error:
            failure = error
            continue
        if best is None or seconds < best_time:
            best, best_time = tile, seconds
    if best is None:
        if failure is None:
            raise ValueError("no candidate tile to choose from")
        raise failure
    return best
