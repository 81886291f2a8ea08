"""The training curve of the built-in model, from a run's ``log.jsonl``. Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from ..plotting import pyplot, save_figure


def read_log(path: Path | str) -> list[dict]:
    """The lines of a training log (see `statekv.builtin.training`); damaged lines are left out (training drops
    them, naming each, when it resumes)."""
    from .training import log_entry

    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return [entry for line in text.splitlines() if line.strip() and (entry := log_entry(line)) is not None]


def plot_log(log: Path | str, path: Path | str) -> Path:
    """Two panels: the answer loss, and answer accuracy per question family, against the step; the video
    length of each curriculum stage (and the long-range phase) is written along the top."""
    lines = [line for line in read_log(log) if line.get("accuracy") is not None  # vision steps answer nothing
             and isinstance(line.get("loss"), (int, float)) and isinstance(line.get("frames"), (int, str))
             and isinstance(line.get("family_accuracy"), dict)]
    plt = pyplot()
    fig, (loss_ax, accuracy_ax) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [line["step"] for line in lines]
    loss_ax.plot(steps, [line["loss"] for line in lines], color="black", linewidth=1)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("cross-entropy of the answer letter")
    for family in sorted({family for line in lines for family in line["family_accuracy"]}):
        points = [(line["step"], line["family_accuracy"][family]) for line in lines
                  if family in line["family_accuracy"]]
        accuracy_ax.plot(*zip(*points, strict=True), linewidth=1, label=family)
    accuracy_ax.axhline(0.25, color="grey", linestyle=":", linewidth=1)
    accuracy_ax.set_ylabel("training accuracy (fresh videos every step)")
    accuracy_ax.set_ylim(0, 1)
    if accuracy_ax.get_legend_handles_labels()[1]:  # none before the first step that asks questions
        accuracy_ax.legend(fontsize=7, ncol=2, loc="lower right")
    for ax in (loss_ax, accuracy_ax):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        _mark_stages(ax, lines)
    fig.suptitle("Training the built-in model (full attention, CPU)", fontsize=11)
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def _mark_stages(ax, lines: list[dict]) -> None:
    """Vertical lines where the video length changes, labelled with the new length in frames."""
    previous = None
    for line in lines:
        if line["frames"] != previous:
            ax.axvline(line["step"] - 1, color="grey", linewidth=0.6, alpha=0.6)
            label = f"{line['frames']}f" if isinstance(line["frames"], int) else line["frames"]
            ax.annotate(label, (line["step"], 1), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=7, color="grey")
            previous = line["frames"]
