"""A detailed cache stored quantized (``kv_cache_dtype="int8"`` or ``"int4"``), as KIVI does (Liu et al., ICML
2024): keys per channel, values per token.

When a step commits, its chunk is quantized: keys with one scale and zero point per ``[B, H_kv, channel]`` over
the step's tokens (keys have outlier channels, so a channel shares one range), values with one per
``[B, H_kv, token]`` over the channels. A code is ``round((x - zero) / scale)`` in ``[0, 2^bits - 1]``; int4
packs two codes per byte (channel ``2i`` in the low nibble, ``2i + 1`` in the high one). Scales and zero points
are kept beside the codes in the model's dtype (float32 for a float32 one; a bfloat16 key can pass float16's
65,504, and a bfloat16 zero point is as fine as the keys it was taken from). Only what a question reads is
dequantized (:meth:`QuantizedStorage.read_range`, :meth:`QuantizedStorage.read_tokens`); the carried state, the
step's own attention and the steps' summaries stay in the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate, islice

import torch

from .blocks import BlockBuffer
from .buffers import TokenBuffer
from .host_pages import saved
from .layer_storage import SAMPLES_PER_STEP, BufferFactory, OffloadedStorage, Released, memory_buffers
from .step_values import StepValues
from ...errors import ConfigurationError
from ...settings.engine import KV_CACHE_BITS, check_kv_cache_dtype


def scale_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype scales and zero points are kept in: the model's (bfloat16 keys and values reach far past
    float16's range), float32 for float32 (and wider) models."""
    return torch.float32 if model_dtype.itemsize >= 4 else model_dtype


def saved_scale_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a saved cache's scales may be in: `scale_dtype`'s, and for bfloat16 float16 too (saved before
    its scales were bfloat16; such a cache goes on in float16)."""
    return (scale_dtype(model_dtype), torch.float16) if model_dtype == torch.bfloat16 else (scale_dtype(model_dtype),)


def quantize(x: torch.Tensor, dim: int, bits: int, scales: torch.dtype = torch.float16
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit quantization of ``x`` ``[B, H, T, D]`` with one range per slice along ``dim`` (2:
    per channel over tokens; 3: per token over channels).

    Returns ``(codes, scale, zero)``: uint8 codes ``[B, H, T, D]`` (``[B, H, T, D / 2]`` packed for 4 bits) and
    ``scale``/``zero`` (``x``'s shape with ``dim`` reduced to 1, in ``scales``; the scale rounded up): ``x ~ code *
    scale + zero``.
    """
    levels = (1 << bits) - 1
    finite = torch.finfo(scales).max
    values = x.float()
    low, high = values.amin(dim, keepdim=True), values.amax(dim, keepdim=True)
    zero = low.clamp(-finite, finite).to(scales)
    exact = ((high - zero.float()) / levels).clamp(0, finite)
    scale = exact.to(scales)
    kind = torch.finfo(scales)
    if kind.bits < 32:  # rounded up where it rounded down: else the slice's largest values need a code past the
        # last, clamped, and read back short by up to levels x its rounding (a bfloat16 scale's: most of a step)
        larger = (exact * (1 + kind.eps) + kind.smallest_normal * kind.eps).clamp(max=finite).to(scales)
        scale = torch.where(scale.float() < exact, larger, scale)
    step = scale.float()
    codes = ((values - zero.float()) / torch.where(step > 0, step, 1.0)).round_().clamp_(0, levels).to(torch.uint8)
    return (pack_int4(codes) if bits == 4 else codes), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale + zero`` in ``dtype`` (codes unpacked first for 4 bits); scale and zero broadcast."""
    values = unpack_int4(codes) if bits == 4 else codes
    return torch.addcmul(zero.float(), values.float(), scale.float()).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in ``[0, 15]`` ``[..., D]`` (D even) -> ``[..., D / 2]``: two per byte."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: ``[..., D / 2]`` -> ``[..., D]``."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def stored_bytes_per_token(kv_heads: int, head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str | None,
                           tokens_per_step: int) -> float:
    """Bytes one token's keys and values take in one layer's detailed cache: codes, the values' per-token
    scale and zero point, and its share of the keys' per-step ones (over ``tokens_per_step`` tokens)."""
    if kv_cache_dtype is None:
        return 2 * kv_heads * head_dim * model_dtype.itemsize
    bits, width = KV_CACHE_BITS[kv_cache_dtype], scale_dtype(model_dtype).itemsize
    codes = 2 * head_dim * bits / 8
    return kv_heads * (codes + 2 * width + 2 * head_dim * width / tokens_per_step)


