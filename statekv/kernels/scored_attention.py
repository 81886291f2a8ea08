"""Launcher of the two-pass scored-attention kernel (imports Triton; load it lazily).

Each call looks its tiles up in a dict keyed by device, dtype, head layout and shape bucket, then launches the
two plain ``triton.jit`` kernels with them: no autotuner runs per call. A key seen for the first time in this
process takes its tiles from the on-disk `TileCache` of the device, or else tunes them once (`_tune`): a few
candidate tiles per pass that fit the device's shared memory (`fitting_tiles`), each timed briefly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .availability import TritonUnavailableError
from .flash_forward import flash_forward_kernel
from .key_mass import key_mass_kernel
from .tile_cache import TileCache, default_path, source_hash
from .tuning import INTERPRETER_TILE, Tile, choose_tile, fitting_tiles, head_block, shape_bucket, tile_candidates

LOG2_E = 1.4426950408889634
TUNING_WARMUP_MS, TUNING_REP_MS = 5, 20  # per candidate tile: brief, a shape bucket tunes in well under a second

_TILES: dict[tuple, tuple[Tile, Tile]] = {}  # (device, dtype, D, Hq, Hkv, q bucket, k bucket) -> (flash, mass)
_DISK: dict[int, TileCache] = {}  # CUDA device index -> its cache file


def _interpreting() -> bool:
    """Whether Triton interprets kernels in this process.

    ``triton.jit`` chooses between compiling and interpreting when a function is defined, Triton's own
    ``triton.language`` helpers included, so it is fixed by ``TRITON_INTERPRET`` at Triton's first import.
    """
    return isinstance(tl.zeros, InterpretedFunction)


INTERPRETING = _interpreting()


def scored_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run both passes on validated inputs; see :func:`statekv.kernels.triton_scored_attention`.

    Shapes: q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]`` (any strides) -> out ``[B, Tq, Hq, D]``
    in q's dtype and key_scores ``[B, Hkv, Tk]`` float32.
    """
    if not q.is_cuda and not INTERPRETING:
        raise TritonUnavailableError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so it cannot interpret kernels in this "
            "process; set it before anything imports Triton (torch and transformers may)"
        )
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, k_len = k.shape[1], k.shape[2]
    out = torch.empty((batch, q_len, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    # one allocation for both fp32 results: the LSE [B, Hq, Tq] of pass 1, then the scores [B, Hkv, Tk]
    lse_size = batch * num_q_heads * q_len
    scratch = torch.empty(lse_size + batch * num_kv_heads * k_len, dtype=torch.float32, device=q.device)
    lse = scratch[:lse_size].view(batch, num_q_heads, q_len)
    key_scores = scratch[lse_size:].view(batch, num_kv_heads, k_len)
    launch = _Launch(q, k, v, out, lse, key_scores, scale)

    switch = q.is_cuda and q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if switch else contextlib.nullcontext():
        key = (q.device, q.dtype, head_dim, num_q_heads, num_kv_heads, *shape_bucket(q_len, k_len))
        tiles = _TILES.get(key)
        if tiles is None:
            tiles = _TILES[key] = _first_use(key, launch)
        launch.forward(tiles[0])
        launch.mass(tiles[1])
    return out, key_scores


class _Launch:
    """The two kernel launches of one call, with its arguments computed once."""

    def __init__(self, q, k, v, out, lse, key_scores, scale: float):
        self.q, self.k, self.v, self.out, self.lse, self.key_scores = q, k, v, out, lse, key_scores
        batch, num_q_heads, q_len, head_dim = q.shape
        num_kv_heads, k_len = k.shape[1], k.shape[2]
        self.batch, self.num_q_heads, self.num_kv_heads = batch, num_q_heads, num_kv_heads
        self.q_len, self.k_len = q_len, k_len
        self.group_size = num_q_heads // num_kv_heads
        self.strides_q, self.strides_k = q.stride(), k.stride()
        self.constants = dict(
            qk_scale_log2=scale * LOG2_E, HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim),
            UPCAST_DOT=INTERPRETING and q.dtype == torch.bfloat16,
            # fp32 inputs must not be rounded to TF32 (1e-5 agreement); 16-bit inputs ignore this.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )

    def forward(self, tile: Tile) -> None:
        flash_forward_kernel[(triton.cdiv(self.q_len, tile.block_m), self.batch * self.num_q_heads)](
            self.q, self.k, self.v, self.out, self.lse,
            *self.strides_q, *self.strides_k, *self.v.stride(), *self.out.stride(),
            self.num_q_heads, self.group_size, self.q_len, self.k_len, **self.constants,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages,
        )

    def mass(self, tile: Tile) -> None:
        key_mass_kernel[(triton.cdiv(self.k_len, tile.block_n), self.batch * self.num_kv_heads)](
            self.q, self.k, self.lse, self.key_scores,
            *self.strides_q, *self.strides_k,
            self.num_kv_heads, self.group_size, self.q_len, self.k_len, **self.constants,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages,
        )


def _first_use(key: tuple, launch: _Launch) -> tuple[Tile, Tile]:
    """The tiles of a key new to this process: fixed under the interpreter, else from the device's tile cache,
    else tuned now (and cached)."""
    if INTERPRETING:
        return INTERPRETER_TILE, INTERPRETER_TILE
    device, dtype, head_dim, num_q_heads, num_kv_heads, q_bucket, k_bucket = key
    cache = _device_cache(device)
    name = f"{str(dtype).removeprefix('torch.')}-d{head_dim}-h{num_q_heads}/{num_kv_heads}-q{q_bucket}-k{k_bucket}"
    tiles = cache.get(name)
    if tiles is None:
        shared_memory = triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]
        tiles = _tune(launch, shared_memory)
        cache.put(name, tiles)
    return tiles


def _tune(launch: _Launch, shared_memory: int) -> tuple[Tile, Tile]:
    """Time the candidate tiles of pass 1, then (on pass 1's LSE) those of pass 2; the fastest of each."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors

    failures = (CompilationError, *(getattr(errors, name) for name in ("OutOfResources", "PTXASError")
                                    if hasattr(errors, name)))
    shape = dict(q_len=launch.q_len, k_len=launch.k_len, head_dim=launch.constants["HEAD_DIM"],
                 element_size=launch.q.element_size(), shared_memory=shared_memory)
    candidates = tile_candidates()
    flash = choose_tile(fitting_tiles("flash", **shape, max_candidates=candidates), _timer(launch.forward), failures)
    launch.forward(flash)  # pass 2 reads the LSE of the chosen tile
    mass = choose_tile(fitting_tiles("mass", **shape, max_candidates=candidates), _timer(launch.mass), failures)
    return flash, mass


def _timer(run: Callable[[Tile], None]) -> Callable[[Tile], float]:
    import triton.testing

    def bench(tile: Tile) -> float:
        run(tile)  # compiles (and fails here if the tile cannot launch)
        return triton.testing.do_bench(lambda: run(tile), warmup=TUNING_WARMUP_MS, rep=TUNING_REP_MS,
                                       return_mode="median")
    return bench


def _device_cache(device: torch.device) -> TileCache:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DISK:
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        identity = {"device": name, "capability": f"{major}.{minor}", "triton": triton.__version__,
                    "kernels": source_hash()}
        _DISK[index] = TileCache(default_path(f"{name}-sm{major}{minor}"), identity)
    return _DISK[index]
