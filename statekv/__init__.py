"""statekv: linear-time long-video encoding for video VLMs (StateKV)."""

from ._torchvision_check import check_torchvision

check_torchvision()  # before transformers is imported: it would report a broken torchvision misleadingly

from .core import (  # noqa: E402
    AttentionShare,
    Candidates,
    CarryPolicy,
    FullAttention,
    KeyNorm,
    MeanKeyMatch,
    MostRecent,
    PerLayerBudget,
    Recency,
    ReKV,
    Retrieval,
    RetrievalRule,
    ScoredPolicy,
    SinksAndRecency,
    StateKV,
    StreamingPrefill,
    WithSinks,
    generate_from_cache,
    scored_attention,
)
from .encoded import EncodedVideo, EncodingStats  # noqa: E402
from .errors import (  # noqa: E402
    ConfigurationError,
    HorizonError,
    InputError,
    StateKVError,
    UnsupportedModelError,
)
from .methods import MethodSpec, register_method  # noqa: E402
from .options import ModelOptions  # noqa: E402
from .pipeline import VideoQA, make_policy  # noqa: E402
from .recent import RecentFrames  # noqa: E402
from .stream import Stream  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AttentionShare", "MeanKeyMatch", "MostRecent", "RetrievalRule", "Candidates", "CarryPolicy",
    "ConfigurationError", "EncodedVideo", "RecentFrames", "EncodingStats", "FullAttention",
    "HorizonError", "InputError", "KeyNorm", "MethodSpec", "ModelOptions", "Recency", "ReKV", "Retrieval",
    "ScoredPolicy", "SinksAndRecency", "StateKV", "StateKVError", "Stream", "StreamingPrefill",
    "UnsupportedModelError", "VideoQA", "WithSinks", "PerLayerBudget", "generate_from_cache", "make_policy", "register_method", "scored_attention",
]
