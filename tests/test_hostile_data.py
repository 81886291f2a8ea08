"""Hostile data and sizes: damaged question files are one line naming the file and the row or field; documented
ranges and sizes are enforced before any work starts; pipes and devices are refused, never waited on; a missing
or read-only home folder is one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import statekv.eval as ev
from statekv.cli import main
from statekv.errors import StateKVError
from statekv.eval.questions import AnnotationError
from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark
from statekv.user_cache import cache_dir


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-data") / "set"
    make_benchmark(root, videos=2, seed=51, num_frames=12)
    return root


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Question files
# ---------------------------------------------------------------------------------------------------------------
def _row_edit(field, value):
    def edit(rows):
        rows[1][field] = value
    return edit


def _second_video_under_the_first_id(rows):
    other = next(row for row in rows if row["video_id"] != rows[0]["video_id"])
    other["video_id"] = rows[0]["video_id"]


QUESTION_DAMAGE = {
    "a null question": (_row_edit("question", None), "row 1: field 'question' must be a non-empty text"),
    "a list question": (_row_edit("question", ["What?"]), "row 1: field 'question' must be a non-empty text"),
    "an empty question": (_row_edit("question", "  "), "row 1: field 'question' must be a non-empty text, got empty"),
    "an object question id": (_row_edit("qid", {"a": 1}), "row 1: field 'qid'"),
    "options as an object": (_row_edit("options", {"A": "red", "B": "blue"}), "row 1: options must be a list"),
    "options as text": (_row_edit("options", "red, blue"), "row 1: options must be a list"),
    "a repeated option": (_row_edit("options", ["red", "blue", "red", "green"]), "option 'red' appears twice"),
    "an empty option": (_row_edit("options", ["red", "", "blue", "green"]), "row 1: option 1 must be a non-empty"),
    "a null option": (_row_edit("options", ["red", None, "blue", "green"]), "row 1: option 1 must be a non-empty"),
    "an answer as a list": (_row_edit("answer", ["A"]), "row 1: field 'answer'"),
    "one video id for two videos": (_second_video_under_the_first_id, "names two videos"),
    "evidence past the video's end": (_row_edit("evidence_frames", [3, 10**6]), "evidence_frames holds 1000000"),
    "a negative evidence frame": (_row_edit("evidence_frames", [-1]), "evidence_frames holds -1"),
    "evidence as text": (_row_edit("evidence_frames", "3"), "field 'evidence_frames' must be a non-empty list"),
    "no evidence": (_row_edit("evidence_frames", []), "field 'evidence_frames' must be a non-empty list"),
    "evidence twice": (_row_edit("evidence_frames", [2, 2]), "names a frame twice"),
    "num_frames zero": (_row_edit("num_frames", 0), "field 'num_frames' must be a positive integer"),
    "num_frames as text": (_row_edit("num_frames", "12"), "field 'num_frames' must be a positive integer"),
}


@pytest.mark.parametrize("case", QUESTION_DAMAGE)
def test_damaged_question_files_are_one_line_naming_the_file_and_the_row(case, data, tmp_path, capsys):
    edit, phrase = QUESTION_DAMAGE[case]
    root = tmp_path / "set"
    shutil.copytree(data, root)
    path = root / QUESTIONS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(AnnotationError, match=phrase.replace("(", r"\(").replace(")", r"\)")) as info:
        ev.load_benchmark("synthetic", root)
    assert "\n" not in str(info.value) and (str(path) in str(info.value) or "video id" in str(info.value))
    code, err = _cli(capsys, "eval", "synthetic", "--model", "builtin", "--data-root", root, "--out",
                     tmp_path / "run", "--no-progress")
    assert code == 2 and phrase.split(": ")[-1][:20] in _one_line(err)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_question_file_that_is_not_utf8_names_its_line(suffix, tmp_path):
    path = tmp_path / f"questions{suffix}"
    latin1 = b'[{"qid": "a"},\n {"qid": "caf\xe9"}]\n' if suffix == ".json" else b'{"qid": "a"}\n{"q": "\xff"}\n'
    path.write_bytes(latin1)
    with pytest.raises(AnnotationError, match=f"{path}:2: not UTF-8 text"):
        ev.load_benchmark("synthetic", tmp_path, annotation=path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_question_file_cut_short_names_where(suffix, tmp_path):
    path = tmp_path / f"questions{suffix}"
    path.write_text('{"qid": "a"}\n{"qid": "b' if suffix == ".jsonl" else '[{"qid": "a"},\n {"qid": "b')
    where = f"{path}:2: not valid JSON (Unterminated string starting at: column 9)" if suffix == ".jsonl" else \
        f"{path}: not valid JSON (Unterminated string starting at: line 2 column 10)"
    with pytest.raises(AnnotationError) as info:
        ev.load_benchmark("synthetic", tmp_path, annotation=path)
    assert str(info.value) == where


def test_a_question_file_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(AnnotationError, match="nested too deeply"):
        ev.load_benchmark("synthetic", tmp_path, annotation=path)


def test_a_damaged_parquet_file_is_one_line(tmp_path):
    path = tmp_path / "test-00000.parquet"
    path.write_bytes(b"PAR1 but not really")
    with pytest.raises(AnnotationError, match="not a readable parquet file"):
        ev.load_benchmark("videomme", tmp_path, annotation=path)


# ---------------------------------------------------------------------------------------------------------------
# Ranges and sizes, before any work
# ---------------------------------------------------------------------------------------------------------------
SIZE_CASES = {
    "a training seed": (["synthetic", "make", "--videos", "1", "--seed", "1000000"], "reserved for training"),
    "a seed past every range": (["synthetic", "make", "--videos", "1", "--seed", str(2**40)], "outside the evaluation"),
    "a negative seed": (["synthetic", "make", "--videos", "1", "--seed", "-1"],
                        "seed must be an integer of at least 0"),
    "absurdly many videos": (["synthetic", "make", "--videos", str(10**12), "--seed", "1"], "at most 100000"),
    "absurdly long videos": (["synthetic", "make", "--videos", "1", "--seed", "1", "--frames", str(10**9)],
                             "argument --frames: expected frames per video from 12 to 36000, got '1000000000'"),
    "videos too short for every family": (["synthetic", "make", "--videos", "1", "--seed", "1", "--frames", "5"],
                                          "argument --frames: expected frames per video from 12 to 36000, got '5'"),
    "more than the disk holds": (["synthetic", "make", "--videos", "100000", "--seed", "1", "--frames", "36000"],
                                 "MiB are free"),
    "a family asked twice": (["synthetic", "make", "--videos", "1", "--seed", "1", "--families", "count,count"],
                             "question family 'count' is given twice"),
    "flops over an absurd horizon": (["flops", "--frames", str(10**9)], "more than the 100000 frames"),
    "more training threads than cores": (["train-builtin", "--threads", str(10**5)], "CPU cores"),
}


@pytest.mark.parametrize("case", SIZE_CASES)
def test_ranges_and_sizes_are_refused_before_any_work(case, tmp_path, capsys):
    argv, phrase = SIZE_CASES[case]
    if argv[0] in ("synthetic", "train-builtin"):
        argv = [*argv, "--out", tmp_path / "out"]
    code, err = _cli(capsys, *argv)
    assert code == 2 and phrase in _one_line(err)
    assert not (tmp_path / "out").exists()


def test_a_synthetic_set_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, err = _cli(capsys, "synthetic", "make", "--videos", "1", "--seed", "1", "--frames", "12", "--out",
                     tmp_path / "afile" / "sub")
    assert code == 2 and "afile is a file, so no folder can be made there" in _one_line(err)


def test_the_evaluation_seed_range_ends_where_training_begins():
    with pytest.raises(StateKVError, match="reserved for training"):
        make_benchmark("unused", videos=1, seed=1_000_000)
    with pytest.raises(StateKVError, match="outside the evaluation"):
        make_benchmark("unused", videos=1, seed=2**32)
    assert not Path("unused").exists()


# ---------------------------------------------------------------------------------------------------------------
# Pipes and devices are refused, never waited on
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["a named pipe", "a device", "a pipe among images", "a folder among images",
                                  "a broken link among images"])
def test_non_regular_files_are_refused_at_once(kind, tmp_path, capsys):
    if kind == "a named pipe":
        source = tmp_path / "camera.mp4"
        os.mkfifo(source)
    elif kind == "a device":
        source = Path("/dev/zero")
    else:
        from PIL import Image

        source = tmp_path / "frames"
        source.mkdir()
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(source / "0.png")
        if kind == "a pipe among images":
            os.mkfifo(source / "1.png")
        elif kind == "a folder among images":
            (source / "1.png").mkdir()
        else:
            (source / "1.png").symlink_to(tmp_path / "gone.png")
    code, err = _cli(capsys, "answer", source, "What?", "--model", "builtin")
    kind = {"a pipe among images": "a named pipe", "a device": "a named pipe"}.get(kind, kind)
    assert code == 2 and f"not a regular file ({kind.split(' among')[0]}" in _one_line(err)


def test_a_broken_link_given_as_the_video_is_called_one(tmp_path, capsys):
    """Before: it was "no such file or folder", though the link is right there."""
    link = tmp_path / "video.mp4"
    link.symlink_to(tmp_path / "moved.mp4")
    code, err = _cli(capsys, "answer", link, "What?", "--model", "builtin")
    assert code == 2 and "video.mp4: a broken link (to " in _one_line(err) and "moved.mp4, which does not exist" in err


# ---------------------------------------------------------------------------------------------------------------
# The home folder
# ---------------------------------------------------------------------------------------------------------------
def test_without_a_home_folder_the_cache_goes_to_the_temporary_folder(monkeypatch):
    for name in ("STATEKV_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    folder = cache_dir()
    assert folder.is_absolute() and folder.parent == Path(__import__("tempfile").gettempdir())


def test_a_read_only_cache_folder_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("STATEKV_CACHE", "/sys/statekv-cache")  # read-only for everyone, root included (sysfs)
    code, err = _cli(capsys, "demo", "--model", "builtin")
    assert code == 2 and "cannot write statekv's cache in /sys/statekv-cache" in _one_line(err)


def test_a_stopped_make_says_how_many_videos_it_kept_and_a_rerun_finishes_the_same_set(tmp_path, capsys,
                                                                                        monkeypatch):
    import signal

    import statekv.synthetic.benchmark as benchmark
    from statekv.console import Stopped

    write, calls = benchmark.write_video, []

    def stopped_at_the_third(plan, path):
        calls.append(path)
        if len(calls) == 3:
            raise Stopped(signal.SIGTERM)
        return write(plan, path)

    monkeypatch.setattr(benchmark, "write_video", stopped_at_the_third)
    argv = ["synthetic", "make", "--videos", "4", "--seed", "52", "--frames", "12", "--out"]
    code, err = _cli(capsys, *argv, tmp_path / "set")
    assert code == 128 + signal.SIGTERM
    assert _one_line(err) == (f"statekv synthetic: stopped by SIGTERM; 2 of 4 videos written in {tmp_path / 'set'}; "
                              "rerun the same command to go on")
    monkeypatch.setattr(benchmark, "write_video", write)
    assert main([*argv, str(tmp_path / "set")]) == 0
    said = capsys.readouterr().out  # before: "wrote 4 videos", as if none had been kept
    assert said.startswith("wrote 4 videos (2 of them written by the make this one went on from) and 24 "
                           "questions"), said
    make_benchmark(tmp_path / "whole", videos=4, seed=52, num_frames=12)
    for name in ("questions.jsonl", *(f"videos/v000{index}.mp4" for index in range(4))):
        assert (tmp_path / "set" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
