"""Seeds: one range for evaluation sets, a disjoint one for training.

Video ``v`` of a set made with seed ``S`` is drawn from ``numpy.random.default_rng([S, v])``. Evaluation sets
take ``S`` in `EVALUATION_SEEDS`; the trainer draws its step-``t`` batch from ``default_rng([S, t])`` with ``S``
in `TRAINING_SEEDS`. The two ranges do not overlap, so no evaluation video is ever trained on.
"""

from __future__ import annotations

import numpy as np

EVALUATION_SEEDS = range(0, 1_000_000)
TRAINING_SEEDS = range(1_000_000, 2**32)


def video_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of video ``index`` of the evaluation set made with ``seed``."""
    return np.random.default_rng([seed, index])


def training_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of training step ``step`` for the training seed ``seed`` (in `TRAINING_SEEDS`)."""
    if seed not in TRAINING_SEEDS:
        raise ValueError(f"training seed {seed} is outside the training range "
                         f"[{TRAINING_SEEDS.start}, {TRAINING_SEEDS.stop})")
    return np.random.default_rng([seed, step])
