"""ReKV's prefill: attention sinks around recency."""

from __future__ import annotations

from dataclasses import dataclass

from .recency import Recency
from .sinks import WithSinks


@dataclass(frozen=True, init=False)
class ReKV(WithSinks):
    """ReKV's prefill (Di et al., ICLR 2025): attention sinks -- the prompt prefix and the first ``sinks``
    tokens after it -- around the tokens of the ``frames`` most recent steps: ``WithSinks(Recency(frames), sinks,
    prefix_tokens)``, named and sized as ReKV is. Answering from retrieved frames (the other half of ReKV) is a
    question-time option of every method (`Retrieval`).

    ``prefix_tokens`` is set per stream by :meth:`for_prefix` (the pipeline knows the prompt's prefix).
    """

    def __init__(self, frames: int, sinks: int = 4, prefix_tokens: int = 0):
        super().__init__(Recency(frames), sinks, prefix_tokens)

    @property
    def frames(self) -> int:
        """The window of recent steps carried."""
        return self.rule.frames

    def for_prefix(self, tokens: int) -> "ReKV":
        return ReKV(self.frames, self.sinks, tokens)

    def __repr__(self) -> str:  # as saved streams record it
        return f"ReKV(frames={self.frames}, sinks={self.sinks}, prefix_tokens={self.prefix_tokens})"
