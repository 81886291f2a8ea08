"""Split questions across ranks and walk them one video at a time.

A video is encoded once and all of its questions are answered from that encoding, so the unit
of work is a video: sharding never splits one, and ``group_by_video`` yields each exactly once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from statekv.eval.questions import Question


@dataclass(frozen=True)
class VideoQuestions:
    """All questions about one video, in the order they should be asked.

    Timed questions (the streaming benchmarks) are sorted by ``query_seconds`` (ceil of their query time; those
    without a time last), so a stream over the source video can ask each one as soon as it has reached that
    second.
    """

    video_id: str
    video_path: Path
    questions: tuple[Question, ...]

    def checkpoints(self) -> list[tuple[int, tuple[Question, ...]]]:
        """OVOBench: ``(seconds, questions asked once the stream has reached that second)``."""
        if any(question.query_seconds is None for question in self.questions):
            raise ValueError(f"{self.video_id}: checkpoints need questions with a realtime (OVOBench)")
        by_second: dict[int, list[Question]] = {}
        for question in self.questions:
            by_second.setdefault(question.query_seconds, []).append(question)
        return [(second, tuple(by_second[second])) for second in sorted(by_second)]


def group_by_video(questions: Iterable[Question]) -> list[VideoQuestions]:
    """Videos in order of first appearance, each with all of its questions."""
    by_video: dict[str, list[Question]] = {}
    for question in questions:
        by_video.setdefault(question.video_id, []).append(question)
    groups = []
    for video_id, video_questions in by_video.items():
        paths = {question.video_path for question in video_questions}
        if len(paths) != 1:
            raise ValueError(f"video {video_id!r} resolves to several paths: {sorted(map(str, paths))}")
        if any(question.realtime is not None for question in video_questions):
            video_questions = sorted(video_questions, key=_asked_at)  # stable: ties keep annotation order
        groups.append(VideoQuestions(video_id, paths.pop(), tuple(video_questions)))
    return groups


def _asked_at(question: Question) -> float:
    return math.inf if question.realtime is None else question.query_seconds


def shard_by_video(
    questions: Sequence[Question],
    rank: int,
    world_size: int,
    weight: Callable[[VideoQuestions], float] | None = None,
) -> list[Question]:
    """The questions rank ``rank`` of ``world_size`` answers, in their original order.

    Videos go whole to one rank. Assignment is deterministic: videos sorted by decreasing
    weight (default: number of questions; pass e.g. video duration to balance compute), ties
    by video id, each to the currently lightest rank (lowest rank on ties). Shard the *full*
    question list, then skip already answered ones, so a resumed run keeps its assignment.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    owner = assign_videos(group_by_video(questions), world_size, weight)
    return [question for question in questions if owner[question.video_id] == rank]


def assign_videos(
    videos: Sequence[VideoQuestions], world_size: int, weight: Callable[[VideoQuestions], float] | None = None
) -> dict[str, int]:
    """``video_id -> rank`` by greedy longest-processing-time-first balancing."""
    weigh = weight or (lambda video: float(len(video.questions)))
    order = sorted(videos, key=lambda video: (-weigh(video), video.video_id))
    loads = [(0.0, rank) for rank in range(world_size)]
    owner = {}
    for video in order:
        load, rank = heapq.heappop(loads)
        owner[video.video_id] = rank
        heapq.heappush(loads, (load + weigh(video), rank))
    return owner
