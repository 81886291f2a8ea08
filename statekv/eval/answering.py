"""Answer one video's benchmark questions with a `VideoQA`, streaming or offline.

``streamed``  (``--mode streaming``) one live stream per video: the source is pushed into it at ``max_fps``, and
              each question is asked when the stream reaches its time (``ceil(realtime)`` seconds: it sees the
              frames before that second), the video's questions in time order on the same stream, its cache
              reused and never re-encoded. A forward question (OVO-Bench's forward tasks, the synthetic set's:
              one `Question` per poll) is a watch on the stream, evaluated at each of its times
              (`statekv.eval.watching`); a proactive output (StreamingBench) is a watch evaluated every second
              until the model says its time has come. Questions without a time are asked once the video has
              ended.
``afresh``    (``--mode offline``, timed questions) each question is answered from an encoding of the frames
              before its time, made for it alone (questions at the same time share it): the offline protocol,
              on the same frames as ``streamed``.
``clips``     (``--mode offline`` on OVO-Bench) each question's released clip ``<id>.mp4`` (``<id>_<j>.mp4`` for a
              poll), cut at ``ceil(realtime)``, encoded by the paper's rule: lmms-eval's and the release's way.
``encoded``   (``--mode offline``, VideoMME, MLVU, the synthetic set) the video is sampled by the paper's rule
              (≤ ``max_fps``, ≤ ``max_frames``), streamed through the model once, and every question is asked of
              that one encoding (``once=False`` re-encodes it for each question: the reference the claim is
              tested against).

Each function is a generator of `Answer`s, yielded as soon as a question is answered so the caller can
make it durable before the next one starts.
"""

from __future__ import annotations

import heapq
import logging
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from statekv.eval import streamingbench
from statekv.eval.prompts import GenerationSettings, build_prompt
from statekv.eval.questions import Question
from statekv.eval.sharding import VideoQuestions
from statekv.eval.watching import VideoWatches, watched

logger = logging.getLogger(__name__)

# A frame within this many seconds of a checkpoint counts as reaching it (timestamps are pts * time_base).
TIME_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Answer:
    """A generated answer and what it cost.

    timings: ``encode`` (seconds spent encoding what the model saw: the whole video for an encoding shared
    by several questions, the stream up to the question for a stream) and ``answer`` (this question's
    decoding; under ``simplestream`` the encoding of its last frames too; a proactive output: all its polls).
    info: ``mode``, ``frames``, ``tokens``, ``carried_tokens`` and ``cache_bytes`` of the encoding it was asked
    of, ``held_bytes`` (what the stream holds between questions: its cache, or a simplestream's frames), its
    ``horizon`` (the planned length in tokens, which fixes the RoPE scaling of dynamic-RoPE models), ``second``
    (when a stream asked it); a proactive output's ``answered_at`` (None: never), ``expected_at`` and ``polls``.
    """

    question: Question
    text: str
    timings: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)


class Asker:
    """Asks benchmark questions of encoded videos with the protocol's prompt and generation settings.

    ``qa`` is a `statekv.VideoQA`; ``max_new_tokens`` overrides the protocol's (only for quick smoke runs).
    """

    def __init__(self, qa, settings: GenerationSettings, protocol: str, max_new_tokens: int | None = None):
        self.qa = qa
        self.settings = settings
        self.protocol = protocol
        self.max_new_tokens = max_new_tokens or settings.max_new_tokens

    def __call__(self, video, question: Question) -> tuple[str, float]:
        """``(answer text cut at the first stop string, seconds)`` for ``question`` about ``video``."""
        return self.ask(video, build_prompt(question, self.protocol))

    def ask(self, video, prompt: str) -> tuple[str, float]:
        """``(answer text cut at the first stop string, seconds)`` for the text ``prompt`` about ``video``."""
        stop = {}
        if self.settings.stop_strings:  # generate() stops early; the text is still cut below
            stop = {"stop_strings": list(self.settings.stop_strings), "tokenizer": self.qa.adapter.tokenizer}
        start = time.perf_counter()
        text = video.ask(prompt, max_new_tokens=self.max_new_tokens, **stop)
        return self.settings.cut(text), time.perf_counter() - start

    def room_for(self, questions: Sequence[Question]) -> int:
        """Tokens to reserve after a video for the longest of ``questions`` (and of their polls) and its answer."""
        prompts = [build_prompt(question, self.protocol) for question in questions]
        prompts += [streamingbench.poll_prompt(question) for question in questions if question.kind == "proactive"]
        return room_for_prompts(self.qa, prompts, self.max_new_tokens)


