"""Hostile uses of evaluation runs, tables and training: a score is right or refused, a damaged run file is one
line naming it, and a signal (SIGTERM, SIGHUP) keeps the work Ctrl-C keeps.

Signals are sent to real child processes, each bounded by a timeout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import statekv
import statekv.eval as ev
from statekv.builtin import training
from statekv.builtin.long_range import LongRange
from statekv.cli import main
from statekv.console import Stopped
from statekv.stopping import request_stop
from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark
from statekv.testing import make_tiny_checkpoint, write_test_video

from hostile import run_child

CHILD_TIMEOUT = 240  # seconds: a child that neither finishes nor stops fails the test instead of hanging it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-runs") / "set"
    make_benchmark(root, videos=2, seed=41, num_frames=12)
    return root


def _copy_set(data: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(data, to)
    return to


def _eval(capsys, data, out, *extra) -> tuple[int, str, str]:
    try:
        code = main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out),
                     "--method", "statekv", "--budget", "16", "--no-progress", "--max-new-tokens", "2",
                     *map(str, extra)])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and "INFO" not in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _rewrite_questions(root: Path, edit) -> None:
    path = root / QUESTIONS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---------------------------------------------------------------------------------------------------------------
# An evaluation reports a right score or refuses
# ---------------------------------------------------------------------------------------------------------------
def _flip_first_answer(rows):
    rows[0]["answer"] = "B" if rows[0]["answer"] != "B" else "C"


def _reword_first_question(rows):
    rows[0]["question"] += " (reworded)"


def _swap_the_videos(root):
    first, second = root / "videos" / "v0000.mp4", root / "videos" / "v0001.mp4"
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


DIFFERENT_DATA = {
    "another answer key": (lambda root: _rewrite_questions(root, _flip_first_answer), "answer key"),
    "other questions": (lambda root: _rewrite_questions(root, _reword_first_question), "questions or videos"),
    "other videos under the same names": (_swap_the_videos, "other videos"),
}


@pytest.mark.parametrize("case", DIFFERENT_DATA)
def test_a_resume_on_other_data_is_refused_and_overwrite_redoes_it(case, data, tmp_path, capsys):
    edit, phrase = DIFFERENT_DATA[case]
    root = _copy_set(data, tmp_path / "set")
    out = tmp_path / "run"
    assert _eval(capsys, root, out, "--limit", "2")[0] == 0
    before = (out / "answers.rank000.jsonl").read_text()
    edit(root)
    code, _, err = _eval(capsys, root, out)
    assert code == 2 and phrase in _one_line(err) and "--overwrite" in err
    assert (out / "answers.rank000.jsonl").read_text() == before  # nothing reused, nothing lost
    code, out_text, _ = _eval(capsys, root, out, "--overwrite", "--limit", "2")
    assert code == 0 and "2 questions answered" in out_text
    questions = {q.qid: q for q in ev.load_benchmark("synthetic", root)}
    for record in ev.read_records(out / "answers.jsonl"):  # scored against the answer key now in the set
        assert record.answer == questions[record.qid].answer


@pytest.mark.parametrize("mode, unread", [("offline", "src_videos"), ("streaming", "chunked_videos")])
def test_an_ovobench_run_resumes_when_the_videos_it_does_not_read_appear(tmp_path, capsys, mode, unread):
    from statekv.eval.fabricate import write_mini_ovobench

    folder = write_mini_ovobench(tmp_path / "data")
    (folder / unread).rename(tmp_path / "aside")  # one of the release's two archives unpacked
    out = tmp_path / "run"
    argv = ["eval", "ovobench", "--model", "builtin", "--data-root", str(tmp_path / "data"), "--out", str(out),
            "--mode", mode, "--budget", "16", "--no-progress", "--max-new-tokens", "2"]
    assert main([*argv, "--limit", "1"]) == 0
    (tmp_path / "aside").rename(folder / unread)  # then the other
    capsys.readouterr()
    assert main([*argv, "--limit", "2"]) == 0, capsys.readouterr().err
    assert len(ev.read_records(out / "answers.jsonl")) == 2


def test_a_resume_with_other_weights_is_refused(data, tmp_path, capsys):
    model = make_tiny_checkpoint("internvl", tmp_path / "model", seed=0)
    out = tmp_path / "run"
    argv = ["eval", "synthetic", "--model", str(model), "--data-root", str(data), "--out", str(out), "--budget",
            "20", "--no-progress", "--max-new-tokens", "2", "--limit", "1", "--attention", "eager"]
    assert main(argv) == 0
    make_tiny_checkpoint("internvl", model, seed=1)  # the same path and name, other weights
    capsys.readouterr()
    assert main(argv) == 2
    assert "made with other weights" in _one_line(capsys.readouterr().err)


def test_a_smaller_limit_on_resume_scores_only_its_questions(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(capsys, data, out, "--limit", "4")[0] == 0
    code, text, _ = _eval(capsys, data, out, "--limit", "1")
    assert code == 0 and "1 question answered" in text
    summary = json.loads((out / "results.json").read_text())
    assert summary["score"]["overall"]["questions"] == 1 and summary["score"]["expected"] == 1


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_out_is_refused_before_anything_is_written(value, data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _eval(capsys, data, value)
    assert code == 2 and "--out" in _one_line(err)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def a_finished_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out), "--method",
                 "statekv", "--budget", "16", "--no-progress", "--max-new-tokens", "2", "--limit", "2"]) == 0
    return out


@pytest.fixture
def finished_run(a_finished_run, tmp_path):
    """A copy of a run of two answered questions, for this test to damage."""
    return _copy_set(a_finished_run, tmp_path / "run")


RUN_FILE_DAMAGE = {
    "run.json not JSON": ("run.json", b"{not json", "run.json: damaged run file"),
    "run.json not UTF-8": ("run.json", b"\xff\xfe{}", "run.json: damaged run file (not UTF-8"),
    "run.json a list": ("run.json", b"[1, 2]", "run.json: damaged run file (not a JSON object)"),
    "run.json settings as text": ("run.json", b'{"settings": "x", "expected_qids": []}', "field 'settings'"),
    "run.json ids not a list": ("run.json", b'{"settings": {}, "expected_qids": 3}', "field 'expected_qids'"),
    "run.json conditions a number": ("run.json", b'{"settings": {}, "expected_qids": [], "conditions": 5}',
                                     "field 'conditions'"),
    "an answer line that is a list": ("answers.rank000.jsonl", b"[1, 2]\n", "answers.rank000.jsonl:3"),
    "an answer line of wrong types": ("answers.rank000.jsonl", None, "answers.rank000.jsonl:1"),
    "an answer log not UTF-8": ("answers.rank000.jsonl", b"\xff\xff\n", "answers.rank000.jsonl:3"),
    "an error log line not JSON": ("errors.rank000.jsonl", b"{oops\n", "errors.rank000.jsonl:1"),
    "an error log line without qids": ("errors.rank000.jsonl", b'{"video_id": "v0000"}\n', "errors.rank000.jsonl:1"),
}


@pytest.mark.parametrize("case", RUN_FILE_DAMAGE)
def test_damaged_run_files_are_one_line_naming_the_file(case, finished_run, data, capsys):
    name, content, phrase = RUN_FILE_DAMAGE[case]
    path = finished_run / name
    if content is None:  # the first record with "correct" as text
        lines = path.read_text().splitlines()
        record = json.loads(lines[0])
        record["correct"] = "yes"
        path.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    elif name.startswith("answers"):
        path.write_bytes(path.read_bytes() + content)
    else:
        path.write_bytes(content)
    code, _, err = _eval(capsys, data, finished_run, "--limit", "3")
    assert code == 2 and phrase in _one_line(err)


@pytest.mark.parametrize("where", ["appended", "a rank file of its own"])
def test_answers_of_another_run_in_the_folder_are_one_line_naming_their_file(where, finished_run, data, capsys):
    """Before: appended, a traceback ("records mix several method values"); a whole rank file of them, taken in
    silently (the table showed another method's score under this run's name)."""
    path = finished_run / "answers.rank000.jsonl"
    foreign = [json.dumps({**json.loads(line), "method": "full", "budget": None})
               for line in path.read_text().splitlines()]
    target = path if where == "appended" else finished_run / "answers.rank001.jsonl"
    with target.open("a") as file:
        file.write("\n".join(foreign) + "\n")
    code, _, err = _eval(capsys, data, finished_run, "--limit", "3")
    assert code == 2 and f"{target.name}: answer" in _one_line(err) and "another run's (method 'full'" in err
    (finished_run / "results.json").unlink()  # scored again from the answers
    assert main(["eval", "table", str(finished_run)]) == 2
    assert "another run's" in _one_line(capsys.readouterr().err)


RESULTS_DAMAGE = {
    "not JSON": (lambda s: "{", "results.json: damaged results file"),
    "no score": (lambda s: json.dumps({k: v for k, v in s.items() if k != "score"}), "field 'score'"),
    "a headline as text": (lambda s: json.dumps({**s, "score": {**s["score"], "headline": "high"}}),
                           "field score.'headline'"),
    "a model as a number": (lambda s: json.dumps({**s, "model": 3}), "field 'model'"),
}


@pytest.mark.parametrize("case", RESULTS_DAMAGE)
def test_a_damaged_results_file_in_a_table_is_one_line(case, finished_run, capsys):
    damage, phrase = RESULTS_DAMAGE[case]
    path = finished_run / "results.json"
    path.write_text(damage(json.loads(path.read_text())))
    code = main(["eval", "table", str(finished_run)])
    err = capsys.readouterr().err
    assert code == 2 and phrase in _one_line(err) and str(path) in err


def test_the_same_run_named_twice_in_a_table_is_refused(finished_run, capsys):
    code = main(["eval", "table", str(finished_run), str(finished_run / ".." / finished_run.name)])
    assert code == 2 and "named twice" in _one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------------------------
# Signals keep the work Ctrl-C keeps
# ---------------------------------------------------------------------------------------------------------------
def _child(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "statekv.cli", *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _signal_after(child: subprocess.Popen, marker: str, number: int) -> tuple[str, str]:
    """Read the child's stdout until a line holding ``marker``, send ``number``, return (stdout, stderr)."""
    seen, deadline = [], time.monotonic() + CHILD_TIMEOUT
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            child.send_signal(number)
            break
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("the child did not stop after the signal")
    return "".join(seen) + out, err


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_signal_while_streaming_saves_the_stream_prints_the_summary_and_says_it_stopped(name, tmp_path):
    number = getattr(signal, name)
    video = write_test_video(tmp_path / "long.mp4", frames=600, fps=4)  # 150 frames at 1 fps
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    saved = tmp_path / "kept.safetensors"
    child = _child(["stream", video, "--model", model, "--budget", "20", "--attention", "eager", "--json",
                    "--max-frames", "151",  # a horizon, as `_restreamed` (past its range this model fits no answer)
                    "--ask", "1:What?", "--ask", "149:And now?", "--save", saved], tmp_path)
    out, err = _signal_after(child, '"event": "answer"', number)
    assert child.returncode == 128 + number, err
    assert err.strip().splitlines()[-1].startswith(f"statekv stream: stopped by {name}; the ")  # and what it kept
    assert len(err.strip().splitlines()) == 1, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["event"] == "summary" and summary["saved"] == str(saved) and summary["error"] == name
    import statekv

    qa = statekv.VideoQA.from_pretrained(model, budget=20, attention="eager")
    with statekv.Stream.load(saved, qa) as resumed:
        assert 1 <= resumed.frames == summary["stats"]["frames"] < 150
        assert _equal_states(resumed, _restreamed(qa, video, resumed.frames))  # the stream up to its last push


