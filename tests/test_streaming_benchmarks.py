"""OVO-Bench (all three groups) and StreamingBench read from small files in their released formats, malformed
files as one-line errors, and their scoring rules on hand-made answers (the official code's where it differs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import statekv.eval as ev
from statekv.eval import ovobench, streamingbench
from statekv.eval.questions import Question, counted
from statekv.eval.records import AnswerRecord


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def choice_row(qid: int, task: str, video: str, realtime: float, gt: int = 0) -> dict:
    return {"id": qid, "task": task, "video": video, "realtime": realtime, "question": f"Question {qid}?",
            "answer": f"option {gt}", "options": ["option 0", "option 1", "option 2", "option 3"], "gt": gt}


# the release's forward rows: REC counts so far, SSR whether a step is under way, CRR whether the clue is there
FORWARD_ROWS = [
    {"id": 1558, "task": "REC", "video": "p/video_4017.mp4", "activity": "jump", "start_times": [6],
     "end_times": [17], "test_info": [{"realtime": 17, "count": 1}, {"realtime": 32.0, "count": 2}]},
    {"id": 1516, "task": "SSR", "video": "COIN/x.mp4", "tutorial": "T", "all_steps": ["a", "b"],
     "start_time": [25, 31], "end_time": [30, 49],
     "test_info": [{"realtime": 27, "step": "a", "type": 1}, {"realtime": 26, "step": "b", "type": 0}]},
    {"id": 1468, "task": "CRR", "video": "MovieNet/m.mp4", "question": "What does she do?", "answer": "walks",
     "ask_time": 297, "clue_time": 308, "test_info": [{"realtime": 297, "type": 0}, {"realtime": 310, "type": 1}]},
]
OVO_ROWS = [choice_row(0, "EPM", "Ego4D/e.mp4", 215, gt=2), choice_row(631, "STU", "Games/g.mp4", 172, gt=1),
            choice_row(632, "OCR", "Games/g.mp4", 10.9, gt=3), *FORWARD_ROWS]


@pytest.fixture
def ovo_root(tmp_path: Path) -> Path:
    folder = tmp_path / "ovobench"
    folder.mkdir()
    (folder / "ovo_bench_new.json").write_text(json.dumps(OVO_ROWS))
    for video in {row["video"] for row in OVO_ROWS}:
        touch(folder / "src_videos" / video)
    return tmp_path


def test_ovobench_reads_all_three_groups_each_poll_a_question(ovo_root):
    questions = ev.load_ovobench(ovo_root)
    assert [q.qid for q in questions] == ["0", "631", "632", "1558_0", "1558_1", "1516_0", "1516_1", "1468_0",
                                          "1468_1"]
    by_id = {q.qid: q for q in questions}
    assert (by_id["0"].group, by_id["631"].group, by_id["1558_0"].group) == ("backward", "realtime", "forward")
    rec = by_id["1558_1"]
    assert (rec.kind, rec.answer, rec.realtime, rec.item_id, rec.options) == ("count", "2", 32.0, "1558", ())
    assert rec.question == "How many times did they jump?"
    assert rec.clip_path == ovo_root / "ovobench" / "chunked_videos" / "1558_1.mp4"
    assert (by_id["1516_0"].kind, by_id["1516_0"].answer, by_id["1516_0"].question) == ("yesno", "Yes", "a")
    assert (by_id["1516_1"].answer, by_id["1468_0"].answer, by_id["1468_1"].answer) == ("No", "No", "Yes")
    assert by_id["1468_1"].question == "What does she do?"
    assert [q.qid for q in ev.load_ovobench(ovo_root, groups=("backward", "forward"))][:2] == ["0", "1558_0"]
    assert [q.qid for q in ev.load_ovobench_realtime(ovo_root)] == ["631", "632"]
    # the polls of one forward question are asked in time order on its video's stream
    ssr = next(group for group in ev.group_by_video(questions) if group.video_id == "COIN/x.mp4")
    assert [q.qid for q in ssr.questions] == ["1516_1", "1516_0"]
    # what a run's log counts: answers, where forward questions are asked at each of their polls
    assert counted(questions) == "answers to give (6 questions, a forward one asked at each of its polls)"
    assert counted(questions[:3]) == "questions to answer"


def test_ovobench_prompts_are_the_releases():
    questions = {q.task_type: q for q in ovobench.ovobench_questions(OVO_ROWS, Path("/o"), check_videos=False,
                                                                     source="rows")}
    assert ev.build_prompt(questions["REC"]).startswith(
        "\nYou're watching a video in which people may perform a certain type of action repetively. \n")
    assert "Now, answer the following question: How many times did they jump?\n" in ev.build_prompt(
        questions["REC"])
    assert ev.build_prompt(questions["SSR"]).endswith(
        "\nb\nYour task is to determine if the man or woman in the video is currently performing this step.\n"
        "Answer only with \u201cYes\u201d or \u201cNo\u201d.\nDo not include any additional text or explanation in "
        "your response.\n")  # the last SSR poll: step b
    assert "the end of the video.\nWhat does she do?\nDecide whether" in ev.build_prompt(questions["CRR"])
    assert ev.build_prompt(questions["EPM"]) == ovobench.choice_prompt("Question 0?", questions["EPM"].options,
                                                                       "ABCD")


@pytest.mark.parametrize("lmms_name", ["REC_PROMPT_TEMPLATE", "SSR_PROMPT_TEMPLATE", "CRR_PROMPT_TEMPLATE",
                                       "BR_PROMPT_TEMPLATE"])
def test_forward_templates_equal_lmms_evals_copy_of_the_release(lmms_name):
    constant = pytest.importorskip("lmms_eval.tasks.ovobench.constant")
    ours = {"REC_PROMPT_TEMPLATE": ovobench.REC_TEMPLATE, "SSR_PROMPT_TEMPLATE": ovobench.SSR_TEMPLATE,
            "CRR_PROMPT_TEMPLATE": ovobench.CRR_TEMPLATE, "BR_PROMPT_TEMPLATE": ovobench.CHOICE_TEMPLATE}[lmms_name]
    placeholders = {"question": "{}", "options": "{}"}
    assert ours.format(**{k: v for k, v in placeholders.items() if "{" + k + "}" in ours}) == getattr(
        constant, lmms_name)


@pytest.mark.parametrize(("change", "message"), [
    (lambda rows: rows[3].update(test_info=[]), "row 3: field 'test_info' must be a non-empty list of polls"),
    (lambda rows: rows[3].update(test_info="17"), "row 3: field 'test_info' must be a non-empty list"),
    (lambda rows: rows[3]["test_info"][0].pop("realtime"), r"row 3 test_info\[0\]: missing field\(s\) realtime"),
    (lambda rows: rows[3]["test_info"][1].update(count=-1), r"test_info\[1\]: count must be a whole number >= 0"),
    (lambda rows: rows[4]["test_info"][0].update(type=2), r"row 4 test_info\[0\]: type must be 0 \(No\) or 1"),
    (lambda rows: rows[4]["test_info"][0].update(realtime="late"), "field 'realtime' must be a number of seconds"),
    (lambda rows: rows[5].pop("question"), r"row 5: missing field\(s\) question"),
    (lambda rows: rows[2].update(id=631), "row 2: id 631 repeats"),
    (lambda rows: rows[1].update(gt=4), "row 1: gt=4 is not an index into its 4 options"),
])
def test_malformed_ovobench_annotations_are_one_line_errors(ovo_root, change, message):
    rows = json.loads(json.dumps(OVO_ROWS))
    change(rows)
    (ovo_root / "ovobench" / "ovo_bench_new.json").write_text(json.dumps(rows))
    with pytest.raises(ev.AnnotationError, match=message) as error:
        ev.load_ovobench(ovo_root)
    assert "\n" not in str(error.value)


def test_a_broken_ovobench_file_and_an_unknown_group_are_one_line_errors_on_the_command_line(ovo_root, tmp_path):
    (ovo_root / "ovobench" / "ovo_bench_new.json").write_text('[{"id": 1, "task": "REC",')
    run = subprocess.run([sys.executable, "-m", "statekv.cli", "eval", "ovobench", "--data-root", str(ovo_root),
                          "--out", str(tmp_path / "out"), "--model", "builtin"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "ovo_bench_new.json: not valid JSON" in run.stderr
    (ovo_root / "ovobench" / "ovo_bench_new.json").write_text('[{"id": 1, "realtime": ' + "9" * 5000 + "}]")
    with pytest.raises(ev.AnnotationError, match="ovo_bench_new.json: not valid JSON .Exceeds the limit"):
        ev.load_ovobench(ovo_root)  # before: a ValueError traceback (an integer of more digits than Python reads)
    with pytest.raises(ev.AnnotationError, match="unknown OVO-Bench group 'sideways'; choose from backward"):
        ovobench.check_groups(["sideways"])
    with pytest.raises(ev.AnnotationError, match="unknown OVO-Bench group ''; choose from"):
        ovobench.check_groups([])
    assert streamingbench.check_groups(None) == tuple(streamingbench.GROUPS)
    with pytest.raises(ev.AnnotationError, match=r"unknown StreamingBench group 'omni'.*left out: it needs the sound"):
        streamingbench.check_groups(["omni"])
    with pytest.raises(ev.AnnotationError, match=r"group 'sideways'; choose from [a-z, ]+$"):
        streamingbench.check_groups(["sideways"])


# ----------------------------------------------------------------------------- StreamingBench


def sb_entry(video: str, *questions: dict) -> dict:
    return {"time": "[0:00:00 - 0:00:10]", "questions": list(questions), "video_categories": "c",
            "video_path": video}


def sb_choice(task: str, clock: str, answer: str = "B", prefixed: bool = True) -> dict:
    options = ["red", "green", "blue", "white"]
    return {"task_type": task, "question": f"Which colour at {clock}?", "time_stamp": clock, "answer": answer,
            "options": [f"{chr(65 + i)}. {o}" for i, o in enumerate(options)] if prefixed else options,
            "required_ability": "x"}


@pytest.fixture
def sb_root(tmp_path: Path) -> Path:
    folder = tmp_path / "streamingbench"
    folder.mkdir()
    real = [sb_entry("./videos/sample_1_real.mp4", sb_choice("Counting", "00:01:05")),
            sb_entry("./videos/sample_1_real.mp4", sb_choice("Object Recognition", "00:00:31", "C"))]
    omni = [sb_entry("./videos/sample_2_omni.mp4", sb_choice("Emotion Recognition", "00:00:20"),
                     sb_choice("Misleading Context Understanding", "00:00:50", "D"))]
    sqa = [[sb_entry("./videos/sample_3_sqa.mp4", sb_choice("Sequential Question Answering", "00:00:36", "A", False)),
            sb_entry("./videos/sample_3_sqa.mp4", sb_choice("Sequential Question Answering", "00:03:02", "C", False))]]
    proactive = [sb_entry("./videos/sample_4_proactive.mp4", {
        "task_type": "Proactive Output", "question": 'When the score shows 3, output "3".', "time_stamp": "00:00:20",
        "ground_truth_time_stamp": "00:00:29", "ground_truth_output": "3", "required_ability": "working memory"})]
    for name, data in (("questions_real.json", real), ("questions_omni.json", omni), ("questions_sqa.json", sqa),
                       ("questions_proactive.json", proactive)):
        (folder / name).write_text(json.dumps(data))
    for video in ("sample_1_real", "sample_2_omni", "sample_3_sqa", "sample_4_proactive"):
        touch(folder / "videos" / f"{video}.mp4")
    return tmp_path


def test_streamingbench_reads_the_groups_a_frame_model_can_take(sb_root):
    questions = ev.load_streamingbench(sb_root)
    assert [q.qid for q in questions] == ["real-0", "real-1", "omni-0", "sqa-0", "sqa-1", "proactive-0"]
    real = questions[0]
    assert (real.group, real.task_type, real.realtime, real.answer) == ("realtime", "Counting", 65.0, "B")
    assert real.video_path == sb_root / "streamingbench" / "videos" / "sample_1_real.mp4"
    assert real.options == ("A. red", "B. green", "C. blue", "D. white")
    assert questions[2].task_type == "Misleading Context Understanding"  # the emotion question is left out
    assert questions[3].context == "" and questions[4].context == (
        streamingbench.CONTEXT_OPENING + "At timestamp 00:00:36, the following question and answer occurred: "
        "Question: Which colour at 00:00:36?; Options: A. red, B. green, C. blue, D. white; Answer: A; ")
    proactive = questions[5]
    assert (proactive.kind, proactive.answer, proactive.realtime, proactive.expected_time) == (
        "proactive", "3", 20.0, 29.0)
    assert streamingbench.poll_times(proactive) == list(range(21, 34))
    assert [q.qid for q in ev.load_streamingbench(sb_root, groups=("contextual",))][0] == "omni-0"


def test_streamingbench_prompts_are_the_releases(sb_root):
    real, _, _, _, sqa, proactive = ev.load_streamingbench(sb_root)
    prompt = ev.build_prompt(real)
    assert prompt.startswith("You are an advanced video question-answering AI assistant. You have been provided "
                             "with some frames from the video and a multiple-choice question")
    assert prompt.endswith("Question: Which colour at 00:01:05?\n\nOptions:\nA. red\nB. green\nC. blue\nD. white"
                           "\n\nThe best option is:")
    assert "\n\nHere are the contextual information related to the video." in ev.build_prompt(sqa)
    assert ev.build_prompt(sqa).endswith("Options:\nA. red\nB. green\nC. blue\nD. white\n\nThe best option is:")
    assert streamingbench.poll_prompt(proactive).endswith(
        'Question: When the score shows 3, output "3". Is it the right time to output "3"? You can only answer yes '
        "or no.\n\nThe answer is:\n")


@pytest.mark.parametrize(("file", "change", "message"), [
    ("questions_real.json", lambda data: data[0]["questions"][0].update(time_stamp="1:xx"),
     r"entry 0 question 0: field 'time_stamp' must be a time as HH:MM:SS, got '1:xx'"),
    ("questions_real.json", lambda data: data[0]["questions"][0].update(time_stamp="00:00:0\u00b2"),
     r"entry 0 question 0: field 'time_stamp' must be a time as HH:MM:SS, got '00:00:0\u00b2'"),
    ("questions_real.json", lambda data: data[0]["questions"][0].update(time_stamp=65),  # before: read as 65 s,
     r"entry 0 question 0: field 'time_stamp' must be a time as HH:MM:SS, got int 65"),  # the release's code fails
    # before: OverflowError / ValueError tracebacks (a float, or Python's int conversion, cannot hold them)
    ("questions_real.json", lambda data: data[0]["questions"][0].update(time_stamp="9" * 400 + ":00"),
     r"entry 0 question 0: field 'time_stamp' must be a time as HH:MM:SS, got '9{40}': too long"),
    ("questions_real.json", lambda data: data[0]["questions"][0]["options"].pop(),
     "expected at least 4 options .the prompt lists A to D; the release's code fails on fewer., got 3"),
    ("questions_real.json", lambda data: data[1]["questions"][0].update(answer="E"), "answer 'E' is not one of ABCD"),
    ("questions_real.json", lambda data: data[1].update(questions={"a": 1}), "field 'questions' must be a list"),
    ("questions_real.json", lambda data: data.append(3), "entry 2: expected an object, got int"),
    ("questions_proactive.json", lambda data: data[0]["questions"][0].pop("ground_truth_output"),
     r"missing field\(s\) ground_truth_output"),
])
def test_malformed_streamingbench_files_are_one_line_errors(sb_root, file, change, message):
    path = sb_root / "streamingbench" / file
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ev.AnnotationError, match=message) as error:
        ev.load_streamingbench(sb_root)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("response", ["", "   ", "\n"])
def test_an_empty_streamingbench_answer_is_unparsable(response):
    assert streamingbench.judge("choice", response, answer="B", letters="ABCD") == (None, False)


def test_streamingbench_needs_its_real_time_file(sb_root):
    (sb_root / "streamingbench" / "questions_real.json").unlink()
    with pytest.raises(ev.MissingFileError, match="questions_real.json"):
        ev.load_streamingbench(sb_root)
    assert ev.load_streamingbench(sb_root, groups=["contextual"])
    with pytest.raises(ev.AnnotationError, match="omni-source is left out"):
        ev.load_streamingbench(sb_root, groups=["omni-source"])


def test_streamingbench_takes_the_groups_asked_for_whatever_file_holds_them(sb_root, caplog):
    """Before: `--groups contextual` read a contextual file's real-time rows as real-time questions, and
    `--groups realtime,contextual` without a contextual file ran the real-time group alone without a word."""
    folder = sb_root / "streamingbench"
    sqa = json.loads((folder / "questions_sqa.json").read_text())
    sqa[0][0]["questions"].append(sb_choice("Counting", "00:00:40"))  # a real-time task in a contextual file
    (folder / "questions_sqa.json").write_text(json.dumps(sqa))
    with caplog.at_level("WARNING"):
        contextual = ev.load_streamingbench(sb_root, groups=["contextual"])
    assert {q.group for q in contextual} == {"contextual"} and len(contextual) == 4
    assert "1 question(s) of the realtime group in a contextual file not used (not in --groups)" in caplog.text
    assert len(ev.load_streamingbench(sb_root)) == 7  # every group: that row as the real-time question it is
    realtime = [q.qid for q in ev.load_streamingbench(sb_root, groups=["realtime"])]  # whatever else is asked for
    assert realtime == [q.qid for q in ev.load_streamingbench(sb_root) if q.group == "realtime"] and len(realtime) == 3
    for name in ("questions_omni.json", "questions_sqa.json", "questions_proactive.json"):
        (folder / name).unlink()
    with pytest.raises(ev.MissingFileError, match="no StreamingBench question of the contextual group found in .* "
                                                  "\\(looked in questions_omni.json, questions_sqa.json, "):
        ev.load_streamingbench(sb_root, groups=["realtime", "contextual"])
    assert len(ev.load_streamingbench(sb_root)) == 2  # every group, none named: the files there


# ----------------------------------------------------------------------------- scoring


def question(benchmark: str, qid: str, task: str, group: str, answer: str, *, kind: str = "choice", item: str = "",
             **fields) -> Question:
    options = ("a", "b", "c", "d") if kind == "choice" else ()
    return Question(benchmark=benchmark, qid=qid, video_id="v", video_path=Path("/v.mp4"), question="?",
                    options=options, answer=answer, task_type=task, group=group, item=item, kind=kind,
                    realtime=1.0, **fields)


def record(q: Question, response: str, **extra) -> AnswerRecord:
    return AnswerRecord.for_answer(q, response, model="m", method="full", **extra)


@pytest.mark.parametrize(("kind", "response", "answer", "read", "correct"), [
    ("count", "3", "3", "3", True),
    ("count", "There are 1 and 2", "12", "12", True),  # the release joins every digit of the answer
    ("count", "three", "3", None, False),
    ("yesno", "Yes, it is.", "Yes", "Yes", True),
    ("yesno", "Y", "Yes", "Yes", True),
    ("yesno", "N", "Yes", "No", False),
    ("yesno", "yes", "Yes", None, False),  # case matters, as in the release
    ("yesno", "No. Yes.", "Yes", "Yes", True),  # the release asks only whether the right word occurs
    ("choice", "The answer is B", "B", "B", True),
])
def test_ovobench_answers_are_read_as_the_release_reads_them(kind, response, answer, read, correct):
    assert ev.judge("ovobench", response, answer=answer, letters="ABCD" if kind == "choice" else "",
                    kind=kind) == (read, correct)


def test_ovobench_overall_is_the_mean_of_groups_with_forward_questions_averaged_per_question():
    records = [record(question("ovobench", "0", "EPM", "backward", "A"), "A"),  # backward 100
               record(question("ovobench", "1", "OCR", "realtime", "A"), "A"),
               record(question("ovobench", "2", "ACR", "realtime", "A"), "B")]  # real-time (100 + 0) / 2 = 50
    polls = [("10", "REC", "1", "1"), ("10", "REC", "2", "5"), ("10", "REC", "3", "3"), ("10", "REC", "4", "0"),
             ("11", "REC", "1", "1"), ("12", "SSR", "Yes", "Yes")]  # REC: (2/4 + 1) / 2 = 75; SSR 100
    for number, (item, task, answer, response) in enumerate(polls):
        kind = "count" if task == "REC" else "yesno"
        records.append(record(question("ovobench", f"{item}_{number}", task, "forward", answer, kind=kind,
                                       item=item), response))
    result = ev.score(records)
    assert result.group_scores == {"backward": 100.0, "forward": pytest.approx(87.5), "realtime": 50.0}
    assert result.headline == pytest.approx((100 + 87.5 + 50) / 3)
    assert result.groups["task_type"]["REC"].questions == 2 and result.groups["task_type"]["REC"].accuracy == 75.0
    # the release pools the polls of a task: REC 3/5 = 60, forward (60 + 100) / 2 = 80
    assert result.official == pytest.approx((100 + 80 + 50) / 3)
    assert set(result.missing_tasks) == {"ASI", "HLD", "ATR", "STU", "FPD", "OJR", "CRR"}
    assert result.overall.questions == 6  # polls count once per question


def test_streamingbench_reads_the_first_character_and_times_proactive_outputs():
    q = question("streamingbench", "r", "Counting", "realtime", "B")
    assert (record(q, " B. green").parsed, record(q, " B. green").correct) == ("B", True)
    assert record(q, "The answer is B").correct is False  # the release reads the first character only
    p = question("streamingbench", "p", "Proactive Output", "contextual", "3", kind="proactive", expected_time=29.0)
    assert record(p, "It shows 3", answered_at=31, expected_at=29.0).correct is True
    assert record(p, "It shows 3", answered_at=32, expected_at=29.0).correct is False  # 3 s late
    assert record(p, "It shows 4", answered_at=29, expected_at=29.0).correct is False
    assert record(p, "no", answered_at=None, expected_at=29.0).correct is False  # never answered
    late = record(p, "It shows 3", answered_at=32, expected_at=29.0)
    assert late.rescored("paper").correct is False and record(p, "3", answered_at=30,
                                                              expected_at=29.0).rescored("paper").correct
    result = ev.score([record(q, "B"), record(question("streamingbench", "r2", "Counting", "realtime", "A"), "B"),
                       record(p, "3", answered_at=29, expected_at=29.0)])
    assert result.headline == pytest.approx(200 / 3) and result.group_scores == {"contextual": 100.0,
                                                                                  "realtime": 50.0}


def test_the_table_shows_ovobench_real_time_its_overall_and_streamingbench(tmp_path):
    import dataclasses

    runs = {"ovo": [record(question("ovobench", "0", "EPM", "backward", "A"), "B"),
                    record(question("ovobench", "1", "OCR", "realtime", "A"), "A")],
            "sb": [record(question("streamingbench", "r", "Counting", "realtime", "B"), "B")]}
    for name, records in runs.items():
        with ev.ResultsWriter(ev.rank_file(tmp_path / name, 0)) as out:
            for answer in records:
                out.write(dataclasses.replace(answer, model="Qwen3-VL-8B", method="simplestream", budget=4))
        ev.write_summary(tmp_path / name)
    assert ev.paper_table([tmp_path / "ovo", tmp_path / "sb"]) == (
        "| Model | Method | VideoMME | MLVU | OVOBench RT | OVO-Bench | StreamingBench |\n"
        "|---|---|---|---|---|---|---|\n"
        "| Qwen3-VL-8B | SimpleStream N=4 | – | – | 100.00 | 50.00 | 100.00 |\n")
