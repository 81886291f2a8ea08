"""``statekv eval BENCHMARK --data-root R --check``: what a run would read, checked in seconds, before a model loads.

Every annotation row is parsed as a run parses it (the first bad row stops the check: exit status 2 and one line
naming it) and every video a run would open is opened for its header only (no frame is decoded). Printed per group:
the questions, the videos a run opens (found, missing, undecodable) and the frames a run of that group would encode
from the videos found, under the run's mode and sampling (``--mode``, ``--max-fps``, ``--max-frames``; a proactive
output counted with all its polls); the same for all groups together (a stream serves every group of its video, so
the total is not the sum); then every missing or undecodable video, what the annotations hold that a run does not
use (`statekv.eval.annotations.LoadNotes`), and the questions that come after their video ends (a run asks them at
its end). Missing videos are listed, not fatal: the status is 0 once every row parses.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from statekv.errors import ConfigurationError, VideoError
from statekv.eval.answering import last_second, past_the_end
from statekv.eval.loaders import load_benchmark, load_benchmark_from_hub
from statekv.eval.questions import Question, questions_asked
from statekv.eval.runner import default_max_frames, resolve_mode
from statekv.eval.sharding import group_by_video
from statekv.eval.streamingbench import poll_times
from statekv.video import Video, num_sampled_frames, open_video

ALL = "all"  # the group of a benchmark without groups
GROUP_ORDER = ("backward", "realtime", "forward", "contextual")  # as the benchmarks list them


@dataclass
class GroupCheck:
    """One group's questions and the videos a run would open for them (``frames``: what it would encode from the
    videos found)."""

    name: str
    questions: int = 0
    answers: int = 0  # more than the questions where a forward question is asked at each of its polls
    videos: set[Path] = field(default_factory=set)
    missing: set[Path] = field(default_factory=set)
    undecodable: set[Path] = field(default_factory=set)
    frames: int = 0

    @property
    def found(self) -> int:
        return len(self.videos) - len(self.missing) - len(self.undecodable)


@dataclass
class CheckReport:
    """The whole check: ``groups`` in the benchmark's order, the total, the unreadable videos with their reasons,
    the annotation notes (one line each) and the questions past their video's end."""

    benchmark: str
    mode: str
    groups: list[GroupCheck]
    total: GroupCheck
    reasons: dict[Path, str]
    notes: list[str]
    late: list[tuple[Question, float]]


def check_benchmark(benchmark: str, data_root: Path | str, *, mode: str | None = None,
                    groups: Sequence[str] | None = None, max_fps: float = 1.0, max_frames: int | None = None,
                    ovobench_videos: str | None = None, from_hub: bool = False) -> CheckReport:
    """Check ``benchmark`` under ``data_root`` as a run with these settings would read it (see the module
    docstring); a bad annotation row raises its one-line `AnnotationError`."""
    mode = resolve_mode(benchmark, mode, ovobench_videos)
    max_frames = default_max_frames(benchmark) if max_frames is None else max_frames
    with _collected_warnings() as notes:
        if from_hub:
            questions = load_benchmark_from_hub(benchmark, data_root, check_videos=False)
        elif benchmark in ("ovobench", "streamingbench"):
            questions = load_benchmark(benchmark, data_root, check_videos=False, groups=groups)
        else:
            questions = load_benchmark(benchmark, data_root, check_videos=False)
    if not questions:  # as a run of it would say
        raise ConfigurationError(f"no {benchmark} questions found under {data_root}")
    clips = benchmark == "ovobench" and mode == "offline"
    headers: dict[Path, Video | str] = {}
    names = sorted(dict.fromkeys(question.group or ALL for question in questions), key=lambda name: (
        GROUP_ORDER.index(name) if name in GROUP_ORDER else len(GROUP_ORDER)))
    late: list[tuple[Question, float]] = []
    groups_checked = [_check_group(name, [question for question in questions if (question.group or ALL) == name],
                                   headers, late, mode=mode, clips=clips, max_fps=max_fps, max_frames=max_frames)
                      for name in names]
    # a run of every group streams each video once, up to its last question: the total is not the groups' sum
    total = _check_group("total", questions, headers, [], mode=mode, clips=clips, max_fps=max_fps,
                         max_frames=max_frames)
    reasons = {path: header for path, header in headers.items() if isinstance(header, str) and header != "missing"}
    return CheckReport(benchmark, mode, groups_checked, total, reasons, notes, late)


