"""A question's retrieval counted in frames, as the front door asks for it (``retrieve``), while the engine counts
steps (two frames each for Qwen3-VL, whose last step of an odd frame count holds one)."""

from __future__ import annotations

from typing import Any

import torch

from ..core import Retrieval
from ..core.positions.placing import QuestionPlan
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


def held_frames(video: Any, keep_tokens: int) -> int:
    """The frames ``video``'s engine still holds in the steps after those wholly inside its first ``keep_tokens``
    tokens (the prompt prefix and sinks): what a retrieval of every held step reads."""
    cache = video.prefill.cache
    first = int(torch.searchsorted(cache.step_starts()[1:], keep_tokens, right=True))
    frames = video.step_frames.tensor()[first:]
    return int(frames[~cache.evicted_steps.mask(first + len(frames))[first:]].sum())
