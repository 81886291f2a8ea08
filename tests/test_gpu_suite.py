"""The GPU suite's smoke mode: the same code as on a CUDA machine, on CPU with tiny shapes, so it cannot rot."""

from __future__ import annotations

import importlib.util
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
    assert list(sections) == ["cuda tests", "8B step", "8B positions", "512-frame prefill", "8B TTFT", "1B TTFT",
                              "1B pipeline", "batched streams", "batched steps", "cache tiers", "live streams"]
    assert all(section["status"] == "ok" for section in sections.values()), sections
    assert sections["cuda tests"]["figures"]["collected"] >= 10  # what runs on a GPU is still selected
    steps = {row["variant"]: row for row in sections["8B step"]["rows"]}
    assert "in place of the Triton kernels" in steps["StateKV B=48 triton"]["note"]  # what differs says why
    compiled = steps["StateKV B=48 triton + graph + compiled"]
    assert compiled["ms_per_frame"] > 0 and compiled["carried_tokens"] == 48 and "error" not in compiled
    assert sections["8B step"]["figures"]["statekv_graph_variant"] in steps
    assert steps["StateKV B=48 eager"]["ms_per_frame"] > 0 and steps["StateKV B=48 eager"]["host_syncs"] == 0
    placed = [row for row in sections["8B positions"]["rows"] if row["positions"] == "bounded"]
    assert len(placed) == 2 and all(row["placed"] and row["over_stream"] > 0 for row in placed), placed
    assert sections["8B positions"]["figures"]["bounded_variant"] in {row["variant"] for row in placed}
    assert sections["512-frame prefill"]["figures"]["prefill_ratio"] > 0
    assert sections["1B pipeline"]["figures"]["pipeline_fps"] > 0
    assert [row["streams"] for row in sections["batched streams"]["rows"]] == [1, 4, 16]
    assert all(row["language_ms_per_round"] > 0 for row in sections["batched streams"]["rows"])
    batched = sections["batched steps"]["rows"]
    assert [row["streams"] for row in batched] == [1, 4, 16] and batched[0]["batched_rows"] == 0
    assert all(row["batched_rows"] > 0 and row["aten_ops"] > 0 for row in batched[1:])  # they did share steps
    assert [row["tier"] for row in sections["cache tiers"]["rows"]] == ["model dtype", "int4", "disk", "disk int4"]
    for model in ("8B", "1B"):  # TTFT at every length of the smoke's (16, 64, 256, 4,096 frames on a GPU)
        ttft = sections[f"{model} TTFT"]
        assert [row["frames"] for row in ttft["rows"]] == [2, 4, 8, 32]
        assert all(row["ttft_ms"] > 0 for row in ttft["rows"])
        assert [row["tokens_seen"] for row in ttft["rows"]] == [8, 16, 32, 128] and ttft["rows"][-1]["steps"] == 14
    live = sections["live streams"]  # statekv bench serve --find-max against the model served in-process
    assert live["figures"]["live_streams_8b"] >= 1 and live["rows"][0]["streams"] == 1
    assert max(row["streams"] for row in live["rows"]) <= 2  # the smoke's --max-streams caps a search of --url
    assert all(row["mean_batch"] is not None for row in live["rows"])
    report = (tmp_path / "gpu_suite.md").read_text()
    assert "Smoke run on CPU" in report and "| 1B whole pipeline, frames/s |" in report
    assert "(met)" not in report and "(short)" not in report and "None GiB" not in report


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_report_sets_only_gpu_figures_against_the_goals_and_shows_memory_only_when_known():
    suite = _suite()
    figures = {key: goal for key, (goal, _, _) in suite.GOALS.items()}  # each exactly at its goal: met
    record = {"smoke": True, "elapsed_s": 1, "budget_s": 300, "sections": [
        {"name": "all", "status": "ok", "reason": None, "seconds": 1, "rows": [], "figures": figures}],
        "environment": {"device": "cpu (smoke)", "device_memory_gib": None}}
    smoke = suite.markdown(record)
    goals = [line for line in smoke.splitlines() if line.startswith("| ") and "figure |" not in line][:len(figures)]
    assert len(goals) == len(figures) and all("(smoke figure, not comparable)" in line for line in goals), goals
    assert "(met)" not in smoke and "(short)" not in smoke
    assert "Device: cpu (smoke)  " in smoke and "GiB" not in smoke
    gpu = suite.markdown({**record, "smoke": False,
                          "environment": {"device": "NVIDIA H100", "device_memory_gib": 79.1}})
    assert gpu.count("(met)") == len(figures) and "not comparable" not in gpu
    assert "Device: NVIDIA H100 (79.1 GiB)" in gpu


def test_a_missing_device_is_one_line_and_nothing_runs(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert [line for line in result.stdout.splitlines() if line.startswith("missing: ")] == [
        "missing: a CUDA device (torch.cuda.is_available() is False; --smoke runs on CPU)"]
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["sections"] == []


def test_kernels_are_told_apart_by_name():
    """Names as an H100 profile reported them: each kind of a step's GPU time is summed under its own column."""
    suite = _suite()
    named = {
        "flash_forward_kernel": "scoring_ms", "key_mass_kernel": "scoring_ms",
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64": "attention_ms",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention_ms",
        "nvjet_sm90_tst_256x88_64x4_2x1_v_bz_splitK_TNT": "matmul_ms",
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8": "matmul_ms",
        "void at::native::radixSortKVInPlace<2, -1, 128, 32, long, long, unsigned int>": "selection_ms",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "selection_ms",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused_ms",
        "triton_poi_fused_index_select_add_3": "fused_ms",
        "void at::native::tensor_kernel_scan_innermost_dim<long, std::plus<long> >": "selection_ms",
        "void at::native::searchsorted_cuda_kernel<long, long>": "selection_ms",
        "Memcpy DtoD (Device -> Device)": "copy_ms",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast": "other_ms",
    }
    assert {name: suite.kernel_kind(name) for name in named} == named


def test_the_cuda_tests_tile_cache_is_removed_after_the_run(tmp_path, monkeypatch):
    _suite()
    import gpu_setup
    from gpu_shapes import Section

    caches = []

    def child(command, **options):
        caches.append(Path(options["env"]["STATEKV_CACHE"]))
        (caches[-1] / "tiles.json").write_text("{}")
        return subprocess.CompletedProcess(command, 0, stdout="3 passed in 0.1s\n", stderr="")

    monkeypatch.setattr(gpu_setup.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(gpu_setup.subprocess, "run", child)
    section = Section("cuda tests")
    gpu_setup.cuda_tests(section, deadline=1e18, smoke=False)  # a child runs them on a GPU only
    assert caches and caches[0].parent == tmp_path and section.status != "failed", section
    assert list(tmp_path.iterdir()) == []


def test_a_smoke_collection_pytest_cannot_run_fails_its_section_saying_so(monkeypatch):
    """Before: the smoke run's in-process collection ignored pytest's exit status, so a file it could not read was
    reported as "no test is marked cuda"."""
    from conftest import benchmark

    setup = benchmark("gpu_setup")
    monkeypatch.setattr(setup, "CUDA_TEST_FILES", ["tests/no_such_file.py"])
    section = setup.Section("cuda tests")
    setup.cuda_tests(section, deadline=float("inf"), smoke=True)
    assert section.status == "failed" and "usage_error" in section.reason, section.reason