def _check_group(name: str, questions: Sequence[Question], headers: dict[Path, Video | str],
                 late: list[tuple[Question, float]], *, mode: str, clips: bool, max_fps: float,
                 max_frames: int | None) -> GroupCheck:
    """``questions`` as a run of them alone would read them; the questions past their video's end go to
    ``late``."""
    group = GroupCheck(name, questions=questions_asked(questions), answers=len(questions))
    for video in group_by_video(questions):
        paths = [question.clip_path for question in video.questions] if clips else [video.video_path]
        for path in paths:
            header = _header(headers, path)
            group.videos.add(path)
            if isinstance(header, str):
                (group.missing if header == "missing" else group.undecodable).add(path)
                continue
            if not clips:
                late += [(question, header.duration) for question in past_the_end(video.questions, header.duration)]
            group.frames += _frames(video.questions, header, mode=mode, clip=clips, max_fps=max_fps,
                                    max_frames=max_frames)
    return group


def _header(headers: dict[Path, Video | str], path: Path) -> Video | str:
    """The opened header of ``path`` ("missing", or why it cannot be read, instead), read once."""
    if path not in headers:
        if not path.is_file():
            headers[path] = "missing"
        else:
            try:
                headers[path] = open_video(path)
            except VideoError as error:
                headers[path] = str(error)
    return headers[path]


def _frames(questions: Sequence[Question], video: Video, *, mode: str, clip: bool, max_fps: float,
            max_frames: int | None) -> int:
    """The frames a run encodes from ``video`` for ``questions`` (a clip: for its one question)."""
    if clip or (mode == "offline" and all(question.realtime is None for question in questions)):
        return num_sampled_frames(video.num_frames, video.fps, max_fps=max_fps,
                                  max_frames=max_frames or video.num_frames)
    rate = min(max_fps, video.fps)  # a stream takes at most one frame per tick and never more than the video has

    def upto(second: float) -> int:
        return max(1, math.ceil(min(second, video.duration) * rate))

    if mode == "streaming":  # one stream, up to the last question
        return upto(max(last_second(question, video.duration) for question in questions))
    seconds = set()  # offline, timed: an encoding for each second a question (or a proactive poll) is asked at
    for question in questions:
        if question.kind == "proactive":
            seconds.update(poll_times(question))
        else:
            seconds.add(video.duration if question.realtime is None else question.query_seconds)
    return sum(upto(second) for second in seconds)


@contextmanager
def _collected_warnings() -> Iterator[list[str]]:
    """The warning lines the loaders log meanwhile, collected for the report instead of printed."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    source = logging.getLogger("statekv.eval")
    handler, propagate = Collect(logging.WARNING), source.propagate
    source.addHandler(handler)
    source.propagate = False
    try:
        yield lines
    finally:
        source.removeHandler(handler)
        source.propagate = propagate


def report_lines(report: CheckReport) -> list[str]:
    """The report as printed (see the module docstring)."""
    rows = [("group", "questions", "videos", "found", "missing", "undecodable", "frames")]
    for group in [*report.groups, *([report.total] if len(report.groups) > 1 else [])]:
        rows.append((group.name, f"{group.questions:,}", f"{len(group.videos):,}", f"{group.found:,}",
                     f"{len(group.missing):,}", f"{len(group.undecodable):,}", f"{group.frames:,}"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [f"{report.benchmark}, {report.mode} mode; frames: what a run of the group (the total: of them all) "
             "would encode from the videos found"]
    lines += ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                        for column, (cell, width) in enumerate(zip(row, widths))) for row in rows]
    total = report.total
    if total.missing:
        lines.append(f"missing videos ({len(total.missing):,}):")
        lines += [f"  {path}" for path in sorted(total.missing)]
    if total.undecodable:
        lines.append(f"undecodable videos ({len(total.undecodable):,}):")
        lines += [f"  {report.reasons[path]}" for path in sorted(total.undecodable)]
    lines += [f"not used or read otherwise: {note}" for note in report.notes]
    if report.late:
        question, duration = report.late[0]
        lines.append(f"{len(report.late):,} question(s) come after their video ends and are asked at its end (the "
                     f"first: {question.qid} at {max(question.realtime, question.expected_time or 0):.0f} s, "
                     f"{question.video_path} lasts {duration:.1f} s)")
    videos = f"{total.found:,} of {len(total.videos):,} videos readable"
    polls = (f" ({total.answers:,} answers to give: a forward question is asked at each of its polls)"
             if total.answers != total.questions else "")
    lines.append(f"every annotation row parses: {total.questions:,} questions{polls}; {videos}")
    return lines


def check_command(args: argparse.Namespace) -> int:
    """``statekv eval BENCHMARK --check``: print `report_lines`; 0 once every row parses (bad rows raise)."""
    report = check_benchmark(args.benchmark, args.data_root, mode=args.mode, groups=getattr(args, "groups", None),
                             max_fps=args.max_fps, max_frames=args.max_frames,
                             ovobench_videos=getattr(args, "videos", None),
                             from_hub=getattr(args, "from_hub", False))
    print("\n".join(report_lines(report)), flush=True)
    return 0
