"""Attention-structure analysis: does a backbone have the structure StateKV relies on? (paper appendix A)

    from statekv.analysis import AnalysisSettings, analyze_attention, approximation_errors

    stats = analyze_attention(model, [steps_of_video_1, steps_of_video_2])      # concentration, oracle, ...
    errors = approximation_errors(model, [steps], [StateKV(256), Recency(frames=4)])

`statistics` holds the pure functions on one step's scores, `accumulator` folds them over a stream,
`runner` drives a model through the streaming engine, `plots` and `report` present the results, and
`command` is ``statekv analyze``.
"""

from .accumulator import PAPER_BUDGETS, PAPER_WINDOWS, AnalysisSettings, AttentionStatistics
from .recording import RecordScores
from .runner import (
    ApproximationErrors,
    Step,
    analyze_attention,
    approximation_errors,
    measure_attention,
    policy_label,
    text_steps,
)

__all__ = [
    "PAPER_BUDGETS", "PAPER_WINDOWS", "AnalysisSettings", "ApproximationErrors", "AttentionStatistics",
    "RecordScores", "Step",
    "analyze_attention", "approximation_errors", "measure_attention", "policy_label", "text_steps",
]