def room_for_prompts(qa, prompts: Sequence[str], max_new_tokens: int) -> int:
    """Tokens to reserve after a video (``reserve_tokens=`` of `VideoQA.encode`/`stream`) for the longest of
    ``prompts`` plus its answer.

    The room after the video sets the planned length, the RoPE horizon that dynamic scaling is frozen at:
    sizing it from the video's own questions (not a fixed reserve) keeps it close to what the model's
    one-shot forward would use, and always large enough for long answers.
    """
    adapter = qa.adapter
    state = adapter.start()
    return max(adapter.question_ids(prompt, state).shape[-1] for prompt in prompts) + max_new_tokens


def answer_encoded(asker: Asker, video: VideoQuestions, *, max_fps: float, max_frames: int | None,
                   once: bool = True, room: Sequence[Question] | None = None) -> Iterator[Answer]:
    """Encode ``video`` once (or once per question) and answer its questions.

    room: the questions to plan room for (default: ``video.questions``); pass all of the video's questions
    when only some are left to answer, so a resumed run plans the same encoding.
    """
    room = room or video.questions
    if once:
        encoded, seconds = _encode(asker, video.video_path, room, max_fps, max_frames)
        with encoded:
            for question in video.questions:
                yield _answer(asker, encoded, question, seconds, mode="encoded")
        return
    for question in video.questions:
        encoded, seconds = _encode(asker, video.video_path, room, max_fps, max_frames)
        with encoded:
            yield _answer(asker, encoded, question, seconds, mode="encoded-per-question")


def answer_clips(asker: Asker, video: VideoQuestions, *, max_fps: float, max_frames: int | None
                 ) -> Iterator[Answer]:
    """Encode each question's released clip by the paper's rule and answer it."""
    for question in video.questions:
        if question.clip_path is None:
            raise ValueError(f"question {question.qid} has no clip (clips are an OVOBench layout)")
        encoded, seconds = _encode(asker, question.clip_path, [question], max_fps, max_frames)
        with encoded:
            yield _answer(asker, encoded, question, seconds, mode="clip")


def answer_streamed(asker: Asker, video: VideoQuestions, *, max_fps: float,
                    room: Sequence[Question] | None = None, replay: Sequence[Question] = ()) -> Iterator[Answer]:
    """Push the source video into one live stream and ask each question when the stream reaches its time.

    A question with query time ``S = ceil(realtime)`` is answered from the frames whose timestamps are
    before ``S`` (at least one frame); questions past the video's end, or without a time, are answered once
    it has ended. Streaming stops after the last question, so the rest of the video is never decoded. room:
    the questions to plan room for (default: ``video.questions``; pass all of the video's questions when only
    some are left to answer, so a resumed run plans the same encoding); it also sets the planned number of
    frames. replay: the run's questions of this video answered before it was interrupted: what they did to the
    stream is done again (a forward poll's watch evaluated, a proactive output polled: each watch steers what
    the stream carries while it is open), and they are not answered again, so a resumed run answers as an
    uninterrupted one.
    """
    from statekv.video import open_video

    room = room or video.questions
    source = open_video(video.video_path)
    warn_past_the_end(video, source.duration)
    last = max(last_second(question, source.duration) for question in room)
    horizon_frames = max(1, math.ceil(min(last, source.duration) * max_fps)) + 1
    stream = asker.qa.stream(horizon_frames=horizon_frames, max_fps=max_fps, name=source.name,
                             reserve_tokens=asker.room_for(room))
    asked = {question.qid for question in (*video.questions, *replay)}
    in_order = [question for question in room if question.qid in asked]  # the uninterrupted run's order
    due = _Schedule(in_order if len(in_order) == len(asked) else [*replay, *video.questions],
                    watch=build_prompt_for(asker), quiet={question.qid for question in replay})
    clock = _Clock()
    with discarded(stream):
        clock.start()
        for frame in source.sample_at_rate(max_fps):
            while due and stream.frames and frame.timestamp + TIME_TOLERANCE >= due.next_second:
                clock.stop()
                yield from due.ask_next(asker, stream, clock.seconds, mode="stream")
                clock.start()
            if not due:
                return
            stream.push(frame)
        clock.stop()
        stream.flush()  # asked after the end of the video: let a frame still waiting for its pair in
        while due:
            yield from due.ask_next(asker, stream, clock.seconds, mode="stream")