def test_a_signal_while_streaming_on_the_disk_tier_keeps_every_frame_in_its_folder_and_says_where(tmp_path, capsys):
    """Before: with no --save the stream was never closed, so its file set resumed at its last checkpoint (every 64
    steps) and the frames after it were lost; nothing said where the folder was; and a `VideoQA` made without
    ``offload="disk"`` could not resume it (a `ConfigurationError` about ``offload_dir``)."""
    video = write_test_video(tmp_path / "long.mp4", frames=600, fps=4)
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    child = _child(["stream", video, "--model", model, "--budget", "20", "--attention", "eager", "--json",
                    "--max-frames", "151", "--offload", "disk", "--offload-dir", tmp_path / "tier",
                    "--ask", "2:What?", "--ask", "149:And now?"], tmp_path)
    out, err = _signal_after(child, '"event": "answer"', signal.SIGTERM)
    assert child.returncode == 128 + signal.SIGTERM, err
    summary = json.loads(out.strip().splitlines()[-1])
    folder = summary["folder"]
    assert [str(path) for path in (tmp_path / "tier").iterdir()] == [folder]
    frames = summary["stats"]["frames"]
    assert err.strip().splitlines() == [f"statekv stream: stopped by SIGTERM; the {frames} frames streamed before it "
                                        f"are kept in {folder} (go on with --resume {folder})"]
    import statekv

    qa = statekv.VideoQA.from_pretrained(model, budget=20, attention="eager")  # the folder says it is a file set
    with statekv.Stream.load(folder, qa) as resumed:
        assert 2 <= resumed.frames == frames < 150 and resumed.frames_lost == 0
        with _restreamed(qa, video, frames) as whole:
            assert resumed.ask("What?", max_new_tokens=4) == whole.ask("What?", max_new_tokens=4)
    assert main(["stream", str(video), "--model", str(model), "--budget", "20", "--attention", "eager", "--json",
                 "--max-frames", "151", "--ask", "2:What?", "--ask", "149:And now?", "--resume", folder]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    asked_again = [2.0] if frames <= 3 else []  # stopped after its answer, before the next frame was pushed
    assert [line["time"] for line in printed if line["event"] == "answer"] == [*asked_again, 149.0]
    assert printed[-1]["stats"]["frames"] == 150 and printed[-1]["folder"] == folder


def test_resume_goes_on_with_a_saved_stream_as_if_it_had_never_stopped(tmp_path, capsys):
    """Its watches too: a saved stream's watch goes on where --watch asks it again, and closes where it does not
    (before, a second was opened beside it, and one no longer asked was evaluated unheard)."""
    import statekv

    video = write_test_video(tmp_path / "long.mp4", frames=600, fps=4)
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    qa = statekv.VideoQA.from_pretrained(model, budget=20, attention="eager")
    saved = tmp_path / "kept.safetensors"
    with _restreamed(qa, video, 40, watches=["What?"]) as partway:  # what `--save` kept of a stopped run
        partway.save(saved)
    video, model, saved = str(video), str(model), str(saved)
    flags = ["--model", model, "--budget", "20", "--attention", "eager", "--max-frames", "151"]
    assert main(["stream", video, *flags, "--json", "--ask", "10:What?", "--ask", "100:And now?", "--watch",
                 "50:What?", "--max-new-tokens", "2", "--resume", saved, "--save", saved]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["time"] for line in printed if line["event"] == "answer"] == [100.0]  # 10 s was asked before
    assert printed[-1]["stats"]["frames"] == 150
    with statekv.Stream.load(saved, qa) as resumed, _restreamed(qa, video, 150, watches=["What?"]) as whole:
        assert [watch.question for watch in resumed.watches] == ["What?"]
        assert resumed.watches[0].evaluations == whole.watches[0].evaluations
        assert _equal_states(resumed, whole)
    assert main(["stream", video, *flags, "--resume", saved, "--save", saved]) == 0  # --watch no longer asks it
    capsys.readouterr()
    with statekv.Stream.load(saved, qa) as resumed:
        assert resumed.frames == 150 and resumed.watches == []
    other = str(write_test_video(tmp_path / "other.mp4", frames=40, fps=4))
    unpaced = str(tmp_path / "unpaced.safetensors")
    with qa.stream(horizon_frames=151, name=video) as stream:  # Python's default: no max_fps
        stream.push(np.zeros((32, 32, 3), np.uint8))
        stream.save(unpaced)
    for argv, resume, message in (
            (["stream", other, *flags], saved, f"it is a stream of {video}, not of {other}"),
            (["stream", video, *flags, "--max-fps", "2"], saved, "it was streamed at --max-fps 1, not --max-fps 2"),
            (["stream", video, *flags[:-2], "--max-frames", "300"], saved,
             "it was made with --max-frames 151, not --max-frames 300"),
            (["stream", video, *flags], unpaced,
             "it was pushed with no frame rate (max_fps=None), which only Python's Stream.load resumes")):
        assert main([*argv, "--resume", resume]) == 2
        assert capsys.readouterr().err.strip() == f"statekv stream: error: --resume {resume}: {message}"


def test_a_resumed_run_says_a_new_watch_first_answer_and_reopens_one_it_would_steer_otherwise(tmp_path, capsys):
    """Before: a watch opened on a resumed stream answered at once, unheard (its first event never printed); a kept
    watch that steered went on steering under --no-steer."""
    import statekv

    video = write_test_video(tmp_path / "v.mp4", frames=200, fps=4)
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    qa = statekv.VideoQA.from_pretrained(model, budget=20, attention="eager")
    saved = tmp_path / "kept.safetensors"
    with _restreamed(qa, video, 20, watches=["What?"]) as partway:
        partway.save(saved)
    flags = ["--model", str(model), "--budget", "20", "--attention", "eager", "--max-frames", "51", "--json",
             "--max-new-tokens", "2", "--resume", str(saved), "--save", str(saved)]
    assert main(["stream", str(video), *flags, "--watch", "50:What?", "--watch", "50:Which?"]) == 0
    heard = [line for line in map(json.loads, capsys.readouterr().out.splitlines()) if line["event"] == "watch"]
    assert heard[0]["question"] == "Which?" and heard[0]["frame"] == 20  # said as it opened
    assert main(["stream", str(video), *flags, "--watch", "50:What?", "--no-steer"]) == 0
    capsys.readouterr()
    with statekv.Stream.load(saved, qa) as resumed:
        assert [(watch.question, watch.steer) for watch in resumed.watches] == [("What?", False)]
    for _ in range(2):  # the same question watched twice: both go on, neither left open unheard nor doubled
        assert main(["stream", str(video), *flags, "--watch", "50:What?", "--watch", "50:What?"]) == 0
    capsys.readouterr()
    with statekv.Stream.load(saved, qa) as resumed:
        assert [watch.question for watch in resumed.watches] == ["What?", "What?"]


@pytest.mark.parametrize("watched, message", [
    ("\u00b2:What?", "expected FRAMES:QUESTION"), ("\u0663:What?", "expected FRAMES:QUESTION"),
    ("300000000000000:What?", "FRAMES must be at most 281,474,976,710,656")])
def test_a_watch_flag_with_a_frame_count_no_stream_takes_is_refused_as_the_command_starts(watched, message, capsys):
    """Before: a superscript digit got argparse's bare "invalid value", an Arabic-Indic one was taken as 3, and a
    count too large was refused only once the model had loaded, without naming --watch."""
    with pytest.raises(SystemExit) as stop:
        main(["stream", "no-such-video.mp4", "--model", "builtin", "--watch", watched])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.startswith(f"statekv stream: error: argument --watch: {message}"), err


def test_a_watch_the_stream_ends_before_is_said_never_evaluated(tmp_path, capsys):
    """Before: a --watch whose period was longer than the video printed nothing and exited 0, as a watch whose
    answer never changed does."""
    video = write_test_video(tmp_path / "v.mp4", frames=8, fps=4)
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    flags = ["--model", str(model), "--budget", "20", "--attention", "eager", "--max-new-tokens", "2"]
    assert main(["stream", str(video), *flags, "--watch", "4:What?", "--watch", "2:Which?", "--json"]) == 0
    printed, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == ("statekv stream: warning: --watch 4:'What?' was never evaluated: the "
                                            "stream holds 2 frames, fewer than the 4 of its first evaluation"), err
    assert "Which?" not in err and json.loads(printed.splitlines()[-1])["watches"][0]["question"] == "Which?"


def test_a_disk_tier_folder_resumed_by_the_command_goes_on_with_its_watches(tmp_path, capsys):
    """Before: --resume FOLDER dropped the stream's watches (only a saved file kept them): each was opened afresh,
    its events and evaluations lost; the resumed run's summary listed none of their events."""
    from statekv.api.stream_disk import read_watches
    from statekv.core.disk.files import read_file_set

    video = write_test_video(tmp_path / "v.mp4", frames=80, fps=4)
    model = make_tiny_checkpoint("internvl", tmp_path / "model")
    flags = ["--model", str(model), "--budget", "20", "--attention", "eager", "--json", "--max-new-tokens", "2",
             "--watch", "4:What?", "--offload", "disk", "--offload-dir", str(tmp_path / "tier")]
    assert main(["stream", str(video), *flags]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    folder = Path(first["folder"])

    def kept() -> list[dict]:
        """The watches the folder would reopen (those its last record after its last checkpoint vouches for)."""
        record = next(record for record in reversed(read_file_set(folder).after) if "watches" in record)
        return read_watches(folder, record)[0] if record["watches"] else []

    before = kept()
    assert [(watch["question"], watch["evaluations"]) for watch in before] == [("What?", 5)]  # frames 4 to 20
    assert main(["stream", str(video), *flags, "--resume", str(folder)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert not [line for line in printed if line["event"] == "watch"]  # the same watch, nothing new to say
    assert printed[-1]["watches"] == first["watches"] and first["watches"]  # before: [], as if it had none
    assert kept() == before
    assert main(["stream", str(video), *flags[:-6], "--offload", "disk", "--offload-dir", str(tmp_path / "tier"),
                 "--resume", str(folder)]) == 0  # --watch no longer asks it: it closes, and is kept no more
    capsys.readouterr()
    assert kept() == []
    plain = [flag for flag in flags[:-6] if flag != "--json"]
    assert main(["stream", str(video), *plain, "--offload", "disk", "--offload-dir", str(tmp_path / "tier"),
                 "--resume", str(folder)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]  # no frame pushed, so no time a frame (was 0.0 ms)
    assert summary.startswith("20 frames") and "kept in" in summary and "ms per frame" not in summary, summary


def test_a_resumed_stream_is_of_the_same_video_file_or_of_one_moved_there(tmp_path):
    from statekv.commands.stream import same_video

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "video.mp4").write_bytes(b"frames")
    (tmp_path / "a" / "link.mp4").symlink_to(tmp_path / "a" / "video.mp4")
    assert same_video(str(tmp_path / "a" / "video.mp4"), str(tmp_path / "a" / "link.mp4"))  # one file, two names
    assert not same_video(str(tmp_path / "a" / "video.mp4"), str(tmp_path / "b" / "video.mp4"))  # two cameras
    assert same_video(str(tmp_path / "gone" / "video.mp4"), str(tmp_path / "b" / "video.mp4"))  # moved since
    assert not same_video(str(tmp_path / "gone" / "video.mp4"), str(tmp_path / "a" / "link.mp4"))


def test_a_stream_given_by_a_relative_path_resumes_from_another_folder_and_only_on_its_file(tmp_path, capsys,
                                                                                                monkeypatch):
    """The stream is named by its video's absolute path: before, it recorded `clip.mp4` as given, so a resume from
    another folder compared it with whatever `clip.mp4` was there."""
    model = str(make_tiny_checkpoint("internvl", tmp_path / "model"))
    for camera, fps in (("cam1", 4), ("cam2", 8)):
        (tmp_path / camera).mkdir()
        write_test_video(tmp_path / camera / "clip.mp4", frames=24, fps=fps)
    saved = str(tmp_path / "kept.safetensors")
    flags = ["--model", model, "--budget", "20", "--attention", "eager", "--max-frames", "7"]
    monkeypatch.chdir(tmp_path / "cam1")
    assert main(["stream", "clip.mp4", *flags, "--save", saved]) == 0
    monkeypatch.chdir(tmp_path / "cam2")
    assert main(["stream", "../cam1/clip.mp4", *flags, "--resume", saved]) == 0  # its own file, named otherwise
    capsys.readouterr()
    assert main(["stream", "clip.mp4", *flags, "--resume", saved]) == 2  # another camera's clip.mp4
    assert capsys.readouterr().err.strip().endswith(f"it is a stream of {tmp_path / 'cam1' / 'clip.mp4'}, not of "
                                                    "clip.mp4")


def _restreamed(qa, video, frames: int, watches: tuple[str, ...] = ()):
    """What `statekv stream VIDEO [--watch 50:QUESTION --max-new-tokens 2 ...]` holds after ``frames`` pushes, never
    stopped."""
    from statekv.video import open_video

    source = open_video(video)
    stream = qa.stream(horizon_frames=math.floor(source.duration) + 1, max_fps=1.0, name=source.name)
    for question in watches:
        stream.watch(question, every=50, max_new_tokens=2)
    for frame, _ in zip(source.sample_at_rate(1.0), range(frames)):
        stream.push(frame)
    return stream


def _equal_states(a, b) -> bool:
    (tensors_a, meta_a), (tensors_b, meta_b) = a.prefill.state_dict(), b.prefill.state_dict()
    return (meta_a == meta_b and sorted(tensors_a) == sorted(tensors_b) and (a.pushed, a.next_tick) == (
        b.pushed, b.next_tick) and all(torch.equal(tensors_a[name], tensors_b[name]) for name in tensors_a))


def test_a_signal_during_an_evaluation_keeps_its_answers_and_a_rerun_finishes(tmp_path):
    # 96-frame videos take seconds each to encode, so the signal lands while the run is answering
    data = make_benchmark(tmp_path / "set", videos=2, seed=42, num_frames=96).parent
    out = tmp_path / "run"
    child = _child(["eval", "synthetic", "--model", "builtin", "--data-root", data, "--out", out, "--budget", "16",
                    "--no-progress", "--max-new-tokens", "2"], tmp_path)
    deadline = time.monotonic() + CHILD_TIMEOUT
    answers = out / "answers.rank000.jsonl"
    while time.monotonic() < deadline and not (answers.is_file() and answers.read_text().count("\n") >= 1):
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    try:
        _, err = child.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("the evaluation did not stop after SIGTERM")
    assert child.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]  # one line: the stop and what was kept
    assert last.startswith("statekv eval: stopped by SIGTERM; ") and "questions answered in" in last, err
    kept = answers.read_text().count("\n")
    assert kept >= 1  # and the lock went with the process: the rerun below is not refused
    assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out),
                 "--budget", "16", "--no-progress", "--max-new-tokens", "2"]) == 0
    qids = [json.loads(line)["qid"] for line in answers.read_text().splitlines()]
    assert len(qids) == len(set(qids)) == len(ev.load_benchmark("synthetic", data))


