"""The base of every carry rule (`CarryPolicy`) and the selection that keeps every candidate (`KEEP_ALL`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .candidates import Candidates

KEEP_ALL = slice(0, None)


@dataclass(frozen=True)
class CarryPolicy:
    """Base class of carry rules. Subclasses override :meth:`select` (or use :class:`ScoredPolicy`).

    Class attributes:
        needs_scores: ``select`` reads ``candidates.scores`` (the attention must then compute them).
        capturable: ``select`` is a function of the candidate tensors alone (no host values that change per
            step), so a steady step may be recorded once as a CUDA graph and replayed.
        carries_everything: ``select`` keeps every candidate, always (full attention): a cache limit that evicts
            would free nothing, since a layer's carried tokens are never given back.
    """

    needs_scores: ClassVar[bool] = False
    capturable: ClassVar[bool] = False
    carries_everything: ClassVar[bool] = False

    def select(self, candidates: Candidates) -> slice | torch.Tensor:
        """Which candidates to carry: a slice over the candidate axis, or indices ``[B, H_kv, K]``."""
        raise NotImplementedError

    def scores_needed(self, size: int) -> bool:
        """Whether :meth:`select` will read scores for ``size`` candidates (lets attention skip scoring)."""
        return self.needs_scores

    @property
    def recent_steps(self) -> int | None:
        """If this rule carries exactly the tokens of its last N steps (after its sink tokens), N: the cache
        then keeps them in a ring buffer once steps have equal lengths. Else None."""
        return None

    def steady_budget(self, layer: int) -> int | None:
        """How many tokens ``layer`` carries once this rule's steps stop changing shape (a scored rule at its
        budget: its steps can then be replayed as a CUDA graph and batched with other streams'); None when the
        rule never settles at a fixed count of its own (full attention; recency settles in its ring instead)."""
        return None

    @property
    def sink_tokens(self) -> int:
        """How many leading tokens of the stream this rule always carries (with ``recent_steps``)."""
        return 0

    def check_layers(self, layers: int) -> None:
        """Refuse (one-line `ConfigurationError`) a model of ``layers`` decoder layers this rule cannot stream, when a
        stream is made rather than at its first step."""

    def for_prefix(self, tokens: int) -> "CarryPolicy":
        """This rule for a stream whose prompt prefix (text before the first frame) has ``tokens`` tokens."""
        return self

    @property
    def name(self) -> str:
        return type(self).__name__
