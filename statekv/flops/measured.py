"""Measured video-prefill FLOPs: the real code paths, run on weightless meta-device models and counted with
:class:`torch.utils.flop_counter.FlopCounterMode`.

* Language side: :class:`statekv.StreamingPrefill` (the engine itself), one ``step`` per chunk of
  ``tokens_per_step`` embeddings, under ``FullAttention`` / ``Recency`` / ``StateKV``.
* Vision side: the Hugging Face vision module's own forward (``InternVLModel.get_image_features`` for
  InternVL3 and Eagle2.5, ``Qwen3VLVisionModel.forward`` for Qwen3-VL) on one step's pixels.

Meta tensors have shapes but no data, so an 8B model costs no memory and a step runs in milliseconds. Two
things do not run on meta and are worked around or reported:

* Qwen3-VL's ``get_vision_interpolation_indices_and_weights`` calls ``torch.repeat_interleave`` without
  ``output_size``, which meta tensors reject; the grid-derived index tensors are therefore computed on CPU
  with transformers' own helpers and passed to the forward (it accepts them precomputed).
* The engine's ``chunked`` score backend reads a tensor value (``int(query_index.max())``), impossible on
  meta; :func:`measure_language` refuses it there. Its count can be taken on a small real CPU model instead.

Counting on CPU with real tensors is not a substitute: PyTorch's CPU fused SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no FLOP formula and counts as 0, whereas on meta SDPA
decomposes into the matrix products it performs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils.flop_counter import FlopCounterMode

from statekv.core.positions.rope import rope_capacity
from statekv.errors import ConfigurationError, HorizonError

from .analytic import Method, make_method, resolve_model
from .presets import ModelSpec, to_config

LINEAR_MODULE = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp)$")


def meta_model(spec: ModelSpec) -> torch.nn.Module:
    """The HF model of ``spec``'s shape with meta-device (weightless) parameters, in eval mode."""
    from transformers import InternVLForConditionalGeneration, Qwen3VLForConditionalGeneration

    cls = Qwen3VLForConditionalGeneration if spec.family == "qwen3_vl" else InternVLForConditionalGeneration
    with torch.device("meta"):
        model = cls(to_config(spec))
    return model.eval()


@contextmanager
def _flops_inside(modules: list[torch.nn.Module]):
    """Count the FLOPs spent inside ``modules`` (a list that receives the total) while an outer counter runs.

    A forward pre-hook opens a nested ``FlopCounterMode`` and the forward hook closes it; nested dispatch modes
    both see every op, so the outer total is unaffected.
    """
    totals: list[int] = []
    open_counters: list[FlopCounterMode] = []

    def enter(module, args):
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        open_counters.append(counter)

    def leave(module, args, output):
        counter = open_counters.pop()
        counter.__exit__(None, None, None)
        totals.append(counter.get_total_flops())

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield totals
    finally:
        for handle in handles:
            handle.remove()
        while open_counters:  # the forward raised inside a counted module
            open_counters.pop().__exit__(None, None, None)


def measure_vision(model: torch.nn.Module, spec: ModelSpec) -> dict[str, int]:
    """FLOPs of one step's pixels through ``model``'s vision tower and projector (meta tensors).

    Returns ``{"vision": ..., "projector": ...}`` (DeepStack mergers count as projector).
    """
    vis = spec.vision
    inner = model.model
    if spec.family == "qwen3_vl":
        forward, inputs = inner.visual, _qwen3_vl_vision_inputs(inner.visual, spec)
        projectors = [inner.visual.merger, *inner.visual.deepstack_merger_list]
    else:
        pixels = torch.empty(1, 3, vis.image_size, vis.image_size, device="meta")
        forward, inputs = inner.get_image_features, {"pixel_values": pixels}
        projectors = [inner.multi_modal_projector]
    with FlopCounterMode(display=False) as total, _flops_inside(projectors) as projector:
        forward(**inputs)
    return {"vision": total.get_total_flops() - sum(projector), "projector": sum(projector)}