def _command(body: str, ignoring: str | None = None) -> subprocess.Popen:
    """A child running ``body`` (the source of a function's body) as a ``statekv`` command (`run_command`), started
    ignoring the signal named ``ignoring`` (as ``nohup`` starts one ignoring SIGHUP)."""
    script = ("import os, signal, sys, time\n"
              + (f"signal.signal(signal.{ignoring}, signal.SIG_IGN)\n" if ignoring else "")
              + "from statekv.console import run_command\n"
              "def body():\n" + "".join(f"    {line}\n" for line in body.splitlines())
              + "sys.exit(run_command('x', body))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_a_second_signal_does_not_cut_the_save_of_the_first(tmp_path):
    child = _command("try:\n"
                     "    print('ready', flush=True)\n"
                     "    while True: time.sleep(0.01)\n"
                     "except KeyboardInterrupt:\n"
                     "    os.kill(os.getpid(), signal.SIGTERM)  # a second signal while saving\n"
                     "    time.sleep(0.2)\n"
                     "    print('saved', flush=True)\n"
                     "    raise")
    out, err = _signal_after(child, "ready", signal.SIGHUP)
    assert child.returncode == 128 + signal.SIGHUP and out == "ready\nsaved\n" and "stopped by SIGHUP" in err


def test_a_command_started_by_nohup_runs_on_when_its_terminal_closes():
    """A command started ignoring SIGHUP (``nohup``) keeps it ignored, and a SIGTERM still stops it; before, its
    own handler replaced the ignore and a closed terminal stopped it."""
    child = _command("print('ready', flush=True)\n"
                     "time.sleep(1.5)\n"
                     "print('still running', flush=True)\n"
                     "time.sleep(60)", ignoring="SIGHUP")
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGHUP)
    out, err = _signal_after(child, "still running", signal.SIGTERM)
    assert child.returncode == 128 + signal.SIGTERM and out == "still running\n" and "stopped by SIGTERM" in err


