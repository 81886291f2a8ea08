"""Pass 1: tiled flash-attention forward that also saves each query's log-sum-exp.

One program per (query tile, batch x query head). Scores are kept in base 2 (``qk_scale_log2``
already holds ``scale * log2(e)``), so the saved statistic is ``lse2 = log2 sum_k 2^(s_qk)`` and
pass 2 recovers probabilities as ``2^(s_qk - lse2)``.
"""

import triton
import triton.language as tl

from .tiles import load_tile, matmul


@triton.jit
def _attend_key_range(
    acc, row_max, row_sum, q, k_head, v_head,
    stride_kt, stride_kd, stride_vt, stride_vd,
    queries, offs_n, offs_d, d_ok, carried, key_start, key_end, qk_scale_log2,
    BLOCK_N: tl.constexpr, CAUSAL_EDGE: tl.constexpr, PAD_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of one query tile with keys ``[key_start, key_end)``.

    Without CAUSAL_EDGE every key of the range is visible to every query of the tile and lies
    inside ``k``, so neither the causal mask nor key bounds are applied.
    """
    for block_start in range(key_start, key_end, BLOCK_N):
        keys = block_start + offs_n
        key_ok = keys < key_end
        k_tile = load_tile(  # [BLOCK_D, BLOCK_N]: K transposed through its strides
            k_head + offs_d[:, None] * stride_kd + keys[None, :] * stride_kt, d_ok, key_ok, PAD_D, CAUSAL_EDGE
        )
        scores = matmul(q, k_tile, UPCAST_DOT, DOT_PRECISION) * qk_scale_log2
        if CAUSAL_EDGE:
            visible = keys[None, :] <= carried + queries[:, None]
            scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every query, so the first block makes each row max finite.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v_tile = load_tile(
            v_head + keys[:, None] * stride_vt + offs_d[None, :] * stride_vd, key_ok, d_ok, CAUSAL_EDGE, PAD_D
        )
        acc = acc * rescale[:, None] + matmul(probs.to(v_tile.dtype), v_tile, UPCAST_DOT, DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit(do_not_specialize=["q_len", "k_len"])  # lengths change every step: no recompiles
def flash_forward_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    num_q_heads, group_size, q_len, k_len, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Out ``[B, Tq, Hq, D]`` (q's dtype) and Lse ``[B, Hq, Tq]`` fp32 (base 2) for one query tile."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    query_tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = (batch_head // num_q_heads).to(tl.int64)
    head = (batch_head % num_q_heads).to(tl.int64)
    kv_head = head // group_size
    carried = k_len - q_len

    first_query = query_tile * BLOCK_M
    queries = first_query + tl.arange(0, BLOCK_M)
    query_ok = queries < q_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_head = Q + batch * stride_qb + head * stride_qh
    q = load_tile(q_head + queries[:, None] * stride_qt + offs_d[None, :] * stride_qd, query_ok, d_ok, True, PAD_D)
    k_head = K + batch * stride_kb + kv_head * stride_kh
    v_head = V + batch * stride_vb + kv_head * stride_vh

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Every query of the tile sees keys [0, carried + first_query]: whole blocks up to there need no
    # mask; the remaining blocks up to the tile's last query form the causal edge.
    last_query = tl.minimum(first_query + BLOCK_M, q_len) - 1
    unmasked_end = (carried + first_query + 1) // BLOCK_N * BLOCK_N
    key_end = carried + last_query + 1
    acc, row_max, row_sum = _attend_key_range(
        acc, row_max, row_sum, q, k_head, v_head, stride_kt, stride_kd, stride_vt, stride_vd,
        queries, offs_n, offs_d, d_ok, carried, 0, unmasked_end, qk_scale_log2,
        BLOCK_N, False, PAD_D, UPCAST_DOT, DOT_PRECISION,
    )
    acc, row_max, row_sum = _attend_key_range(
        acc, row_max, row_sum, q, k_head, v_head, stride_kt, stride_kd, stride_vt, stride_vd,
        queries, offs_n, offs_d, d_ok, carried, unmasked_end, key_end, qk_scale_log2,
        BLOCK_N, True, PAD_D, UPCAST_DOT, DOT_PRECISION,
    )

    out = acc / row_sum[:, None]
    out_ptrs = Out + batch * stride_ob + head * stride_oh + queries[:, None] * stride_ot + offs_d[None, :] * stride_od
    if PAD_D:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=query_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=query_ok[:, None])
    tl.store(Lse + batch_head * q_len + queries, row_max + tl.log2(row_sum), mask=query_ok)