def _qwen3_vl_vision_inputs(visual: torch.nn.Module, spec: ModelSpec) -> dict:
    """One temporal patch's flattened patches (meta) plus grid-derived indices computed on CPU."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    vis = spec.vision
    side = vis.image_size // vis.patch_size
    grid = torch.tensor([[1, side, side]])  # stays on CPU: the forward reads its values
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=vis.merge)
    positions = get_vision_position_ids(grid, vis.merge)
    patch_values = 3 * vis.temporal_patch_size * vis.patch_size**2
    return dict(hidden_states=torch.empty(vis.patches, patch_values, device="meta"), grid_thw=grid,
                interp_indices=indices.to("meta"), interp_weights=weights.to("meta"),
                position_ids=positions.to("meta"))


def policy_for(method: Method, frames_per_step: int = 1):
    """The engine's carry policy for ``method`` (the registry's, as every other part of statekv uses)."""
    return method.spec.policy(method.settings, frames_per_step)


def measure_language(model: torch.nn.Module, spec: ModelSpec, method: Method, n_steps: int,
                     attention: str = "eager", seed: int = 0,
                     on_step: Callable[[int], None] | None = None) -> list[dict[str, int]]:
    """FLOPs of ``n_steps`` chunks through :class:`statekv.StreamingPrefill`, on ``model``'s device.

    On meta (the normal case) the chunks are shapes only. On a real device random chunks are drawn: useful to
    count the ``chunked`` score backend on a small CPU model. Steps that need no scores (full attention,
    recency, StateKV below its budget) go through PyTorch's fused SDPA, which FlopCounterMode counts as 0 on
    CPU, so on CPU only StateKV with a budget below one step's tokens is accepted.

    Returns one ``{"lm_linear": ..., "lm_attention": ...}`` per step; ``lm_attention`` is everything outside
    the q/k/v/o projections and MLPs: attention itself and StateKV's score pass. ``on_step(done)`` is called after
    each step.
    """
    import statekv

    device = next(model.parameters()).device
    if device.type == "meta" and attention != "eager":
        raise ConfigurationError(f"score backend {attention!r} cannot run on meta tensors; use 'eager' "
                                 "('chunked' reads tensor values to skip key blocks, 'triton' needs CUDA)")
    tokens = spec.tokens_per_step
    if device.type == "cpu" and not (method.scores and method.budget < tokens):
        # Only a StateKV step with more candidates than its budget avoids SDPA (it scores explicitly).
        raise ConfigurationError(f"{method.label} runs PyTorch's fused CPU SDPA at some step, which FlopCounterMode "
                                 f"counts as 0 FLOPs; measure on a meta-device model, or use StateKV with a budget "
                                 f"below the {tokens} tokens per step")
    try:
        stream = statekv.StreamingPrefill(model, policy_for(method, spec.frames_per_step), attention=attention,
                                          horizon=n_steps * tokens)
    except HorizonError:  # its own advice names flags of the commands that stream videos
        capacity = rope_capacity(model.config.get_text_config())
        raise ConfigurationError(f"{n_steps} steps of {tokens} tokens take {n_steps * tokens} positions, beyond the "
                                 f"model's RoPE (at most {capacity}): measure at most {capacity // tokens} "
                                 "steps") from None
    # Vision-tower modules may match too; they never run during a language step, so they count nothing.
    linear = [m for name, m in model.named_modules() if LINEAR_MODULE.search(name)]
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n_steps):
        shape = (1, tokens, spec.language.hidden_size)
        chunk = (torch.empty(shape, device="meta") if device.type == "meta"
                 else torch.randn(shape, generator=generator).to(device))
        with FlopCounterMode(display=False) as total, _flops_inside(linear) as inside:
            stream.step(inputs_embeds=chunk)
        steps.append({"lm_linear": sum(inside), "lm_attention": total.get_total_flops() - sum(inside)})
        if on_step is not None:
            on_step(len(steps))
    return steps


def measure_prefill(model, method: str | Method, n_steps: int, *, budget: int | None = None,
                    frames: int | None = None, attention: str = "eager",
                    on_step: Callable[[int], None] | None = None) -> list[dict[str, int]]:
    """Measured FLOPs of the first ``n_steps`` steps of ``model`` (preset name, spec or config) under ``method``.

    Each entry holds ``vision``, ``projector``, ``lm_linear``, ``lm_attention`` (score pass included) and
    ``total``. The vision side is measured once: it is the same for every step. ``on_step(done)`` is called after
    each language step.
    """
    spec, method = resolve_model(model), make_method(method, budget, frames)
    hf_model = meta_model(spec)
    vision = measure_vision(hf_model, spec)
    return [{**vision, **lm, "total": sum(vision.values()) + sum(lm.values())}
            for lm in measure_language(hf_model, spec, method, n_steps, attention, on_step=on_step)]
