"""The model-agnostic engine: carry policies, scored attention, the two-state cache and streaming prefill."""

from .attention.scored import chunk_attention, scored_attention
from .cache.two_state import TwoStateCache
from .rules import (Candidates, CarryPolicy, FullAttention, KeyNorm, PerLayerBudget, Recency, ReKV, ScoredPolicy,
                    SinksAndRecency, StateKV, WithSinks)
from .stream.prefill import StreamingPrefill
from .answering.together import Asked, answer_together
from .answering.retrieval import (RETRIEVAL_RULES, AttentionShare, LayerQuestion, MeanKeyMatch, MostRecent, Retrieval,
                                  RetrievalRule)
from ..settings.methods import retrieval_rule
from .positions.rope import FrozenRope, check_horizon, freeze_rope, rope_capacity

__all__ = [
    "RETRIEVAL_RULES", "Asked", "AttentionShare", "answer_together", "LayerQuestion", "MeanKeyMatch", "MostRecent",
    "RetrievalRule",
    "retrieval_rule", "Candidates", "CarryPolicy", "FrozenRope", "FullAttention", "KeyNorm", "PerLayerBudget",
    "Recency", "ReKV", "Retrieval", "WithSinks",
    "ScoredPolicy", "SinksAndRecency", "StateKV", "StreamingPrefill", "TwoStateCache", "check_horizon",
    "chunk_attention", "freeze_rope", "rope_capacity", "scored_attention",
]
