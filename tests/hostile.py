"""What the hostile suites share: a small StateKV engine over a tiny checkpoint's adapter, and frames of noise."""

from __future__ import annotations

import numpy as np

import statekv


def small_qa(adapter, **kwargs) -> statekv.VideoQA:
    """StateKV B=12 with eager attention and room for 40 tokens of prompt, over ``adapter``."""
    return statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40, **kwargs)


def noise_frames(count: int, seed: int = 0) -> np.ndarray:
    """``count`` random RGB frames ``[count, 24, 32, 3]``."""
    return np.random.default_rng(seed).integers(0, 256, (count, 24, 32, 3), dtype=np.uint8)
