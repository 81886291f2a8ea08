"""StreamingBench (Lin et al., 2024): the groups a model that sees frames can take, read from the release's
question files, prompted and scored as its code does.

===========  =====================================================================  ===========================
group        tasks (the release's ``task_type``)                                    file
===========  =====================================================================  ===========================
realtime     Object Recognition, Action Recognition, Text-Rich Understanding,       ``questions_real.json``
             Clips Summarize, Attribute Recognition, Spatial Understanding,
             Counting, Event Understanding, Causal Reasoning, Prospective Reasoning
contextual   Misleading Context Understanding, Anomaly Context Understanding        ``questions_omni.json``
             Sequential Question Answering                                          ``questions_sqa.json``
             Proactive Output                                                       ``questions_proactive.json``
===========  =====================================================================  ===========================

Left out: the omni-source group (Emotion Recognition, Scene Understanding, Source Discrimination, Multimodal
Alignment, the rest of ``questions_omni.json``), whose questions are about the sound track; statekv's models
see frames only. The two contextual tasks of the omni file are taken from their frames alone.

Each entry of a file is a video and a time window holding questions with a ``time_stamp`` (``HH:MM:SS``); the
five questions of a video come at different times. Question ids are ``<file stem>-<n>`` in file order.
Prompts are the release's (``src/benchmark/StreamingBench*.py``). A multiple-choice answer is right when its
first character (after leading white space) is the answer letter (``src/data/count.py`` takes the first
character). A sequential question's prompt carries the earlier questions of its video with their correct
answers. A proactive output is polled every second from one second after the question: "Is it the right time
to output ...? yes or no"; at the first answer containing "yes" the question itself is asked and polling stops
(at the latest four seconds after the expected time); it is right when that second is within 2 s of the
expected one and the expected output occurs in the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from statekv.errors import MissingFileError
from statekv.eval.annotations import (LoadNotes, checked_groups, parse_options, read_json_document, require_fields,
                                      video_in)
from statekv.eval.questions import AnnotationError, Question

REALTIME_TASKS = ("Object Recognition", "Action Recognition", "Text-Rich Understanding", "Clips Summarize",
                  "Attribute Recognition", "Spatial Understanding", "Counting", "Event Understanding",
                  "Causal Reasoning", "Prospective Reasoning")
CONTEXTUAL_TASKS = ("Misleading Context Understanding", "Anomaly Context Understanding",
                    "Sequential Question Answering", "Proactive Output")
OMNI_SOURCE_TASKS = ("Emotion Recognition", "Scene Understanding", "Source Discrimination", "Multimodal Alignment")
GROUPS = {"realtime": REALTIME_TASKS, "contextual": CONTEXTUAL_TASKS}
GROUP_OF = {task: group for group, tasks in GROUPS.items() for task in tasks}
FILES = {"questions_real.json": "realtime", "questions_omni.json": "contextual", "questions_sqa.json": "contextual",
         "questions_proactive.json": "contextual"}
POLL_SECONDS = 1  # a proactive output is polled every second
POLL_AFTER = 4  # ... until this many seconds after the expected time
ON_TIME = 2  # an output within this many seconds of the expected time is on time
LETTERS = "ABCD"  # the release's multiple-choice templates have four option places

CHOICE_TEMPLATE = (
    "You are an advanced video question-answering AI assistant. You have been provided with some frames from the "
    "video and a multiple-choice question related to the video. Your task is to carefully analyze the video and "
    "provide the best answer to question, choosing from the four options provided. Respond with only the letter "
    "(A, B, C, or D) of the correct option.\n\nQuestion: {question}\n\nOptions:\n{options}\n\nThe best option is:"
)
SEQUENTIAL_TEMPLATE = (
    "You are an advanced video question-answering AI assistant. You have been provided with a video and a "
    "multiple-choice question related to the video. Your task is to carefully analyze the video and the provided "
    "context to answer the question, choosing from the four options provided. Respond with only the letter (A, B, "
    "C, or D) of the correct option.\n\n{context}\n\nHere is the question. Answer it and don't confuse it with the "
    "previous conversation.\nQuestion: {question}\n\nOptions:\n{options}\n\nThe best option is:"
)
PROACTIVE_TEMPLATE = (
    "You are an advanced image question-answering AI assistant. You have been provided with images and a question "
    "related to the images. Your task is to carefully analyze the images and provide the answer to the question. "
    "You need to carefully confirm whether the images content meet the conditions of the question, and then output "
    "the correct content.\n\nQuestion: {question}\n\nThe answer is:\n"
)
CONTEXT_OPENING = ("Here are the contextual information related to the video. Please answer the questions based on "
                   "the contextual information: ")


def lettered(options: Iterable[str]) -> list[str]:
    """The options as the release shows them: ``"A. text"`` unless they already start so."""
    options = list(options)
    return options if options[0].startswith("A.") else [f"{chr(65 + i)}. {text}" for i, text in enumerate(options)]


def prompt(question: Question) -> str:
    """The text that follows the video (for a proactive output: the question asked once it is due)."""
    if question.kind == "proactive":
        return PROACTIVE_TEMPLATE.format(question=question.question)
    options = "\n".join(lettered(question.options))
    if question.context:
        return SEQUENTIAL_TEMPLATE.format(context=question.context, question=question.question, options=options)
    return CHOICE_TEMPLATE.format(question=question.question, options=options)


def poll_prompt(question: Question) -> str:
    """A proactive output's poll: is it the time to give the output?"""
    return PROACTIVE_TEMPLATE.format(question=f'{question.question} Is it the right time to output '
                                              f'"{question.answer}"? You can only answer yes or no.')


