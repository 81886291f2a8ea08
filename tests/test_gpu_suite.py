"""The GPU suite's smoke mode: the same code as on a CUDA machine, on CPU with tiny shapes, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_run_measures_every_section_and_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = {section["name"]: section for section in record["sections"]}
    assert list(sections) == ["cuda tests", "8B step", "512-frame prefill", "1B pipeline", "batched streams",
                              "cache tiers"]
    assert all(section["status"] == "ok" for section in sections.values()), sections
    assert sections["cuda tests"]["figures"]["collected"] >= 10  # what runs on a GPU is still selected
    steps = {row["variant"]: row for row in sections["8B step"]["rows"]}
    assert "in place of the Triton kernels" in steps["StateKV B=48 triton"]["note"]  # what differs says why
    compiled = steps["StateKV B=48 triton + graph + compiled"]
    assert compiled["ms_per_frame"] > 0 and compiled["carried_tokens"] == 48 and "error" not in compiled
    assert sections["8B step"]["figures"]["statekv_graph_variant"] in steps
    assert steps["StateKV B=48 eager"]["ms_per_frame"] > 0 and steps["StateKV B=48 eager"]["host_syncs"] == 0
    assert sections["512-frame prefill"]["figures"]["prefill_ratio"] > 0
    assert sections["1B pipeline"]["figures"]["pipeline_fps"] > 0
    assert [row["streams"] for row in sections["batched streams"]["rows"]] == [1, 4, 16]
    assert [row["tier"] for row in sections["cache tiers"]["rows"]] == ["model dtype", "int4", "disk", "disk int4"]
    report = (tmp_path / "gpu_suite.md").read_text()
    assert "Smoke run on CPU" in report and "| 1B whole pipeline, frames/s |" in report


def test_a_missing_device_is_one_line_and_nothing_runs(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert [line for line in result.stdout.splitlines() if line.startswith("missing: ")] == [
        "missing: a CUDA device (torch.cuda.is_available() is False; --smoke runs on CPU)"]
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["sections"] == []