# ---------------------------------------------------------------------------------------------------------------
# Training: stopped, damaged, resumed
# ---------------------------------------------------------------------------------------------------------------
TINY_RECIPE = training.Recipe(videos_per_batch=2, curriculum=((0, 2), (3, 4)), log_every=1, checkpoint_every=2,
                              warmup_steps=1, long_range=LongRange(steps=0))


def _stop_at(monkeypatch, step_to_stop: int, number: int = signal.SIGTERM):
    """A signal stops the training in the middle of step ``step_to_stop`` (0-based, a step on videos): as the step
    draws its videos, after its vision forward."""
    real = training.training_rng

    def draw(seed, step):
        if step == step_to_stop:
            raise Stopped(number)
        return real(seed, step)

    monkeypatch.setattr(training, "training_rng", draw)


def test_a_stopped_training_saves_its_last_step_and_resumes_from_it(tmp_path, monkeypatch):
    _stop_at(monkeypatch, 3)
    with pytest.raises(Stopped) as stopped:
        training.train(TINY_RECIPE, tmp_path, threads=1)
    assert stopped.value.__notes__ == [f"{tmp_path / training.STATE_FILE} holds step 3 of 6: rerun the same command "
                                       "to go on"]  # the command's stop line says it (before: only a log line)
    state = torch.load(tmp_path / training.STATE_FILE, weights_only=True)
    assert state["step"] == 3  # steps 0-2 done; the checkpoint of step 2 kept as the previous one
    assert torch.load(tmp_path / training.PREVIOUS_STATE_FILE, weights_only=True)["step"] == 2
    monkeypatch.undo()
    training.train(TINY_RECIPE, tmp_path, threads=1)
    steps = [json.loads(line)["step"] for line in (tmp_path / training.LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_training_from_given_weights_stopped_before_its_first_step_says_nothing_was_kept(tmp_path, monkeypatch):
    """A run begun from ``init`` weights starts at the long-range phase's first step with no checkpoint yet. Before:
    stopped before that step was done, its stop line said the state file held that step (none was written)."""
    from statekv.builtin import WEIGHTS_DIR

    recipe = training.Recipe(videos_per_batch=1, curriculum=((0, 1), (16, 2)), log_every=1,
                             long_range=LongRange(steps=1, frames=(6,), stream_frames=300, span=60))
    _stop_at(monkeypatch, 0)  # the long-range phase's first draw
    with pytest.raises(Stopped) as stopped:
        training.train(recipe, tmp_path, threads=1, init=WEIGHTS_DIR)
    assert not (tmp_path / training.STATE_FILE).exists()
    assert stopped.value.__notes__ == ["no step was finished"], stopped.value.__notes__


def test_a_stop_as_the_update_ends_saves_the_step_the_weights_are_of(tmp_path, monkeypatch):
    """A stop landing as the optimiser's update returns (before the step was counted) waits for the count: the
    checkpoint names the step its weights are of, and the resumed run takes the uninterrupted one's steps."""
    updates, real = [], torch.optim.AdamW.step

    def update(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        updates.append(1)
        if len(updates) == 3:
            request_stop(signal.SIGINT, None)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", update)
    with pytest.raises(KeyboardInterrupt):
        training.train(TINY_RECIPE, tmp_path / "stopped", threads=1)
    monkeypatch.undo()
    stopped = torch.load(tmp_path / "stopped" / training.STATE_FILE, weights_only=True)
    training.train(TINY_RECIPE, tmp_path / "through", threads=1, stop_after=3)
    through = torch.load(tmp_path / "through" / training.STATE_FILE, weights_only=True)
    assert stopped["step"] == through["step"] == 3
    assert all(torch.equal(stopped["model"][name], through["model"][name]) for name in through["model"])


TRAINING_DAMAGE = {
    "cut in half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "not a checkpoint": lambda p: p.write_bytes(b"hello"),
    "a step as text": lambda p: torch.save({**torch.load(p, weights_only=True), "step": "3"}, p),
    "no optimizer": lambda p: torch.save({k: v for k, v in torch.load(p, weights_only=True).items()
                                          if k != "optimizer"}, p),
    "NaN weights": lambda p: torch.save({**(s := torch.load(p, weights_only=True)), "model": {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in s["model"].items()}}, p),
}


@pytest.mark.parametrize("case", TRAINING_DAMAGE)
def test_a_damaged_training_checkpoint_resumes_from_the_one_before(case, tmp_path, monkeypatch, caplog):
    _stop_at(monkeypatch, 5)
    with pytest.raises(Stopped):
        training.train(TINY_RECIPE, tmp_path, threads=1)
    monkeypatch.undo()
    TRAINING_DAMAGE[case](tmp_path / training.STATE_FILE)  # step 5's checkpoint; step 4's is the previous
    log = tmp_path / training.LOG_FILE
    log.write_text(log.read_text() + "{damaged\n")
    with caplog.at_level(logging.INFO, logger=training.logger.name):
        training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=4)  # resumes, and has no step left to take
    assert any(message.endswith("from step 4") for message in caplog.messages)
    assert any(str(tmp_path / training.STATE_FILE) in message for message in caplog.messages)
    assert any(f"{log}:" in message and "damaged log line" in message for message in caplog.messages)
    # the log keeps the lines up to the step resumed from (step 5's was written before its checkpoint was damaged)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]
    # set aside, so the next save keeps step 4's as the one before (before: the damaged one took its place)
    assert (tmp_path / (training.STATE_FILE + ".damaged")).is_file() and not (tmp_path / training.STATE_FILE).exists()
    training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=5)
    assert training.trained_steps(tmp_path) == 5
    assert torch.load(tmp_path / training.PREVIOUS_STATE_FILE, weights_only=True)["step"] == 4


def test_no_usable_training_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / training.STATE_FILE).write_bytes(b"hello")
    code = main(["train-builtin", "--out", str(tmp_path), "--threads", "1", "--stop-after", "1"])
    assert code == 2 and "no usable checkpoint" in _one_line(capsys.readouterr().err)