def poll_times(question: Question) -> list[int]:
    """The seconds a proactive output is polled at: from one second after the question until four seconds after
    the expected time (at least once)."""
    first = int(question.realtime) + POLL_SECONDS
    last = int(question.expected_time) + POLL_AFTER
    return list(range(first, max(first, last) + 1, POLL_SECONDS))


def said_yes(response: str) -> bool:
    return "yes" in response.strip().lower()


def judge(kind: str, response: str, answer: str, letters: str, answered_at: float | None = None,
          expected_at: float | None = None) -> tuple[str | None, bool]:
    """``(what was read, correct)``: the first character for a choice; for a proactive output, the output when
    it was given on time."""
    if kind == "proactive":
        on_time = answered_at is not None and expected_at is not None and abs(answered_at - expected_at) <= ON_TIME
        given = answer if answer in response else None
        return given, on_time and given is not None
    first = response.lstrip()[:1]
    return (first if first and first in letters else None), first == answer


# ------------------------------------------------------------------------------------------- loading


def streamingbench_questions(folder: Path, *, check_videos: bool, groups: Iterable[str] | None = None
                             ) -> list[Question]:
    """Questions of ``groups`` (None: every group) in the files under ``folder`` (``questions_real.json`` is required
    when the real-time group is wanted; each contextual file is read when present), in file order."""
    wanted = check_groups(groups)
    # every file there, whichever groups are wanted: a file may hold rows of another group's tasks, and a group's
    # questions are the same whatever other group is asked for
    files = [name for name in FILES if (folder / name).is_file()]
    if "realtime" in wanted and "questions_real.json" not in files:
        raise MissingFileError(f"StreamingBench questions not found: {folder / 'questions_real.json'}")
    if not files:
        raise MissingFileError(f"no StreamingBench question file found in {folder} (looked for "
                               f"{', '.join(name for name, group in FILES.items() if group in wanted)})")
    questions: list[Question] = []
    notes = LoadNotes("StreamingBench")
    for name in files:
        path = folder / name
        for question in _file_questions(path, _entries(path, read_json_document(path)), folder, notes):
            if question.group in wanted:  # a file holds rows of its task types, whatever group it is named for
                questions.append(question)
            elif question.group != FILES[name]:  # (its own group's rows, not asked for, go unsaid)
                notes.add(f"question(s) of the {question.group} group in a {FILES[name]} file not used (not in "
                          "--groups)", str(path))
    notes.warn()
    empty = [group for group in wanted if groups is not None and not any(q.group == group for q in questions)]
    if empty:  # asked for by name: a run of the other groups alone would look like a run of every one
        raise MissingFileError(f"no StreamingBench question of the {empty[0]} group found in {folder} (looked in "
                               f"{', '.join(name for name, group in FILES.items() if group == empty[0])})")
    if check_videos:
        check_video_files(questions)
    return questions


def check_video_files(questions: Iterable[Question]) -> None:
    """A one-line `MissingFileError` for the first question whose video is not there."""
    for question in questions:
        if not question.video_path.is_file():
            raise MissingFileError(f"StreamingBench video not found: {question.video_path} (question "
                                   f"{question.qid})")


def check_groups(groups: Iterable[str] | None) -> tuple[str, ...]:
    """``groups`` checked against the groups taken (None: all of them)."""
    omni = groups is not None and any("omni" in group for group in groups if group not in GROUPS)
    return checked_groups(groups, GROUPS, "StreamingBench",
                          " (omni-source is left out: it needs the sound track)" if omni else "")


def _entries(path: Path, data: Any) -> list[tuple[int, dict[str, Any]]]:
    """``(index, entry)`` of a question file: a list of entries, or (sequential questions) a list of one list of
    entries per video."""
    if not isinstance(data, list):
        raise AnnotationError(f"{path}: expected a JSON list of entries")
    entries = []
    for index, row in enumerate(data):
        for entry in row if isinstance(row, list) else [row]:
            if not isinstance(entry, dict):
                raise AnnotationError(f"{path} entry {index}: expected an object, got {type(entry).__name__}")
            entries.append((index, entry))
    return entries


