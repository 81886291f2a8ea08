"""Answer one video's benchmark questions with a `VideoQA`, in the three ways a benchmark needs.

``encoded``  VideoMME, MLVU: the video is sampled by the paper's rule (≤ ``max_fps``, ≤ ``max_frames``),
             streamed through the model once, and every question is asked of that one encoding
             (``once=False`` re-encodes it for each question: the reference the claim is tested against).
``streamed`` OVOBench: the source video is pushed into a live stream at ``max_fps`` and each question is
             asked when the stream reaches ``ceil(realtime)`` seconds, i.e. from the frames before that
             time, which is what the released clip of that question holds.
``clips``    OVOBench: each question's released clip ``<id>.mp4`` (cut at ``ceil(realtime)``) is encoded
             by the paper's rule and asked about, as lmms-eval does.

Each function is a generator of `Answer`s, yielded as soon as a question is answered so the caller can
make it durable before the next one starts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from statekv.eval.prompts import GenerationSettings, build_prompt
from statekv.eval.questions import Question
from statekv.eval.sharding import VideoQuestions

# A frame within this many seconds of a checkpoint counts as reaching it (timestamps are pts * time_base).
TIME_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Answer:
    """A generated answer and what it cost.

    timings: ``encode`` (seconds spent encoding what the model saw: the whole video for an encoding shared
    by several questions, the stream up to the question for a stream) and ``answer`` (this question's
    decoding). info: ``mode``, ``frames``, ``tokens`` and ``carried_tokens`` of the encoding it was asked of,
    and its ``horizon`` (the planned length in tokens, which fixes the RoPE scaling of dynamic-RoPE models).
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
        stop = {}
        if self.settings.stop_strings:  # generate() stops early; the text is still cut below
            stop = {"stop_strings": list(self.settings.stop_strings), "tokenizer": self.qa.adapter.tokenizer}
        start = time.perf_counter()
        text = video.ask(build_prompt(question, self.protocol), max_new_tokens=self.max_new_tokens, **stop)
        return self.settings.cut(text), time.perf_counter() - start

    def room_for(self, questions: Sequence[Question]) -> int:
        """Tokens to reserve after a video for the longest of ``questions`` and its answer."""
        prompts = [build_prompt(question, self.protocol) for question in questions]
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


def answer_encoded(asker: Asker, video: VideoQuestions, *, max_fps: float, max_frames: int,
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


def answer_clips(asker: Asker, video: VideoQuestions, *, max_fps: float, max_frames: int) -> Iterator[Answer]:
    """Encode each question's released clip by the paper's rule and answer it."""
    for question in video.questions:
        if question.clip_path is None:
            raise ValueError(f"question {question.qid} has no clip (clips are an OVOBench layout)")
        encoded, seconds = _encode(asker, question.clip_path, [question], max_fps, max_frames)
        with encoded:
            yield _answer(asker, encoded, question, seconds, mode="clip")


def answer_streamed(asker: Asker, video: VideoQuestions, *, max_fps: float,
                    room: Sequence[Question] | None = None) -> Iterator[Answer]:
    """Push the source video into one live stream and ask each question when the stream reaches its time.

    A question with query time ``S = ceil(realtime)`` is answered from the frames whose timestamps are
    before ``S`` (at least one frame); questions past the video's end are answered once it has ended.
    Streaming stops after the last question, so the rest of the video is never decoded. room: as for
    `answer_encoded`; it also sets the planned number of frames.
    """
    from statekv.video import open_video

    room = room or video.questions
    pending = video.checkpoints()
    source = open_video(video.video_path)
    # planned for all of the video's questions, so a resumed run plans (and answers) the same way
    last_second = max(question.query_seconds for question in room)
    horizon_frames = max(1, math.ceil(min(last_second, source.duration) * max_fps)) + 1
    stream = asker.qa.stream(horizon_frames=horizon_frames, max_fps=max_fps, name=source.name,
                             reserve_tokens=asker.room_for(room))
    encode_seconds = 0.0
    with stream:
        started = time.perf_counter()
        for frame in source.sample_at_rate(max_fps):
            while pending and stream.frames and frame.timestamp + TIME_TOLERANCE >= pending[0][0]:
                encode_seconds += time.perf_counter() - started
                for question in pending.pop(0)[1]:
                    yield _answer(asker, stream, question, encode_seconds, mode="stream")
                started = time.perf_counter()
            if not pending:
                return
            stream.push(frame)
        encode_seconds += time.perf_counter() - started
        if pending:  # asked after the end of the video: let a frame still waiting for its pair in
            stream.flush()
            for _, questions in pending:
                for question in questions:
                    yield _answer(asker, stream, question, encode_seconds, mode="stream")


def _encode(asker: Asker, path, room: Sequence[Question], max_fps: float, max_frames: int):
    start = time.perf_counter()
    encoded = asker.qa.encode(path, max_fps=max_fps, max_frames=max_frames, reserve_tokens=asker.room_for(room),
                              protocol=True)  # the benchmarks' published sampling rule, kept as published
    return encoded, time.perf_counter() - start


def _answer(asker: Asker, encoded, question: Question, encode_seconds: float, *, mode: str) -> Answer:
    text, seconds = asker(encoded, question)
    stats = encoded.stats
    info = {"mode": mode, "frames": stats.frames, "tokens": stats.tokens, "carried_tokens": stats.carried_tokens,
            "horizon": encoded.horizon}
    return Answer(question, text, {"encode": encode_seconds, "answer": seconds}, info)
