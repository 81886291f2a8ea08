"""A carry rule that keeps everything (exact full attention) and hands every layer's scores to a listener."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from statekv.errors import InputError
from statekv.core.rules import KEEP_ALL, Candidates, CarryPolicy

ScoreListener = Callable[[int, torch.Tensor, tuple[int, ...]], None]


@dataclass(frozen=True)
class RecordScores(CarryPolicy):
    """Full attention that reports, for every (layer, step), the attention mass each streamed token received.

    ``listener(layer, scores, lengths)`` gets ``scores`` float32 ``[H_kv, N]`` (mass from the step's queries,
    summed over them and over the query heads of each KV group; the step's own tokens are the last
    ``lengths[-1]``) and ``lengths``, the token count of every step so far. It is called during the forward,
    once per layer, and must not keep ``scores``: the next layer's replace them.
    """

    listener: ScoreListener = field(compare=False)
    needs_scores: ClassVar[bool] = True

    def select(self, candidates: Candidates) -> slice:
        scores = candidates.scores
        if scores.shape[0] != 1:
            raise InputError(f"the attention analysis streams one video at a time (batch 1), "
                             f"got batch {scores.shape[0]}")
        self.listener(candidates.layer, scores[0], candidates.chunk_lengths)
        return KEEP_ALL
