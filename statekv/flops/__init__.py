"""Video-prefill compute accounting: analytic FLOPs per frame, measured FLOPs, break-even frames, figures.

    from statekv.flops import prefill_flops, break_even
    small = prefill_flops("internvl3-1b", "full", n_frames=3600)
    big = prefill_flops("internvl3-8b", "statekv", budget=16384, n_frames=3600)
    break_even(big, small)          # first frame at which the 8B StateKV video is cheaper in total

The counting convention is documented in :mod:`statekv.flops.analytic` and ``docs/flops.md``.
"""

from .analytic import (
    COMPONENTS,
    SCORE_PASSES,
    Method,
    PrefillFlops,
    break_even,
    lm_attention_flops,
    lm_linear_flops,
    prefill_flops,
    projector_flops,
    step_flops,
    vision_encoder_flops,
)
from .presets import PRESETS, LanguageSpec, ModelSpec, VisionSpec, from_config, get_preset, to_config

__all__ = [
    "COMPONENTS", "PRESETS", "SCORE_PASSES", "LanguageSpec", "Method", "ModelSpec", "PrefillFlops",
    "VisionSpec", "break_even", "from_config", "get_preset", "lm_attention_flops", "lm_linear_flops",
    "prefill_flops", "projector_flops", "step_flops", "to_config", "vision_encoder_flops",
]
