"""The GPU suite's report: its figures against the goals, then each section's rows."""

from __future__ import annotations

from typing import Any

GOALS = {  # figure -> (goal (issue 48), better when "lower"/"higher", what was measured before the static step)
    "statekv_graph_ms": (14.0, "lower", "59 ms (H100, eager Triton step)"),
    "statekv_graph_launches": (1, "lower", "~1,306 launches (H100)"),
    "bounded_ratio": (1.05, "lower", "1.04x (CPU, 4 layers)"),
    "prefill_ratio": (0.6, "lower", "2.95x one-shot (H100)"),
    "pipeline_fps": (120.0, "higher", "12.7 frames/s (H100)"),
}

# a goal's figure -> the best variant's name, which it is
VARIANT_OF = {"statekv_graph_ms": "statekv_graph_variant", "bounded_ratio": "bounded_variant",
              "prefill_ratio": "prefill_variant", "pipeline_fps": "pipeline_variant"}


def markdown(record: dict, embedded: bool = False) -> str:
    """The report; ``embedded``: as the body of a docs section (no title, sub-headings one level down)."""
    environment = record["environment"]
    sub = "###" if embedded else "##"
    lines = [] if embedded else ["# statekv GPU suite", ""]
    lines += [("Smoke run on CPU: tiny shapes, no figure is a GPU figure." if record["smoke"] else
               "Command: `python benchmarks/gpu_suite.py` on the device below, from a bare machine."), "",
             f"Device: {environment.get('device')}" + ("" if environment.get("device_memory_gib") is None else
                                                        f" ({environment['device_memory_gib']} GiB)") + "  ",
             "Versions: " + ", ".join(f"{name} {environment.get(name)}" for name in
                                      ("python", "torch", "cuda", "triton", "transformers", "av", "statekv"))
             + f", commit {environment.get('commit')}  ",
             f"Elapsed: {record['elapsed_s']} s of a {record['budget_s']:.0f} s budget.", ""]
    if environment.get("missing"):
        lines += [f"Missing: {'; '.join(environment['missing'])}", ""]
    lines += [f"{sub} Against the goals", "", "| figure | measured | goal | before |", "|---|---:|---:|---|"]
    figures = {key: value for section in record["sections"] for key, value in section["figures"].items()}
    names = {"statekv_graph_ms": "8B StateKV B=4096 step, ms per frame",
             "statekv_graph_launches": "8B StateKV step, kernel + graph launches per step",
             "bounded_ratio": "8B StateKV graphed step, GPU time, bounded positions past the range / stream",
             "prefill_ratio": "512-frame prefill, StateKV / one-shot SDPA time",
             "pipeline_fps": "1B whole pipeline, frames/s"}
    for key, (goal, better, before) in GOALS.items():
        value = figures.get(key)
        shown = "not measured" if value is None else f"{value:.3g}"
        if value is not None:
            met = value <= goal if better == "lower" else value >= goal
            # a smoke figure is tiny shapes on a CPU: set against a GPU goal, met or short would mean nothing
            shown += " (smoke figure, not comparable)" if record["smoke"] else " (met)" if met else " (short)"
            if key == "prefill_ratio" and figures.get("prefill_ratio_estimated"):
                shown += ", StateKV's time partly estimated"
            if figures.get(VARIANT_OF.get(key)):
                shown += f": {figures[VARIANT_OF[key]]}"
        lines.append(f"| {names[key]} | {shown} | {'<=' if better == 'lower' else '>='} {goal:g} | {before} |")
    lines.append("")
    for section in record["sections"]:
        lines += [f"{sub} {section['name']}", "", f"Status: {section['status']}"
                  + (f" ({section['reason']})" if section["reason"] else "") + f"; {section['seconds']:.0f} s.", ""]
        if section["rows"]:
            # list-valued columns (kernels named, per-frame times) are in the JSON only
            columns = list(dict.fromkeys(key for row in section["rows"] for key, value in row.items()
                                         if not isinstance(value, list)))
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for row in section["rows"]:
                lines.append("| " + " | ".join(shown_value(row.get(column)) for column in columns) + " |")
            lines.append("")
        other = {key: value for key, value in section["figures"].items() if key not in GOALS}
        if other:
            lines += ["Figures: " + ", ".join(f"{key} {shown_value(value)}" for key, value in other.items()), ""]
    return "\n".join(lines)


def shown_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/")
