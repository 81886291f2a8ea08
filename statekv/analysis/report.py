"""The analysis report: a JSON document of every statistic, and a short markdown summary next to the paper's
numbers (appendix A: InternVL3-1B/2B/8B, 16 VideoMME-train videos x 128 frames)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from statekv.errors import OutputError
from statekv.flushing import write_whole

PAPER_MODELS = ("InternVL3-1B", "InternVL3-2B", "InternVL3-8B")
# statistic -> {budget B or window R: (1B, 2B, 8B)}
PAPER = {
    "concentration": {256: (0.71, 0.69, 0.72), 1024: (0.83, 0.80, 0.82), 4096: (0.93, 0.93, 0.93)},
    "weighted_recall": {16: (0.90, 0.95, 0.92), 256: (0.96, 0.97, 0.96)},
    "retention": {1: (0.81, 0.89, 0.85)},
    # top-B gain over keeping the last R frames (256 tokens vs 1 frame, 1024 tokens vs 4 frames)
    "recency_gap": {1: (0.59, 0.57, 0.62), 4: (0.59, 0.57, 0.61)},
}


def build_report(statistics: dict, errors: dict | None, *, model: str, videos: list[str],
                 tokens: list[int], label: str = "", note: str = "") -> dict:
    """The JSON document: run description, every statistic, the approximation errors and the paper's numbers."""
    return {"label": label, "note": note, "model": model, "videos": videos, "tokens_per_video": tokens,
            "statistics": statistics, "errors": errors or {},
            "paper": {"models": list(PAPER_MODELS),
                      **{name: {str(k): v for k, v in values.items()} for name, values in PAPER.items()}}}


def write_json(report: dict, path: str | Path) -> Path:
    return write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", path)


