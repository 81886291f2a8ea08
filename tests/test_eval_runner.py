"""The evaluation runner end to end on fabricated mini benchmarks with a tiny InternVL checkpoint.

The mini benchmarks (`statekv.eval.fabricate`) use the published layouts; their videos show one still picture
per second, coded losslessly. Answers of a tiny random model are gibberish, so these tests check the
machinery (records, resuming, sharding, streaming, merging), not accuracies; the parsers and the scoring
rules are checked on hand-made answers in test_eval_protocol.py.
"""

from __future__ import annotations

import json
import shutil
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import statekv.eval as ev
from statekv.eval.fabricate import write_mini_mlvu, write_mini_ovobench, write_mini_videomme
from statekv.eval.runner import EvalConfig, display_name, frames_read, run_evaluation
from statekv.errors import ConfigurationError
from statekv.api.videoqa import VideoQA
from statekv.testing import make_tiny_checkpoint

METHODS = {"statekv": {"budget": 32}, "recency": {"frames": 2}, "full": {}, "rekv": {"frames": 2, "retrieve": 2}}
FAST = {"max_new_tokens": 3, "progress": False}  # tiny answers keep the tests fast; the protocol is tested apart


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("benchmarks")
    write_mini_videomme(root)  # two videos, three questions each
    write_mini_mlvu(root, tasks=("count", "needle", "order"))  # three videos, four questions
    write_mini_ovobench(root)  # two source videos, seven questions (six on the first, one of them polled twice)
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Tiny InternVL with dynamic RoPE (max_position 128), as InternVL3's LM has."""
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def models(checkpoint):
    cache = {}

    def get(method: str) -> VideoQA:
        if method not in cache:
            cache[method] = VideoQA.from_pretrained(checkpoint, method=method, **METHODS[method])
        return cache[method]

    return get


def config(benchmark, checkpoint, data_root, out, method="statekv", **overrides) -> EvalConfig:
    return EvalConfig.for_model(benchmark, str(checkpoint), data_root, out, method=method,
                                **{**METHODS[method], **FAST, **overrides})


