"""The benchmark scripts' reports say what was measured: their tables name the settings a run was given."""

from __future__ import annotations

import pytest

from conftest import benchmark


def test_the_long_video_table_names_the_frames_retrieved_and_the_budget_given():
    long_video = benchmark("long_video")
    rows = [long_video.Row("StateKV B=1024", False, 2.0, 1.0, 0.5, 0.1, 0.2),
            long_video.Row("StateKV B=1024 offloaded", True, 3.0, 0.5, 0.5, 0.1, None)]
    text = long_video.report(rows, ["header"], retrieve=16, budget=1024)
    assert "answer, 16 frames retrieved (s)" in text and "64 frames" not in text
    assert "StateKV with offload / without: 1.500x per frame." in text


def test_the_accuracy_section_describes_the_set_it_evaluated(tmp_path):
    accuracy = benchmark("accuracy")
    results = {accuracy.Setting("full"): {"overall": (3, 6), "needle": (1, 2)}}
    made = {"num_frames": 40, "videos": 2, "seed": 5}  # a set --data named, not the default one
    text = accuracy.markdown(results, ["needle"], "python benchmarks/accuracy.py", 4, made)
    assert "`statekv synthetic make --frames 40 --videos 2 --seed 5` (6 questions, 40 frames per video" in text


def test_batched_steps_refuses_too_few_steps_to_measure_before_running(capsys):
    batched_steps = benchmark("batched_steps")
    with pytest.raises(SystemExit):
        batched_steps.main(["--steps", "4", "--budget-frames", "4"])  # steady only from step 8: nothing to measure
    assert "--steps at least --budget-frames + 5 (9)" in capsys.readouterr().err


def test_quantized_accuracy_describes_its_set_and_refuses_another_seed_before_running(tmp_path):
    quantized = benchmark("quantized_accuracy")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "benchmark.json").write_text('{"seed": 5, "videos": 2, "num_frames": 40}')
    with pytest.raises(SystemExit, match="was made with seed 5, not --seed 9091"):
        quantized.main(["--data", str(tmp_path / "data"), "--seed", "9091", "--runs", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()
    made = quantized.set_made(tmp_path / "data", 5)
    assert "`statekv synthetic make --frames 40 --videos 2 --seed 5` (12 questions)" in quantized.held_out(made, 12)


def test_the_held_out_sets_in_a_folder_must_be_the_ones_the_flags_name(tmp_path):
    from statekv.synthetic.benchmark import make_benchmark

    bounded = benchmark("bounded_positions")
    make_benchmark(tmp_path, videos=1, seed=5, num_frames=12)
    bounded.make_set(tmp_path, 1, 5, 12)  # the same set: kept
    with pytest.raises(SystemExit, match="holds another set than `statekv synthetic make --frames 96 --videos 1 "):
        bounded.make_set(tmp_path, 1, 5, 96)  # a table would call these 12-frame videos 96-frame ones