def scale_bytes_per_step(kv_heads: int, head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
    """Bytes of one step's key scales and zero points in one layer (per channel over the step's tokens)."""
    return 0 if kv_cache_dtype is None else kv_heads * 2 * head_dim * scale_dtype(model_dtype).itemsize


def summary_bytes_per_step(kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes one step's summaries take in one layer (its mean key and ``SAMPLES_PER_STEP`` keys)."""
    return kv_heads * (1 + SAMPLES_PER_STEP) * head_dim * model_dtype.itemsize


class QuantizedStorage(OffloadedStorage):
    """The detailed cache quantized to ``bits`` (8 or 4) in ``device`` memory (None: the model's device).

    Like :class:`OffloadedStorage`, a step stages its chunk and summaries on the model's device (the carried
    state and the step's attention stay in the model's dtype; no window can be a view of this storage) and the
    chunk is quantized and stored when the step commits. Buffers (from ``make_buffer``): ``key_codes`` and
    ``value_codes`` ``[B, H_kv, tokens, D * bits / 8]`` uint8, ``key_scales`` ``[B, H_kv, steps, 2 * D]``
    (scale then zero point per channel), ``value_scales`` ``[B, H_kv, tokens, 2]`` (scale, zero point).
    """

    holds_window = False

    def __init__(self, kv_cache_dtype: str, capacity_hint: int | None, device: torch.device | str | None,
                 on_replace: Callable[[], None], make_buffer: BufferFactory | None = None):
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        if self.kv_cache_dtype is None:
            raise ConfigurationError("QuantizedStorage needs kv_cache_dtype int8 or int4")
        self.bits = KV_CACHE_BITS[self.kv_cache_dtype]
        self.offloaded = device is not None
        self._length = 0
        self._starts = StepValues()  # each committed step's first token
        self._starts_tensor: torch.Tensor | None = None  # off the host: every step's start
        self.dtype: torch.dtype | None = None  # the model's
        super().__init__(capacity_hint, device, on_replace, make_buffer or memory_buffers(device, on_replace))

    def _make_detailed(self, make_buffer: BufferFactory, capacity_hint: int | None) -> None:
        self.detailed = None  # the codes and scales below hold it
        self.key_codes = make_buffer("key_codes", 1, capacity_hint)
        self.value_codes = make_buffer("value_codes", 1, capacity_hint)
        self.value_scales = make_buffer("value_scales", 1, capacity_hint)
        self.key_scales = make_buffer("key_scales", 1, None)

    @property
    def buffers(self) -> tuple[TokenBuffer | BlockBuffer, ...]:
        return self.key_codes, self.key_scales, self.value_codes, self.value_scales

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the scales and zero points (part of `nbytes`)."""
        return self.key_scales.nbytes + self.value_scales.nbytes

    def start(self, key_states: torch.Tensor) -> None:
        if self.bits == 4 and key_states.shape[-1] % 2:
            raise ConfigurationError(f"kv_cache_dtype int4 packs two channels per byte: the head dimension "
                                     f"{key_states.shape[-1]} must be even")
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        self._scales_like = torch.empty(b, h, 1, 2 * d, dtype=scale_dtype(self.dtype), device=key_states.device)
        super().start(key_states)

    def prepare(self, chunk_len: int) -> None:
        horizon = self.key_codes.capacity_hint
        expected = 0 if horizon is None else self.block_keys.length + math.ceil(
            max(horizon - self.length, 0) / chunk_len) + 1
        self.block_keys.reserve(self.means_like, self.block_keys.length + 1, expected)
        self.step_samples.reserve(self.samples_like, self.step_samples.length + 1, expected)
        self.key_scales.reserve(self._scales_like, self.key_scales.length + 1, expected)

    def commit_host(self, chunk_len: int) -> None:
        self.commit_segment()
        keys, values = self.staged[0], self.staged[1]
        width = self._scales_like.dtype  # scale_dtype's, or a resumed cache's own
        key_codes, key_scale, key_zero = quantize(keys, 2, self.bits, width)
        value_codes, value_scale, value_zero = quantize(values, 3, self.bits, width)
        start, steps = self._length, self.block_keys.length
        self.key_codes.write(start, key_codes)
        self.value_codes.write(start, value_codes)
        self.value_scales.write(start, torch.cat([value_scale, value_zero], dim=-1))
        self.key_scales.write(steps, torch.cat([key_scale, key_zero], dim=-1))
        self.block_keys.write(steps, self.staged_mean)
        self.step_samples.write(steps, self.staged_samples)
        for buffer in self.buffers:
            buffer.length += chunk_len if buffer is not self.key_scales else 1
        self.block_keys.length += 1
        self.step_samples.length += 1
        self._starts.append(start)
        self._starts_tensor = None
        self._length += chunk_len

    def device_nbytes(self) -> int:
        staged = super().device_nbytes()
        return staged if self.offloaded else staged + self.nbytes + self.summary_nbytes

    def synchronize(self) -> None:
        self.key_codes.synchronize()

    # the read path -----------------------------------------------------------------------------------------
    def read_range(self, start: int, end: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[start, end)`` dequantized, ``[B, H_kv, end - start, D]`` each (default: on the storage's
        device, in the model's dtype)."""
        steps = self._step_of(torch.arange(start, end, device=self._where))
        parts = (self.key_codes.view(start, end)[0], self.key_scales.gather(steps)[0],
                 self.value_codes.view(start, end)[0], self.value_scales.view(start, end)[0])
        return self._dequantized(parts, device, dtype)

    def read_tokens(self, index: torch.Tensor, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens ``index`` (LongTensor ``[N]``) dequantized, ``[B, H_kv, N, D]`` each: only their codes and
        scales are read and moved."""
        index = index.to(self._where)
        parts = (self.key_codes.gather(index)[0], self.key_scales.gather(self._step_of(index))[0],
                 self.value_codes.gather(index)[0], self.value_scales.gather(index)[0])
        return self._dequantized(parts, device, dtype)

    @property
    def _where(self) -> torch.device:
        scales = self.key_scales  # one tensor, blocks in host memory (a stream that evicts), or files on disk
        if scales.device is not None:  # never its rows: on disk they are mapped to be read, every step's at once
            return scales.device
        return None if scales.keys is None else scales.keys.device

    def _step_of(self, index: torch.Tensor) -> torch.Tensor:
        """The committed step each token of ``index`` belongs to. On the host, searched in the starts' runs (a
        stream evicting for weeks keeps no tensor of every step's start, which would grow a step at a time)."""
        if index.device.type == "cpu":
            return self._starts.searched(index) - 1
        if self._starts_tensor is None or self._starts_tensor.device != index.device:
            self._starts_tensor = self._starts.tensor().to(index.device)
        return torch.searchsorted(self._starts_tensor, index, right=True) - 1

    def _dequantized(self, parts, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key_codes, key_scales, value_codes, value_scales = (
            part if device is None else part.to(device, non_blocking=True) for part in parts)
        dtype = dtype or self.dtype
        dim = key_scales.shape[-1] // 2
        keys = dequantize(key_codes, key_scales[..., :dim], key_scales[..., dim:], self.bits, dtype)
        values = dequantize(value_codes, value_scales[..., :1], value_scales[..., 1:], self.bits, dtype)
        return keys, values

    # saving and resuming -----------------------------------------------------------------------------------
    def export(self) -> dict[str, torch.Tensor]:
        """The codes, scales and summaries as they are stored (nothing dequantized)."""
        tokens, steps = self.length, self.block_keys.length
        tensors = {}
        for name in ("key_codes", "value_codes", "value_scales"):
            tensors.update(saved((name,), getattr(self, name), tokens))
        tensors.update(saved(("key_scales",), self.key_scales, steps))
        tensors.update(self.export_summaries())
        tensors.update(self.export_segments())
        return tensors

    def load(self, tensors: dict[str, torch.Tensor], steps: Sequence[int], device: torch.device,
             released: Released = None) -> None:
        released = released or {}
        storage = self.key_codes.device or device
        for name in ("key_codes", "value_codes", "value_scales", "key_scales"):
            getattr(self, name).load(tensors[name].to(storage), released=released.get(name, ()))
        self._length = self.key_codes.length
        self._starts = StepValues(islice(accumulate(steps, initial=0), len(steps)))  # not a list a step
        self._starts_tensor = None
        if "block_keys" in tensors:
            self.load_summaries(tensors, tensors["block_keys"], steps, storage, released)
            self.dtype = tensors["block_keys"].dtype
            self._scales_like = tensors["key_scales"][:, :, :1]
            self.load_segments(tensors, None, steps, storage, released)


def expected_tensors(kv_cache_dtype: str | None, head: tuple[int, int], tokens: int, steps: int, head_dim: int,
                     dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a layer's saved detailed cache (summaries and carried state excluded)."""
    if kv_cache_dtype is None:
        return {"keys": ((*head, tokens, head_dim), dtype), "values": ((*head, tokens, head_dim), dtype)}
    codes = head_dim * KV_CACHE_BITS[kv_cache_dtype] // 8
    width = scale_dtype(dtype)
    return {"key_codes": ((*head, tokens, codes), torch.uint8), "value_codes": ((*head, tokens, codes), torch.uint8),
            "key_scales": ((*head, steps, 2 * head_dim), width), "value_scales": ((*head, tokens, 2), width)}
