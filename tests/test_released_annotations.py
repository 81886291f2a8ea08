"""The benchmarks' own annotation files load whole, read as their releases' code reads them.

The rows statekv once refused are copied from the releases into tests/data/releases (see its README): a repeated
option is kept as listed (the letter is the answer), a question is prompted with as many letters as the
release's code gives it (OVO-Bench: all of them; StreamingBench: A to D, its template's four places). The whole
released files are read when they are present under ``$STATEKV_BENCHMARKS`` (default ``data/benchmarks`` in the
checkout; docs/evaluation.md, "The released annotation files", has the commands that fetch them) and skipped,
with the reason, otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

import statekv.eval as ev
from statekv.cli import main
from statekv.eval import ovobench, streamingbench

REPO = Path(__file__).resolve().parents[1]
ROWS = Path(__file__).resolve().parent / "data" / "releases"
RELEASES = Path(os.environ.get("STATEKV_BENCHMARKS", REPO / "data" / "benchmarks"))
FETCH = "docs/evaluation.md, 'The released annotation files', fetches them"


@pytest.fixture
def rows_root(tmp_path: Path) -> Path:
    """The copied rows in statekv's layout (``<root>/ovobench``, ``<root>/streamingbench``)."""
    shutil.copytree(ROWS / "ovobench", tmp_path / "ovobench")
    shutil.copytree(ROWS / "streamingbench", tmp_path / "streamingbench")
    return tmp_path


# ------------------------------------------------------------------------------------------ the rows that broke


def test_ovobench_rows_with_a_repeated_option_keep_it_and_its_letter(rows_root):
    questions = {q.qid: q for q in ev.load_benchmark("ovobench", rows_root, check_videos=False)}
    stu, ojr, acr = questions["642"], questions["831"], questions["1303"]
    assert stu.options[0] == stu.options[2] and stu.answer == "D" and stu.letters == "ABCD"
    assert ojr.options[:2] == ("A wooden bridge.", "A wooden bridge.") and ojr.answer == "A"
    assert acr.options[0] == acr.options[3] == "She is waving her hands." and acr.answer == "D"
    # prompted as the release's build_prompt lists them: every option, its letter before it
    assert "Options:\nA. A wooden bridge.; B. A wooden bridge.; C. A stone bridge.; D. A stone house.;\n" in \
        ev.build_prompt(ojr)
    assert ev.judge("ovobench", "A", answer=ojr.answer, letters=ojr.letters) == ("A", True)
    assert ev.judge("ovobench", "B", answer=ojr.answer, letters=ojr.letters) == ("B", False)  # as the release scores


def test_ovobench_five_options_are_prompted_with_five_letters(rows_root):
    five = {q.qid: q for q in ev.load_benchmark("ovobench", rows_root, check_videos=False)}["8"]
    assert five.letters == "ABCDE" and five.answer == "D"
    assert "A. two; B. three; C. four; D. five; E. six;" in ev.build_prompt(five)


def test_streamingbench_six_options_are_prompted_a_to_d_as_the_release_prompts_them(rows_root, caplog):
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        contextual = ev.load_benchmark("streamingbench", rows_root, check_videos=False, groups=["contextual"])
    assert [q.task_type for q in contextual] == ["Anomaly Context Understanding"] * 3
    six = contextual[0]
    assert six.options == tuple(json.loads((ROWS / "streamingbench" / "questions_omni.json").read_text())[1][
        "questions"][0]["options"][:4]) and six.answer == "B" and six.letters == "ABCD"
    prompt = ev.build_prompt(six)
    assert prompt.endswith("D. a woman in a green shirt and blue jeans walks into the room with a cake.\n\nThe best "
                           "option is:") and "E. ." not in prompt and "DeepL" not in prompt
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # one line accounts for everything the file holds that is not used
    assert "1 question(s) of task 'Scene Understanding' not used (omni-source: about the sound track)" in warnings[0]
    assert "2 question(s) asked with A to D only, as the release's prompt shows them (their options past D are not " \
           "used)" in warnings[0]
    assert "questions_omni.json entry 1 question 0, " in warnings[0] and "entry 2 question 0" in warnings[0]


def test_streamingbench_times_are_read_as_the_release_reads_them(rows_root, caplog):
    with caplog.at_level(logging.WARNING, logger="statekv.eval"):
        real = ev.load_benchmark("streamingbench", rows_root, check_videos=False, groups=["realtime"])
    assert [q.realtime for q in real] == [31.0, 740.0, 12450.0, 24.0]  # "00:12450": 12450 s, "00:24": 24 s
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "1 time(s) with minutes or seconds past 59, read as the release's code reads them ('00:12450' is " \
           "12450 s): " in warning and "entry 1 question 1" in warning


