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
tiling the query rows (and, past ``MAX_KEYS`` keys, the keys too, in two passes: log-sum-exp, then output and
mass; `chunked_scored_attention` takes the tiles as arguments); ``triton`` is the fused GPU kernel of
:mod:`statekv.kernels`; ``auto`` picks triton on CUDA when it is importable, else chunked.

The visibility pattern depends only on ``(Tq, Tk)``: :class:`ChunkMask` builds it once per shape, so a
steady stream never rebuilds it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ...errors import ConfigurationError, InputError
from ...settings.engine import BACKENDS

# Tiles of the chunked backend: at most BLOCK_ROWS x MAX_KEYS logits per KV head are alive at once; beyond
# MAX_KEYS keys, they are visited BLOCK_KEYS at a time in two passes.
BLOCK_ROWS = 512
MAX_KEYS = 16384
BLOCK_KEYS = 4096


_building = threading.Lock()
MASKS_KEPT = 256  # masks no recorded graph reads, kept for their next use (full attention makes one a step)


class ChunkMask:
    """Visibility of ``Tk`` keys (``Tk - Tq`` carried, then the chunk) to a chunk's ``Tq`` queries.

    Its tensors are built at their first use (SDPA on CUDA reads none of them): a question's prompt makes one mask
    that every layer reads.
    """

    _built: dict[tuple, "ChunkMask"] = {}
    _uses = itertools.count()  # a mask's ``used``: when it was last looked up, in lookups

    def __init__(self, tq: int, tk: int, groups: int, device: torch.device):
        self.tq, self.tk, self.groups, self.device = tq, tk, groups, device
        self._bias: torch.Tensor | None = None
        self._sdpa: dict[torch.dtype, torch.Tensor] = {}
        self.recorded = False  # read by a recorded CUDA graph: kept for good
        self.used = 0

    @property
    def bias(self) -> torch.Tensor:
        """float32 ``[G * Tq, Tk]``, 0 where visible and -inf elsewhere, for the grouped rows of :func:`_grouped`
        (row ``r`` is query ``r % Tq``): what the scored backends add to the logits."""
        if self._bias is None:
            bias = self._additive(torch.float32).repeat(self.groups, 1)
            with _building:  # masks are shared by threads: the first kept is the one every step reads
                if self._bias is None:
                    self._bias = bias
        return self._bias

    def _additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``[Tq, Tk]`` in ``dtype``: 0 where visible and -inf elsewhere."""
        visible = torch.arange(self.tk, device=self.device) <= torch.arange(self.tk - self.tq, self.tk,
                                                                            device=self.device)[:, None]
        return torch.zeros(self.tq, self.tk, dtype=dtype, device=self.device).masked_fill_(~visible, float("-inf"))

    @classmethod
    def of(cls, tq: int, tk: int, groups: int, device: torch.device) -> "ChunkMask":
        """The mask of this shape, built on first use and kept: for good once a recorded CUDA graph reads it (it
        may at any later replay), else among the `MASKS_KEPT` used last (a full-attention stream's keys grow at
        every step: each step's shape kept would hold memory quadratic in its length)."""
        key = (tq, tk, groups, device)
        mask = cls._built.get(key)
        if torch.compiler.is_compiling():  # traced into a compiled step, which holds what it reads
            return mask if mask is not None else cls._built.setdefault(key, cls(tq, tk, groups, device))
        if mask is None:  # a new shape: built, and the least recently used let go beyond the kept ones
            with _building:  # a thread that made one too takes the kept one
                mask = cls._built.setdefault(key, cls(tq, tk, groups, device))
                over = len(cls._built) - MASKS_KEPT
                if over > 0:
                    idle = sorted((old for old, kept in cls._built.items() if not kept.recorded and old != key),
                                  key=lambda old: cls._built[old].used)
                    for old in idle[:over]:
                        del cls._built[old]
        mask.used = next(cls._uses)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            mask.recorded = True
        return mask

    def sdpa(self, dtype: torch.dtype):
        """What SDPA takes for queries of ``dtype``: on CUDA torch's lower-right causal bias (lets it use its
        fused kernels), else an additive ``[Tq, Tk]`` mask in ``dtype`` (a boolean one would be converted on
        every call)."""
        if self.device.type == "cuda":
            return causal_lower_right(self.tq, self.tk)
        if dtype not in self._sdpa:
            self._sdpa[dtype] = self._additive(dtype)
        return self._sdpa[dtype]


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, backend: str = "auto",
                     mask: ChunkMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk attention over ``[carried; chunk]`` keys plus each key's attention mass (see module doc).

    Returns ``(out [B, Tq, Hq, D] in q's dtype, key_scores [B, Hkv, Tk] float32)``. ``mask``: the prebuilt
    :class:`ChunkMask` of these shapes, if the caller has it.
    """
    _check_shapes(q, k, v)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from statekv.kernels import triton_scored_attention

        return triton_scored_attention(q, k, v, scale=scale)
    mask = mask or ChunkMask.of(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
    if backend == "eager":
        return _eager(q, k, v, scale, mask)
    return _chunked(q, k, v, scale, mask)


def chunked_scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                             mask: ChunkMask | None = None, block_rows: int | None = None,
                             max_keys: int | None = None, block_keys: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``chunked`` backend of `scored_attention` with its tiles chosen: ``block_rows`` grouped query rows at a
    time; past ``max_keys`` keys, two passes over key blocks of ``block_keys`` (defaults: `BLOCK_ROWS`,
    `MAX_KEYS`, `BLOCK_KEYS`). The tiles change the memory and the work, never the result.

    Returns ``(out [B, Tq, Hq, D] in q's dtype, key_scores [B, Hkv, Tk] float32)``, as `scored_attention`.
    """
    _check_shapes(q, k, v)
    mask = mask or ChunkMask.of(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
    return _chunked(q, k, v, scale, mask, block_rows, max_keys, block_keys)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    mask: ChunkMask | None = None) -> torch.Tensor:
    """The same attention without scores, through PyTorch SDPA. Returns ``[B, Tq, Hq, D]``."""
    _check_shapes(q, k, v)
    if q.shape[2] == 1:  # one query sees every key
        attn_mask = None
    else:
        mask = mask or ChunkMask.of(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
        attn_mask = mask.sdpa(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``auto`` into a concrete backend for ``device`` and validate explicit choices."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "chunked"
    if backend == "triton" and device.type != "cuda":
        from statekv.kernels.availability import interpreter_requested

        if not interpreter_requested():
            raise ConfigurationError(f"attention 'triton' runs on CUDA, and the model is on {device.type}: choose "
                                     "'chunked' or 'eager' (or set TRITON_INTERPRET=1 to interpret it, slowly)")
    return backend


@functools.cache  # asked at every step's placing and every auto-backend call: the answer does not change
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


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, Tq, D]`` -> float32 ``[B * Hkv, G * Tq, D]``: each KV head's query heads stacked along rows."""
    b, hq, tq, d = q.shape
    return q.reshape(b * hkv, (hq // hkv) * tq, d).float()


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, Tk, D]`` -> float32 ``[B * Hkv, Tk, D]`` (a view when it can be)."""
    return x.reshape(-1, *x.shape[2:]).float()


def _ungrouped(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B * Hkv, G * Tq, D]`` -> ``[B, Tq, Hq, D]`` in ``q``'s dtype."""
    return rows.view(q.shape).transpose(1, 2).to(q.dtype)


def _probabilities(rows: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of ``scale * rows @ keys^T + bias``: ``[B*Hkv, R, D] x [B*Hkv, K, D] -> [B*Hkv, R, K]``."""
    return torch.baddbmm(bias, rows, keys.transpose(1, 2), alpha=scale).softmax(dim=-1)


def _eager(q, k, v, scale, mask):
    b, hkv, tk = k.shape[0], k.shape[1], k.shape[2]
    probs = _probabilities(_grouped(q, hkv), _flat(k), mask.bias, scale)
    return _ungrouped(torch.bmm(probs, _flat(v)), q), probs.sum(dim=1).view(b, hkv, tk)


def _chunked(q, k, v, scale, mask, block_rows: int | None = None, max_keys: int | None = None,
             block_keys: int | None = None):
    """Tiles of ``block_rows`` grouped query rows; past ``max_keys`` keys, key blocks of ``block_keys``
    (defaults: the module's ``BLOCK_ROWS``, ``MAX_KEYS``, ``BLOCK_KEYS``)."""
    block_rows, max_keys = block_rows or BLOCK_ROWS, max_keys or MAX_KEYS
    block_keys = block_keys or BLOCK_KEYS
    b, hkv, tk = k.shape[0], k.shape[1], k.shape[2]
    n_rows = q.shape[1] // hkv * q.shape[2]
    if n_rows <= block_rows and tk <= max_keys:
        return _eager(q, k, v, scale, mask)
    rows, keys, values = _grouped(q, hkv), _flat(k), _flat(v)
    tq = q.shape[2]
    outs, scores = [], torch.zeros(b * hkv, tk, device=q.device)
    for r0 in range(0, n_rows, block_rows):
        r1 = min(r0 + block_rows, n_rows)
        tile = rows[:, r0:r1], keys, values, mask.bias[r0:r1], scale, scores
        if tk <= max_keys:
            outs.append(_row_tile(*tile))
        else:
            last_visible = tk - tq + largest_query_index(r0, r1, tq)
            blocks = [slice(s, min(s + block_keys, tk)) for s in range(0, last_visible + 1, block_keys)]
            outs.append(_blocked_row_tile(*tile, blocks))
    return _ungrouped(torch.cat(outs, dim=1), q), scores.view(b, hkv, tk)


def largest_query_index(r0: int, r1: int, tq: int) -> int:
    """The largest query index among the grouped rows ``[r0, r1)`` (row ``r`` is query ``r % tq``, see
    `ChunkMask`), so that a tile of those rows sees the keys up to ``Tk - tq + largest_query_index(...)``.

    ``max(i % tq for i in range(r0, r1))`` in host arithmetic: no device sync, and it works on meta tensors.
    """
    first, last = r0 % tq, (r1 - 1) % tq
    return last if r1 - r0 < tq and first <= last else tq - 1


def _row_tile(rows, keys, values, bias, scale, scores):
    """Output of one tile of rows against every key; adds the tile's mass to ``scores [B*Hkv, Tk]``."""
    probs = _probabilities(rows, keys, bias, scale)
    scores += probs.sum(dim=1)
    return torch.bmm(probs, values)


def _blocked_row_tile(rows, keys, values, bias, scale, scores, blocks: list[slice]):
    """As :func:`_row_tile`, visiting the key ``blocks`` that hold every key these rows see: pass 1 accumulates
    each row's log-sum-exp, pass 2 forms the exact probabilities block by block."""

    def logits(block: slice) -> torch.Tensor:
        return torch.baddbmm(bias[:, block], rows, keys[:, block].transpose(1, 2), alpha=scale)

    lse = torch.full(rows.shape[:2], float("-inf"), device=rows.device)
    for block in blocks:
        lse = torch.logaddexp(lse, logits(block).logsumexp(dim=-1))
    out = torch.zeros(*rows.shape[:2], values.shape[-1], device=rows.device)
    for block in blocks:
        probs = (logits(block) - lse[..., None]).exp()
        out += torch.bmm(probs, values[:, block])
        scores[:, block] += probs.sum(dim=1)
    return out
