"""statekv: linear-time long-video encoding for video VLMs (StateKV)."""

from .torchvision_check import check_torchvision

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
    scored_attention,
)
from .settings.engine import EngineSettings  # noqa: E402
from .api.encoded import EncodedVideo  # noqa: E402
from .api.stats import EncodingStats  # noqa: E402
from .errors import (  # noqa: E402
    ConfigurationError,
    HorizonError,
    InputError,
    StateKVError,
    UnsupportedModelError,
)
from .settings.methods import MethodSpec, register_method  # noqa: E402
from .settings.options import ModelOptions  # noqa: E402
from .api.videoqa import VideoQA, make_policy  # noqa: E402
from .api.recent import RecentFrames  # noqa: E402
from .api.stream import Stream  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AttentionShare", "MeanKeyMatch", "MostRecent", "RetrievalRule", "Candidates", "CarryPolicy",
    "ConfigurationError", "EncodedVideo", "EncodingStats", "EngineSettings", "FullAttention", "RecentFrames",
    "HorizonError", "InputError", "KeyNorm", "MethodSpec", "ModelOptions", "Recency", "ReKV", "Retrieval",
    "ScoredPolicy", "SinksAndRecency", "StateKV", "StateKVError", "Stream", "StreamingPrefill",
    "UnsupportedModelError", "VideoQA", "WithSinks", "PerLayerBudget", "make_policy", "register_method", "scored_attention",
]
