"""RoPE for a whole streaming run: one rotation, fixed before the first chunk, kept through decoding.

Static RoPE types (``default``, ``linear``, ``yarn``, ``llama3``, M-RoPE) rotate a position the same way
whatever else is in the batch, so streaming needs nothing from them. ``dynamic`` (NTK) and ``longrope``
recompute their frequencies from the largest position of the *current call*: chunk by chunk that would
rotate every chunk with a different base, and decoding with yet another. :func:`freeze_rope` computes the
frequencies once for the planned horizon, exactly as a one-shot forward over ``horizon`` tokens would, and
turns the per-call update off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..errors import HorizonError, UnsupportedModelError
from ..values import check_int

RECOMPUTED_PER_CALL = ("dynamic", "longrope")


def rope_parameters(config) -> dict:
    """The text config's RoPE parameters (``rope_type`` always set)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type RoPE parameters are not supported by the streaming engine")
    params.setdefault("rope_type", "default")
    return params


def rope_capacity(config) -> int | None:
    """Largest sequence length (in tokens) the configuration's RoPE is meant to represent; ``None``: no limit.

    Dynamic NTK has no fixed limit: it rescales its base to whatever length it is given (InternVL3 runs
    512-frame videos, 4x its trained context, this way), so only the horizon has to be known in advance.
    """
    params = rope_parameters(config)
    max_positions = int(config.max_position_embeddings)
    kind, factor = params["rope_type"], float(params.get("factor", 1.0) or 1.0)
    if kind == "dynamic":
        return None
    if kind == "linear":
        return int(max_positions * factor)
    if kind in ("yarn", "longrope"):
        original = int(params.get("original_max_position_embeddings", max_positions))
        return max(max_positions, int(original * factor))
    return max_positions


def check_horizon(config, horizon: int | None) -> int:
    """Validate a planned horizon in tokens.

    ``None`` means: as long as the RoPE allows for static types; for ``dynamic``/``longrope`` the length the
    model was trained at (their rotation depends on the horizon, so a longer run must declare it).
    """
    capacity = rope_capacity(config)
    if horizon is None:
        if rope_parameters(config)["rope_type"] in RECOMPUTED_PER_CALL:
            return int(config.max_position_embeddings)
        return capacity
    check_int(horizon, "horizon (tokens)", error=HorizonError)
    if capacity is not None and horizon > capacity:
        raise HorizonError(
            f"horizon of {horizon} tokens is beyond the model's RoPE ({rope_parameters(config)['rope_type']}, "
            f"at most {capacity} tokens); sample fewer frames or use a model with a longer context"
        )
    return horizon


_INSTALLED: dict[int, "FrozenRope"] = {}  # id(rotary module) -> the frozen rotation it currently holds


@dataclass(eq=False)
class FrozenRope:
    """The frozen rotation of the rotary modules of a decoder whose RoPE is recomputed per call (``dynamic``,
    ``longrope``; static types need nothing and are not listed). :meth:`apply` is idempotent and costs nothing
    when this rotation is already installed."""

    horizon: int
    modules: list[nn.Module]
    frozen: list[torch.Tensor]
    saved: list[tuple[str, torch.Tensor, object]] = field(default_factory=list)

    def apply(self) -> None:
        """Install the frozen frequencies, unless they already are: call before each chunk and before decoding
        (another stream on the same model may have installed its own)."""
        for module, inv_freq in zip(self.modules, self.frozen):
            if _INSTALLED.get(id(module)) is self:
                continue
            module.inv_freq.copy_(inv_freq.to(module.inv_freq.device))
            module.rope_type = "default"  # the decorator's per-call update is keyed on this name
            _INSTALLED[id(module)] = self

    def restore(self) -> None:
        """Give the modules back their own behaviour (those where another open stream's rotation is installed
        keep it: that stream restores them when it closes)."""
        for module, (rope_type, inv_freq, max_cached) in zip(self.modules, self.saved):
            if _INSTALLED.get(id(module)) is not self:
                continue
            del _INSTALLED[id(module)]
            module.rope_type = rope_type
            module.inv_freq.copy_(inv_freq)
            if max_cached is not None:
                module.max_seq_len_cached = max_cached


def freeze_rope(decoder: nn.Module, horizon: int) -> FrozenRope:
    """Fix the rotation of ``decoder``'s rotary modules for sequences of up to ``horizon`` tokens.

    For ``dynamic`` the frequencies are those the model itself would use for a ``horizon``-token sequence;
    for ``longrope`` the long or short factors, whichever that length selects. Static types need nothing and
    are left alone.
    """
    modules, frozen, saved = [], [], []
    for module in decoder.modules():
        if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            continue
        owner = _INSTALLED.get(id(module))  # frozen by another stream that is still open: its original state
        original = owner.saved[owner.modules.index(module)] if owner is not None else (
            getattr(module, "rope_type", None), module.inv_freq.detach().clone(),
            getattr(module, "max_seq_len_cached", None))
        rope_type = original[0]
        if rope_type not in RECOMPUTED_PER_CALL:
            continue
        saved.append(original)
        modules.append(module)
        frozen.append(_frequencies_for(module, rope_type, horizon))
    rope = FrozenRope(horizon, modules, frozen, saved)
    rope.apply()
    return rope


def _frequencies_for(module: nn.Module, rope_type: str, horizon: int) -> torch.Tensor:
    original = getattr(module, "original_inv_freq", module.inv_freq).detach().clone()
    config = module.config
    if rope_type == "dynamic":
        if horizon <= module.original_max_seq_len:
            return original
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, original.device, seq_len=horizon)
        return inv_freq
    threshold = int(config.rope_parameters["original_max_position_embeddings"])
    if horizon <= threshold:
        return original
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, original.device, seq_len=threshold + 1)
    return inv_freq