def test_training_threads_beyond_the_cores_are_refused(tmp_path, capsys):
    code = main(["train-builtin", "--out", str(tmp_path / "t"), "--threads", str(10**6)])
    assert code == 2 and "CPU cores" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "t").exists()



@pytest.mark.parametrize("omp, threads", [("1", 1), ("3,1", 3), (None, 2), ("lots", 2)])
def test_training_threads_default_to_what_omp_num_threads_asks(monkeypatch, tmp_path, omp, threads):
    """Before: `OMP_NUM_THREADS=1 statekv train-builtin` trained on two threads (a shared CPU's steps far slower)."""
    import statekv.builtin.training as training_module

    used = []
    def train(recipe, out, threads, **kwargs):
        used.append(threads)
        return out / "model"  # not written: a run stopped part way

    monkeypatch.setattr(training_module, "train", train)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    main(["train-builtin", "--out", str(tmp_path / "t"), "--stop-after", "1"])
    main(["train-builtin", "--out", str(tmp_path / "t"), "--stop-after", "1", "--threads", "4"])  # given: taken
    assert used == [threads, 4]


def test_training_outputs_named_by_folders_are_refused_before_training(tmp_path, capsys):
    """Before: a folder named loss.png (or log.jsonl, checkpoint.pt) in --out was a traceback after the training."""
    for name in (training.LOG_FILE, "loss.png", training.STATE_FILE):
        out = tmp_path / name.replace(".", "-")
        (out / name).mkdir(parents=True)
        code = main(["train-builtin", "--out", str(out), "--threads", "1", "--stop-after", "1"])
        assert code == 2 and "names a folder" in _one_line(capsys.readouterr().err)
        assert [path.name for path in out.iterdir()] == [name]  # nothing trained, nothing written