def answer_afresh(asker: Asker, video: VideoQuestions, *, max_fps: float,
                  room: Sequence[Question] | None = None) -> Iterator[Answer]:
    """Answer each question from a stream of the frames before its time made for it alone (the offline protocol
    on the frames `answer_streamed` sees; a proactive output's every poll gets its own)."""
    from statekv.video import open_video

    room = room or video.questions
    source = open_video(video.video_path)
    warn_past_the_end(video, source.duration)
    due = _Schedule(video.questions)
    while due:
        second = due.next_second
        limit = min(second, source.duration + 1)
        frames = max(1, math.ceil(min(second, source.duration) * max_fps)) + 1
        clock = _Clock()
        with discarded(asker.qa.stream(horizon_frames=frames, max_fps=max_fps, name=source.name,
                                       reserve_tokens=asker.room_for(room))) as stream:
            clock.start()
            for frame in source.sample_at_rate(max_fps):
                if stream.frames and frame.timestamp + TIME_TOLERANCE >= limit:
                    break
                stream.push(frame)
            stream.flush()
            clock.stop()
            yield from due.ask_next(asker, stream, clock.seconds, mode="afresh")


@contextmanager
def discarded(stream: Any) -> Iterator[Any]:
    """``stream``, closed at the end and its disk-tier file set (``offload="disk"``) removed: a stream made to answer
    questions is never resumed, and its folder holds its whole detailed cache."""
    folder = getattr(stream, "folder", None)  # a `RecentFrames` (SimpleStream) has none
    try:
        with stream:
            yield stream
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def past_the_end(questions: Sequence[Question], duration: float) -> list[Question]:
    """The timed ``questions`` asked after a video of ``duration`` seconds has ended (a stream asks them at its
    end): a query second past the video's last whole second, or a proactive output due after it."""
    end = math.ceil(duration)
    return [question for question in questions if question.realtime is not None and (
        question.query_seconds > end or (question.expected_time or 0) > end)]


def warn_past_the_end(video: VideoQuestions, duration: float) -> None:
    """One warning line naming the questions of ``video`` asked after it ends (they are asked at its end)."""
    late = past_the_end(video.questions, duration)
    if late:
        first = late[0]
        logger.warning("%s: %d question(s) come after the video ends at %.1f s and are asked at its end (the first: "
                       "%s at %.0f s)", video.video_path, len(late), duration, first.qid,
                       max(first.realtime, first.expected_time or 0))


def last_second(question: Question, duration: float) -> float:
    """The last second ``question`` may be asked at (a proactive output's last poll; the end without a time)."""
    if question.kind == "proactive":
        return streamingbench.poll_times(question)[-1]
    return duration if question.realtime is None else question.query_seconds


def build_prompt_for(asker: Asker):
    """The prompt of a question as ``asker`` asks it."""
    return lambda question: build_prompt(question, asker.protocol)


