"""RoPE for a whole streaming run: one rotation per stream, fixed before its first step, kept through decoding.

Static RoPE types (``default``, ``linear``, ``yarn``, ``llama3``, M-RoPE) rotate a position the same way
whatever else is in the batch, so their rotation needs nothing for streaming. ``dynamic`` (NTK) and ``longrope``
recompute their frequencies from the largest position of the *current call*: chunk by chunk that would
rotate every chunk with a different base, and decoding with yet another. :func:`freeze_rope` computes the
frequencies once for the planned horizon, exactly as a one-shot forward over ``horizon`` tokens would, and
turns the per-call update off.

A bounded stream past its range whose steps the host places at one base (`SettledRotary`) runs the decoder at
the same positions step after step: its rotary modules' outputs are made by the first such step and read by the
next (:func:`settle_rotary`, which routes every rotary module of a bounded stream's decoder, static types too,
through the same per-thread lookup as :func:`freeze_rope`).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from types import MethodType

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ...errors import ConfigurationError, HorizonError, UnsupportedModelError
from ...settings.values import check_int
from ..attention.thread_value import ThreadValue

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
            f"at most {capacity} tokens); sample fewer frames (--max-frames), place them within it "
            "(positions='bounded', --positions bounded) or use a model with a longer context"
        )
    return horizon


def trained_range(config) -> int:
    """The positions the model was trained on: its RoPE capacity (``max_position_embeddings``, times the factor
    of ``linear``/``yarn``/``longrope``); for ``dynamic`` NTK, the length it was trained at."""
    capacity = rope_capacity(config)
    if capacity is None or rope_parameters(config)["rope_type"] in RECOMPUTED_PER_CALL:
        return int(config.max_position_embeddings)
    return int(capacity)


class FrozenRope:
    """One stream's rotation: the frequencies of a decoder's rotary modules whose RoPE is recomputed per call
    (``dynamic``, ``longrope``; static types need nothing and are not listed), fixed for ``horizon`` tokens.

    The model's modules keep their behaviour: :func:`freeze_rope` makes each of them consult the rotation active in
    the calling thread (:meth:`active`), so streams with different horizons share one model, each rotating with
    its own frequencies, and ordinary calls of the model keep its own RoPE.
    """

    def __init__(self, horizon: int, modules: list[nn.Module], frozen: list[torch.Tensor]):
        self.horizon, self.modules, self.frozen = horizon, modules, frozen
        self._by_module = {id(module): inv_freq for module, inv_freq in zip(modules, frozen)}

    def frequencies(self, module: nn.Module) -> torch.Tensor | None:
        """The frozen ``inv_freq [D/2]`` of ``module`` (None: not one of this rotation's modules)."""
        return self._by_module.get(id(module))

    def active(self) -> AbstractContextManager[None]:
        """This rotation used by the rotary modules for calls made in this thread inside the block."""
        return _active.set(self)

    def restore(self) -> None:
        """Nothing to give back: the model's modules keep their own behaviour for every other call."""


_active = ThreadValue()  # the FrozenRope of the stream whose call runs in this thread, if any
_install_lock = threading.Lock()


class _WithFrequencies:
    """A rotary module seen with other frequencies and no per-call update, for its own forward code."""

    rope_type = "default"  # the decorator's per-call update is keyed on this name

    def __init__(self, module: nn.Module, inv_freq: torch.Tensor):
        self._module, self.inv_freq = module, inv_freq

    def __getattr__(self, name):
        return getattr(self._module, name)


class SettledRotary:
    """The rotary modules' outputs for the chunk positions ``positions`` ``[T]`` of steps whose places the host
    settled (`statekv.core.positions.placing.StreamPositions.settled_step`): the same at every such step, so the
    first step's forward makes them and later ones read them (a recorded step too: they are kept)."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self.made: dict[tuple, object] = {}

    def active(self) -> AbstractContextManager[None]:
        """These outputs read by the rotary modules for calls made in this thread inside the block."""
        return _settled.set(self)

    def key(self, module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple | None:
        """What ``module``'s output for ``x`` at ``position_ids`` is kept under, where those are these positions
        (their memory, rows expanded); else None."""
        *rows, length = position_ids.shape
        *row_strides, stride = position_ids.stride()
        if position_ids.data_ptr() != self.positions.data_ptr() or length != len(self.positions) or stride != 1 \
                or any(step and size > 1 for step, size in zip(row_strides, rows)):
            return None
        # inference-mode outputs cannot be saved for backward outside it
        return id(module), x.dtype, x.device, tuple(position_ids.shape), torch.is_inference_mode_enabled()


_settled = ThreadValue()  # the SettledRotary of the step whose forward runs in this thread, if any


def _stream_aware_forward(module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """The module's own forward, with the frozen frequencies of the stream calling from this thread, if any; a
    settled step's output read where an earlier step made it."""
    settled: SettledRotary | None = None if args or kwargs or torch.compiler.is_compiling() else _settled.get()
    key = None if settled is None else settled.key(module, x, position_ids)
    if key is not None and key in settled.made:
        return settled.made[key]
    rope: FrozenRope | None = _active.get()
    inv_freq = rope.frequencies(module) if rope is not None else None
    target = module if inv_freq is None else _WithFrequencies(module, inv_freq)
    output = type(module).forward(target, x, position_ids, *args, **kwargs)
    if key is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        output = settled.made.setdefault(key, output)  # made outside a graph's memory pool
    return output


def _make_stream_aware(module: nn.Module) -> None:
    """Once per module: route its forward through :func:`_stream_aware_forward` (an instance attribute, so the
    class and other models are untouched)."""
    with _install_lock:
        if getattr(module, "_statekv_stream_aware", False):
            return
        module.forward = MethodType(_stream_aware_forward, module)
        module._statekv_stream_aware = True


def settle_rotary(decoder: nn.Module) -> None:
    """Let ``decoder``'s rotary modules read a settled step's outputs (`SettledRotary`) instead of making them."""
    for module in decoder.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            _make_stream_aware(module)


def freeze_rope(decoder: nn.Module, horizon: int) -> FrozenRope:
    """The rotation of ``decoder``'s rotary modules for sequences of up to ``horizon`` tokens, for one stream.

    For ``dynamic`` the frequencies are those the model itself would use for a ``horizon``-token sequence;
    for ``longrope`` the long or short factors, whichever that length selects. Static types need nothing and
    are left alone. The rotation is used only inside :meth:`FrozenRope.active`.
    """
    modules, frozen = [], []
    for module in decoder.modules():
        if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            continue
        rope_type = getattr(module, "rope_type", None)
        if rope_type not in RECOMPUTED_PER_CALL:
            continue
        _make_stream_aware(module)
        modules.append(module)
        frozen.append(_frequencies_for(module, rope_type, horizon))
    return FrozenRope(horizon, modules, frozen)


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


def model_frequencies(decoder: torch.nn.Module, frozen=None) -> torch.Tensor:
    """The rotary frequencies ``[R / 2]`` the decoder rotates keys with (the stream's frozen ones for dynamic
    RoPE), on the host in float32."""
    for module in decoder.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            if frozen is not None and frozen.frequencies(module) is not None:
                inv_freq = frozen.frequencies(module)
            return inv_freq.detach().to("cpu", torch.float32).clone()
    raise ConfigurationError("positions='bounded' needs a RoPE model (no rotary frequencies were found)")
