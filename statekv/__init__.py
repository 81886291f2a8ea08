"""statekv: linear-time long-video encoding for video VLMs (StateKV)."""

from ._torchvision_check import check_torchvision

check_torchvision()  # before transformers is imported: it would report a broken torchvision misleadingly

from .core import (  # noqa: E402
    Candidates,
    CarryPolicy,
    ConfigurationError,
    FullAttention,
    HorizonError,
    InputError,
    KeyNorm,
    Recency,
    ReKV,
    Retrieval,
    ScoredPolicy,
    SinksAndRecency,
    StateKV,
    StateKVError,
    StreamingPrefill,
    UnsupportedModelError,
    generate_from_cache,
    scored_attention,
)

from .pipeline import EncodedVideo, EncodingStats, VideoQA, make_policy  # noqa: E402
from .stream import Stream  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Candidates", "CarryPolicy", "ConfigurationError", "FullAttention", "HorizonError", "InputError", "KeyNorm",
    "Recency", "ReKV", "Retrieval", "ScoredPolicy", "SinksAndRecency", "StateKV", "StateKVError", "StreamingPrefill", "UnsupportedModelError",
    "generate_from_cache", "scored_attention", "EncodedVideo", "EncodingStats", "VideoQA", "make_policy", "Stream",
]
