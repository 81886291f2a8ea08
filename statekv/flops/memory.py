"""Bytes of detailed cache per frame and per hour of video, for a model preset and a ``kv_cache_dtype``.

The detailed cache stores every token's keys and values in every layer: in the model's dtype, or quantized
(:mod:`statekv.core.storage.quantized`: codes, each token's value scale and zero point, and each step's key scales and
zero points shared by its tokens). Beside it, kept in the model's dtype in RAM whatever the storage, each
step's retrieval summaries: its mean key and ``SAMPLES_PER_STEP`` sampled keys per layer and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statekv.core.storage.quantized import stored_bytes_per_token, summary_bytes_per_step
from .analytic import resolve_model

KV_CACHE_DTYPES = (None, "int8", "int4")  # None: the model's dtype
FRAMES_PER_HOUR = 3600  # at 1 frame per second


@dataclass(frozen=True)
class CacheBytes:
    """One model's detailed cache under one ``kv_cache_dtype``: bytes per frame (the detailed cache alone and
    the step summaries), and per hour of video at 1 fps."""

    model: str
    kv_cache_dtype: str | None
    dtype: str
    detailed_per_frame: float
    summaries_per_frame: float

    @property
    def per_hour(self) -> float:
        return (self.detailed_per_frame + self.summaries_per_frame) * FRAMES_PER_HOUR

    def as_dict(self) -> dict:
        return {"model": self.model, "kv_cache_dtype": self.kv_cache_dtype or self.dtype, "dtype": self.dtype,
                "detailed_per_frame": self.detailed_per_frame, "summaries_per_frame": self.summaries_per_frame,
                "per_hour": self.per_hour}


def cache_bytes(model, kv_cache_dtype: str | None = None, dtype: torch.dtype = torch.bfloat16) -> CacheBytes:
    """Bytes per frame of ``model``'s (a preset name or `ModelSpec`) detailed cache and summaries, the model
    running in ``dtype``."""
    spec = resolve_model(model)
    language, tokens = spec.language, spec.tokens_per_step
    per_token = stored_bytes_per_token(language.num_kv_heads, language.head_dim, dtype, kv_cache_dtype, tokens)
    detailed = language.num_layers * per_token * tokens / spec.frames_per_step
    summaries = language.num_layers * summary_bytes_per_step(language.num_kv_heads, language.head_dim, dtype)
    return CacheBytes(spec.name, kv_cache_dtype, str(dtype).removeprefix("torch."), detailed,
                      summaries / spec.frames_per_step)


def cache_table(models: list[str], dtype: torch.dtype = torch.bfloat16) -> list[CacheBytes]:
    return [cache_bytes(name, kv, dtype) for name in models for kv in KV_CACHE_DTYPES]


def format_cache_table(rows: list[CacheBytes]) -> str:
    """Plain text: MB per frame (detailed, summaries) and GB per hour at 1 fps, per model and storage."""
    lines = ["Detailed cache per frame and per hour at 1 fps (MB = 1e6 bytes, GB = 1e9; summaries: each step's "
             "mean key and 16 sampled keys, kept in the model's dtype; GB/hour: both; vs model: the detailed "
             "cache against the model's dtype)", ""]
    head = f"{'model':<14}  {'stored as':<9}  {'MB/frame':>9}  {'summ. MB/frame':>14}  {'GB/hour':>8}  {'vs model':>8}"
    lines += [head, "-" * len(head)]
    base: dict[str, float] = {}
    for row in rows:
        if row.kv_cache_dtype is None:
            base[row.model] = row.detailed_per_frame
        ratio = row.detailed_per_frame / base[row.model] if row.model in base else float("nan")
        lines.append(f"{row.model:<14}  {row.kv_cache_dtype or row.dtype:<9}  {row.detailed_per_frame / 1e6:>9.2f}  "
                     f"{row.summaries_per_frame / 1e6:>14.3f}  {row.per_hour / 1e9:>8.1f}  {ratio:>8.3f}")
    return "\n".join(lines)
