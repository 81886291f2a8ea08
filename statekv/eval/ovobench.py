"""OVO-Bench (Li et al., CVPR 2025): twelve tasks in three groups, read from the release's annotation file
(``ovo_bench_new.json``), prompted and scored as the benchmark defines.

=========  ==================================  ===========================================================
group      tasks                               a question
=========  ==================================  ===========================================================
backward   EPM ASI HLD                         multiple choice at ``realtime``; the evidence lies before it
realtime   OCR ACR ATR STU FPD OJR             multiple choice at ``realtime``; the evidence is at it
forward    REC SSR CRR                         polled at each ``test_info[j].realtime``, each poll with its
                                               own answer: REC a count so far, SSR / CRR Yes or No
=========  ==================================  ===========================================================

Each poll of a forward question becomes one `Question` (id ``<id>_<j>``, the name of its released clip
``chunked_videos/<id>_<j>.mp4``; ``item`` is ``<id>``); backward and real-time questions keep ``<id>`` (clip
``<id>.mp4``). Prompts are the release's (``constant.py``; lmms-eval 0.7's ``ovobench`` task carries the same
strings). Scoring (`group_scores`): a multiple-choice answer is right when the ground-truth letter occurs in
it; REC when the digits of the answer, joined, are the count; SSR / CRR when the answer is exactly "Y" / "N" or
contains "Yes" / "No". A task's accuracy averages its questions, a forward question being the mean of its polls;
a group's is the mean of its tasks'; the overall score is the mean of the three groups. The official code
(`official_score`) differs for forward tasks: it pools every poll of a task (a question polled ten times
weighs ten times one polled once).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from statekv.errors import MissingFileError
from statekv.eval.annotations import LoadNotes, checked_groups, parse_options, require_fields, video_in
from statekv.eval.questions import AnnotationError, Question
from statekv.settings.values import LATEST_TIMESTAMP

BACKWARD_TASKS = ("EPM", "ASI", "HLD")
REALTIME_TASKS = ("OCR", "ACR", "ATR", "STU", "FPD", "OJR")
FORWARD_TASKS = ("REC", "SSR", "CRR")
GROUPS = {"backward": BACKWARD_TASKS, "realtime": REALTIME_TASKS, "forward": FORWARD_TASKS}
GROUP_OF = {task: group for group, tasks in GROUPS.items() for task in tasks}

CHOICE_TEMPLATE = (
    "\nQuestion: {question}\nOptions:\n{options}\n\n"
    "Respond only with the letter corresponding to your chosen option (e.g., A, B, C). \n"
    "Do not include any additional text or explanation in your response.\n"
)
REC_TEMPLATE = (
    "\nYou're watching a video in which people may perform a certain type of action repetively. \n"
    "The person performing this kind of action are referred to as 'they' in the following statement.\n"
    "You're task is to count how many times have different people in the video perform this kind of action in "
    "total.\nOne complete motion counts as one. \nNow, answer the following question: {question}\n"
    "Provide your answer as a single number (e.g., 0, 1, 2, 3\u2026) indicating the total count.\n"
    "Do not include any additional text or explanation in your response.\n"
)
SSR_TEMPLATE = (
    "\nYou're watching a tutorial video which contain a sequential of steps. \n"
    "The following is one step from the whole procedures: \n{question}\n"
    "Your task is to determine if the man or woman in the video is currently performing this step.\n"
    "Answer only with \u201cYes\u201d or \u201cNo\u201d.\n"
    "Do not include any additional text or explanation in your response.\n"
)
CRR_TEMPLATE = (
    "\nYou're responsible of answering questions based on the video content. \n"
    "The following question are relevant to the latest frames, i.e. the end of the video.\n{question}\n"
    "Decide whether existing visual content, especially latest frames, i.e. frames that near the end of the "
    "video, provide enough information for answering the question.\n"
    "Answer only with \u201cYes\u201d or \u201cNo\u201d.\n"
    "Do not include any additional text or explanation in your response.\n"
)
FORWARD_TEMPLATES = {"REC": REC_TEMPLATE, "SSR": SSR_TEMPLATE, "CRR": CRR_TEMPLATE}


def choice_prompt(question: str, options: Sequence[str], letters: str) -> str:
    """The multiple-choice prompt: options on one line, ``"A. text; B. text;"``."""
    listed = "; ".join(f"{letter}. {text}" for letter, text in zip(letters, options, strict=True)) + ";"
    return CHOICE_TEMPLATE.format(question=question, options=listed)


def prompt(question: Question) -> str:
    """The text that follows the video for an OVO-Bench question or poll."""
    if question.kind == "choice":
        return choice_prompt(question.question, question.options, question.letters)
    return FORWARD_TEMPLATES[question.task_type].format(question=question.question)


# ------------------------------------------------------------------------------------------- loading


def ovobench_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool, videos: str = "source",
                       source: str, groups: Iterable[str] | None = None) -> list[Question]:
    """The questions (and polls) of the annotation ``rows`` in ``groups`` (default: all three), in file order.

    ``videos``: which files must exist when ``check_videos``: the source videos (``src_videos/<video>``, a stream
    per video) or the released clips (``chunked_videos/<id>.mp4``, ``<id>_<j>.mp4``). A row of a task the release
    does not define is not used, and counted in one warning line (the release's code skips it too); a row without
    a task is refused (the release's code fails on it)."""
    if videos not in ("source", "clips"):
        raise ValueError(f"videos must be 'source' or 'clips', got {videos!r}")
    wanted = check_groups(groups)
    questions: list[Question] = []
    seen: dict[str, int] = {}  # by row id, then by question id
    asked: dict[str, int] = {}
    notes = LoadNotes("OVO-Bench")
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        made = row_questions(row, folder, where, groups=wanted, notes=notes)
        if not made:
            continue
        qid = made[0].item_id
        if qid in seen:
            raise AnnotationError(f"{where}: id {qid} repeats (first at row {seen[qid]})")
        seen[qid] = index
        for question in made:  # a poll's id (``{id}_{j}``) is no other row's either
            if question.qid in asked:
                raise AnnotationError(f"{where}: question id {question.qid} repeats (first at row "
                                      f"{asked[question.qid]})")
            asked[question.qid] = index
            required = question.video_path if videos == "source" else question.clip_path
            if check_videos and not required.is_file():
                kind = "source video" if videos == "source" else "clip"
                raise MissingFileError(f"OVO-Bench {kind} not found: {required}")
        questions += made
    notes.warn()
    return questions


def row_questions(row: dict[str, Any], folder: Path, where: str, *, groups: Iterable[str] = tuple(GROUPS),
                  notes: LoadNotes | None = None) -> list[Question]:
    """The questions (a forward row: one per poll) of one annotation row, read as `ovobench_questions` reads it
    (the lmms-eval plugin reads its documents with it too); ``[]`` for a row of another group, or of a task the
    release does not define (then noted in ``notes``). A malformed row is a one-line `AnnotationError`."""
    if "task" not in row:
        raise AnnotationError(f"{where}: missing field task (the release's code fails on such a row too)")
    task = row["task"]
    if not isinstance(task, str) or task not in GROUP_OF:
        if notes is not None:
            notes.add(f"row(s) of task {str(task)[:40]!r}, which OVO-Bench does not define, not used (its code "
                      "skips them too)", where)
        return []
    if GROUP_OF[task] not in groups:
        return []
    require_fields(row, ("id", "video"), where)
    qid = str(row["id"])
    video_in(folder / "chunked_videos", f"{qid}.mp4", where, "id")  # its clips' names: inside the folder
    video_path = video_in(folder / "src_videos", row["video"], where)
    if task in FORWARD_TASKS:
        return _polls(row, where, qid, video_path, folder)
    return [_choice(row, where, qid, video_path, folder)]


def check_groups(groups: Iterable[str] | None) -> tuple[str, ...]:
    """``groups`` checked against OVO-Bench's three (None: all of them)."""
    return checked_groups(groups, GROUPS, "OVO-Bench")


def _choice(row: dict[str, Any], where: str, qid: str, video_path: Path, folder: Path) -> Question:
    require_fields(row, ("realtime", "question", "options", "gt"), where)
    options = parse_options(row["options"], where, distinct=False)
    gt = row["gt"]
    if isinstance(gt, bool) or not isinstance(gt, int) or not 0 <= gt < len(options):
        raise AnnotationError(f"{where}: gt={gt!r} is not an index into its {len(options)} options")
    return Question(benchmark="ovobench", qid=qid, video_id=str(row["video"]), video_path=video_path,
                    question=str(row["question"]), options=options, answer=chr(ord("A") + gt),
                    task_type=str(row["task"]), realtime=seconds(row["realtime"], f"{where}: field 'realtime'"),
                    clip_path=folder / "chunked_videos" / f"{qid}.mp4", group=GROUP_OF[row["task"]])


def _polls(row: dict[str, Any], where: str, qid: str, video_path: Path, folder: Path) -> list[Question]:
    task = row["task"]
    asked = {"REC": ("activity",), "SSR": (), "CRR": ("question",)}[task]
    require_fields(row, (*asked, "test_info"), where)
    polls = row["test_info"]
    if not isinstance(polls, list) or not polls:
        raise AnnotationError(f"{where}: field 'test_info' must be a non-empty list of polls")
    made = []
    for j, poll in enumerate(polls):
        at = f"{where} test_info[{j}]"
        if not isinstance(poll, dict):
            raise AnnotationError(f"{at}: expected an object, got {type(poll).__name__}")
        if task == "REC":
            require_fields(poll, ("realtime", "count"), at)
            count = poll["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise AnnotationError(f"{at}: count must be a whole number >= 0, got {count!r}")
            text, answer, kind = f"How many times did they {row['activity']}?", str(count), "count"
        else:
            require_fields(poll, ("realtime", "type", *(("step",) if task == "SSR" else ())), at)
            if poll["type"] not in (0, 1) or isinstance(poll["type"], bool):
                raise AnnotationError(f"{at}: type must be 0 (No) or 1 (Yes), got {poll['type']!r}")
            text = str(poll["step"]) if task == "SSR" else str(row["question"])
            answer, kind = ("Yes" if poll["type"] == 1 else "No"), "yesno"
        made.append(Question(benchmark="ovobench", qid=f"{qid}_{j}", video_id=str(row["video"]),
                             video_path=video_path, question=text, options=(), answer=answer, task_type=task,
                             realtime=seconds(poll["realtime"], f"{at}: field 'realtime'"),
                             clip_path=folder / "chunked_videos" / f"{qid}_{j}.mp4", group="forward", item=qid,
                             kind=kind))
    return made


def seconds(value: Any, what: str) -> float:
    """A time in seconds from 0 to a stream's latest (`LATEST_TIMESTAMP`) from an annotation; a one-line
    `AnnotationError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= LATEST_TIMESTAMP:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:40]}..."
        raise AnnotationError(f"{what} must be a number of seconds from 0 to {LATEST_TIMESTAMP:.0e}, got {shown}")
    return float(value)


# ------------------------------------------------------------------------------------------- scoring


def judge(kind: str, response: str, answer: str, letters: str) -> tuple[str | None, bool]:
    """``(what was read, correct)`` under the release's rules (see the module docstring)."""
    if kind == "choice":
        text = response.strip()
        if answer in text:
            return answer, True
        return next((letter for letter in letters if letter in text), None), False
    if kind == "count":
        digits = "".join(re.findall(r"\d+", response))
        return digits or None, digits == answer
    if response in ("Y", "N"):
        said = "Yes" if response == "Y" else "No"
        return said, said == answer
    said = next((word for word in (answer, "Yes", "No") if word in response), None)
    return said, said == answer


def official_score(items: dict[tuple[str, str], list[float]]) -> float:
    """The overall score as the release's scoring code (``utils/OVOBenchScore.py`` at its last commit) computes
    it from ``{(group, task): [poll scores]}``: a task's accuracy pools all of its polls, a group's is the mean
    of its tasks', the overall the mean of the groups present. (Its first release averaged the twelve tasks.)"""
    by_group: dict[str, list[float]] = {}
    for (group, _), scores in items.items():
        by_group.setdefault(group, []).append(100.0 * sum(scores) / len(scores))
    means = [sum(tasks) / len(tasks) for tasks in by_group.values()]
    return sum(means) / len(means) if means else float("nan")
