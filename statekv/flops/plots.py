"""The paper's compute figures: FLOPs vs frame index (marginal / cumulative, linear / log) with break-even
points, and the compute-accuracy frontier. Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from statekv.plotting import pyplot, save_figure

from .analytic import PrefillFlops
from .report import TERA, BreakEven

LINESTYLES = {"full": ":", "recency": "--", "statekv": "-"}
MARKERS = {"full": "o", "recency": "s", "statekv": "^"}
BENCHMARK_NAMES = {"videomme": "VideoMME", "mlvu": "MLVU (M-avg)", "ovobench": "OVOBench real-time"}


def _colors(names: list[str]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:gray", "tab:olive", "tab:cyan"]
    unique = list(dict.fromkeys(names))
    return {name: palette[i % len(palette)] for i, name in enumerate(unique)}


def plot_flops_vs_frames(curves: list[PrefillFlops], pairs: list[BreakEven], path: str | Path) -> Path:
    """2 x 2 figure: rows linear / log y axis, columns marginal / cumulative, break-even points marked.

    Full attention is dotted, StateKV solid (thicker for larger budgets), recency dashed. Only break-even
    points between different models are marked (same-model ones are in the tables).
    """
    plt = pyplot()
    colors = _colors([c.model.name for c in curves])
    budgets = sorted({c.method.budget for c in curves if c.method.budget is not None})
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), sharex=True)
    for row, scale in enumerate(("linear", "log")):
        for col, kind in enumerate(("marginal", "cumulative")):
            ax = axes[row, col]
            for c in curves:
                width = 1.2 + (budgets.index(c.method.budget) if c.method.budget is not None else 0) * 0.8
                ax.plot(c.frames, getattr(c, kind) / TERA, LINESTYLES.get(c.method.kind, "-."),
                        color=colors[c.model.name], linewidth=width, label=c.label)
            for p in pairs:
                frame = getattr(p, kind)
                if frame is None or p.cheaper.model.name == p.baseline.model.name:
                    continue
                y = getattr(p.baseline, kind)[frame - 1] / TERA
                ax.plot([frame], [y], "o", markersize=6, markerfacecolor="white", markeredgecolor="black", zorder=5)
                ax.annotate(str(frame), (frame, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
            ax.set_yscale(scale)
            ax.set_title(f"{kind} FLOPs per {'frame' if kind == 'marginal' else 'video'} ({scale} scale)")
            ax.set_ylabel("TFLOPs")
            ax.grid(True, which="both", alpha=0.3)
            if row == 1:
                ax.set_xlabel("frame index")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.suptitle("Video-prefill compute vs frame index (dotted: Full SA, dashed: recency, dash-dot: ReKV, solid: "
                 "StateKV; circles: break-even)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05 + 0.015 * ((len(labels) - 1) // 4), 1, 0.97))
    return _save(fig, plt, path)


def plot_frontier(points: list[dict], path: str | Path, benchmark: str = "videomme", n_frames: int = 512) -> Path:
    """Accuracy vs total prefill FLOPs at ``n_frames`` (log x): colour = model, marker = method."""
    plt = pyplot()
    colors = _colors([p["model"] for p in points])
    fig, ax = plt.subplots(figsize=(8.5, 6))
    for p in points:
        ax.scatter(p["flops"] / TERA, p["accuracy"], marker=MARKERS[p["method"]], color=colors[p["model"]], s=55,
                   edgecolors="black", linewidths=0.5, zorder=3)
    for model, color in colors.items():
        ax.scatter([], [], color=color, label=model)
    for kind, marker in MARKERS.items():
        name = {"full": "Full SA", "recency": "ReKV R=16", "statekv": "StateKV B=4096"}[kind]
        ax.scatter([], [], marker=marker, color="white", edgecolors="black", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"total video-prefill TFLOPs at {n_frames} frames")
    ax.set_ylabel(f"{BENCHMARK_NAMES.get(benchmark, benchmark)} accuracy (%, paper Table 1)")
    ax.set_title(f"Compute-accuracy frontier at {n_frames} frames")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    try:
        return save_figure(fig, path, dpi=130)
    finally:
        plt.close(fig)
