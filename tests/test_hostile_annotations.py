"""Hostile annotation rows: every row statekv does not use is refused or counted and named in one warning line (and
in ``--check``); times past the video are asked at its end with a warning where the video is known; a negative
evidence frame in a streaming synthetic set is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import statekv.eval as ev
from statekv.cli import main
from statekv.eval.fabricate import write_mini_mlvu, write_mini_ovobench, write_mini_streamingbench, write_mini_videomme
from statekv.eval.lmms_plugin import query_time, round_times
from statekv.eval.questions import AnnotationError
from statekv.synthetic.benchmark import STREAMING_FILE, make_benchmark


def _warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _check(capsys, *argv) -> tuple[int, str]:
    code = main(["eval", *map(str, argv), "--check"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture
def ovo(tmp_path) -> Path:
    write_mini_ovobench(tmp_path, clips=False)
    return tmp_path


# ------------------------------------------------------------------------------------------ rows not used


def test_ovobench_rows_of_an_unknown_task_are_counted_in_one_warning_line(ovo, caplog, capsys):
    path = ovo / "ovobench" / "ovo_bench_new.json"
    _edit(path, lambda rows: (rows[1].update(task="XYZ"), rows[3].update(task="XYZ"), rows[4].update(task=None)))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        questions = ev.load_benchmark("ovobench", ovo, check_videos=False)
    assert len(questions) == 8 - 3
    (line,) = _warnings(caplog)
    assert line == (f"OVO-Bench: 2 row(s) of task 'XYZ', which OVO-Bench does not define, not used (its code skips "
                    f"them too): {path} row 1, {path} row 3; 1 row(s) of task 'None', which OVO-Bench does not "
                    f"define, not used (its code skips them too): {path} row 4")
    code, out = _check(capsys, "ovobench", "--data-root", ovo)
    assert code == 0 and f"not used or read otherwise: {line}\n" in out


def test_a_check_of_a_file_with_no_usable_row_fails_as_its_run_would(ovo, capsys):
    _edit(ovo / "ovobench" / "ovo_bench_new.json", lambda rows: [row.update(task="XYZ") for row in rows])
    code, out = _check(capsys, "ovobench", "--data-root", ovo)
    assert code == 2 and f"no ovobench questions found under {ovo}" in out


def test_an_ovobench_row_without_a_task_is_refused(ovo):
    path = ovo / "ovobench" / "ovo_bench_new.json"
    _edit(path, lambda rows: rows[2].pop("task"))
    with pytest.raises(AnnotationError, match=f"^{path} row 2: missing field task \\(the release's code fails on "
                                              "such a row too\\)$"):
        ev.load_benchmark("ovobench", ovo, check_videos=False)


def test_streamingbench_questions_of_an_unknown_task_are_counted(tmp_path, caplog):
    folder = write_mini_streamingbench(tmp_path)
    _edit(folder / "questions_real.json", lambda entries: entries[1]["questions"][0].update(task_type="Telepathy"))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        questions = ev.load_benchmark("streamingbench", tmp_path, check_videos=False)
    assert "Telepathy" not in {q.task_type for q in questions}
    (line,) = _warnings(caplog)
    assert line.startswith("StreamingBench: 1 question(s) of task 'Telepathy' not used (not a StreamingBench task): "
                           f"{folder}/questions_real.json entry 1 question 0; ")
    assert "1 question(s) of task 'Emotion Recognition' not used (omni-source: about the sound track)" in line


def test_mlvu_rows_outside_the_seven_tasks_are_a_warning(tmp_path, caplog):
    folder = write_mini_mlvu(tmp_path, fmt="jsonl")
    path = next((folder / "mlvu").glob("test*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["task_type"] = "summary"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        questions = ev.load_benchmark("mlvu", tmp_path, check_videos=False)
    assert len(questions) == len(rows) - 1
    assert _warnings(caplog) == [f"MLVU: 1 row(s) of task 'summary' not used (not one of the seven multiple-choice "
                                 f"tasks): {path} row 0"]


# ------------------------------------------------------------------------------------------ videos outside the set


@pytest.mark.parametrize("name", ["/etc/passwd", "../../elsewhere/v.mp4", "videos/../../v.mp4", "."])
def test_a_video_named_outside_the_benchmarks_folder_is_refused(tmp_path, name):
    write_mini_ovobench(tmp_path / "ovo", clips=False)
    ovo = tmp_path / "ovo" / "ovobench" / "ovo_bench_new.json"
    _edit(ovo, lambda rows: rows[1].update(video=name))
    sb = write_mini_streamingbench(tmp_path / "sb") / "questions_real.json"
    _edit(sb, lambda entries: entries[0].update(video_path=name))
    mlvu = next((write_mini_mlvu(tmp_path / "mlvu", fmt="jsonl") / "mlvu").glob("test*.jsonl"))
    rows = [json.loads(line) for line in mlvu.read_text().splitlines()]
    rows[0]["video_name"] = name
    mlvu.write_text("".join(json.dumps(row) + "\n" for row in rows))
    synthetic = tmp_path / "synthetic"
    make_benchmark(synthetic, videos=1, seed=72, num_frames=12, streaming=True)
    _edit(synthetic / STREAMING_FILE, lambda rows: rows[0].update(video=name))
    videomme = next((write_mini_videomme(tmp_path / "vm", videos=1, fmt="jsonl") / "videomme").glob("test*.jsonl"))
    rows = [json.loads(line) for line in videomme.read_text().splitlines()]
    rows[0]["videoID"] = name
    videomme.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for benchmark, root, where, field in [("ovobench", tmp_path / "ovo", f"{ovo} row 1", "video"),
                                          ("videomme", tmp_path / "vm", f"{videomme} row 0", "videoID"),
                                          ("streamingbench", tmp_path / "sb", f"{sb} entry 0", "video_path"),
                                          ("mlvu", tmp_path / "mlvu", f"{mlvu} row 0", "video_name"),
                                          ("synthetic", synthetic, f"{synthetic / STREAMING_FILE} row 0", "video")]:
        if name.startswith("/") and benchmark == "streamingbench":
            continue  # read under videos/ (the next test)
        with pytest.raises(AnnotationError) as refused:
            ev.load_benchmark(benchmark, root, check_videos=False)
        assert str(refused.value).startswith(f"{where}: field '{field}' ({name!r}) must be a path inside "), benchmark


def test_an_ovobench_id_naming_a_clip_outside_its_folder_or_another_rows_poll_is_refused(tmp_path):
    """Before: an id with ``..`` named a clip outside chunked_videos/, and a row whose id is another row's poll id
    (``{id}_{j}``) silently replaced that poll's answer."""
    folder = tmp_path / "ovo" / "ovobench"
    write_mini_ovobench(tmp_path / "ovo", clips=False)
    annotations = folder / "ovo_bench_new.json"
    rows = json.loads(annotations.read_text())
    forward = next(index for index, row in enumerate(rows) if row["task"] == "REC")
    choice = next(index for index, row in enumerate(rows) if row["task"] != "REC" and "realtime" in row)
    for changed, phrase in (({"id": "../../x"}, "field 'id' ('../../x.mp4') must be a path inside"),
                            ({"id": f"{rows[forward]['id']}_0"}, f"question id {rows[forward]['id']}_0 repeats")):
        edited = [dict(row) for row in rows]
        edited[choice].update(changed)
        annotations.write_text(json.dumps(edited))
        with pytest.raises(AnnotationError) as refused:
            ev.load_benchmark("ovobench", tmp_path / "ovo", check_videos=False)
        assert phrase in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_video_paths_as_the_releases_write_them_are_read(tmp_path, caplog):
    folder = write_mini_streamingbench(tmp_path)
    _edit(folder / "questions_real.json", lambda entries: entries[0].update(video_path="./videos/a.mp4"))
    questions = ev.load_benchmark("streamingbench", tmp_path, check_videos=False)
    assert folder / "videos" / "a.mp4" in {question.video_path for question in questions}
    # StreamingBench's preprocess.sh rewrites each path to where its checkout keeps the video
    _edit(folder / "questions_real.json", lambda entries: entries[0].update(video_path="/home/x/src/data/videos/a.mp4"))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        again = ev.load_benchmark("streamingbench", tmp_path, check_videos=False)
    assert [(q.video_id, q.video_path) for q in again] == [(q.video_id, q.video_path) for q in questions]
    assert "1 video path(s) absolute, as the release's preprocess.sh writes them, read under videos/" in caplog.text


