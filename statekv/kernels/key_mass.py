"""Pass 2: per-key attention mass, reduced over the query heads of each KV group in the kernel.

One program per (key tile, batch x KV head). It loads its K tile once and sweeps every query head
of the group and every query tile that can see the keys, accumulating
``mass_k = sum_{h in group} sum_q 2^(s_qk - lse2_q)`` in fp32 registers. No [Tq, Tk]
matrix and no per-query-head score tensor is ever written.
"""

import triton
import triton.language as tl

from .tiles import load_tile, matmul


@triton.jit(do_not_specialize=["q_len", "k_len"])  # lengths change every step: no recompiles
def key_mass_kernel(
    Q, K, Lse, Scores,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    num_kv_heads, group_size, q_len, k_len, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Scores ``[B, Hkv, Tk]`` fp32 for one key tile, from Q, K and pass 1's Lse ``[B, Hq, Tq]``."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    key_tile = tl.program_id(0)
    batch_kv_head = tl.program_id(1)
    batch = (batch_kv_head // num_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % num_kv_heads).to(tl.int64)
    carried = k_len - q_len

    first_key = key_tile * BLOCK_N
    keys = first_key + tl.arange(0, BLOCK_N)
    key_ok = keys < k_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    k_head = K + batch * stride_kb + kv_head * stride_kh
    k_tile = load_tile(k_head + offs_d[:, None] * stride_kd + keys[None, :] * stride_kt, d_ok, key_ok, PAD_D, True)

    mass = tl.zeros([BLOCK_N], tl.float32)
    # Chunk key c is seen by queries c.. only: start at the query tile holding the first such query.
    first_query_tile_start = tl.maximum(first_key - carried, 0) // BLOCK_M * BLOCK_M
    for group_member in range(0, group_size):
        head = kv_head * group_size + group_member
        q_head = Q + batch * stride_qb + head * stride_qh
        lse_head = Lse + (batch * num_kv_heads * group_size + head) * q_len
        for tile_start in range(first_query_tile_start, q_len, BLOCK_M):
            queries = tile_start + offs_m
            query_ok = queries < q_len
            q = load_tile(
                q_head + queries[:, None] * stride_qt + offs_d[None, :] * stride_qd, query_ok, d_ok, True, PAD_D
            )
            lse = tl.load(lse_head + queries, mask=query_ok, other=0.0)
            scores = matmul(q, k_tile, UPCAST_DOT, DOT_PRECISION) * qk_scale_log2
            visible = (keys[None, :] <= carried + queries[:, None]) & query_ok[:, None]
            probs = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
            mass += tl.sum(probs, axis=0)
    tl.store(Scores + batch_kv_head * k_len + keys, mass, mask=key_ok)