def test_training_from_a_folder_without_weights_is_one_line(tmp_path, capsys):
    """Before: transformers' own OSError, as a traceback."""
    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text(json.dumps({"model_type": "internvl"}))
    code = main(["train-builtin", "--out", str(tmp_path / "run"), "--threads", "1", "--stop-after", "3601",
                 "--init", str(init)])
    assert code == 2 and "cannot load its weights" in _one_line(capsys.readouterr().err)


def test_training_from_another_models_weights_or_over_a_run_is_one_line(tmp_path, capsys):
    """Before: another model's checkpoint as --init was torch's size-mismatch traceback, and --init over a folder
    holding a run was ignored without a word (the run went on from its own checkpoint)."""
    other = make_tiny_checkpoint("internvl", tmp_path / "other", layout="chat")
    capsys.readouterr()
    code = main(["train-builtin", "--out", str(tmp_path / "run"), "--threads", "1", "--stop-after", "3601",
                 "--init", str(other)])
    said = _one_line(capsys.readouterr().err)  # and no loading bar: stderr is not a terminal
    assert code == 2 and "not the built-in model's architecture" in said and "in state_dict" in said, said
    (tmp_path / "done").mkdir()
    torch.save({"step": 3}, tmp_path / "done" / training.STATE_FILE)
    code = main(["train-builtin", "--out", str(tmp_path / "done"), "--threads", "1", "--init", str(other)])
    assert code == 2 and "holds a run already (step 3)" in _one_line(capsys.readouterr().err)


