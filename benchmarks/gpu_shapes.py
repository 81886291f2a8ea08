"""The sizes a GPU-suite run measures at (the real models' or a smoke run's tiny ones), and what each of its
sections records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Shapes:
    """The sizes one run uses: the real ones, or tiny ones for ``--smoke``."""

    lm: dict  # Qwen2Config fields of the large decoder
    frame_tokens: int
    budget: int
    window_frames: int
    step_warmup: int
    step_timed: int
    prefill_frames: int
    vlm_text: dict | None  # the 1B InternVL's text and vision configs (None: make_tiny_checkpoint's)
    vlm_vision: dict | None
    image_size: int
    pipeline_frames: int
    stream_counts: tuple[int, ...]
    stream_frames: int
    tier_frames: int
    vlm_budget: int
    device: str
    ttft_frames: tuple[int, ...]  # frames seen when TTFT is measured
    ttft_frame_tokens: int  # tokens of a frame in the TTFT streams
    ttft_group_after: int  # frames streamed one per step; then ttft_group per step
    ttft_group: int
    ttft_prompt_tokens: int
    ttft_budget: int
    live_start: int  # the cameras the live-stream search starts at
    live_duration: float  # seconds of each run of that search
    live_warm_frames: int  # frames each camera streams before a run's clock starts (its carried state full)
    live_max: int  # the most cameras that search tries


REAL = Shapes(
    lm=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
            intermediate_size=18944, vocab_size=151674, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    frame_tokens=259, budget=4096, window_frames=16, step_warmup=24, step_timed=16, prefill_frames=512,
    vlm_text=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  intermediate_size=4864, max_position_embeddings=32768),
    vlm_vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    image_size=448, patch_size=14),
    image_size=448, pipeline_frames=300, stream_counts=(1, 4, 16), stream_frames=8, tier_frames=48,
    vlm_budget=4096, device="cuda", ttft_frames=(16, 64, 256, 4096), ttft_frame_tokens=16, ttft_group_after=256,
    ttft_group=16, ttft_prompt_tokens=16, ttft_budget=1024, live_start=8, live_duration=6.0,
    live_warm_frames=16, live_max=256)
SMOKE = Shapes(
    lm=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=128, tie_word_embeddings=False),
    frame_tokens=12, budget=48, window_frames=4, step_warmup=6, step_timed=3, prefill_frames=16,
    vlm_text=None, vlm_vision=None, image_size=64, pipeline_frames=8, stream_counts=(1, 4, 16), stream_frames=2,
    tier_frames=6, vlm_budget=64, device="cpu", ttft_frames=(2, 4, 8, 32), ttft_frame_tokens=4, ttft_group_after=8,
    ttft_group=4, ttft_prompt_tokens=4, ttft_budget=16, live_start=1, live_duration=2.0,
    live_warm_frames=2, live_max=2)


@dataclass
class Section:
    name: str
    status: str = "not run"  # ok, failed, skipped, not run
    reason: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
