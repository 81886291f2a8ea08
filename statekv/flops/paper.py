"""The paper's reported accuracies (Table 1), used to place methods on the compute-accuracy frontier.

``ACCURACY[model][method] = {benchmark: percent}`` with ``method`` one of ``"full"``, ``"recency"``
(ReKV, R = 16 frames) and ``"statekv"`` (B = 4096), the settings the paper reports for all seven models.
"""

from __future__ import annotations

from ..settings.methods import MethodSettings
from .analytic import Method

PAPER_SETTINGS = MethodSettings()  # the registry's defaults are the paper's settings (B = 4096, R = 16)

BENCHMARKS = ("videomme", "mlvu", "ovobench")
REPORTED_METHODS = ("full", "recency", "statekv")


def reported_method(kind: str) -> Method:
    """The method ``kind`` at the settings the paper reports (made on use: a `Method` needs the engine's methods
    registered, and ``statekv flops``' parser is built without them)."""
    return Method(kind, **{"full": {}, "recency": {"frames": PAPER_SETTINGS.frames},
                           "statekv": {"budget": PAPER_SETTINGS.budget}}[kind])


_TABLE = {  # model: (VideoMME, MLVU, OVOBench real-time) for Full SA, ReKV R=16, StateKV B=4096
    "internvl3-1b": ((46.19, 47.05, 55.79), (37.11, 33.44, 37.75), (45.80, 46.35, 55.44)),
    "internvl3-2b": ((55.81, 56.61, 60.22), (31.78, 5.49, 33.33), (54.15, 57.31, 61.05)),
    "qwen3-vl-2b": ((58.67, 58.83, 60.45), (49.44, 45.60, 46.71), (58.00, 57.72, 60.93)),
    "qwen3-vl-4b": ((66.59, 68.98, 64.76), (52.63, 49.91, 49.22), (65.89, 67.80, 64.87)),
    "internvl3-8b": ((64.19, 61.14, 71.45), (54.56, 31.11, 56.03), (62.52, 62.85, 70.25)),
    "eagle2.5-8b": ((69.81, 73.85, 69.30), (58.70, 55.01, 55.44), (67.96, 70.52, 68.70)),
    "qwen3-vl-8b": ((70.52, 75.82, 67.86), (55.52, 50.91, 53.88), (68.11, 71.38, 64.99)),
}

ACCURACY: dict[str, dict[str, dict[str, float]]] = {
    model: {method: dict(zip(BENCHMARKS, scores, strict=True))
            for method, scores in zip(REPORTED_METHODS, rows, strict=True)}
    for model, rows in _TABLE.items()
}
