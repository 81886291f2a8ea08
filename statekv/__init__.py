"""statekv: linear-time long-video encoding for video VLMs (StateKV).

The public names below load on first use (PEP 562): importing the package, or the command's module, loads neither
torch nor transformers, so the ``statekv`` command is running, and takes a Ctrl-C in one line, while they load.
"""

import importlib

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
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'statekv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
