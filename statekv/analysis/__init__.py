"""Attention-structure analysis: does a backbone have the structure StateKV relies on? (paper appendix A)

    from statekv.analysis import AnalysisSettings, analyze_attention, approximation_errors

    stats = analyze_attention(model, [steps_of_video_1, steps_of_video_2])      # concentration, oracle, ...
    errors = approximation_errors(model, [steps], [StateKV(256), Recency(frames=4)])

`statistics` holds the pure functions on one step's scores, `accumulator` folds them over a stream,
`runner` drives a model through the streaming engine, `plots` and `report` present the results, and
`command` is ``statekv analyze``.
"""

from ..lazy_names import names_on_first_use

_HOMES = {  # loaded on first use: ``statekv analyze``'s parser is built without the engine
    ".accumulator": ("PAPER_BUDGETS", "PAPER_WINDOWS", "AnalysisSettings", "AttentionStatistics"),
    ".recording": ("RecordScores",),
    ".runner": ("ApproximationErrors", "Step", "analyze_attention", "approximation_errors", "measure_attention",
                "policy_label", "text_steps"),
}
__all__, __getattr__, __dir__ = names_on_first_use(globals(), _HOMES)