def test_training_that_would_run_no_step_from_given_weights_is_refused_as_it_starts(tmp_path, capsys):
    """Before: --init (which starts at the long-range phase) with a --stop-after inside the curriculum ran no step,
    then failed reading the log it never wrote; later it said "stopped at step 0; rerun to go on", and a rerun
    without --init, as it had advised, began the curriculum from its first step."""
    from statekv.builtin.install import WEIGHTS_DIR

    code = main(["train-builtin", "--out", str(tmp_path / "run"), "--threads", "1", "--stop-after", "3",
                 "--init", str(WEIGHTS_DIR)])
    said = _one_line(capsys.readouterr().err)
    assert code == 2 and "--stop-after 3" in said and "starts at step 3600" in said, said
    assert not (tmp_path / "run").exists()


def _only(recipe):
    """A stand-in for `Recipe` whose default is ``recipe`` (the command trains the default recipe)."""
    def made():
        return recipe
    made.from_dict = training.Recipe.from_dict
    return made


def test_a_run_from_given_weights_goes_on_when_begun_again_the_same_way_and_says_another_thread_count(
        tmp_path, capsys, monkeypatch, caplog):
    """Before: a run begun with --init was refused when the same command was run again to go on ("holds a run
    already"), and a run resumed on another thread count, whose weights differ from an uninterrupted run's, went on
    without a word."""
    from statekv.builtin.install import WEIGHTS_DIR

    recipe = training.Recipe(**{**TINY_RECIPE.__dict__, "long_range": LongRange(steps=2, frames=(4,))})
    monkeypatch.setattr(training, "Recipe", _only(recipe))
    run = tmp_path / "run"
    begun = ["train-builtin", "--out", str(run), "--init", str(WEIGHTS_DIR)]
    assert main([*begun, "--threads", "1", "--stop-after", str(recipe.curriculum_steps + 1)]) == 0
    assert "ran on" not in caplog.text
    assert main([*begun, "--threads", "2"]) == 0
    assert "wrote" in capsys.readouterr().out and training.trained_steps(run) == recipe.steps
    assert "the run's steps so far ran on 1 threads: going on with 2" in caplog.text
    other = make_tiny_checkpoint("internvl", tmp_path / "other", layout="chat")
    capsys.readouterr()
    assert main(["train-builtin", "--out", str(run), "--threads", "1", "--init", str(other)]) == 2
    assert "does not name these weights as its start" in _one_line(capsys.readouterr().err)


def test_a_run_stopped_early_beside_an_earlier_runs_model_says_so_and_installs_nothing(tmp_path, capsys,
                                                                                        monkeypatch):
    """Before: a model/ folder left by an earlier run (its checkpoints deleted to start over) made a run stopped
    after one step say it wrote its model, and --install ship the earlier run's weights."""
    import shutil

    from statekv.builtin.install import WEIGHTS_DIR

    installed = []
    monkeypatch.setattr("statekv.builtin.install.install_weights", lambda *given, **named: installed.append(given))
    monkeypatch.setattr(training, "Recipe", _only(TINY_RECIPE))
    run = tmp_path / "run"
    shutil.copytree(WEIGHTS_DIR, run / training.MODEL_DIR)
    assert main(["train-builtin", "--out", str(run), "--threads", "1", "--stop-after", "1", "--install"]) == 0
    assert "stopped at step 1 of 6" in capsys.readouterr().out and installed == []


def test_two_trainings_in_one_folder_are_refused(tmp_path):
    """Before: a second run in the folder of one under way went on beside it, each writing the log and the
    checkpoints the other was writing."""
    from statekv.errors import OutputError
    from statekv.locks import FileLock

    lock = FileLock.acquire(tmp_path, what="the folder")
    try:
        with pytest.raises(OutputError, match="in use by .*another train-builtin is writing it"):
            training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=1)
    finally:
        lock.release()
    assert not (tmp_path / training.STATE_FILE).exists()