def _file_questions(path: Path, entries: list[tuple[int, dict[str, Any]]], folder: Path,
                    notes: LoadNotes) -> list[Question]:
    stem = path.stem.removeprefix("questions_")
    questions: list[Question] = []
    contexts: dict[str, str] = {}
    for index, entry in entries:
        where = f"{path} entry {index}"
        require_fields(entry, ("questions", "video_path"), where)
        if not isinstance(entry["questions"], list):
            raise AnnotationError(f"{where}: field 'questions' must be a list")
        if not entry["questions"]:
            notes.add("video(s) with no questions, not used", where)
        video = str(entry["video_path"])
        if PurePosixPath(video).is_absolute():  # as the release's preprocess.sh rewrites them: its videos/ folder
            notes.add("video path(s) absolute, as the release's preprocess.sh writes them, read under videos/", where)
            video = f"./videos/{PurePosixPath(video).name}"
        video_path = video_in(folder, video, where, "video_path")
        for number, row in enumerate(entry["questions"]):
            at = f"{where} question {number}"
            if not isinstance(row, dict):
                raise AnnotationError(f"{at}: expected an object, got {type(row).__name__}")
            require_fields(row, ("task_type", "question", "time_stamp"), at)
            task = str(row["task_type"])
            if task not in GROUP_OF:
                why = "omni-source: about the sound track" if task in OMNI_SOURCE_TASKS else "not a StreamingBench task"
                notes.add(f"question(s) of task {task[:40]!r} not used ({why})", at)
                continue
            qid = f"{stem}-{len(questions)}"
            common = dict(benchmark="streamingbench", qid=qid, video_id=video, video_path=video_path,
                          question=str(row["question"]), task_type=task, group=GROUP_OF[task],
                          realtime=clock_seconds(row["time_stamp"], f"{at}: field 'time_stamp'", notes))
            if task == "Proactive Output":
                require_fields(row, ("ground_truth_time_stamp", "ground_truth_output"), at)
                question = Question(**common, options=(), answer=str(row["ground_truth_output"]), kind="proactive",
                                    expected_time=clock_seconds(row["ground_truth_time_stamp"],
                                                                f"{at}: field 'ground_truth_time_stamp'", notes))
            else:
                require_fields(row, ("options", "answer"), at)
                options = prompted_options(parse_options(row["options"], at, distinct=False), at, notes)
                answer = str(row["answer"]).strip()
                if answer not in LETTERS or len(answer) != 1:
                    raise AnnotationError(f"{at}: answer {answer!r} is not one of {LETTERS} (the release's prompt "
                                          "lists those options only)")
                context = contexts.get(video, "") if task == "Sequential Question Answering" else ""
                question = Question(**common, options=options, answer=answer, context=context)
                if task == "Sequential Question Answering":
                    contexts[video] = (contexts.get(video) or CONTEXT_OPENING) + (
                        f"At timestamp {row['time_stamp']}, the following question and answer occurred: Question: "
                        f"{row['question']}; Options: {', '.join(lettered(options))}; Answer: {answer}; ")
            questions.append(question)
    return questions


def prompted_options(options: tuple[str, ...], where: str, notes: LoadNotes) -> tuple[str, ...]:
    """The options the release's prompt shows: the first four, A to D (its template has four places; a fifth or
    sixth option is never shown, and noted as not used). Fewer than four: a one-line `AnnotationError` (the
    release's code fails on such a question too)."""
    if len(options) < len(LETTERS):
        raise AnnotationError(f"{where}: expected at least 4 options (the prompt lists A to D; the release's code "
                              f"fails on fewer), got {len(options)}")
    if len(options) > len(LETTERS):
        notes.add("question(s) asked with A to D only, as the release's prompt shows them (their options past D are "
                  "not used)", where)
    return options[: len(LETTERS)]


def clock_seconds(value: Any, what: str, notes: LoadNotes | None = None) -> float:
    """Seconds from the release's ``HH:MM:SS`` (or ``MM:SS``) time, summed as its code sums them (``00:12450`` is
    12450 s, noted in ``notes``: minutes or seconds past 59); a one-line `AnnotationError` for anything but digits
    and colons, a number among them (its code splits the text: it fails on those too)."""
    if not isinstance(value, str):
        raise AnnotationError(f"{what} must be a time as HH:MM:SS, got {type(value).__name__} {str(value)[:40]}")
    parts = value.strip().split(":")
    if not 1 <= len(parts) <= 3 or not all(part.isascii() and part.isdigit() for part in parts):
        raise AnnotationError(f"{what} must be a time as HH:MM:SS, got {value!r}")
    if sum(len(part) for part in parts) > 12:  # no video is longer: past it a float or an int cannot hold the time
        raise AnnotationError(f"{what} must be a time as HH:MM:SS, got {str(value)[:40]!r}: too long")
    seconds = float(sum(int(part) * 60 ** power for power, part in enumerate(reversed(parts))))
    if notes is not None and any(int(part) >= 60 for part in parts[1:]):
        notes.add(f"time(s) with minutes or seconds past 59, read as the release's code reads them "
                  f"({str(value)[:20]!r} is {seconds:.0f} s)", what)
    return seconds
