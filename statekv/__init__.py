"""statekv: linear-time long-video encoding for video VLMs (StateKV)."""

from .core import (
    Candidates,
    CarryPolicy,
    ConfigurationError,
    FullAttention,
    HorizonError,
    InputError,
    KeyNorm,
    Recency,
    ScoredPolicy,
    SinksAndRecency,
    StateKV,
    StateKVError,
    StreamingPrefill,
    UnsupportedModelError,
    generate_from_cache,
    scored_attention,
)

from .pipeline import EncodedVideo, EncodingStats, VideoQA, make_policy
from .stream import Stream

__version__ = "0.1.0"

__all__ = [
    "Candidates", "CarryPolicy", "ConfigurationError", "FullAttention", "HorizonError", "InputError", "KeyNorm",
    "Recency", "ScoredPolicy", "SinksAndRecency", "StateKV", "StateKVError", "StreamingPrefill", "UnsupportedModelError",
    "generate_from_cache", "scored_attention", "EncodedVideo", "EncodingStats", "VideoQA", "make_policy", "Stream",
]
