"""Will a stream's detailed cache fit? The bytes a horizon needs, against the memory its storage device has.

A stream sizes its detailed buffers for the declared horizon up front (so a steady stream never reallocates),
which makes an impossible horizon fail at once with the figure, rather than as an allocator error deep in the
first step or, worse, when the stream reaches it hours later.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ...errors import HorizonError
from .quantized import stored_bytes_per_token

GIB = 2**30


@dataclass(frozen=True)
class CacheGeometry:
    """What one token costs in a decoder's cache: ``layers`` x 2 (keys, values) x ``kv_heads`` x ``head_dim``
    elements of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "CacheGeometry":
        """From a decoder's (text) config and the dtype its weights run in."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    def to_dict(self) -> dict:
        """The geometry as JSON-able fields (what the disk tier's manifest records)."""
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).removeprefix("torch.")}

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def detailed_bytes(self, tokens: int, batch: int = 1, kv_cache_dtype: str | None = None) -> int:
        """Bytes of the detailed cache (keys and values of every layer) for ``tokens`` tokens, stored in the
        model's dtype or quantized (codes and per-token scales; the keys' per-step scales grow as steps come)."""
        if kv_cache_dtype is None:
            return self.bytes_per_token * tokens * batch
        per_token = stored_bytes_per_token(self.kv_heads, self.head_dim, self.dtype, kv_cache_dtype, tokens or 1)
        return math.ceil(self.layers * per_token * tokens * batch)

    def describe(self, tokens: int) -> str:
        return (f"{self.layers} layers x 2 x {self.kv_heads} KV heads x {self.head_dim} x {self.dtype.itemsize} "
                f"bytes x {tokens} tokens")


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on ``device`` (None when it cannot be told).

    CUDA: free device memory plus what torch's allocator holds unused; CPU: the kernel's ``MemAvailable``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return _host_available_bytes()
    return None


def check_cache_fits(geometry: CacheGeometry, horizon: int, device: torch.device,
                     kv_cache_dtype: str | None = None) -> None:
    """A one-line `HorizonError` with the figures when ``horizon`` tokens of detailed cache (quantized if
    ``kv_cache_dtype`` says so) cannot be held on ``device``."""
    needed = geometry.detailed_bytes(horizon, kv_cache_dtype=kv_cache_dtype)
    available = available_bytes(device)
    if available is not None and needed > available:
        raise HorizonError(
            f"a horizon of {horizon} tokens needs {needed / GIB:,.1f} GiB of detailed cache "
            f"({geometry.describe(horizon)}), but {device} has {available / GIB:,.1f} GiB available; declare "
            "fewer frames" + (", keep the detailed cache in CPU memory (offload, --offload)" if device.type != "cpu"
                              else "")
            + " or use a smaller dtype"
            + ("" if kv_cache_dtype else " (kv_cache_dtype int8 or int4, --kv-cache-dtype)"))


def _host_available_bytes() -> int | None:
    """``MemAvailable``, or less when this process's cgroup (a container's limit) leaves less."""
    available = _meminfo_available()
    limit = _read_int("/sys/fs/cgroup/memory.max")  # cgroup v2; "max" (no limit) reads as None
    if limit is not None:
        room = max(limit - (_read_int("/sys/fs/cgroup/memory.current") or 0), 0)
        available = room if available is None else min(available, room)
    return available


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None