def rank_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(run_dir.glob("answers.rank*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize("benchmark", ["videomme", "mlvu", "ovobench"])
def test_every_method_completes_and_writes_records_results_and_table(benchmark, checkpoint, data_root, models,
                                                                    tmp_path):
    limit = 3 if benchmark == "videomme" else None  # one VideoMME video; the other tests cover both
    questions = ev.load_benchmark(benchmark, data_root)[:limit]
    expected = [q.qid for q in questions]
    for method in METHODS:
        out = tmp_path / method
        summary = run_evaluation(config(benchmark, checkpoint, data_root, out, method, limit=limit),
                                 qa=models(method))
        records = ev.read_records(out / "answers.jsonl")
        assert sorted(r.qid for r in records) == sorted(expected)  # each question once
        assert len(rank_lines(out)) == len(expected)
        budget = {"statekv": 32, "recency": 2, "full": None, "rekv": 2}[method]
        for record in records:
            assert (record.benchmark, record.method, record.budget, record.model) == (
                benchmark, method, budget, checkpoint.name)
            assert set(record.timings) == {"encode", "answer"} and all(t > 0 for t in record.timings.values())
            assert record.extra["frames"] > 0 and record.extra["tokens"] > 0
            question = next(q for q in ev.load_benchmark(benchmark, data_root) if q.qid == record.qid)
            assert (record.parsed, record.correct) == ev.judge(benchmark, record.prediction, answer=question.answer,
                                                              letters=question.letters, kind=question.kind)
        assert summary == json.loads((out / "results.json").read_text())
        items = {q.item_id for q in questions}  # OVO-Bench's forward question is polled twice: one question
        assert summary["score"]["overall"]["questions"] == len(items) and summary["score"]["missing"] == 0
        assert set(summary["scores"]) == set(ev.PARSERS) and summary["errors"] == []
        assert summary["run"]["method"] == method and summary["run"]["max_new_tokens"] == 3
        label = ev.method_label(method, budget)
        assert f"| {checkpoint.name} | {label} |" in (out / "table.md").read_text()


def test_encode_once_answers_equal_per_question_encoding(checkpoint, data_root, models, tmp_path, monkeypatch):
    qa = models("statekv")
    encodes = []
    real_encode = qa.encode
    monkeypatch.setattr(qa, "encode", lambda *a, **k: encodes.append(a[0]) or real_encode(*a, **k))
    once = config("videomme", checkpoint, data_root, tmp_path / "once")
    run_evaluation(once, qa=qa)
    assert len(encodes) == 2  # two videos, three questions each
    run_evaluation(config("videomme", checkpoint, data_root, tmp_path / "each", encode_once=False), qa=qa)
    assert len(encodes) == 2 + 6
    shared = {r.qid: (r.prediction, r.extra["tokens"]) for r in ev.run_records(tmp_path / "once")}
    separate = {r.qid: (r.prediction, r.extra["tokens"]) for r in ev.run_records(tmp_path / "each")}
    assert shared == separate and len(shared) == 6
    assert {r.extra["mode"] for r in ev.run_records(tmp_path / "each")} == {"encoded-per-question"}


def test_ovobench_stream_asks_at_ceil_realtime_and_agrees_with_the_released_clips(data_root, tmp_path_factory,
                                                                                  monkeypatch):
    # Dynamic RoPE is frozen at the planned length, which differs between one stream and each clip; a model
    # whose horizon stays within max_position has one RoPE for both, so the answers asked must agree exactly
    # (a forward poll is an evaluation of a watch under streaming, of the whole clip offline).
    checkpoint = make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("steady"),
                                      text_config={"max_position_embeddings": 8192})
    qa = VideoQA.from_pretrained(checkpoint, method="statekv", budget=32)
    streams = []
    real_stream = qa.stream
    monkeypatch.setattr(qa, "stream", lambda *a, **k: streams.append(k) or real_stream(*a, **k))
    out = tmp_path_factory.mktemp("runs")
    settings = dict(method="statekv", max_new_tokens=5)
    run_evaluation(config("ovobench", checkpoint, data_root, out / "stream", **settings), qa=qa)
    run_evaluation(config("ovobench", checkpoint, data_root, out / "clips", ovobench_videos="clips", **settings),
                   qa=qa)
    assert len(streams) == 2  # one stream per source video
    streamed = {r.qid: r for r in ev.run_records(out / "stream")}
    clipped = {r.qid: r for r in ev.run_records(out / "clips")}
    questions = {q.qid: q for q in ev.load_benchmark("ovobench", data_root)}
    durations = {"Fabricated/source0.mp4": 6, "Fabricated/source1.mp4": 3}
    for qid, record in streamed.items():
        question = questions[qid]
        assert record.extra["mode"] == "stream" and clipped[qid].extra["mode"] == "clip"
        assert record.extra["frames"] == min(math.ceil(question.realtime), durations[question.video_id])
        assert (record.extra["frames"], record.extra["tokens"]) == (clipped[qid].extra["frames"],
                                                                    clipped[qid].extra["tokens"])
        if question.group == "forward":  # a poll of a watch on the stream, which reads its carried state
            assert record.extra["watch"] and "watch" not in clipped[qid].extra
        else:
            assert record.prediction == clipped[qid].prediction
    assert sorted(streamed) == sorted(questions)


def test_rerun_answers_only_what_is_missing_and_refuses_other_settings(checkpoint, data_root, models, tmp_path):
    out = tmp_path / "run"
    first = run_evaluation(config("videomme", checkpoint, data_root, out, limit=2), qa=models("statekv"))
    assert first["score"]["overall"]["questions"] == 2 and first["score"]["missing"] == 0
    before = (out / "answers.rank000.jsonl").read_text()
    summary = run_evaluation(config("videomme", checkpoint, data_root, out), qa=models("statekv"))
    after = (out / "answers.rank000.jsonl").read_text()
    assert after.startswith(before) and len(after.splitlines()) == 6  # 2 kept, 4 added, none repeated
    assert summary["score"]["overall"]["questions"] == 6
    fresh = tmp_path / "fresh"  # answers do not depend on when the run was interrupted
    run_evaluation(config("videomme", checkpoint, data_root, fresh), qa=models("statekv"))
    answers = {r.qid: (r.prediction, r.extra["horizon"]) for r in ev.run_records(out)}
    assert answers == {r.qid: (r.prediction, r.extra["horizon"]) for r in ev.run_records(fresh)}
    assert run_evaluation(config("videomme", checkpoint, data_root, out), qa=models("statekv")) == summary
    assert (out / "answers.rank000.jsonl").read_text() == after  # nothing left: nothing answered again
    with pytest.raises(ConfigurationError, match="method='statekv', not 'full'"):
        run_evaluation(config("videomme", checkpoint, data_root, out, method="full"), qa=models("full"))
    with pytest.raises(ConfigurationError, match="parser='lmms-eval-0.7', not 'paper'"):
        run_evaluation(config("videomme", checkpoint, data_root, out, parser="paper"), qa=models("statekv"))


def test_a_resumed_stream_answers_as_an_uninterrupted_one(checkpoint, data_root, models, tmp_path):
    # the first source video has real-time questions at 2, 4, 4 and 6 s, a backward one at 2 s and a forward one
    # polled at 3 and 6 s; stop after the first two
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    run_evaluation(config("ovobench", checkpoint, data_root, resumed, limit=2), qa=models("statekv"))
    run_evaluation(config("ovobench", checkpoint, data_root, resumed), qa=models("statekv"))
    run_evaluation(config("ovobench", checkpoint, data_root, fresh), qa=models("statekv"))
    assert len(rank_lines(resumed)) == 8
    answers = {r.qid: (r.prediction, r.extra["horizon"]) for r in ev.run_records(resumed)}
    assert answers == {r.qid: (r.prediction, r.extra["horizon"]) for r in ev.run_records(fresh)}


def test_a_half_written_answer_is_cut_once_and_said_once_on_resuming(checkpoint, data_root, models, tmp_path,
                                                                    caplog):
    """Before: the resumed run said so three times (reading what was done, checking the run, then cutting)."""
    out = tmp_path / "run"
    run_evaluation(config("videomme", checkpoint, data_root, out, limit=1), qa=models("statekv"))
    rank_file = ev.rank_file(out, 0)
    with rank_file.open("a") as file:
        file.write('{"qid": "half')
    with pytest.raises(ConfigurationError, match="holds a run with"):  # another run's folder: left as it is
        run_evaluation(config("videomme", checkpoint, data_root, out, method="full"), qa=models("full"))
    assert rank_file.read_bytes().endswith(b'\n{"qid": "half')
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        run_evaluation(config("videomme", checkpoint, data_root, out, limit=2), qa=models("statekv"))
    said = [record.getMessage() for record in caplog.records if "unterminated" in record.getMessage()]
    assert said == [f"{rank_file}: dropping an unterminated last line (13 bytes), an answer cut short by a stop; its "
                    "question is asked again"]
    assert len(rank_lines(out)) == 2


def test_a_streaming_run_killed_between_two_polls_of_a_watch_resumes_as_if_never_stopped(checkpoint, data_root,
                                                                                          models, tmp_path):
    """--mode streaming: the first video's forward question is one watch evaluated at each of its polls (3 and
    6 s). A run killed after the first poll's answer opened the watch again at the second on resuming (its first
    evaluation then, another answer); the polls answered before are replayed in the stream, unanswered."""
    fresh = tmp_path / "fresh"
    run_evaluation(config("ovobench", checkpoint, data_root, fresh, mode="streaming"), qa=models("statekv"))
    lines = (fresh / "answers.rank000.jsonl").read_text().splitlines(keepends=True)
    records = {r.qid: (r.prediction, r.extra.get("evaluations")) for r in ev.run_records(fresh)}
    polls = [json.loads(line)["qid"] for line in lines if json.loads(line)["extra"].get("watch")]
    assert len(polls) == 2 and records[polls[1]][1] == 2
    killed = tmp_path / "killed"  # as a kill leaves it: the answers of the first poll and before, durable
    killed.mkdir()
    shutil.copy(fresh / "run.json", killed / "run.json")
    first = next(number for number, line in enumerate(lines) if json.loads(line)["qid"] == polls[0])
    (killed / "answers.rank000.jsonl").write_text("".join(lines[:first + 1]))
    run_evaluation(config("ovobench", checkpoint, data_root, killed, mode="streaming"), qa=models("statekv"))
    assert (killed / "answers.rank000.jsonl").read_text().startswith("".join(lines[:first + 1]))
    assert len(rank_lines(killed)) == len(lines)  # nothing answered twice
    assert {r.qid: (r.prediction, r.extra.get("evaluations")) for r in ev.run_records(killed)} == records


def test_unreadable_video_is_reported_and_retried_on_rerun(checkpoint, tmp_path, models):
    root = tmp_path / "data"
    folder = write_mini_videomme(root)
    video = folder / "data" / "fab001.mp4"
    good = video.read_bytes()
    video.write_bytes(b"not a video")
    out = tmp_path / "run"
    summary = run_evaluation(config("videomme", checkpoint, root, out), qa=models("statekv"))
    assert summary["score"]["overall"]["questions"] == 3 and summary["score"]["missing"] == 3
    assert [e["video_id"] for e in summary["errors"]] == ["fab001"] and "fab001" in summary["errors"][0]["error"]
    assert "(partial 3/6)" in (out / "table.md").read_text()
    # rerun with a --limit that leaves the unreadable video out: every question asked is answered (before: its
    # logged error still counted, and the run ended as if questions were unanswered)
    summary = run_evaluation(config("videomme", checkpoint, root, out, limit=3), qa=models("statekv"))
    assert summary["score"]["missing"] == 0 and summary["errors"] == []
    video.write_bytes(good)
    summary = run_evaluation(config("videomme", checkpoint, root, out), qa=models("statekv"))
    assert summary["score"]["missing"] == 0 and summary["errors"] == []


def test_the_same_groups_in_another_order_resume_the_same_run(checkpoint, data_root, models, tmp_path):
    """Before: ``--groups backward,realtime`` was refused as another run than ``--groups realtime,backward``."""
    out = tmp_path / "run"
    first = run_evaluation(config("ovobench", checkpoint, data_root, out, groups=("realtime", "backward")),
                           qa=models("statekv"))
    again = run_evaluation(config("ovobench", checkpoint, data_root, out, groups=("backward", "realtime", "backward")),
                           qa=models("statekv"))
    assert again["score"] == first["score"]


def test_display_names():
    assert display_name("OpenGVLab/InternVL3-1B-hf") == "InternVL3-1B"
    assert display_name("Qwen/Qwen3-VL-2B-Instruct/") == "Qwen3-VL-2B"
    assert display_name("/ckpts/Eagle2.5-8B") == "Eagle2.5-8B"


def test_a_run_says_what_it_reads_of_each_video(checkpoint, data_root, models, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="statekv")
    run_evaluation(config("videomme", checkpoint, data_root, tmp_path / "run", limit=1), qa=models("statekv"))
    assert "frames read at up to 1 a second, at most 512 a video" in caplog.text
    assert "rank 0/1" not in caplog.text  # one process: no rank to name
    synthetic = config("synthetic", checkpoint, data_root, tmp_path / "synthetic", max_fps=2.0)
    untimed, timed = SimpleNamespace(realtime=None), SimpleNamespace(realtime=30.0)
    assert frames_read(synthetic, [untimed]) == "frames read at up to 2 a second, every one of each video"
    assert frames_read(synthetic, [untimed, timed]) == "frames read at up to 2 a second, each question's up to its time"
    streaming = config("synthetic", checkpoint, data_root, tmp_path / "streaming", mode="streaming")
    assert frames_read(streaming, [untimed]).endswith("each question's up to its time")
    ovobench = config("ovobench", checkpoint, data_root, tmp_path / "ovobench", mode="offline")
    assert frames_read(ovobench, [timed]).endswith("at most 512 a clip")  # the released clips
    ovobench = config("ovobench", checkpoint, data_root, tmp_path / "ovobench-streamed")  # its default: streamed
    assert frames_read(ovobench, [timed]).endswith("each question's up to its time")


def test_bad_configurations_are_one_line_errors(checkpoint, data_root, tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'mvbench'"):
        EvalConfig.for_model("mvbench", "m", data_root, tmp_path)
    with pytest.raises(ValueError, match="unknown method 'snapkv'"):
        EvalConfig.for_model("mlvu", "m", data_root, tmp_path, method="snapkv")
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        EvalConfig.for_model("mlvu", "m", data_root, tmp_path, limit=0)
    with pytest.raises(ValueError, match="ovobench_videos must be one of stream, clips"):
        EvalConfig.for_model("ovobench", "m", data_root, tmp_path, ovobench_videos="frames")
    with pytest.raises(FileNotFoundError, match="chunked_videos"):
        root = tmp_path / "noclips"
        write_mini_ovobench(root, clips=False)
        run_evaluation(config("ovobench", checkpoint, root, tmp_path / "o", ovobench_videos="clips"))


# ----------------------------------------------------------------------------- processes


def eval_command(benchmark: str, checkpoint: Path, data_root: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "statekv.eval.command", benchmark, "--model", str(checkpoint), "--data-root", str(data_root),
            "--out", str(out), "--budget", "32", "--no-progress", *extra]


def subprocess_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


def test_sigkill_mid_run_then_rerun_loses_nothing_and_repeats_nothing(checkpoint, data_root, tmp_path):
    expected = sorted(q.qid for q in ev.load_benchmark("videomme", data_root))
    out = tmp_path / "run"
    # long answers keep the run going for seconds after its first record
    command = [sys.executable, *eval_command("videomme", checkpoint, data_root, out, "--max-new-tokens", "48")]
    process = subprocess.Popen(command, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rank_file = out / "answers.rank000.jsonl"
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        if rank_file.is_file() and rank_file.read_bytes().count(b"\n") >= 1:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    output = process.communicate()[0].decode()
    assert process.returncode == -signal.SIGKILL, output
    written = rank_file.read_bytes().count(b"\n")
    assert 1 <= written < len(expected)
    assert not (out / "results.json").exists()

    rerun = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    lines = rank_lines(out)
    assert sorted(line["qid"] for line in lines) == expected  # complete, and no question twice
    assert json.loads((out / "results.json").read_text())["score"]["missing"] == 0
    assert f"{len(expected)} questions answered" in rerun.stdout
    assert "INFO statekv.eval.runner: " in rerun.stderr and "rank" not in rerun.stderr  # one process: no rank named


def test_two_process_gloo_run_equals_one_process_run(checkpoint, data_root, models, tmp_path):
    single = tmp_path / "single"
    run_evaluation(config("videomme", checkpoint, data_root, single), qa=models("statekv"))
    double = tmp_path / "double"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "--log-dir", str(tmp_path / "torchrun"),  # else a folder left in the system's temporary one
              *eval_command("videomme", checkpoint, data_root, double, "--max-new-tokens", "3")]
    result = subprocess.run(launch, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = [ev.read_records(ev.rank_file(double, rank)) for rank in (0, 1)]
    assert all(per_rank), "each rank answers one of the two videos"
    assert {r.video_id for r in per_rank[0]}.isdisjoint(r.video_id for r in per_rank[1])
    one = {r.qid: (r.prediction, r.parsed, r.extra["tokens"]) for r in ev.run_records(single)}
    two = {r.qid: (r.prediction, r.parsed, r.extra["tokens"]) for r in ev.read_records(double / "answers.jsonl")}
    assert one == two and len(one) == 6
    merged = json.loads((double / "results.json").read_text())
    assert merged["score"] == json.loads((single / "results.json").read_text())["score"]
    assert result.stdout.count("wrote") == 1  # only rank 0 merges and reports
    assert "[rank 1] INFO statekv.eval.runner: rank 1/2: " in result.stderr  # each rank's lines name it
