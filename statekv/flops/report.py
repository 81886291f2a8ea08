"""Sweeps, break-even tables, the compute-accuracy frontier and their text / JSON renderings.

Pure data: nothing here draws (see :mod:`statekv.flops.plots`) or parses arguments (see
:mod:`statekv.flops.command`).
"""

from __future__ import annotations

from dataclasses import dataclass

from statekv.errors import ConfigurationError

from .analytic import (COMPONENTS, Method, PrefillFlops, break_even, prefill_flops, question_flops,
                       resolve_model)
from .paper import ACCURACY, BENCHMARKS, reported_method

TERA = 1e12

CONVENTION = {
    "flop": "a multiply-add is 2 FLOPs; only matrix products are counted (linear, conv, QK^T, PV)",
    "causal": "in-chunk attention is counted over the full queries x keys tile (dense kernels compute it)",
    "lm_head": "excluded: prefill needs hidden states and the KV cache, not logits",
    "score": {"eager": "StateKV sums probabilities the attention already computed: no extra matrix product",
              "recompute": "StateKV recomputes QK^T for the per-key mass (Triton; chunked past 16,384 keys)"},
    "tokens": "video tokens only: the prompt prefix and the question are not counted",
}


def sweep(models: list[str], budgets: list[int], windows: list[int], n_frames: int,
          score: str = "eager", rekv_windows: list[int] = ()) -> list[PrefillFlops]:
    """Curves for every model x (full, each recency window R, each ReKV window, each StateKV budget B)."""
    methods = [Method("full"), *(Method("recency", frames=r) for r in windows),
               *(Method("rekv", frames=r) for r in rekv_windows), *(Method("statekv", budget=b) for b in budgets)]
    return [prefill_flops(resolve_model(m), method, n_frames=n_frames, score=score)
            for m in models for method in methods]


def model_cost(curve: PrefillFlops) -> float:
    """Per-frame cost that does not depend on the method (vision, projector, LM linears): orders model sizes."""
    return sum(float(curve.breakdown[name][0]) for name in ("vision", "projector", "lm_linear"))


@dataclass(frozen=True)
class BreakEven:
    """Where a compressed run of one model becomes cheaper than full attention of an equal or smaller one."""

    cheaper: PrefillFlops   # the compressed run (recency or StateKV)
    baseline: PrefillFlops  # full attention
    cumulative: int | None  # first frame number at which the total is lower; None: not within the horizon
    marginal: int | None    # first frame number at which one more frame is cheaper

    def as_dict(self) -> dict:
        return {"a": self.cheaper.label, "b": self.baseline.label,
                "cumulative": self.cumulative, "marginal": self.marginal}


def break_even_pairs(curves: list[PrefillFlops]) -> list[BreakEven]:
    """Every compressed curve against every full-attention curve of an equal or smaller model."""
    full = [c for c in curves if c.method.kind == "full"]
    pairs = []
    for a in curves:
        if a.method.kind == "full":
            continue
        for b in full:
            if model_cost(a) >= model_cost(b):
                pairs.append(BreakEven(a, b, break_even(a, b, "cumulative"), break_even(a, b, "marginal")))
    return pairs


def frontier(benchmark: str = "videomme", n_frames: int = 512, score: str = "eager") -> list[dict]:
    """Total prefill FLOPs at ``n_frames`` and the paper's accuracy for each reported (model, method)."""
    if benchmark not in BENCHMARKS:
        raise ConfigurationError(f"unknown benchmark {benchmark!r}; expected one of {', '.join(BENCHMARKS)}")
    points = []
    for model, by_method in ACCURACY.items():
        for kind, scores in by_method.items():
            curve = prefill_flops(model, reported_method(kind), n_frames=n_frames, score=score)
            points.append({"model": model, "method": kind, "label": curve.label,
                           "flops": float(curve.cumulative[-1]), "accuracy": scores[benchmark]})
    return points


def question_costs(models: list[str], n_frames: int, retrieve: int) -> list[dict]:
    """Per model: FLOPs of answering one question after ``n_frames`` frames from the whole detailed cache and
    from ``retrieve`` retrieved frames (what every method's answer costs, and ReKV's)."""
    rows = []
    for name in models:
        spec = resolve_model(name)
        per_frame = spec.tokens_per_step / spec.frames_per_step
        whole = question_flops(spec, round(n_frames * per_frame))
        retrieved = question_flops(spec, round(min(retrieve, n_frames) * per_frame))
        rows.append({"model": spec.name, "frames": n_frames, "retrieve": retrieve, "whole_cache": whole,
                     "retrieved": retrieved})
    return rows


def to_json(curves: list[PrefillFlops], pairs: list[BreakEven], at: list[int], score: str) -> dict:
    """A JSON-ready summary: convention, per-curve values at the requested frames, break-even frames."""
    return {
        "convention": {**CONVENTION, "score": CONVENTION["score"][score]},
        "score": score,
        "n_frames": curves[0].n_frames if curves else 0,
        "curves": [
            {"model": c.model.name, "method": c.method.kind, "budget": c.method.budget,
             "frames": c.method.frames, "label": c.label, "tokens_per_step": c.model.tokens_per_step,
             "frames_per_step": c.model.frames_per_step, "at": {str(f): c.at(f) for f in at}}
            for c in curves
        ],
        "break_even": [p.as_dict() for p in pairs],
    }


def format_tables(curves: list[PrefillFlops], pairs: list[BreakEven], at: list[int], score: str) -> str:
    """Plain-text tables: marginal and cumulative TFLOPs at ``at``, the breakdown at the last frame, break-even."""
    last = curves[0].n_frames
    name_width = max(len(c.label) for c in curves)
    lines = [f"Video-prefill FLOPs in TFLOPs (1 multiply-add = 2 FLOPs, LM head excluded, score pass: {score})", ""]
    head = f"{'model / method':<{name_width}}  tok/step" + "".join(f"  {'marg@' + str(f):>11}  {'cum@' + str(f):>11}"
                                                                   for f in at)
    lines += [head, "-" * len(head)]
    for c in curves:
        row = f"{c.label:<{name_width}}  {c.model.tokens_per_step:>8}"
        for f in at:
            v = c.at(f)
            row += f"  {v['marginal'] / TERA:>11.2f}  {v['cumulative'] / TERA:>11.1f}"
        lines.append(row)
    lines += ["", f"Marginal breakdown at frame {last} (TFLOPs)", ""]
    head = f"{'model / method':<{name_width}}" + "".join(f"  {name:>12}" for name in COMPONENTS)
    lines += [head, "-" * len(head)]
    for c in curves:
        v = c.at(last)
        lines.append(f"{c.label:<{name_width}}" + "".join(f"  {v[name] / TERA:>12.3f}" for name in COMPONENTS))
    if pairs:
        lines += ["", f"Break-even: first frame at which A is cheaper than B (- = not within {last} frames)", ""]
        width_a = max(len(p.cheaper.label) for p in pairs)
        width_b = max(len(p.baseline.label) for p in pairs)
        head = f"{'A':<{width_a}}  {'B':<{width_b}}  {'cumulative':>10}  {'marginal':>8}"
        lines += [head, "-" * len(head)]
        for p in pairs:
            cum, marg = ("-" if x is None else str(x) for x in (p.cumulative, p.marginal))
            lines.append(f"{p.cheaper.label:<{width_a}}  {p.baseline.label:<{width_b}}  {cum:>10}  {marg:>8}")
    return "\n".join(lines)
