"""One benchmark question, as every other part of the harness sees it, and the harness's errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from statekv.errors import DataError

BENCHMARKS = ("videomme", "mlvu", "ovobench", "streamingbench", "synthetic")

MLVU_TASKS = ("anomaly_reco", "count", "ego", "needle", "order", "plotQA", "topic_reasoning")
OVOBENCH_REALTIME_TASKS = ("OCR", "ACR", "ATR", "STU", "FPD", "OJR")
# How an answer is read: an option letter, a count (OVO-Bench REC), Yes/No (OVO-Bench SSR, CRR), or an output
# given when the model says the time has come (StreamingBench's proactive output).
ANSWER_KINDS = ("choice", "count", "yesno", "proactive")


class AnnotationError(DataError):
    """An annotation row is malformed (missing field, answer outside the options, ...)."""


@dataclass(frozen=True)
class Question:
    """A multiple-choice question about one video.

    ``options`` are kept exactly as published: VideoMME's already carry their "A. " prefixes,
    MLVU's are the bare ``candidates`` (its ``question`` text embeds them again), OVOBench's are
    bare texts. ``answer`` is always a letter; ``letters`` are the valid ones ("ABCD" for four
    options). ``video_id`` is the key questions are grouped and sharded by: VideoMME's
    ``videoID``, MLVU's ``video_name``, OVOBench's source ``video`` path, the synthetic set's
    ``video_id``. Synthetic options are bare texts, like OVOBench's.

    Streaming benchmarks (OVO-Bench, StreamingBench, a synthetic set made with ``--streaming``): ``realtime`` is
    the query time in seconds (the model may see the video up to ``query_seconds`` = ceil(realtime), capped at
    the video's duration), ``group`` the benchmark's group of the task (OVO-Bench: backward, realtime, forward;
    StreamingBench: realtime, contextual) and ``clip_path`` the released pre-cut clip holding exactly that prefix
    (OVO-Bench). A question asked several times (OVO-Bench's forward tasks poll at preset times) is one
    `Question` per poll, each with its own time and answer, sharing ``item`` (the annotation's question id).
    ``kind`` says how the answer is read (`ANSWER_KINDS`); for kinds other than ``choice`` there are no options
    and ``answer`` is the expected text ("3", "Yes", an output). ``context``: text the prompt carries before
    the question (StreamingBench's sequential questions: the earlier questions and their answers).
    ``expected_time``: when a proactive output is due (seconds).
    """

    benchmark: str
    qid: str
    video_id: str
    video_path: Path
    question: str
    options: tuple[str, ...]
    answer: str
    task_type: str
    duration: str = ""  # VideoMME bucket: short | medium | long
    domain: str = ""  # VideoMME
    sub_category: str = ""  # VideoMME
    realtime: float | None = None  # streaming benchmarks
    clip_path: Path | None = None  # OVO-Bench
    group: str = ""
    item: str = ""
    kind: str = "choice"
    context: str = ""
    expected_time: float | None = None  # StreamingBench's proactive output

    @property
    def letters(self) -> str:
        return "".join(chr(ord("A") + i) for i in range(len(self.options)))

    @property
    def item_id(self) -> str:
        """The question this one is a poll of (its own id when it is asked once)."""
        return self.item or self.qid

    @property
    def query_seconds(self) -> int | None:
        """Whole seconds of video visible when an OVOBench question is asked (ceil(realtime))."""
        return None if self.realtime is None else math.ceil(self.realtime)


def questions_asked(questions: Sequence[Question]) -> int:
    """How many questions ``questions`` ask: a forward question asked at each of its polls counts once."""
    return len({(question.video_id, question.item or question.qid) for question in questions})


def counted(questions: Sequence[Question]) -> str:
    """What a count of ``questions`` counts, in words: questions to answer, or answers to give where a forward
    question is asked at each of its polls (one `Question` per poll, sharing its ``item``)."""
    asked = questions_asked(questions)
    if asked == len(questions):
        return "questions to answer"
    return f"answers to give ({asked} questions, a forward one asked at each of its polls)"


def first_questions(questions: Sequence[Question], limit: int | None) -> list[Question]:
    """The first ``limit`` questions of ``questions`` (None: all), each with all its polls (a forward question asked
    at several times is one question)."""
    if not limit:
        return list(questions)
    kept: set[tuple[str, str]] = set()
    for question in questions:
        if len(kept) == limit:
            break
        kept.add((question.video_id, question.item_id))
    return [question for question in questions if (question.video_id, question.item_id) in kept]