class _Schedule:
    """A video's asks in time order: each question at its second (at the end without one); a proactive output
    at each poll second until the model says its time has come. ``watch``: forward polls and proactive outputs go
    through watches on the stream (`VideoWatches`; the function gives a question's prompt)."""

    def __init__(self, questions: Sequence[Question], watch=None, quiet: set[str] = frozenset()):
        self.quiet = quiet  # asked before an interruption: what they do to the stream is done again, unanswered
        self.heap: list[tuple[float, int, Question, int]] = []
        self.polls: dict[str, list[tuple[str, float]]] = {}  # a proactive output's (poll answer, seconds) so far
        self.watches = None if watch is None else VideoWatches(questions, watch)
        for order, question in enumerate(questions):
            if question.kind == "proactive":
                second: float = streamingbench.poll_times(question)[0]
            else:
                second = math.inf if question.realtime is None else question.query_seconds
            heapq.heappush(self.heap, (second, order, question, 0))

    def __bool__(self) -> bool:
        return bool(self.heap)

    @property
    def next_second(self) -> float:
        return self.heap[0][0]

    def ask_next(self, asker: Asker, video, encode_seconds: float, *, mode: str) -> Iterator[Answer]:
        """Ask every question due at the next second; yield those answered."""
        second = self.next_second
        while self.heap and self.heap[0][0] == second:
            _, order, question, poll = heapq.heappop(self.heap)
            quiet = question.qid in self.quiet
            if question.kind != "proactive" and self.watches is not None and watched(question):
                text, seconds, info = self.watches.answer(video, question, asker.max_new_tokens)
                info = {**_info(video, mode, second), **info}
                if not quiet:
                    yield Answer(question, asker.settings.cut(text), {"encode": encode_seconds, "answer": seconds},
                                 info)
                continue
            if question.kind != "proactive":
                if not quiet:  # a question reads the stream, and leaves it as it was
                    yield _answer(asker, video, question, encode_seconds, mode=mode, second=second)
                continue
            answer = self._poll(asker, video, question, poll, encode_seconds, mode, second)
            if answer is None:
                heapq.heappush(self.heap, (streamingbench.poll_times(question)[poll + 1], order, question, poll + 1))
            elif not quiet:
                yield answer

    def _poll(self, asker: Asker, video, question: Question, poll: int, encode_seconds: float, mode: str,
              second: float) -> Answer | None:
        """One poll of a proactive output: its answer once the model says yes (or the polls run out), else None."""
        if self.watches is not None:  # an evaluation of the poll's watch
            key = (question.qid, streamingbench.poll_prompt(question))
            text, seconds, _ = self.watches.evaluate(video, key, key[1], asker.max_new_tokens)
            text = asker.settings.cut(text)
        else:
            text, seconds = asker.ask(video, streamingbench.poll_prompt(question))
        history = self.polls.setdefault(question.qid, [])
        history.append((text, seconds))
        answered = streamingbench.said_yes(text)
        if self.watches is not None and (answered or poll + 1 >= len(streamingbench.poll_times(question))):
            self.watches.close((question.qid, streamingbench.poll_prompt(question)))
        if answered:
            text, asked = asker.ask(video, build_prompt(question, asker.protocol))
            history.append(("", asked))
        elif poll + 1 < len(streamingbench.poll_times(question)):
            return None
        info = _info(video, mode, second)
        info.update(answered_at=second if answered else None, expected_at=question.expected_time, polls=poll + 1,
                    poll_answers=[answer for answer, _ in history[:poll + 1]])
        return Answer(question, text, {"encode": encode_seconds, "answer": sum(spent for _, spent in history)}, info)


class _Clock:
    """Seconds spent encoding, between `start` and `stop` calls."""

    def __init__(self) -> None:
        self.seconds, self.started = 0.0, None

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        if self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.started = None


def _encode(asker: Asker, path, room: Sequence[Question], max_fps: float, max_frames: int | None):
    """An encoding of ``path`` by the benchmarks' rule (``max_frames`` None: every frame at ``max_fps``)."""
    from statekv.video import open_video

    start = time.perf_counter()
    if max_frames is None:
        max_frames = open_video(path).num_frames
    encoded = asker.qa.encode(path, max_fps=max_fps, max_frames=max_frames, reserve_tokens=asker.room_for(room),
                              protocol=True)  # the benchmarks' published sampling rule, kept as published
    return encoded, time.perf_counter() - start


def _answer(asker: Asker, encoded, question: Question, encode_seconds: float, *, mode: str,
            second: float | None = None) -> Answer:
    text, seconds = asker(encoded, question)
    return Answer(question, text, {"encode": encode_seconds, "answer": seconds}, _info(encoded, mode, second))


def _info(encoded, mode: str, second: float | None) -> dict[str, Any]:
    stats = encoded.stats
    info = {"mode": mode, "frames": stats.frames, "tokens": stats.tokens, "carried_tokens": stats.carried_tokens,
            "horizon": encoded.horizon, "cache_bytes": stats.cache_bytes,
            "held_bytes": getattr(encoded, "held_bytes", stats.cache_bytes)}
    if getattr(encoded, "handover", None) is not None:  # bounded positions' handover layout: where it stands
        info["handover"] = encoded.handover
    if second is not None:
        info["second"] = second if math.isfinite(second) else None
    return info
