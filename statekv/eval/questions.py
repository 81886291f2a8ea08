"""One benchmark question, as every other part of the harness sees it, and the harness's errors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from statekv.errors import DataError

BENCHMARKS = ("videomme", "mlvu", "ovobench", "synthetic")

MLVU_TASKS = ("anomaly_reco", "count", "ego", "needle", "order", "plotQA", "topic_reasoning")
OVOBENCH_REALTIME_TASKS = ("OCR", "ACR", "ATR", "STU", "FPD", "OJR")


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

    OVOBench only: ``realtime`` is the query time in seconds (the model may see the video up to
    ``query_seconds`` = ceil(realtime), capped at the video's duration) and ``clip_path`` the
    released pre-cut clip ``<id>.mp4`` holding exactly that prefix.
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
    realtime: float | None = None  # OVOBench
    clip_path: Path | None = None  # OVOBench

    @property
    def letters(self) -> str:
        return "".join(chr(ord("A") + i) for i in range(len(self.options)))

    @property
    def query_seconds(self) -> int | None:
        """Whole seconds of video visible when an OVOBench question is asked (ceil(realtime))."""
        return None if self.realtime is None else math.ceil(self.realtime)