def test_the_rows_pass_the_check_command(rows_root, capsys):
    assert main(["eval", "ovobench", "--data-root", str(rows_root), "--check"]) == 0
    out = capsys.readouterr().out
    assert ("every annotation row parses: 5 questions (16 answers to give: a forward question is asked at each of its "
            "polls); 0 of 5 videos readable") in out
    assert main(["eval", "streamingbench", "--data-root", str(rows_root), "--check"]) == 0
    out = capsys.readouterr().out
    assert "every annotation row parses: 7 questions" in out and "not used or read otherwise: StreamingBench: " in out



@pytest.mark.parametrize("benchmark, name", [("ovobench", "ovo_bench_new.json"),
                                             ("streamingbench", "questions_real.json")])
def test_a_file_an_editor_saved_with_a_byte_order_mark_loads_as_the_release(rows_root, benchmark, name):
    """Before: a file that begins with UTF-8's byte-order mark (what some editors write) was refused as
    not valid JSON."""
    groups = {"groups": ["realtime"]} if benchmark == "streamingbench" else {}
    released = ev.load_benchmark(benchmark, rows_root, check_videos=False, **groups)
    path = rows_root / benchmark / name
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert ev.load_benchmark(benchmark, rows_root, check_videos=False, **groups) == released


# ------------------------------------------------------------------------------------------ the whole releases


def _release(*parts: str) -> Path:
    path = RELEASES.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"the released file {path} is not here ({FETCH})")
    return path


def test_the_whole_ovobench_release_loads():
    rows = json.loads(_release("ovobench", "ovo_bench_new.json").read_text())
    questions = ev.load_benchmark("ovobench", RELEASES, check_videos=False)
    assert len(rows) == 1640 and len({q.item_id for q in questions}) == 1640
    assert len({q.video_id for q in questions}) == 644
    assert len(questions) == 3035  # with the forward polls
    assert {group: sum(q.group == group for q in questions) for group in ovobench.GROUPS} == {
        "backward": 631, "realtime": 837, "forward": 1567}
    realtime = ev.load_benchmark("ovobench", RELEASES, check_videos=False, groups=["realtime"])
    assert len(realtime) == 837


def test_the_whole_streamingbench_release_loads():
    _release("streamingbench", "questions_real.json")
    questions = ev.load_benchmark("streamingbench", RELEASES, check_videos=False)
    by_group = {group: [q for q in questions if q.group == group] for group in streamingbench.GROUPS}
    assert len(by_group["realtime"]) == 2500
    assert {task: sum(q.task_type == task for q in by_group["contextual"]) for task in streamingbench.CONTEXTUAL_TASKS} \
        == dict.fromkeys(streamingbench.CONTEXTUAL_TASKS, 250)


def test_the_whole_videomme_release_loads():
    folder = RELEASES / "videomme" / "videomme"
    if not any(folder.glob("test*.parquet")):
        pytest.skip(f"the released VideoMME annotations are not in {folder} ({FETCH})")
    pytest.importorskip("pyarrow")
    questions = ev.load_benchmark("videomme", RELEASES, check_videos=False)
    assert len(questions) == 2700 and len({q.video_id for q in questions}) == 900


def test_the_whole_mlvu_release_loads():
    folder = RELEASES / "mlvu"
    if not any(folder.rglob("test*.parquet")):
        pytest.skip(f"the released MLVU dev annotations are not under {folder} ({FETCH})")
    pytest.importorskip("pyarrow")
    from statekv.eval.annotations import find_annotation_files, read_rows

    rows = read_rows(find_annotation_files([folder / "mlvu", folder], "test"))
    questions = ev.load_benchmark("mlvu", RELEASES, check_videos=False)
    assert len(questions) == sum(row["task_type"] in ev.MLVU_TASKS for row in rows) > 0


@pytest.mark.parametrize("benchmark", ["ovobench", "streamingbench"])
def test_the_check_command_reads_the_whole_release(benchmark, capsys):
    _release(benchmark, "ovo_bench_new.json" if benchmark == "ovobench" else "questions_real.json")
    assert main(["eval", benchmark, "--data-root", str(RELEASES), "--check"]) == 0
    out = capsys.readouterr().out
    total = {"ovobench": "3,035", "streamingbench": "3,500"}[benchmark]
    assert f"every annotation row parses: {total} questions" in out


def test_json_lines_with_a_byte_order_mark_load(tmp_path):
    from statekv.eval.annotations import read_table

    path = tmp_path / "questions.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "a"}\n{"question": "b"}\n')
    assert read_table(path) == [{"question": "a"}, {"question": "b"}]
