"""Attention-structure analysis: does a backbone have the structure StateKV relies on? (paper appendix A)

    from statekv.analysis import AnalysisSettings, analyze_attention, approximation_errors

    stats = analyze_attention(model, [steps_of_video_1, steps_of_video_2])      # concentration, oracle, ...
    errors = approximation_errors(model, [steps], [StateKV(256), Recency(frames=4)])

`statistics` holds the pure functions on one step's scores, `accumulator` folds them over a stream,
`runner` drives a model through the streaming engine, `plots` and `report` present the results, and
`command` is ``statekv analyze``.
"""

import importlib

_HOMES = {  # loaded on first use (PEP 562): ``statekv analyze``'s parser is built without the engine
    ".accumulator": ("PAPER_BUDGETS", "PAPER_WINDOWS", "AnalysisSettings", "AttentionStatistics"),
    ".recording": ("RecordScores",),
    ".runner": ("ApproximationErrors", "Step", "analyze_attention", "approximation_errors", "measure_attention",
                "policy_label", "text_steps"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'statekv.analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
