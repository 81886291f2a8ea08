"""``statekv eval synthetic``: the ordinary runner on a synthetic set; resuming; one-line errors for bad files."""

from __future__ import annotations

import json
import logging

import pytest

import statekv.eval as ev
from statekv.cli import main
from statekv.eval.runner import EvalConfig, run_evaluation
from statekv.eval.video_errors import unresolved_errors
from statekv.api.videoqa import EncodedVideo, VideoQA
from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark
from statekv.synthetic.tasks import FAMILIES


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic-eval") / "set"
    make_benchmark(root, videos=2, seed=31, num_frames=16)
    return root


def _eval(data, out, *extra: str) -> int:
    return main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out),
                 "--method", "statekv", "--budget", "16", "--no-progress", *extra])


def _qids(out) -> list[str]:
    return [json.loads(line)["qid"] for line in (out / "answers.rank000.jsonl").read_text().splitlines()]


def test_eval_synthetic_runs_resumes_and_scores_per_family(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "5") == 0
    assert len(_qids(out)) == 5
    assert _eval(data, out) == 0  # the rest, nothing twice
    expected = [q.qid for q in ev.load_benchmark("synthetic", data)]
    assert sorted(_qids(out)) == sorted(expected) and len(expected) == 2 * len(FAMILIES)
    summary = json.loads((out / "results.json").read_text())
    assert summary["benchmark"] == "synthetic" and summary["method_label"] == "StateKV B=16"
    assert set(summary["score"]["groups"]["task_type"]) == set(FAMILIES) and summary["score"]["missing"] == 0
    assert "| Synthetic |" in (out / "table.md").read_text()
    printed = capsys.readouterr().out
    assert "on synthetic:" in printed
    families = summary["score"]["groups"]["task_type"]  # and per family, as docs/accuracy.md's tables show them
    few = [families[name] for name in ("needle", "attribute", "order", "first_last")]
    correct = sum(family["correct"] for family in few)
    assert ", ".join(f"{name} {families[name]['accuracy']:.2f}" for name in FAMILIES) in printed
    assert f"needle, attribute, order and first_last together: {100 * correct / 8:.2f} ({correct} of 8)" in printed