def write_text(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` whole or not at all, its folders made; a one-line `OutputError` when it cannot be
    written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, text.encode("utf-8"))
    except OSError as error:
        raise OutputError(f"cannot write {path} ({error.strerror or error})") from None
    return path


def _value(values: list[float | None] | None, index: int | None) -> str:
    if values is None or index is None or values[index] is None:
        return "—"
    return f"{values[index]:.2f}"


def _at(keys: list[int], key: int) -> int | None:
    return keys.index(key) if key in keys else None


def paper_rows(statistics: dict) -> list[tuple[str, str, tuple[float, ...]]]:
    """``(statistic, this run's value, paper's values)`` for every number the paper states."""
    layer = statistics.get("layer", {})
    budgets, windows = statistics["budgets"], statistics["windows"]
    oracle = layer.get("oracle", {})
    rows = []
    for budget, paper in PAPER["concentration"].items():
        rows.append((f"concentration C(B={budget})",
                     _value(layer.get("concentration", {}).get("mean"), _at(budgets, budget)), paper))
    for budget, paper in PAPER["weighted_recall"].items():
        rows.append((f"weighted candidate-pool recall, B={budget}",
                     _value(oracle.get("weighted_recall", {}).get("mean"), _at(budgets, budget)), paper))
    for budget, paper in PAPER["retention"].items():
        rows.append((f"retention, B={budget}", _value(oracle.get("retention", {}).get("mean"), _at(budgets, budget)),
                     paper))
    for window, paper in PAPER["recency_gap"].items():
        gap = layer.get("recency", {}).get("gap", {}).get("mean")
        rows.append((f"top-B gain over the last {window} frame{'s' * (window > 1)} (same tokens)",
                     _value(gap, _at(windows, window)), paper))
    return rows


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _range(per_layer: list[list[float | None]], index: int) -> str:
    values = [row[index] for row in per_layer if row[index] is not None]
    return f"{min(values):.2f}–{max(values):.2f}" if values else "—"


def markdown_summary(report: dict, figures: list[str] | None = None) -> str:
    """A short markdown summary: the paper comparison first, then one table per statistic."""
    stats = report["statistics"]
    layer = stats["layer"]
    budgets, windows = stats["budgets"], stats["windows"]
    title = f"# Attention analysis: {report['label']}" if report["label"] else "# Attention analysis"
    lines = [title, ""]
    if report.get("note"):
        lines += [f"> {report['note']}", ""]
    tokens = report["tokens_per_video"]
    lines += [f"Model `{report['model']}`; {len(report['videos'])} video(s), {stats['steps']} steps in all "
              f"({min(tokens)}–{max(tokens)} tokens per video); {stats['layers']} layers. Statistics are averaged "
              "over videos, steps and layers (per-layer values in the JSON).", ""]

    lines += ["## Side by side with the paper", "",
              "Paper: InternVL3 on 16 VideoMME-train videos x 128 frames (appendix A).", ""]
    lines += _table(["statistic", "this run", *(f"paper {m.split('-')[-1]}" for m in PAPER_MODELS)],
                    [[name, mine, *(f"{p:.2f}" for p in paper)] for name, mine, paper in paper_rows(stats)])
    lines += ["", "(—: that budget or window was not measured in this run.)"]

    lines += ["", "## Concentration of historical attention", "",
              "C(B): share of the historical mass (keys of earlier steps) on the top-B historical tokens.", ""]
    concentration = layer["concentration"]
    lines += _table(["B", "C(B) mean", "range over layers"],
                    [[b, _value(concentration["mean"], i), _range(concentration["per_layer"], i)]
                     for i, b in enumerate(budgets)])
    share = layer["historical_share"]["mean"][0]
    lines += ["", f"Share of each step's attention that goes to history (rather than to the step itself): "
              f"{share:.2f}." if share is not None else ""]

    if "oracle" in layer:
        oracle = layer["oracle"]
        lines += ["", "## Slow evolution of the oracle state", "",
                  "Oracle state S_n: top-B of all tokens seen by step n. Recall of S_{n+1} by S_n ∪ step n+1, "
                  "retention |S_n ∩ S_{n+1}| / |S_n|, churn |S_{n+1} \\ S_n| / |S_{n+1}|.", ""]
        lines += _table(["B", "recall", "weighted recall", "retention", "churn"],
                        [[b, *(_value(oracle[name]["mean"], i) for name in
                               ("recall", "weighted_recall", "retention", "churn"))] for i, b in enumerate(budgets)])

    recency = layer["recency"]
    lines += ["", "## Recency vs attention-based selection", "",
              "Share of historical mass kept by the last R steps, and by the top tokens at the same token count.", ""]
    lines += _table(["R", "tokens (mean)", "last R steps", "top tokens", "gain"],
                    [[r, f"{recency['window_tokens'][i]:.0f}", _value(recency["recent_mass"]["mean"], i),
                      _value(recency["selected_mass"]["mean"], i), _value(recency["gap"]["mean"], i)]
                     for i, r in enumerate(windows)])

    distance = layer["distance"]["mean"]
    # Distances 1, 2, 4, 8... that some step reached, and the pooled far column if any step reached it.
    shown = [2**k - 1 for k in range(len(distance).bit_length()) if 2**k - 1 < len(distance) - 1]
    shown = [i for i in shown + [len(distance) - 1] if distance[i] is not None]
    lines += ["", "## Historical mass by step distance", "",
              "Share of a step's historical mass on the step d steps back (mean over the steps that have one).", ""]
    lines += _table(["distance d", *(stats["distance_labels"][i] for i in shown)],
                    [["share (mean over layers)", *(_value(distance, i) for i in shown)]])

    if report.get("errors"):
        lines += ["", "## Approximation error against full attention", "",
                  "Relative Frobenius error of the detailed-cache keys/values (mean over layers) and of the last "
                  "hidden states of every step, on the same video(s).", ""]
        runs = sorted(report["errors"].values(), key=lambda r: (r["kind"], r["budget_tokens"] or 0))
        lines += _table(["method", "carried tokens", "keys", "values", "hidden states"],
                        [[r["label"], f"{r['budget_tokens']:.0f}", f"{r['key_error']['mean']:.3g}",
                          f"{r['value_error']['mean']:.3g}", f"{r['hidden_error']:.3g}"] for r in runs])
    if figures:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"
