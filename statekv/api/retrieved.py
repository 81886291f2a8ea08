"""A question's retrieval counted in frames, as the front door asks for it (``retrieve``), while the engine counts
steps (two frames each for Qwen3-VL, whose last step of an odd frame count holds one)."""

from __future__ import annotations

import bisect
from typing import Any

from ..core import Retrieval
from ..core.positions.placing import QuestionPlan
from ..core.watching.fitting import check_retrieval_fits
from ..errors import RetrievalTooWide


def fit_in_frames(video: Any, prompt_tokens: int, answer_tokens: int, retrieval: Retrieval | None,
                  frames: int | None) -> QuestionPlan | None:
    """`StreamingPrefill.fit_question` of ``video``'s engine (an `EncodedVideo`) for a question retrieving by
    ``retrieval``, made of ``frames`` frames; its refusal of too many retrieved steps counted in frames: the hint is
    then a ``retrieve`` that fits."""
    try:
        return video.prefill.fit_question(prompt_tokens, answer_tokens, retrieval)
    except RetrievalTooWide as error:
        raise in_frames(error, video, retrieval, frames) from None


def in_frames(error: RetrievalTooWide, video: Any, retrieval: Retrieval, frames: int) -> RetrievalTooWide:
    """The engine's refusal ``error`` (counted in steps) of ``video``'s question (or watch) retrieving ``frames``
    frames by ``retrieval``, counted in frames: its hint a ``retrieve`` that fits."""
    read = min(frames, held_frames(video, retrieval.keep_tokens))  # every held step read: no more than held
    return error.counted_in("frames", video.adapter.frames_per_step, read)


def fits_past_range(video: Any, room: int, retrieval: Retrieval, frames: int) -> None:
    """`check_retrieval_fits` for each of ``video``'s engines (a watch retrieving ``frames`` frames by
    ``retrieval``, its question and answer taking ``room`` positions), its refusal counted in frames."""
    adapter = video.adapter
    least = adapter.min_video_tokens(adapter.frames_per_step) - adapter.min_video_tokens(0)  # a frame step's span
    for prefill in video.engines:
        try:
            check_retrieval_fits(prefill, room, retrieval, least)
        except RetrievalTooWide as error:
            raise error.counted_in("frames", adapter.frames_per_step, frames) from None


def held_frames(video: Any, keep_tokens: int) -> int:
    """The frames ``video``'s engine still holds in the steps after those wholly inside its first ``keep_tokens``
    tokens (the prompt prefix and sinks): what a retrieval of every held step reads."""
    cache = video.prefill.cache
    first = bisect.bisect_right(cache.starts, keep_tokens, lo=1) - 1  # steps wholly inside the kept tokens
    frames = video.step_frames
    return sum(frames.total(max(start, first), end) for start, end in cache.evicted_steps.held_runs(len(frames))
               if end > first)