# ------------------------------------------------------------------------------------------ times past the video


def test_times_far_past_the_video_are_named_by_the_check(ovo, capsys, caplog):
    path = ovo / "ovobench" / "ovo_bench_new.json"
    _edit(path, lambda rows: (rows[0].update(realtime=10**6), rows[-1]["test_info"][0].update(realtime=5000)))
    code, out = _check(capsys, "ovobench", "--data-root", ovo)
    assert code == 0
    assert (f"2 question(s) come after their video ends and are asked at its end (the first: 100 at 1000000 s, "
            f"{ovo}/ovobench/src_videos/Fabricated/source0.mp4 lasts 6.0 s)") in out


def test_a_time_stamp_of_99_99_99_is_noted_and_named_past_the_end(tmp_path, capsys):
    folder = write_mini_streamingbench(tmp_path)
    _edit(folder / "questions_real.json", lambda entries: entries[0]["questions"][0].update(time_stamp="99:99:99"))
    code, out = _check(capsys, "streamingbench", "--data-root", tmp_path)
    assert code == 0
    assert ("1 time(s) with minutes or seconds past 59, read as the release's code reads them ('99:99:99' is "
            f"362439 s): {folder}/questions_real.json entry 0 question 0: field 'time_stamp'") in out
    assert "1 question(s) come after their video ends and are asked at its end (the first: real-0 at 362439 s" in out


