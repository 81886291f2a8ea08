"""statekv: linear-time long-video encoding for video VLMs (StateKV).

The public names below load on first use (PEP 562): importing the package, or the command's module, loads neither
torch nor transformers, so the ``statekv`` command is running, and takes a Ctrl-C in one line, while they load.
"""

from .lazy_names import names_on_first_use
from .torchvision_check import check_before_transformers

check_before_transformers()  # transformers would report a broken torchvision misleadingly

__version__ = "0.1.0"

_HOMES = {
    "statekv.core": (
        "AttentionShare", "Candidates", "CarryPolicy", "FullAttention", "KeyNorm", "MeanKeyMatch", "MostRecent",
        "PerLayerBudget", "Recency", "ReKV", "Retrieval", "RetrievalRule", "ScoredPolicy", "SinksAndRecency",
        "StateKV", "StreamingPrefill", "WithSinks", "scored_attention",
    ),
    "statekv.settings.engine": ("EngineSettings",),
    "statekv.api.encoded": ("EncodedVideo",),
    "statekv.api.stats": ("EncodingStats",),
    "statekv.errors": ("ConfigurationError", "HorizonError", "InputError", "StateKVError", "UnsupportedModelError"),
    "statekv.settings.methods": ("MethodSpec", "register_method"),
    "statekv.settings.options": ("ModelOptions",),
    "statekv.api.videoqa": ("VideoQA", "make_policy"),
    "statekv.api.recent": ("RecentFrames",),
    "statekv.api.stream": ("Stream",),
}
__all__, __getattr__, __dir__ = names_on_first_use(globals(), _HOMES)
