"""A step's inputs checked before anything runs (`StreamingPrefill.checked_inputs`): each bad input is a one-line
`StateKVError` naming it, and the stream is unchanged."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ConfigurationError, InputError, UnsupportedModelError

# Forward arguments a step sets itself: given by a caller, the forward would bypass the stream's cache or return
# what the step cannot read.
STEP_ARGUMENTS = frozenset({"use_cache", "past_key_values", "return_dict", "cache_position"})


def check_step_arguments(forward_kwargs: dict) -> None:
    """Refuse the forward arguments a step sets itself (`STEP_ARGUMENTS`)."""
    engine_owned = sorted(set(forward_kwargs) & STEP_ARGUMENTS)
    if engine_owned:
        raise InputError(f"{engine_owned[0]} is the engine's own: a step runs the decoder through the stream's cache "
                         "and reads its hidden states; leave it out")


def check_embeds(inputs_embeds: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> None:
    """A chunk's embeddings must be ``[B, T, hidden_size]`` in the model's ``dtype``, and, in host memory, finite (on
    a GPU the check would wait for the step before: not made)."""
    if inputs_embeds.dim() != 3:
        raise InputError(f"inputs_embeds must be [B, T, D], got shape {tuple(inputs_embeds.shape)}")
    if inputs_embeds.shape[-1] != hidden_size:
        raise InputError(f"inputs_embeds has hidden size {inputs_embeds.shape[-1]}, but the model's is {hidden_size}")
    if inputs_embeds.dtype != dtype:
        raise InputError(f"inputs_embeds are {str(inputs_embeds.dtype).removeprefix('torch.')}, but the model runs "
                         f"in {str(dtype).removeprefix('torch.')}; convert them first")
    if inputs_embeds.device.type == "cpu" and not finite_on_host(inputs_embeds):
        raise InputError("inputs_embeds hold NaN or infinite values: a step would carry them into every later step "
                         "and answer")


def check_positions(position_ids: torch.Tensor | None, chunk: torch.Tensor, device: torch.device,
                    limit: int | None = None) -> None:
    """Explicit RoPE positions must be integer ``[B, T]`` (or ``[3 or 4, B, T]``) on the model's device; in host
    memory, also at least 0 and below ``limit`` (the stream's horizon under ``stream`` positions), read by numpy
    (a GPU's would be a sync a step)."""
    if position_ids is None:
        return
    expected = f"[B, T] (or [3 or 4, B, T] for M-RoPE) with B={chunk.shape[0]}, T={chunk.shape[1]}"
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.long, torch.int32):
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise InputError(f"position_ids must be an integer tensor {expected}, got {got}")
    if (position_ids.dim() not in (2, 3) or position_ids.shape[-1] != chunk.shape[1]
            or position_ids.shape[-2] not in (1, chunk.shape[0])):
        raise InputError(f"position_ids must be {expected}, got shape {tuple(position_ids.shape)}")
    if position_ids.device != device:
        raise InputError(f"position_ids are on {position_ids.device}, but the model is on {device}")
    if position_ids.device.type == "cpu" and position_ids.numel():
        values = position_ids.numpy()
        if values.min() < 0:
            raise InputError(f"position_ids must be at least 0, got {values.min()}")
        if limit is not None and values.max() >= limit:
            raise InputError(f"position_ids reach {values.max()}, past the stream's horizon of {limit} tokens "
                             f"(positions 0 to {limit - 1})")


def finite_on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (in host memory) holds only finite values, read by numpy on the host: no op of the step's
    own (a step's ops are what a GPU would run)."""
    data = tensor.detach()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: its exponent bits all set is NaN or infinite
        bits = data.view(torch.int16).numpy()
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    if data.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(data.numpy()).all())
    return bool(torch.isfinite(data).all())  # a type numpy does not hold (float8...)


def check_device_present(device: torch.device | None, name: str) -> None:
    """Refuse (one-line `ConfigurationError`) a device this machine does not have."""
    if device is None or device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    count = module.device_count() if module is not None and module.is_available() else 0
    if count == 0 or (device.index is not None and device.index >= count):
        raise ConfigurationError(f"{name}={str(device)!r}: this machine has no such device "
                                 f"({count} {device.type} device(s) available)")


def check_plain_causal(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
                                       or not bool(attention_mask.all())):
        raise InputError("the streaming engine attends causally over [carried; chunk] and cannot apply an "
                         "attention mask (padding or a custom mask); pass none, or an all-ones [B, T] mask")


def check_supported(config) -> None:
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise UnsupportedModelError("models with sliding-window attention layers are not supported")