def test_a_run_asks_a_question_past_the_end_at_the_end_and_says_so(tmp_path, caplog):
    root = tmp_path / "set"
    make_benchmark(root, videos=1, seed=71, num_frames=12, streaming=True)
    _edit(root / STREAMING_FILE, lambda rows: rows[0].update(realtime=99_999))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        code = main(["eval", "synthetic", "--model", "builtin", "--method", "recency", "--frames", "4", "--data-root",
                     str(root), "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 0
    (line,) = _warnings(caplog)
    assert line == (f"{root}/videos/v0000.mp4: 1 question(s) come after the video ends at 12.0 s and are asked at "
                    "its end (the first: 0 at 99999 s)")
    answers = {r.qid: r for r in ev.run_records(tmp_path / "run")}
    assert answers["0"].extra["frames"] == 12  # the whole video, as at its end


# ------------------------------------------------------------------------------------------ streaming synthetic


def test_a_negative_evidence_frame_in_a_streaming_set_is_refused(tmp_path):
    root = tmp_path / "set"
    make_benchmark(root, videos=1, seed=72, num_frames=12, streaming=True)
    _edit(root / STREAMING_FILE, lambda rows: rows[2].update(evidence=[-1]))
    with pytest.raises(AnnotationError, match=f"^{root / STREAMING_FILE} row 2: evidence holds -1, not a frame "
                                              r"\(0-based\)$"):
        ev.load_benchmark("synthetic", root, check_videos=False)


# ------------------------------------------------------------------------------------------ the lmms-eval plugin


@pytest.mark.parametrize("time", [1e300, 10**400], ids=["1e300", "400 digits"])
def test_a_time_no_stream_reaches_is_refused_in_one_short_line(ovo, capsys, time):
    """Before: 1e300 was asked at the video's end and the check printed it as a number of 301 digits; an integer of
    400 digits raised Python's own OverflowError."""
    path = ovo / "ovobench" / "ovo_bench_new.json"
    _edit(path, lambda rows: rows[0].update(realtime=time))
    with pytest.raises(AnnotationError, match=r"field 'realtime' must be a number of seconds from 0 to 1e\+11, got ") \
            as refused:
        ev.load_benchmark("ovobench", ovo, check_videos=False)
    assert len(str(refused.value)) < len(str(path)) + 150


def test_the_plugin_reads_ovobench_documents_with_the_same_loader(ovo):
    rows = json.loads((ovo / "ovobench" / "ovo_bench_new.json").read_text())
    choice, polled = rows[0], rows[-1]
    assert query_time({**choice, "options": ["a", "a", "b", "c", "d"], "gt": 4}) == choice["realtime"]
    assert round_times(polled, 2) == [5.5, 3.0]
    with pytest.raises(AnnotationError, match="^ovo_realtime doc 0: field 'realtime' must be a number of seconds "
                                              "from 0 to 1e\\+11, got -1$"):
        query_time({**choice, "realtime": -1}, where="ovo_realtime doc 0")
    with pytest.raises(AnnotationError, match=r"test_info\[1\]: count must be a whole number >= 0"):
        round_times({**polled, "test_info": [polled["test_info"][0], {"realtime": 3, "count": "two"}]}, 2)
    assert query_time({**choice, "task": "XYZ"}) is None  # not OVO-Bench's: asked from its clip, as any document


def test_a_streamingbench_video_with_no_questions_is_counted_in_the_warning_line(tmp_path, caplog):
    """Before: it was dropped without a word."""
    write_mini_streamingbench(tmp_path)
    path = tmp_path / "streamingbench" / "questions_real.json"
    before = len(ev.load_benchmark("streamingbench", tmp_path, check_videos=False))
    _edit(path, lambda entries: entries[0].update(questions=[]))
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        questions = ev.load_benchmark("streamingbench", tmp_path, check_videos=False)
    assert len(questions) == before - 1
    assert f"1 video(s) with no questions, not used: {path} entry 0" in " ".join(_warnings(caplog))


def test_mlvu_question_ids_that_repeat_are_numbered_by_row_and_said(tmp_path, caplog):
    """Before: one repeated question_id renumbered every question of the file without a word."""
    from statekv.eval.loaders import mlvu_questions

    rows = [{"video_name": f"clip{n}.mp4", "question": "Which?", "candidates": ["a", "b", "c", "d"], "answer": "A",
             "task_type": "count", "question_id": f"q{n}"} for n in range(3)]
    folder = tmp_path / "mlvu"
    assert [q.qid for q in mlvu_questions(rows, folder, check_videos=False, source="dev.json")] == ["q0", "q1", "q2"]
    rows[2]["question_id"] = "q0"
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        questions = mlvu_questions(rows, folder, check_videos=False, source="dev.json")
    assert [q.qid for q in questions] == ["0", "1", "2"]
    assert _warnings(caplog) == ["dev.json: rows 0 and 2 share question_id 'q0', so its questions are numbered by "
                                 "their rows"]
    caplog.clear()
    for row in rows:
        del row["question_id"]  # the released dev file has none: numbered by row, as documented, without a warning
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        mlvu_questions(rows, folder, check_videos=False, source="dev.json")
    assert _warnings(caplog) == []