def test_an_interrupted_evaluation_loses_and_repeats_nothing(data, tmp_path, monkeypatch):
    qa = VideoQA.from_pretrained("builtin", method="recency", frames=4)
    interrupted, fresh = tmp_path / "interrupted", tmp_path / "fresh"
    ask, calls = EncodedVideo.ask, []

    def ask_then_stop(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # as if the run were stopped while answering its fourth question
        return ask(self, *args, **kwargs)

    monkeypatch.setattr(EncodedVideo, "ask", ask_then_stop)
    config = EvalConfig.for_model("synthetic", "builtin", data, interrupted, method="recency", frames=4,
                        progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(config, qa=qa)
    assert len(_qids(interrupted)) == 3
    monkeypatch.setattr(EncodedVideo, "ask", ask)
    run_evaluation(config, qa=qa)
    run_evaluation(EvalConfig.for_model("synthetic", "builtin", data, fresh, method="recency", frames=4,
                              progress=False), qa=qa)
    assert len(_qids(interrupted)) == len(set(_qids(interrupted))) == 2 * len(FAMILIES)
    answers = {r.qid: r.prediction for r in ev.run_records(interrupted)}
    assert answers == {r.qid: r.prediction for r in ev.run_records(fresh)}


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_missing_or_malformed_question_files_are_one_line_errors_naming_the_file(data, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _eval(empty, tmp_path / "o1") == 2
    assert f"{empty} is a folder with no {QUESTIONS_FILE}" in _one_line(capsys.readouterr().err)

    broken = tmp_path / "broken"
    make_benchmark(broken, videos=1, seed=32, num_frames=16)
    questions = broken / QUESTIONS_FILE
    lines = questions.read_text().splitlines()
    questions.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert _eval(broken, tmp_path / "o2") == 2
    assert f"{questions}:2" in _one_line(capsys.readouterr().err)

    row = json.loads(lines[0])
    del row["answer"]
    questions.write_text(json.dumps(row) + "\n")
    assert _eval(broken, tmp_path / "o3") == 2
    assert str(questions) in (message := _one_line(capsys.readouterr().err)) and "answer" in message

    (broken / "videos" / "v0000.mp4").unlink()
    questions.write_text(lines[0] + "\n")
    assert _eval(broken, tmp_path / "o4") == 2
    assert "v0000.mp4" in _one_line(capsys.readouterr().err)


def test_a_resume_may_change_how_it_computes_and_says_so(data, tmp_path, caplog):
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "2") == 0
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        assert _eval(data, out, "--limit", "4", "--vision-batch", "2", "--offload") == 0
    (line,) = [record.getMessage() for record in caplog.records if "resumed with" in record.getMessage()]
    assert line.startswith(f"{out}: resumed with vision_batch 2 (before: None), offload True (before: None); ")
    conditions = json.loads((out / "run.json").read_text())["conditions"]
    assert [entry["vision_batch"] for entry in conditions] == [None, 2]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        assert _eval(data, out, "--vision-batch", "2", "--offload") == 0  # the same again: nothing to say
    assert not [record for record in caplog.records if "resumed with" in record.getMessage()]
    assert len(_qids(out)) == 2 * len(FAMILIES)


def test_a_run_records_the_device_it_computed_on_and_a_resume_elsewhere_says_so(data, tmp_path, caplog):
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "2") == 0
    run = json.loads((out / "run.json").read_text())
    assert run["conditions"] == [{"vision_batch": None, "offload": None, "compile_step": False, "cuda_graph": True,
                                  "device": "cpu"}]
    run["conditions"][-1]["device"] = "cuda: NVIDIA H200"  # as a run begun on that GPU records it
    (out / "run.json").write_text(json.dumps(run))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        assert _eval(data, out, "--limit", "3") == 0
    (line,) = [record.getMessage() for record in caplog.records if "resumed with" in record.getMessage()]
    assert line.startswith(f"{out}: resumed with device 'cpu' (before: 'cuda: NVIDIA H200'); ")
    assert [entry["device"] for entry in json.loads((out / "run.json").read_text())["conditions"]] == [
        "cuda: NVIDIA H200", "cpu"]
    run = json.loads((out / "run.json").read_text())
    run["conditions"] = [{key: value for key, value in run["conditions"][-1].items() if key != "device"}]
    (out / "run.json").write_text(json.dumps(run))  # as an earlier statekv recorded it: no device
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        assert _eval(data, out, "--limit", "4") == 0
    assert not [record for record in caplog.records if "resumed with" in record.getMessage()]


def test_a_video_that_failed_part_way_counts_only_the_questions_it_left(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "2") == 0
    rows = [json.loads(line) for line in (data / QUESTIONS_FILE).read_text().splitlines()]
    video = [row["qid"] for row in rows if row["video_id"] == rows[0]["video_id"]]
    answered = _qids(out)
    assert set(answered) < set(video)  # the video's first questions answered, the rest left by its error
    entry = {"video_id": rows[0]["video_id"], "qids": video, "error": "frame 9 cannot be decoded"}
    (out / "errors.rank000.jsonl").write_text(json.dumps(entry) + "\n")
    left = [qid for qid in video if qid not in answered]
    assert unresolved_errors(out) == [{**entry, "qids": left}]
    assert unresolved_errors(out, answered) == []  # of the questions a --limit 2 rerun asks, none is left
    capsys.readouterr()
    assert _eval(data, out, "--limit", "2") == 0  # before: 1, for questions the run did not ask
    assert "unanswered" not in capsys.readouterr().err


def test_an_undecodable_video_is_named_in_one_line(tmp_path, capsys, caplog):
    root = tmp_path / "set"
    make_benchmark(root, videos=2, seed=33, num_frames=16)
    (root / "videos" / "v0001.mp4").write_bytes(b"not a video at all")
    with caplog.at_level(logging.ERROR, logger="statekv.eval.runner"):
        assert _eval(root, tmp_path / "run") == 1  # the other video's questions are answered; the run says so
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and "v0001.mp4" in errors[0] and "\n" not in errors[0]
    assert "1 video(s) could not be read" in _one_line(capsys.readouterr().err)
    assert len(_qids(tmp_path / "run")) == len(FAMILIES)
    (root / "videos" / "v0000.mp4").write_bytes(b"")
    assert _eval(root, tmp_path / "run2") == 2  # nothing readable: the run fails with one line
    assert "no question was answered" in _one_line(capsys.readouterr().err)


def test_a_synthetic_set_streams_every_frame_unless_told_otherwise(tmp_path):
    """The set's videos are the model's own test videos: past the published benchmarks' 512-frame cap too."""
    root = tmp_path / "long"
    make_benchmark(root, videos=1, seed=34, num_frames=520, families=("needle",))
    assert _eval(root, tmp_path / "every") == 0
    assert [json.loads(line)["extra"]["frames"] for line in (tmp_path / "every" / "answers.rank000.jsonl").open()] \
        == [520]
    assert json.loads((tmp_path / "every" / "results.json").read_text())["run"]["max_frames"] is None
    assert _eval(root, tmp_path / "capped", "--max-frames", "100") == 0
    assert json.loads((tmp_path / "capped" / "answers.rank000.jsonl").read_text())["extra"]["frames"] == 100
    assert EvalConfig.for_model("synthetic", "builtin", root, tmp_path / "api").max_frames is None
    assert EvalConfig.for_model("videomme", "builtin", root, tmp_path / "api").max_frames == 512