def test_a_training_checkpoint_the_disk_cannot_hold_is_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    """Before: torch's writer failing on a full disk was a chained traceback, its partial file left filling the
    disk."""
    save = torch.save

    def full(obj, path, *args, **kwargs):
        save(obj, path, *args, **kwargs)  # written, then the disk is found full
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(statekv.errors.OutputError, match="cannot write the training checkpoint") as caught:
        training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=2)
    assert "\n" not in str(caught.value) and "goes on from the last one written, 0 steps" in str(caught.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == [training.LOG_FILE]


def test_a_runs_steps_are_those_its_checkpoint_records(tmp_path):
    """What `statekv train-builtin --stop-after N` reports when it stops: before, N itself, even when the run was
    already past it."""
    assert training.trained_steps(tmp_path) == 0
    torch.save({"step": 30}, tmp_path / training.PREVIOUS_STATE_FILE)
    (tmp_path / training.STATE_FILE).write_bytes(b"damaged")
    assert training.trained_steps(tmp_path) == 30


def test_analysis_and_flops_outputs_named_by_folders_are_refused_before_the_work(tmp_path, capsys):
    """Before: a folder named analysis.json in --out (or flops_vs_frames.png in --plot) was a traceback once the
    work was done, with part of the output written."""
    video = write_test_video(tmp_path / "v.mp4", frames=2)
    (tmp_path / "out" / "analysis.json").mkdir(parents=True)
    code = main(["analyze", "--model", str(tmp_path / "no-model"), str(video), "--out", str(tmp_path / "out")])
    assert code == 2 and "analysis.json names a folder" in _one_line(capsys.readouterr().err)
    (tmp_path / "plots" / "flops_vs_frames.png").mkdir(parents=True)
    code = main(["flops", "--frames", "32", "--models", "internvl3-1b", "--plot", str(tmp_path / "plots")])
    assert code == 2 and "flops_vs_frames.png names a folder" in _one_line(capsys.readouterr().err)


def test_the_demo_refuses_a_plot_it_would_not_draw_and_says_its_own_answer_length(capsys):
    """Before: --plot with --video was ignored (no plot, no word), and --help said answers were 128 tokens long."""
    code = main(["demo", "--video", "missing.mp4", "--plot", "p.png"])
    assert code == 2 and "--plot draws the held-out videos' comparison" in _one_line(capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "longest answer in tokens (default: 16)" in capsys.readouterr().out


def test_a_stop_between_a_checkpoints_two_renames_resumes_from_the_new_checkpoint(tmp_path, caplog):
    training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=4)
    # what a stop between the renames leaves: step 2's checkpoint already the previous one, step 4's written whole
    # under its unfinished name and not yet renamed
    os.replace(tmp_path / training.STATE_FILE, tmp_path / training.UNFINISHED_STATE_FILE)
    assert training.trained_steps(tmp_path) == 4
    with caplog.at_level(logging.INFO, logger=training.logger.name):
        training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=4)  # nothing left to take
    assert any(message.endswith("from step 4") for message in caplog.messages)  # before: from step 2
    assert torch.load(tmp_path / training.STATE_FILE, weights_only=True)["step"] == 4
    assert torch.load(tmp_path / training.PREVIOUS_STATE_FILE, weights_only=True)["step"] == 2
    assert not (tmp_path / training.UNFINISHED_STATE_FILE).exists()
    # one a stop cut short as it was written is removed, and the run goes on from the checkpoint before it
    written = (tmp_path / training.STATE_FILE).read_bytes()
    (tmp_path / training.UNFINISHED_STATE_FILE).write_bytes(written[: len(written) // 2])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=training.logger.name):
        training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=4)
    assert any(message.endswith("from step 4") for message in caplog.messages)
    assert not (tmp_path / training.UNFINISHED_STATE_FILE).exists()
    log = (tmp_path / training.LOG_FILE).read_text()
    assert [json.loads(line)["step"] for line in log.splitlines()] == [1, 2, 3, 4]


FULL_DISK_TRAINING = """
from statekv.builtin import training
from test_hostile_runs import TINY_RECIPE
attempt(lambda: training.train(TINY_RECIPE, sys.argv[1], threads=1, stop_after=int(sys.argv[2])))
"""


def test_a_full_disk_while_training_is_one_line_naming_it_and_keeps_the_log(tmp_path):
    training.train(TINY_RECIPE, tmp_path, threads=1, stop_after=4)
    log = tmp_path / training.LOG_FILE
    log.write_text(log.read_text() + "{damaged\n")  # a resume rewrites the log without it
    before = log.read_bytes()
    result, _ = run_child(FULL_DISK_TRAINING, tmp_path, 4, max_file_bytes=len(before) // 2)
    assert result["kind"] == "OutputError" and "\n" not in result["message"], result
    assert result["message"].startswith(f"cannot rewrite the training log {log}"), result
    assert log.read_bytes() == before  # before: cut to what fitted
    # a checkpoint the disk cannot hold: said as a full disk, not as torch's "unexpected pos"
    result, _ = run_child(FULL_DISK_TRAINING, tmp_path, 5, max_file_bytes=64_000)
    assert result["kind"] == "OutputError" and "\n" not in result["message"], result
    assert "the disk is full or a file size limit was reached" in result["message"], result
    assert training.trained_steps(tmp_path) == 4 and not (tmp_path / training.UNFINISHED_STATE_FILE).exists()


def test_a_stop_logs_the_steps_since_the_last_log_line_as_stop_after_does(tmp_path, monkeypatch):
    """Before: a stop between two log lines saved its steps in the checkpoint but left them out of log.jsonl, so the
    resumed run's next line averaged only the steps after the stop."""
    recipe = training.Recipe(videos_per_batch=2, curriculum=((0, 2), (3, 4)), log_every=4, checkpoint_every=4,
                             warmup_steps=1, long_range=LongRange(steps=0))
    _stop_at(monkeypatch, 3)
    with pytest.raises(Stopped):
        training.train(recipe, tmp_path / "stopped", threads=1)
    monkeypatch.undo()
    training.train(recipe, tmp_path / "split", threads=1, stop_after=3)

    def logged(run):
        lines = [json.loads(line) for line in (tmp_path / run / training.LOG_FILE).read_text().splitlines()]
        return [{k: v for k, v in line.items() if "seconds" not in k} for line in lines]

    assert [line["step"] for line in logged("stopped")] == [3]
    assert logged("stopped") == logged("split")
