"""Evaluation protocol: loaders, prompts, parsers, scoring, crash-safe records, sharding, reports.

Fast and model-free: annotation files are fabricated in ``tmp_path`` in the published layouts
and videos are empty placeholder files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import stat
import sys
import types
from pathlib import Path

import pytest

import statekv.eval as ev
from statekv.eval import AnswerRecord, Question
from statekv.errors import ConfigurationError, DataError

# ----------------------------------------------------------------------------- fabricated layouts


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def videomme_row(video: str, number: int, answer: str = "A", duration: str = "short") -> dict:
    return {
        "video_id": video[-3:],
        "duration": duration,
        "domain": "Knowledge",
        "sub_category": "Astronomy",
        "url": f"https://www.youtube.com/watch?v={video}",
        "videoID": video,
        "question_id": f"{video[-3:]}-{number}",
        "task_type": "Counting Problem",
        "question": f"How many planets are shown ({number})?",
        "options": ["A. One.", "B. Two.", "C. Three.", "D. Four."],
        "answer": answer,
    }


@pytest.fixture
def videomme_root(tmp_path: Path) -> Path:
    rows = [videomme_row("vidAAA001", n) for n in (1, 2, 3)]
    rows += [videomme_row("vidBBB002", n, answer="C", duration="long") for n in (1, 2, 3)]
    rows += [videomme_row("vidCCC003", 1, answer="D", duration="medium")]
    write_jsonl(tmp_path / "videomme" / "videomme" / "test.jsonl", rows)
    touch(tmp_path / "videomme" / "data" / "vidAAA001.mp4")
    touch(tmp_path / "videomme" / "data" / "vidBBB002.MP4")
    touch(tmp_path / "videomme" / "data" / "vidCCC003.mkv")
    return tmp_path


MLVU_ROWS = [
    {
        "video_name": "video/1_plotQA/movie.mp4",
        "duration": 412.5,
        "question_id": "plotQA_1",
        "task_type": "plotQA",
        "question": "What does the hero do first?\n(A) runs\n(B) sleeps\n(C) eats\n(D) sings",
        "candidates": ["runs", "sleeps", "eats", "sings"],
        "answer": "B",
    },
    {
        "video_name": "video/2_needle/clip.mp4",
        "duration": 300.0,
        "question_id": "needle_1",
        "task_type": "needle",
        "question": "Which object appears?\n(A) cup\n(B) hat\n(C) key\n(D) pen",
        "candidates": ["cup", "hat", "key", "pen"],
        "answer": "D",
    },
    # open-ended (generation) task: not one of the seven multiple-choice tasks, must be skipped
    {
        "video_name": "video/8_sub_scene/x.mp4",
        "duration": 50.0,
        "question_id": "sub_1",
        "task_type": "subPlot",
        "question": "Describe the scene.",
        "candidates": ["a", "b"],
        "answer": "A",
    },
]


@pytest.fixture
def mlvu_root(tmp_path: Path) -> Path:
    (tmp_path / "mlvu" / "mlvu").mkdir(parents=True)
    (tmp_path / "mlvu" / "mlvu" / "test.json").write_text(json.dumps(MLVU_ROWS))
    touch(tmp_path / "mlvu" / "video" / "1_plotQA" / "movie.mp4")
    touch(tmp_path / "mlvu" / "video" / "2_needle" / "clip.mp4")
    return tmp_path


def ovo_row(qid: int, task: str, video: str, realtime: float, gt: int = 0) -> dict:
    return {
        "id": qid,
        "task": task,
        "video": video,
        "realtime": realtime,
        "question": f"Question {qid}?",
        "answer": f"option {gt}",
        "options": ["option 0", "option 1", "option 2", "option 3"],
        "gt": gt,
    }


OVO_ROWS = [
    ovo_row(631, "STU", "YouTube_Games/game&index=1.mp4", 172, gt=1),
    ovo_row(632, "OCR", "YouTube_Games/game&index=1.mp4", 10.9, gt=3),
    ovo_row(633, "ACR", "Ego4D/ego.mp4", 5, gt=0),
    ovo_row(634, "OJR", "YouTube_Games/game&index=1.mp4", 10.2, gt=2),
    ovo_row(10, "EPM", "Ego4D/ego.mp4", 50),  # backward tracing: not a real-time task
    {"id": 900, "task": "REC", "video": "COIN/c.mp4", "activity": "jump", "test_info": []},  # forward task
]


@pytest.fixture
def ovobench_root(tmp_path: Path) -> Path:
    (tmp_path / "ovobench").mkdir()
    (tmp_path / "ovobench" / "ovo_bench_new.json").write_text(json.dumps(OVO_ROWS))
    for video in ("YouTube_Games/game&index=1.mp4", "Ego4D/ego.mp4"):
        touch(tmp_path / "ovobench" / "src_videos" / video)
    return tmp_path


def make_question(
    benchmark="videomme", qid="q", video="v", answer="A", task_type="t", options=None, **fields
) -> Question:
    default_options = {"videomme": ("A. a", "B. b", "C. c", "D. d")}.get(benchmark, ("a", "b", "c", "d"))
    return Question(
        benchmark=benchmark,
        qid=qid,
        video_id=video,
        video_path=Path(f"/videos/{video}.mp4"),
        question=f"question {qid}",
        options=tuple(options or default_options),
        answer=answer,
        task_type=task_type,
        **fields,
    )


# ----------------------------------------------------------------------------- loaders


def test_videomme_loader_reads_fields_and_resolves_each_extension(videomme_root):
    questions = ev.load_benchmark("videomme", videomme_root)
    assert [q.qid for q in questions] == ["001-1", "001-2", "001-3", "002-1", "002-2", "002-3", "003-1"]
    data = videomme_root / "videomme" / "data"
    assert questions[0].video_path == data / "vidAAA001.mp4"
    assert questions[3].video_path == data / "vidBBB002.MP4"
    assert questions[6].video_path == data / "vidCCC003.mkv"
    first = questions[3]
    assert (first.benchmark, first.video_id, first.answer, first.duration) == ("videomme", "vidBBB002", "C", "long")
    assert (first.domain, first.sub_category, first.task_type) == ("Knowledge", "Astronomy", "Counting Problem")
    assert first.options == ("A. One.", "B. Two.", "C. Three.", "D. Four.")
    assert first.letters == "ABCD" and first.realtime is None


def test_videomme_missing_video_names_the_path(videomme_root):
    (videomme_root / "videomme" / "data" / "vidCCC003.mkv").unlink()
    with pytest.raises(ev.MissingFileError, match=r"vidCCC003\.mp4"):
        ev.load_videomme(videomme_root)
    unchecked = ev.load_videomme(videomme_root, check_videos=False)
    assert unchecked[-1].video_path.name == "vidCCC003.mp4"


def test_missing_annotation_names_where_it_looked(tmp_path):
    with pytest.raises(ev.MissingFileError, match=r"videomme/videomme/test\*"):
        ev.load_videomme(tmp_path)
    with pytest.raises(FileNotFoundError, match="ovo_bench_new.json"):
        ev.load_ovobench_realtime(tmp_path)


def test_bad_annotation_rows_are_reported(videomme_root):
    path = videomme_root / "videomme" / "videomme" / "test.jsonl"
    bad = videomme_row("vidAAA001", 9, answer="E")
    write_jsonl(path, [bad])
    with pytest.raises(ev.AnnotationError, match="answer 'E' is not one of ABCD"):
        ev.load_videomme(videomme_root)
    del bad["options"]
    write_jsonl(path, [bad])
    with pytest.raises(ev.AnnotationError, match="missing field.*options"):
        ev.load_videomme(videomme_root)
    path.write_text('{"videoID": "x"}\n{not json\n')
    with pytest.raises(ev.AnnotationError, match=r"test\.jsonl:2"):
        ev.load_videomme(videomme_root)


def test_mlvu_loader_keeps_the_seven_multiple_choice_tasks(mlvu_root):
    questions = ev.load_mlvu(mlvu_root)
    assert [q.qid for q in questions] == ["plotQA_1", "needle_1"]
    plot = questions[0]
    assert plot.video_path == mlvu_root / "mlvu" / "video" / "1_plotQA" / "movie.mp4"
    assert plot.video_id == "video/1_plotQA/movie.mp4"
    assert plot.options == ("runs", "sleeps", "eats", "sings") and plot.answer == "B"
    assert plot.task_type == "plotQA" and plot.question.startswith("What does the hero do first?\n(A) runs")
    (mlvu_root / "mlvu" / "video" / "2_needle" / "clip.mp4").unlink()
    with pytest.raises(ev.MissingFileError, match=r"mlvu/video/2_needle/clip\.mp4"):
        ev.load_mlvu(mlvu_root)


def test_question_ids_fall_back_to_row_position_when_not_unique(mlvu_root):
    rows = [dict(MLVU_ROWS[0]), dict(MLVU_ROWS[1], question_id="plotQA_1")]
    (mlvu_root / "mlvu" / "mlvu" / "test.json").write_text(json.dumps(rows))
    assert [q.qid for q in ev.load_mlvu(mlvu_root)] == ["0", "1"]


def test_ovobench_loader_filters_realtime_tasks_and_maps_gt_to_letters(ovobench_root):
    questions = ev.load_ovobench_realtime(ovobench_root)
    assert [q.qid for q in questions] == ["631", "632", "633", "634"]
    stu = questions[0]
    folder = ovobench_root / "ovobench"
    assert stu.video_path == folder / "src_videos" / "YouTube_Games" / "game&index=1.mp4"
    assert stu.clip_path == folder / "chunked_videos" / "631.mp4"
    assert (stu.answer, stu.task_type, stu.realtime, stu.query_seconds) == ("B", "STU", 172.0, 172)
    assert stu.options == ("option 0", "option 1", "option 2", "option 3")
    assert questions[1].answer == "D" and questions[1].query_seconds == 11  # ceil(10.9)


def test_ovobench_clips_mode_requires_the_released_clips(ovobench_root):
    with pytest.raises(ev.MissingFileError, match=r"chunked_videos/631\.mp4"):
        ev.load_ovobench_realtime(ovobench_root, videos="clips")
    for qid in (631, 632, 633, 634):
        touch(ovobench_root / "ovobench" / "chunked_videos" / f"{qid}.mp4")
    assert len(ev.load_ovobench_realtime(ovobench_root, videos="clips")) == 4


def test_ovobench_accepts_lmms_eval_realtime_subset(tmp_path):
    realtime_only = [row for row in OVO_ROWS if row["task"] in ev.OVOBENCH_REALTIME_TASKS]
    (tmp_path / "ovobench" / "realtime").mkdir(parents=True)
    (tmp_path / "ovobench" / "realtime" / "data.json").write_text(json.dumps(realtime_only))
    assert len(ev.load_ovobench_realtime(tmp_path, check_videos=False)) == 4


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "videomme" / "videomme" / "test-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigurationError, match="pyarrow"):  # one line on the command line
        ev.load_videomme(tmp_path, check_videos=False)


def test_parquet_in_the_published_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [videomme_row("vidAAA001", 1), videomme_row("vidAAA001", 2, answer="B")]
    path = tmp_path / "videomme" / "videomme" / "test-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    questions = ev.load_videomme(tmp_path, check_videos=False)
    assert [q.answer for q in questions] == ["A", "B"]
    assert questions[0].options == ("A. One.", "B. Two.", "C. Three.", "D. Four.")


def test_hub_loader_is_optional_and_converts_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigurationError, match="pip install datasets"):
        ev.load_benchmark_from_hub("videomme", tmp_path)

    def unreachable(repo, config, split):
        raise ConnectionError(f"Couldn't reach '{repo}' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(DataError, match=r"^cannot load lmms-lab/Video-MME from the Hugging Face Hub "
                                                r"\(Couldn't reach 'lmms-lab/Video-MME' on the Hub "):
        ev.load_benchmark_from_hub("videomme", tmp_path)

    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return [videomme_row("vidAAA001", 1, answer="D")]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    questions = ev.load_benchmark_from_hub("videomme", tmp_path, check_videos=False)
    assert calls == [("lmms-lab/Video-MME", "videomme", "test")]
    assert questions[0].answer == "D" and questions[0].video_path.parent == tmp_path / "videomme" / "data"
    with pytest.raises(ValueError, match="hub loading supports videomme, mlvu"):
        ev.load_benchmark_from_hub("ovobench", tmp_path)


def test_unknown_names_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'mvbench'"):
        ev.load_benchmark("mvbench", tmp_path)
    with pytest.raises(ValueError, match="unknown parser"):
        ev.parse_answer("videomme", "A", parser="0.6")
    with pytest.raises(ValueError, match="unknown protocol"):
        ev.build_prompt(make_question(), protocol="lmms-eval-0.6")


# ----------------------------------------------------------------------------- prompts


VIDEOMME_QUESTION = Question(
    benchmark="videomme",
    qid="001-1",
    video_id="v",
    video_path=Path("v.mp4"),
    question="What color is the car?",
    options=("A. Red.", "B. Blue.", "C. Green.", "D. Black."),
    answer="B",
    task_type="Attribute Perception",
    duration="short",
    domain="Life Record",
    sub_category="Travel",
)


def test_videomme_prompts_are_byte_exact():
    body = (
        "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        "What color is the car?\nA. Red.\nB. Blue.\nC. Green.\nD. Black."
    )
    assert (
        ev.build_prompt(VIDEOMME_QUESTION)
        == body + "\n\nAnswer with the option's letter from the given choices directly."
    )
    assert ev.build_prompt(VIDEOMME_QUESTION, protocol="paper") == body


def test_mlvu_prompt_ends_with_an_open_parenthesis():
    q = Question(
        benchmark="mlvu",
        qid="1",
        video_id="v",
        video_path=Path("v.mp4"),
        question="What is the main topic?\n(A) cooking\n(B) sports",
        options=("cooking", "sports"),
        answer="A",
        task_type="topic_reasoning",
    )
    expected = "What is the main topic?\n(A) cooking\n(B) sports\nOnly give the best option.\nBest option: ("
    assert ev.build_prompt(q) == expected == ev.build_prompt(q, protocol="paper")


def test_ovobench_prompt_is_byte_exact():
    q = Question(
        benchmark="ovobench",
        qid="7",
        video_id="v",
        video_path=Path("v.mp4"),
        question="What is written on the sign?",
        options=("STOP", "EXIT", "OPEN"),
        answer="C",
        task_type="OCR",
        realtime=12.5,
    )
    expected = (
        "\nQuestion: What is written on the sign?\nOptions:\nA. STOP; B. EXIT; C. OPEN;\n\n"
        "Respond only with the letter corresponding to your chosen option (e.g., A, B, C). \n"
        "Do not include any additional text or explanation in your response.\n"
    )
    assert ev.build_prompt(q) == expected


def test_generation_settings():
    assert ev.generation_settings("videomme") == ev.GenerationSettings(16, ("\n\n",))
    assert ev.generation_settings("videomme", "paper") == ev.GenerationSettings(1024, ("\n\n",))
    assert ev.generation_settings("mlvu") == ev.GenerationSettings(16, ("\n\n",))
    assert ev.generation_settings("ovobench").max_new_tokens == 128
    assert all(not ev.generation_settings(b, p).do_sample for b in ev.BENCHMARKS for p in ev.PROTOCOLS)


def test_generated_text_is_cut_at_the_first_stop_string():
    settings = ev.generation_settings("videomme")
    assert settings.cut("B\n\nBecause the car is blue.\n\nMore") == "B"
    assert settings.cut("B. Blue\nsecond line") == "B. Blue\nsecond line"
    assert ev.GenerationSettings(8, ("\n\n", "</s>")).cut("C</s>x\n\ny") == "C"
    assert ev.generation_settings("ovobench").cut("A\n\nB") == "A\n\nB"  # no stop strings


# ----------------------------------------------------------------------------- parsers

LONG_NO_LETTER = "the video shows a small cat sitting quietly on a mat near the window all day"

# (response, lmms-eval 0.7 ranked extractor, paper-era VideoMME parser); the 0.7 column was checked
# against lmms-eval 0.7.3's extract_mcq_answer. Rules by rank: start > end > phrase > "(X)" > "X." >
# "X:" > "X)" > "X " > any (only when nothing else matched); within a rule the last position wins.
VIDEOMME_TABLE = [
    ("Based on the video, C", "C", "B"),  # paper: the B of "Based"; 0.7: letter at the end
    ("I think it's c", None, None),  # lowercase is not a letter choice
    ("B", "B", "B"),
    ("  D  ", "D", "D"),
    ("", None, None),
    (LONG_NO_LETTER, None, None),  # more than 10 words and no letter
    ("no letter here", None, None),  # short and no letter
    ("The answer is B", "B", "B"),
    ("The answer: C", "C", "C"),  # paper deletes "The answer", leaving ": C"
    ("The best answer is: D", "D", "D"),
    ("Answer: (B) dogs", "B", "A"),  # paper: the A of "Answer"; 0.7: "(X)"
    ("Correct: D", "D", "C"),  # paper: the C of "Correct"
    ("C. The man is cooking.", "C", "C"),  # start
    ("B) the dog", "B", "B"),
    ("(A) or (C)", "C", "A"),  # "(" first is no start: "(X)", the last one
    ("A man is riding a horse", "A", "A"),  # start: "A" then a space
    ("Options A and B are wrong; D.", "D", "A"),  # end, once the final "." is stripped
    ("The answer is C because A is wrong", "A", "C"),  # phrase: every later letter counts, the last wins
    ("the correct option is (C), not A", "A", "C"),  # end outranks phrase
    ("I choose B and then C", "C", "B"),  # end
    ("Option D seems right.", "D", "D"),  # "X "
    ("Both (A) and (B) fit here somewhat", "B", "B"),  # "(X)", the last; paper: the B of "Both"
    ("The first person, A, B... hmm D: no", "B", "A"),  # "X." outranks "X:"
    ("Maybe D: tall, or C: short, right", "C", "D"),  # "X:", the last
    ("Pick A) here or B) there then", "B", "A"),  # "X)", the last
    ("ABCD", "D", "A"),  # padded with a space, "D " matches "X "
    ("I would say A, then again B, hmm", "B", "A"),  # nothing marked: any, the last
    ("Dogs", "D", "D"),  # any: even inside a word, when nothing else matched
    ('"B."', "B", "B"),  # quotes, then the period, are stripped
    ("This is E", None, None),  # outside the four options
]


@pytest.mark.parametrize("response, ranked, paper", VIDEOMME_TABLE)
def test_videomme_parsers(response, ranked, paper):
    assert ev.parse_answer("videomme", response) == ranked
    assert ev.parse_answer("videomme", response, parser="lmms-eval-0.7") == ranked
    assert ev.parse_answer("videomme", response, parser="paper") == paper


def test_ranked_extractor_equals_lmms_eval_when_installed():
    mcq = pytest.importorskip("lmms_eval.tasks._task_utils.mcq_extract", reason="lmms-eval is an optional extra")
    rng = random.Random(7)
    atoms = ["A", "B", "C", "D", "E", "a", "c", " ", "(", ")", ".", ":", ",", "!", ";", "'", '"', "\n",
             "The answer is ", "I choose ", "correct option is ", "Based", "Dog", "AB", "word"]
    responses = [row[0] for row in VIDEOMME_TABLE]
    responses += ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    for response in responses:
        assert ev.ranked_letter(response) == (mcq.extract_mcq_answer(response, choices=list("ABCD")) or None)


# (response, paper-era MLVU parser): the character before the first ")", else the whole answer
MLVU_PAPER_TABLE = [
    ("A) The man runs away", "A"),
    ("B", "B"),
    (" C ", "C"),
    ("(B)", "B"),
    ("The answer is (C)", "C"),
    ("D. the dog", None),  # no ")": the whole answer, which is not a letter
    (") A", None),  # ")" first: the empty string
    ("Based on the video, C", None),
    ("x) A", None),  # the character before ")" must be an option letter
    (LONG_NO_LETTER, None),
]


@pytest.mark.parametrize("response, expected", MLVU_PAPER_TABLE)
def test_mlvu_paper_parser(response, expected):
    assert ev.parse_answer("mlvu", response, parser="paper") == expected


def test_mlvu_default_parser_is_the_ranked_extractor():
    assert ev.parse_answer("mlvu", "A) The man runs away") == "A"
    assert ev.parse_answer("mlvu", "Based on the video, C") == "C"
    assert ev.parse_answer("mlvu", "E) five", letters="ABCDE") is None  # lmms-eval extracts A-D only
    assert ev.parse_answer("mlvu", "E) five", letters="ABCDE", parser="paper") == "E"


@pytest.mark.parametrize(
    "response, answer, letter, correct",
    [
        ("C", "C", "C", True),
        ("  C.  ", "C", "C", True),
        ("Based on the video, C", "B", "B", True),  # substring rule: the B of "Based" counts
        ("Based on the video, C", "C", "C", True),
        ("The answer is D", "A", "D", False),  # "answer" has no capital A
        ("c", "C", None, False),  # no option letter at all: unparsable
        ("I do not know", "A", None, False),
    ],
)
def test_ovobench_substring_rule(response, answer, letter, correct):
    assert ev.judge("ovobench", response, answer=answer, letters="ABCD") == (letter, correct)
    assert ev.judge("ovobench", response, answer=answer, letters="ABCD", parser="paper") == (letter, correct)


# ----------------------------------------------------------------------------- scoring


def answered(question: Question, prediction: str, **settings) -> AnswerRecord:
    settings = {"model": "InternVL3-1B", "method": "statekv", "budget": 4096, **settings}
    return AnswerRecord.for_answer(question, prediction, **settings)


WRONG = {"A": "B", "B": "C", "C": "D", "D": "A"}
UNPARSABLE = "I am not sure what happens in this clip at all, sorry about that"


def test_videomme_micro_accuracy_and_breakdowns():
    spec = [  # (duration, domain, task type, outcome)
        ("short", "Knowledge", "OCR Problems", "right"),
        ("short", "Knowledge", "Counting Problem", "right"),
        ("short", "Sports", "OCR Problems", "unparsable"),
        ("long", "Sports", "Counting Problem", "right"),
        ("long", "Knowledge", "OCR Problems", "wrong"),
        ("long", "Sports", "OCR Problems", "wrong"),
    ]
    records = []
    for index, (duration, domain, task, outcome) in enumerate(spec):
        q = make_question(
            qid=f"{index:03d}-1",
            video=f"v{index}",
            answer="ABCD"[index % 4],
            task_type=task,
            duration=duration,
            domain=domain,
            sub_category="Travel",
        )
        prediction = {"right": q.answer, "wrong": f"The answer is {WRONG[q.answer]}", "unparsable": UNPARSABLE}[outcome]
        records.append(answered(q, prediction))
    result = ev.score(records)
    assert result.headline == pytest.approx(50.0) and result.metric == "micro accuracy"
    assert (result.overall.questions, result.overall.correct, result.overall.unparsable) == (6, 3, 1)
    assert result.groups["duration"]["short"].accuracy == pytest.approx(200 / 3)
    assert result.groups["duration"]["long"].accuracy == pytest.approx(100 / 3)
    assert result.groups["domain"]["Knowledge"].accuracy == pytest.approx(200 / 3)
    assert result.groups["domain"]["Sports"].accuracy == pytest.approx(100 / 3)
    assert result.groups["task_type"]["OCR Problems"].accuracy == pytest.approx(25.0)
    assert result.groups["task_type"]["Counting Problem"].accuracy == pytest.approx(100.0)
    assert result.groups["domain"]["Sports"].unparsable == 1
    expected = [r.qid for r in records] + ["999-1", "999-2"]
    assert (ev.score(records, expected).expected, ev.score(records, expected).missing) == (8, 2)


def build_records(benchmark: str, per_task: dict[str, tuple[int, int]], unparsable_tasks=()) -> list[AnswerRecord]:
    """``per_task[task] = (questions, correct)``; wrong answers of ``unparsable_tasks`` are unparsable."""
    records = []
    for task, (count, correct) in per_task.items():
        for index in range(count):
            q = make_question(
                benchmark,
                qid=f"{task}-{index}",
                video=f"{task}-video",
                answer="C",
                task_type=task,
                **({"realtime": 5.0} if benchmark == "ovobench" else {}),
            )
            wrong = "no idea" if task in unparsable_tasks else "A"
            records.append(answered(q, "C" if index < correct else wrong))
    return records


def test_mlvu_m_avg_is_the_unweighted_mean_of_the_seven_tasks():
    per_task = {
        "anomaly_reco": (2, 1),
        "count": (1, 1),
        "ego": (1, 0),
        "needle": (4, 4),
        "order": (2, 0),
        "plotQA": (1, 1),
        "topic_reasoning": (1, 0),
    }
    result = ev.score(build_records("mlvu", per_task, unparsable_tasks={"topic_reasoning"}))
    assert result.headline == pytest.approx((50 + 100 + 0 + 100 + 0 + 100 + 0) / 7)  # 50.0
    assert result.overall.accuracy == pytest.approx(100 * 7 / 12)  # micro differs: 58.33
    assert result.overall.unparsable == 1 and result.missing_tasks == ()
    assert result.groups["task_type"]["needle"].questions == 4
    partial = ev.score(build_records("mlvu", {"count": (1, 1), "ego": (2, 1)}))
    assert partial.headline == pytest.approx(75.0)
    assert partial.missing_tasks == ("anomaly_reco", "needle", "order", "plotQA", "topic_reasoning")


def test_ovobench_score_is_the_unweighted_mean_of_the_six_subtasks():
    per_task = {"OCR": (2, 2), "ACR": (1, 0), "ATR": (1, 1), "STU": (4, 1), "FPD": (1, 1), "OJR": (1, 0)}
    result = ev.score(build_records("ovobench", per_task, unparsable_tasks={"OJR"}))
    assert result.headline == pytest.approx((100 + 0 + 100 + 25 + 100 + 0) / 6)  # 54.17
    assert result.overall.accuracy == pytest.approx(50.0)
    assert result.overall.unparsable == 1


def test_scoring_refuses_mixed_parsers_and_repeated_questions():
    q = make_question("mlvu", task_type="count")
    with pytest.raises(ValueError, match="mix several parser"):
        ev.score([answered(q, "A"), answered(make_question("mlvu", qid="r", task_type="count"), "A", parser="paper")])
    with pytest.raises(ValueError, match="repeat a question id"):
        ev.score([answered(q, "A"), answered(q, "B")])


def test_rescoring_with_the_paper_parser():
    q = make_question("mlvu", answer="C", task_type="count")
    record = answered(q, "Based on the video, C")
    assert (record.parsed, record.correct, record.parser) == ("C", True, "lmms-eval-0.7")
    paper = record.rescored("paper")
    assert (paper.parsed, paper.correct, paper.parser) == (None, False, "paper")


# ----------------------------------------------------------------------------- records


def test_writer_fsyncs_each_line_and_reads_back(tmp_path, monkeypatch):
    synced = []  # per fsync: whether it forced a folder (the new file's name) or a file
    real_fsync = ev.records.os.fsync
    monkeypatch.setattr(ev.records.os, "fsync",
                        lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    path = ev.rank_file(tmp_path / "run", 0)
    questions = [make_question(qid=f"q{i}", video=f"v{i}") for i in range(3)]
    with ev.ResultsWriter(path) as out:
        for q in questions:
            out.write(answered(q, "A", timings={"encode": 1.5, "answer": 0.25}, frames=512))
    assert synced == [True, False, False, False] and path.name == "answers.rank000.jsonl"
    back = ev.read_records(path)
    assert [r.qid for r in back] == ["q0", "q1", "q2"]
    assert back[0].timings == {"encode": 1.5, "answer": 0.25} and back[0].extra == {"frames": 512}
    assert back[0] == answered(questions[0], "A", timings={"encode": 1.5, "answer": 0.25}, frames=512)


def test_truncated_last_line_from_a_killed_writer_is_dropped(tmp_path):
    path = ev.rank_file(tmp_path, 1)
    questions = [make_question(qid=f"q{i}", video=f"v{i}") for i in range(4)]
    with ev.ResultsWriter(path) as out:
        for q in questions[:3]:
            out.write(answered(q, "A"))
    full_line = json.dumps(answered(questions[3], "A").to_json())
    with path.open("a") as file:  # what SIGKILL in the middle of write() leaves behind
        file.write(full_line[: len(full_line) // 2])
    assert [r.qid for r in ev.read_records(path)] == ["q0", "q1", "q2"]
    assert ev.completed_qids(tmp_path) == {"q0", "q1", "q2"}

    with path.open("a") as file:  # a complete object still lacks its newline: not yet committed
        file.write(full_line[len(full_line) // 2 :])
    assert ev.completed_qids(tmp_path) == {"q0", "q1", "q2"}

    with ev.ResultsWriter(path) as out:  # the resumed run cuts the tail and re-answers q3
        out.write(answered(questions[3], "B"))
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)
    assert [r.prediction for r in ev.read_records(path)] == ["A", "A", "A", "B"]


def test_corrupt_line_inside_a_results_file_is_an_error(tmp_path):
    path = tmp_path / "answers.rank000.jsonl"
    good = json.dumps(answered(make_question(), "A").to_json())
    path.write_text(good + "\n{garbage\n" + good + "\n")
    with pytest.raises(ev.ResultsFileError, match=r"answers\.rank000\.jsonl:2"):
        ev.read_records(path)
    with pytest.raises(TypeError, match="AnswerRecord"), ev.ResultsWriter(tmp_path / "other.jsonl") as out:
        out.write({"qid": "q"})
    for late in ({"extra": {"answered_at": "soon"}}, {"expected_at": [1]}):  # what a proactive score reads
        path.write_text(json.dumps({**json.loads(good), **late}) + "\n")
        with pytest.raises(ev.ResultsFileError, match=r"answers\.rank000\.jsonl:1: .*extra\.(answered|expected)_at"):
            ev.read_records(path)


def test_merge_of_rank_files_deduplicates_and_sorts(tmp_path):
    qs = {n: make_question(qid=str(n), video=f"v{n}") for n in (2, 10, 1, 7)}
    with ev.ResultsWriter(ev.rank_file(tmp_path, 0)) as out:
        out.write(answered(qs[10], "A"))
        out.write(answered(qs[2], "B"))
    with ev.ResultsWriter(ev.rank_file(tmp_path, 1)) as out:
        out.write(answered(qs[7], "A"))
        out.write(answered(qs[1], "A"))
        out.write(answered(qs[2], "A"))  # re-answered after a restart: the later record wins
    merged = ev.merge_rank_files(tmp_path)
    assert [r.qid for r in merged] == ["1", "2", "7", "10"]
    assert [r.prediction for r in merged if r.qid == "2"] == ["A"]
    assert [r.qid for r in ev.read_records(tmp_path / "answers.jsonl")] == ["1", "2", "7", "10"]


# ----------------------------------------------------------------------------- sharding and grouping


def questions_over_videos(counts: list[int]) -> list[Question]:
    questions = [make_question(qid=f"v{v}-q{i}", video=f"video{v}") for v, n in enumerate(counts) for i in range(n)]
    random.Random(0).shuffle(questions)  # questions of one video need not be adjacent
    return questions


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 12])
def test_sharding_covers_every_question_once_and_keeps_videos_whole(world_size):
    questions = questions_over_videos([5, 1, 3, 3, 2, 4, 1, 1])
    shards = [ev.shard_by_video(questions, rank, world_size) for rank in range(world_size)]
    qids = [q.qid for shard in shards for q in shard]
    assert sorted(qids) == sorted(q.qid for q in questions) and len(qids) == len(set(qids))
    owners = {}
    for rank, shard in enumerate(shards):
        for q in shard:
            assert owners.setdefault(q.video_id, rank) == rank
        assert shard == [q for q in questions if q in shard]  # original order kept
    loads = [len(shard) for shard in shards]
    if world_size <= 8:
        assert max(loads) - min(loads) <= 5  # never worse than the largest video
    again = [ev.shard_by_video(list(reversed(questions)), rank, world_size) for rank in range(world_size)]
    assert [{q.qid for q in s} for s in again] == [{q.qid for q in s} for s in shards]  # input order irrelevant


def test_sharding_validates_rank():
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        ev.shard_by_video(questions_over_videos([1]), 2, 2)


def test_group_by_video_yields_each_video_once_with_all_its_questions():
    questions = questions_over_videos([3, 1, 2])
    groups = ev.group_by_video(questions)
    assert sorted(g.video_id for g in groups) == ["video0", "video1", "video2"]
    for group in groups:
        assert {q.qid for q in group.questions} == {q.qid for q in questions if q.video_id == group.video_id}
        assert group.video_path == Path(f"/videos/{group.video_id}.mp4")


def test_ovobench_group_is_sorted_by_ceil_of_realtime(ovobench_root):
    questions = ev.load_ovobench_realtime(ovobench_root)
    game = next(g for g in ev.group_by_video(questions) if g.video_id.startswith("YouTube_Games"))
    # 632 (10.9 s) and 634 (10.2 s) are both asked at second 11: ties keep annotation order
    assert [(q.qid, q.query_seconds) for q in game.questions] == [("632", 11), ("634", 11), ("631", 172)]
    assert [(second, [q.qid for q in qs]) for second, qs in game.checkpoints()] == [
        (11, ["632", "634"]),
        (172, ["631"]),
    ]


# ----------------------------------------------------------------------------- summary and table


def make_run(run_dir: Path, benchmark: str, model: str, method: str, budget, per_task, unparsable_tasks=()):
    records = [
        dataclasses.replace(r, model=model, method=method, budget=budget)
        for r in build_records(benchmark, per_task, unparsable_tasks)
    ]
    with ev.ResultsWriter(ev.rank_file(run_dir, 0)) as out:
        for record in records:
            out.write(record)
    return records


def test_the_ovobench_real_time_cell_counts_its_own_unparsed_answers(tmp_path):
    make_run(tmp_path / "r", "ovobench", "Qwen3-VL-2B", "statekv", 4096, {"OJR": (2, 1), "EPM": (2, 0)}, {"EPM"})
    ev.write_summary(tmp_path / "r", expected_qids=["OJR-0", "OJR-1", "EPM-0", "EPM-1", "EPM-2"])
    row = ev.paper_table([tmp_path / "r"]).splitlines()[-1]
    assert "| 50.00 (partial of the run 4/5) |" in row  # real time: its own answers, none unparsed
    assert "(2 unparsed) (partial 4/5)" in row  # every group: the backward answers unparsed


def test_results_json_and_paper_table(tmp_path):
    full_vmme = {"Counting Problem": (4, 3)}  # 75.00
    runs = {
        "a": ("videomme", "InternVL3-1B", "statekv", 4096, full_vmme, ()),
        "b": ("videomme", "InternVL3-1B", "full", None, {"Counting Problem": (3, 2)}, ()),  # 66.67
        "c": ("mlvu", "InternVL3-1B", "recency", 16, {"count": (2, 1), "ego": (1, 0)}, {"ego"}),  # 25.00, 1 unparsed
        "d": ("ovobench", "Qwen3-VL-2B", "statekv", 4096, {t: (1, 1) for t in ev.OVOBENCH_REALTIME_TASKS}, ()),
    }
    for name, (benchmark, model, method, budget, per_task, unparsable) in runs.items():
        make_run(tmp_path / name, benchmark, model, method, budget, per_task, unparsable)
    summary = ev.write_summary(tmp_path / "a", expected_qids=[f"Counting Problem-{i}" for i in range(5)])
    for name in "bcd":
        ev.write_summary(tmp_path / name)

    on_disk = ev.read_summary(tmp_path / "a")
    assert on_disk == json.loads(json.dumps(summary))
    assert (on_disk["benchmark"], on_disk["model"], on_disk["method_label"]) == (
        "videomme",
        "InternVL3-1B",
        "StateKV B=4096",
    )
    assert on_disk["score"]["headline"] == pytest.approx(75.0)
    assert on_disk["score"]["overall"] == {"questions": 4, "correct": 3, "unparsable": 0, "accuracy": 75.0}
    assert (on_disk["score"]["expected"], on_disk["score"]["missing"]) == (5, 1)
    assert set(on_disk["scores"]) == {"lmms-eval-0.7", "paper"}
    assert (tmp_path / "a" / "answers.jsonl").is_file()

    table = ev.paper_table([tmp_path / name for name in "dcba"])
    assert table == (
        "| Model | Method | VideoMME | MLVU | OVOBench RT |\n"
        "|---|---|---|---|---|\n"
        "| Qwen3-VL-2B | StateKV B=4096 | – | – | 100.00 |\n"
        "| InternVL3-1B | Full SA | 66.67 | – | – |\n"
        "| InternVL3-1B | Recency R=16 | – | 25.00 (1 unparsed) | – |\n"
        "| InternVL3-1B | StateKV B=4096 | 75.00 (partial 4/5) | – | – |\n"
    )
    assert "| Qwen3-VL-2B | StateKV B=4096 | – | – | 100.00 |" in ev.paper_table([tmp_path / "d"], parser="paper")
    with pytest.raises(ValueError, match="is named twice"):
        ev.paper_table([tmp_path / "a", tmp_path / "a"])
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")
    with pytest.raises(ValueError, match="two runs give InternVL3-1B / StateKV B=4096 on videomme"):
        ev.paper_table([tmp_path / "a", tmp_path / "a-copy"])
    for run, mode in (("a", "offline"), ("a-copy", "streaming")):  # what tells them apart is named
        (tmp_path / run / "run.json").write_text(json.dumps({"settings": {"benchmark": "videomme", "mode": mode}}))
    with pytest.raises(ValueError, match=r"\(they differ in mode: offline, streaming\); the table takes one"):
        ev.paper_table([tmp_path / "a", tmp_path / "a-copy"])
    for run, layout in (("a", None), ("a-copy", "own-then-cache")):  # engine settings make rows of their own
        (tmp_path / run / "run.json").write_text(json.dumps({"settings": {"benchmark": "videomme",
                                                                          "bounded_layout": layout}}))
    assert ev.paper_table([tmp_path / name for name in ("a", "a-copy", "b")]) == (
        "| Model | Method | VideoMME | MLVU | OVOBench RT |\n"
        "|---|---|---|---|---|\n"
        "| InternVL3-1B | Full SA | 66.67 | – | – |\n"
        "| InternVL3-1B | StateKV B=4096 (bounded_layout default) | 75.00 (partial 4/5) | – | – |\n"
        "| InternVL3-1B | StateKV B=4096 (bounded_layout own-then-cache) | 75.00 (partial 4/5) | – | – |\n"
    )
    (tmp_path / "a" / "run.json").write_text(json.dumps({"settings": {"benchmark": "videomme", "question_span": 384,
                                                                      "cache_limit": "refuse"}}))
    (tmp_path / "a-copy" / "run.json").write_text(json.dumps({"settings": {"benchmark": "videomme"}}))  # before then
    with pytest.raises(ValueError, match="two runs give InternVL3-1B / StateKV B=4096 on videomme"):  # one row
        ev.paper_table([tmp_path / "a", tmp_path / "a-copy"])


def test_method_labels():
    assert ev.method_label("full", None) == "Full SA"
    assert ev.method_label("FullAttention", None) == "Full SA"
    assert ev.method_label("recency", 16) == "Recency R=16"
    assert ev.method_label("rekv", 16) == "ReKV R=16"
    assert ev.method_label("statekv", 4096) == "StateKV B=4096"
    assert ev.method_label("snapkv", 1024) == "snapkv (1024)"
