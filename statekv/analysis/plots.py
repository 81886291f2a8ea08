"""Figures of an analysis report (matplotlib, Agg). Each function takes the JSON-ready result and a path."""

from __future__ import annotations

import math
from pathlib import Path

from statekv.plotting import pyplot, save_figure
from statekv.stopping import stop_point

TRANSITION_LABELS = {"recall": "recall", "weighted_recall": "weighted recall", "retention": "retention",
                     "churn": "churn"}


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    try:
        saved = save_figure(fig, path, dpi=120)
    finally:
        pyplot().close(fig)
    stop_point()  # matplotlib can swallow a Ctrl-C while it draws
    return saved


def _layer_colors(plt, layers: int):
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(layers - 1, 1)) for i in range(layers)]


def _nan(values):
    return [math.nan if v is None else v for v in values]


def plot_concentration(stats: dict, path: str | Path, title: str = "") -> Path:
    """C(B) against B: one line per layer (dark = first layer, light = last), the layer mean in black."""
    plt = pyplot()
    layer = stats["layer"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    per_layer = layer["concentration"]["per_layer"]
    for index, (values, color) in enumerate(zip(per_layer, _layer_colors(plt, len(per_layer)), strict=True)):
        ax.plot(stats["budgets"], _nan(values), color=color, lw=1, alpha=0.8,
                label="layers (first → last)" if index == 0 else None)
    ax.plot(stats["budgets"], _nan(layer["concentration"]["mean"]), color="black", lw=2.5, marker="o",
            label="mean over layers")
    ax.set(xscale="log", xlabel="budget B (historical tokens kept)", ylim=(0, 1.02),
           ylabel="C(B): share of historical mass on top-B", title=title or "Concentration of historical attention")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_oracle(stats: dict, path: str | Path, title: str = "") -> Path:
    """Candidate-pool recall, weighted recall, retention and churn of the oracle state against B (mean over
    layers; the band spans the layers)."""
    plt = pyplot()
    oracle = stats["layer"].get("oracle")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if oracle:
        for name, label in TRANSITION_LABELS.items():
            per_layer = [_nan(v) for v in oracle[name]["per_layer"]]
            low = [min(col) for col in zip(*per_layer, strict=True)]
            high = [max(col) for col in zip(*per_layer, strict=True)]
            line, = ax.plot(stats["budgets"], _nan(oracle[name]["mean"]), marker="o", label=label)
            ax.fill_between(stats["budgets"], low, high, color=line.get_color(), alpha=0.15)
    ax.set(xscale="log", xlabel="budget B (tokens in the oracle state)", ylim=(-0.02, 1.02), ylabel="share",
           title=title or "Oracle state: recall by (previous state ∪ new frame), retention, churn")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, path)


def plot_recency(stats: dict, path: str | Path, title: str = "") -> Path:
    """Historical mass kept: top-B selection (curve, and at each window's exact token count) vs the last R
    frames (squares), mean over layers and frames."""
    plt = pyplot()
    layer = stats["layer"]
    recency = layer["recency"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(stats["budgets"], _nan(layer["concentration"]["mean"]), color="tab:blue", lw=2,
            label="attention-based top-B")
    tokens = recency["window_tokens"]
    ax.plot(tokens, _nan(recency["selected_mass"]["mean"]), "o", color="tab:blue", ms=8,
            label="top tokens at the window's budget")
    ax.plot(tokens, _nan(recency["recent_mass"]["mean"]), "s", color="tab:red", ms=8, label="last R frames")
    for r, x, y in zip(stats["windows"], tokens, _nan(recency["recent_mass"]["mean"]), strict=True):
        ax.annotate(f"R={r}", (x, y), textcoords="offset points", xytext=(6, -12), color="tab:red")
    ax.set(xscale="log", xlabel="tokens kept", ylabel="share of historical mass", ylim=(0, 1.02),
           title=title or "Attention-based selection vs recency at equal budget")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_distance(stats: dict, path: str | Path, title: str = "") -> Path:
    """Heatmap layer x step distance: share of historical mass on the step that many steps back (averaged
    over the steps that have such a distance); the last column pools the distances beyond ``max_distance``."""
    plt = pyplot()
    rows = [_nan(v) for v in stats["layer"]["distance"]["per_layer"]]
    labels = stats["distance_labels"]
    # Drop trailing columns that no step reached (a short video never has the far distances).
    used = max((i + 1 for i in range(len(labels)) if any(not math.isnan(r[i]) for r in rows)), default=1)
    rows, labels = [r[:used] for r in rows], labels[:used]
    fig, ax = plt.subplots(figsize=(min(4 + 0.12 * used, 14), 1.5 + 0.22 * len(rows)))
    image = ax.imshow(rows, aspect="auto", cmap="magma", interpolation="nearest", origin="lower")
    fig.colorbar(image, ax=ax, label="share of historical mass")
    step = max(1, used // 16)
    ticks = list(range(0, used, step))
    ax.set_xticks(ticks, [labels[i] for i in ticks])
    ax.set(xlabel="distance in steps (1 = previous frame)", ylabel="layer",
           title=title or "Where historical attention lands")
    return _save(fig, path)


def plot_errors(errors: dict, path: str | Path, title: str = "") -> Path:
    """Relative error against full attention vs the carried budget in tokens: detailed-cache keys and values
    (mean over layers) and last hidden states, StateKV (B) and recency (R frames)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharex=True)
    styles = {"statekv": ("tab:blue", "o", "StateKV (top-B)"), "recency": ("tab:red", "s", "recency (last R)")}
    for kind, (color, marker, label) in styles.items():
        runs = sorted((r for r in errors.values() if r["kind"] == kind), key=lambda r: r["budget_tokens"])
        if not runs:
            continue
        x = [r["budget_tokens"] for r in runs]
        for ax, values in zip(axes, ([r["key_error"]["mean"] for r in runs], [r["value_error"]["mean"] for r in runs],
                                     [r["hidden_error"] for r in runs]), strict=True):
            ax.plot(x, values, color=color, marker=marker, label=label)
    for ax, name in zip(axes, ("detailed-cache keys", "detailed-cache values", "last hidden states"), strict=True):
        ax.set(xscale="log", xlabel="tokens carried at the end",
               ylabel="relative Frobenius error", title=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    return _save(fig, path)


FIGURES = ("concentration", "oracle", "recency", "distance", "error")  # plot_all's, each ``{prefix}{name}.png``


def figure_names(report: dict, prefix: str = "analysis_") -> list[str]:
    """The files `plot_all` writes for ``report``, in its order."""
    return [f"{prefix}{name}.png" for name in FIGURES if name != "error" or report.get("errors")]


def plot_all(report: dict, out: str | Path, prefix: str = "analysis_") -> list[Path]:
    """Every figure of ``report`` (see :func:`statekv.analysis.report.build_report`) into folder ``out``
    (`figure_names`)."""
    out = Path(out)
    stats, label = report["statistics"], report.get("label", "")
    paths = [plot_concentration(stats, out / f"{prefix}concentration.png", _titled("Concentration", label)),
             plot_oracle(stats, out / f"{prefix}oracle.png", _titled("Oracle state", label)),
             plot_recency(stats, out / f"{prefix}recency.png", _titled("Top-B vs recency", label)),
             plot_distance(stats, out / f"{prefix}distance.png", _titled("Historical mass by distance", label))]
    if report.get("errors"):
        paths.append(plot_errors(report["errors"], out / f"{prefix}error.png",
                                 _titled("Approximation error vs full attention", label)))
    return paths


def _titled(name: str, label: str) -> str:
    return f"{name}: {label}" if label else name
