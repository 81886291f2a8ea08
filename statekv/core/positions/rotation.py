"""Rotating keys stored at one RoPE position to another (`rotate`: RoPE's own rotation by the difference), and a
placed step's carried keys, every layer's at once (`place_carried`), where a layout (`statekv.core.positions.layouts`)
puts them."""

from __future__ import annotations

from collections.abc import Callable

import torch

def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``keys`` ``[..., N, D]`` (RoPE applied at some position) rotated by ``delta`` ``[..., N]`` more positions,
    with the model's frequencies ``inv_freq`` ``[R / 2]`` over the first R dims (rotate-half layout, as every
    transformers RoPE applies it). Computed in float32; returns ``keys``' dtype, written into ``out`` (same
    shape) when given. ``delta == 0`` returns the key unchanged (cos 1, sin 0)."""
    rotary = 2 * inv_freq.shape[0]
    angles = delta.unsqueeze(-1) * inv_freq.to(keys.device, torch.float32)  # [B, H, N, R/2], float32
    cos, sin = angles.cos(), angles.sin()
    first, second = keys[..., :rotary].float().chunk(2, -1)
    out = torch.empty_like(keys) if out is None else out
    low, high = out[..., :rotary].chunk(2, -1)
    torch.sub(first * cos, second * sin, out=low)
    torch.add(second * cos, first * sin, out=high)
    if rotary < keys.shape[-1]:
        out[..., rotary:] = keys[..., rotary:]
    return out


Placer = Callable[[torch.Tensor], torch.Tensor]


PLACED_TOGETHER_BYTES = 8 << 20  # carried keys rotated in one stack, at most (the rotation's float32 temporaries
# hold several times as much while it runs, and in a CUDA graph's memory pool for as long as the graph is kept)


def place_carried(placer: Placer, frequencies: torch.Tensor, carried: list[tuple[torch.Tensor, torch.Tensor] | None],
                  chunk_len: int, fused: bool = False) -> list[torch.Tensor | None]:
    """Every layer's keys handed to attention in a placed step, ``[B, H, K + T, D]`` each: the carried ``K``
    rotated to where ``placer`` puts them, the last ``T`` left for the chunk's keys (the layer writes them as it
    stages the chunk; they were computed where the chunk is placed, so they are not rotated).

    ``carried``: per layer, its carried keys ``[B, H, K, D]`` at their stored rotations and their placements
    ``[2, B, H, K]`` (anchors, rotations), or None where it carries nothing (its entry is then None). The carried
    state is fixed before the step runs, so layers carrying as many tokens are stacked and rotated together, up to
    `PLACED_TOGETHER_BYTES` of keys a stack: a step's rotation is one set of ops for all of a small model's layers,
    not one a layer, and its temporaries stay bounded for a large carried state.

    ``fused``: each stack rotated by the Triton kernel `statekv.kernels.rotation.rotate_keys`, which reads every
    key once and keeps its angles in registers (equal to `rotate` up to float32 rounding)."""
    placed: list[torch.Tensor | None] = [None] * len(carried)
    groups: dict[tuple, list[list[int]]] = {}
    for index, entry in enumerate(carried):
        if entry is None or entry[0].shape[-2] == 0:
            continue
        keys = entry[0]
        stacks = groups.setdefault((tuple(keys.shape), keys.dtype, keys.device), [[]])
        if stacks[-1] and (len(stacks[-1]) + 1) * keys.numel() * keys.element_size() > PLACED_TOGETHER_BYTES:
            stacks.append([])
        stacks[-1].append(index)
    for (shape, _, _), stacks in groups.items():
        *lead, size, dim = shape
        for members in stacks:
            keys = _stacked([carried[index][0] for index in members])  # [G, B, H, K, D]
            placements = _stacked([carried[index][1] for index in members])  # [G, 2, B, H, K]
            keys_out = keys.new_empty(len(members), *lead, size + chunk_len, dim)
            anchors, rotations = placements.unbind(1)
            delta, target = placer(anchors) - rotations, keys_out[..., :size, :]
            if not (fused and _rotated_fused(keys, delta, frequencies, target)):
                rotate(keys, delta, frequencies, out=target)
            for index, layer_keys in zip(members, keys_out.unbind(0)):
                placed[index] = layer_keys
    return placed


def _rotated_fused(keys: torch.Tensor, delta: torch.Tensor, frequencies: torch.Tensor, out: torch.Tensor) -> bool:
    from statekv.kernels.rotation import rotate_keys  # imports Triton: only where the kernel runs

    return rotate_keys(keys, delta, frequencies, out)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)
