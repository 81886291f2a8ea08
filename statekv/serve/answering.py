"""What an answer over HTTP needs around `Stream.ask_tokens`: the question's room checked (`prompt_tokens`), and an
answer given token by token stopped once its client has gone away (`streamer_arguments`, `ClientLeft`)."""

from __future__ import annotations

from typing import Any

from ..errors import QuestionTooLong
from .errors import ServiceError
from .sse import ClientGone


def prompt_tokens(video: Any, question: str, max_new_tokens: int) -> int:
    """The question's prompt length in tokens, refused (413) when it and the answer do not fit the video (an
    `EncodedVideo` or `Stream`; the engine's one check, `StreamingPrefill.fit_question`)."""
    prompt = int(video.adapter.question_ids(question, video.state).shape[1])
    try:
        video.prefill.fit_question(prompt, max_new_tokens)
    except QuestionTooLong as error:
        raise ServiceError(413, f"the question is {prompt} tokens and its answer up to {max_new_tokens}: more than "
                           f"the {error.room} tokens kept for them; ask a shorter question") from None
    return prompt


class ClientLeft(ServiceError):
    """The client that asked went away: its answer was stopped (between two tokens) and is not recorded."""

    def __init__(self, tokens: int):
        super().__init__(499, f"the answer was stopped after {tokens} tokens: its client went away")


def streamer_arguments(streamer: Any) -> dict[str, Any]:
    """``generate``'s arguments for answering token by token through ``streamer`` (a `sse.TokenStreamer`): the
    streamer, and a stop once its client has gone away."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    return {"streamer": streamer, "stopping_criteria": StoppingCriteriaList([ClientGone(streamer.gone)])}


def check_still_there(streamer: Any) -> None:
    """`ClientLeft` when the client answered through ``streamer`` has gone away."""
    if streamer is not None and streamer.gone.is_set():
        raise ClientLeft(streamer.tokens)
