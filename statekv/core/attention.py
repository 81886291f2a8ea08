"""Attention of one chunk against its carried keys, with the attention mass every key receives.

Layout shared by every function here:

* ``q`` ``[B, Hq, Tq, D]``; ``k``, ``v`` ``[B, Hkv, Tk, D]``, with ``Hq = Hkv * G`` and query head ``h``
  reading KV head ``h // G`` (transformers' ``repeat_kv`` convention).
* The first ``Tk - Tq`` keys are carried and visible to every query; the last ``Tq`` keys are the chunk
  itself, causal: query ``i`` sees chunk keys ``0..i``.
* Outputs are ``[B, Tq, Hq, D]`` in ``q``'s dtype (what transformers' attention functions return) and
  ``key_scores`` ``[B, Hkv, Tk]`` float32: softmax probability summed over the ``Tq`` queries and the ``G``
  query heads of each KV group (so each row sums to ``Tq * G``).

Backends: ``eager`` materialises the probabilities in float32 (the reference); ``chunked`` bounds memory by
tiling queries and keys in two passes (log-sum-exp, then output and mass); ``triton`` is the fused GPU kernel
of :mod:`statekv.kernels`; ``auto`` picks triton on CUDA when it is importable, else chunked.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .errors import ConfigurationError, InputError

BACKENDS = ("auto", "eager", "chunked", "triton")

# Tiles of the chunked backend: at most BLOCK_ROWS x BLOCK_KEYS logits per KV head are alive at once.
BLOCK_ROWS = 512
BLOCK_KEYS = 4096


def scored_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk attention over ``[carried; chunk]`` keys plus each key's attention mass (see module doc).

    Returns ``(out [B, Tq, Hq, D] in q's dtype, key_scores [B, Hkv, Tk] float32)``.
    """
    _check_shapes(q, k, v)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from statekv.kernels import triton_scored_attention

        return triton_scored_attention(q, k, v, scale=scale)
    if backend == "eager":
        return _eager(q, k, v, scale)
    return _chunked(q, k, v, scale)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The same attention without scores, through PyTorch SDPA. Returns ``[B, Tq, Hq, D]``."""
    _check_shapes(q, k, v)
    tq, tk = q.shape[-2], k.shape[-2]
    visible = _visibility(torch.arange(tq, device=q.device), tk - tq, tk)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``auto`` into a concrete backend for ``device`` and validate explicit choices."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "chunked"
    return backend


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise InputError(f"expected q [B,Hq,Tq,D] and k, v [B,Hkv,Tk,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    (b, hq, tq, d), (bk, hkv, tk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise InputError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if hq % hkv:
        raise InputError(f"{hq} query heads cannot be grouped over {hkv} KV heads")
    if tq > tk:
        raise InputError(f"the chunk has {tq} queries but only {tk} keys (the chunk's own keys must be included)")


def _visibility(query_index: torch.Tensor, carried: int, tk: int) -> torch.Tensor:
    """Bool ``[len(query_index), tk]``: may query ``i`` of the chunk see key ``j``."""
    return torch.arange(tk, device=query_index.device) <= (carried + query_index)[:, None]


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, Tq, D]`` -> ``[B, Hkv, G*Tq, D]``: each KV head's query heads stacked along rows."""
    b, hq, tq, d = q.shape
    return q.reshape(b, hkv, (hq // hkv) * tq, d)


def _ungrouped(rows: torch.Tensor, hq: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hkv, G*Tq, D]`` -> ``[B, Tq, Hq, D]`` in ``dtype``."""
    b, _, _, d = rows.shape
    return rows.reshape(b, hq, -1, d).transpose(1, 2).to(dtype)


def _largest_query_index(r0: int, r1: int, tq: int) -> int:
    """``max(i % tq for i in range(r0, r1))`` in host arithmetic (no device sync, works on meta tensors)."""
    first, last = r0 % tq, (r1 - 1) % tq
    return last if r1 - r0 < tq and first <= last else tq - 1


def _eager(q, k, v, scale):
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rows = _grouped(q, hkv).float()
    logits = rows @ k.float().transpose(-1, -2) * scale  # [B, Hkv, G*Tq, Tk]
    visible = _visibility(torch.arange(rows.shape[2], device=q.device) % tq, tk - tq, tk)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = probs @ v.float()
    return _ungrouped(out, hq, q.dtype), probs.sum(dim=-2)


def _chunked(q, k, v, scale, block_rows: int = BLOCK_ROWS, block_keys: int = BLOCK_KEYS):
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    carried = tk - tq
    rows = _grouped(q, hkv)
    n_rows = rows.shape[2]
    out = torch.empty(b, hkv, n_rows, d, dtype=torch.float32, device=q.device)
    scores = torch.zeros(b, hkv, tk, dtype=torch.float32, device=q.device)
    key_blocks = [(s, min(s + block_keys, tk)) for s in range(0, tk, block_keys)]

    for r0 in range(0, n_rows, block_rows):
        r1 = min(r0 + block_rows, n_rows)
        q_blk = rows[:, :, r0:r1].float()
        query_index = torch.arange(r0, r1, device=q.device) % tq
        last_visible = carried + _largest_query_index(r0, r1, tq)

        def logits(k0: int, k1: int) -> torch.Tensor:
            blk = q_blk @ k[:, :, k0:k1].float().transpose(-1, -2) * scale
            return blk.masked_fill(~_visibility(query_index, carried - k0, k1 - k0), float("-inf"))

        blocks = [(k0, k1) for k0, k1 in key_blocks if k0 <= last_visible]
        # Pass 1: each row's log-sum-exp over all of its visible keys.
        lse = torch.full((b, hkv, r1 - r0), float("-inf"), device=q.device)
        for k0, k1 in blocks:
            lse = torch.logaddexp(lse, logits(k0, k1).logsumexp(dim=-1))
        # Pass 2: exact probabilities, block by block, into the output and the per-key mass.
        acc = torch.zeros(b, hkv, r1 - r0, d, dtype=torch.float32, device=q.device)
        for k0, k1 in blocks:
            probs = (logits(k0, k1) - lse[..., None]).exp()
            acc += probs @ v[:, :, k0:k1].float()
            scores[:, :, k0:k1] += probs.sum(dim=-2)
        out[:, :, r0:r1] = acc
    return _ungrouped(out, hq, q.dtype), scores
