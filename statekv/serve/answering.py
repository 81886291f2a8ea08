"""What an answer over HTTP needs around `Stream.ask_tokens`: the question's room checked (`prompt_tokens`), and an
answer stopped between two tokens once its client has gone away (`ClientLeft`) or once the server, stopping, can wait
no longer (`ServerStopped`) or its stream is deleted (`StreamDeleted`): `answer_arguments` and `check_answer`."""

from __future__ import annotations

import threading
from typing import Any

from ..core.answering.together import end_tokens
from ..errors import HorizonError, QuestionTooLong
from .errors import ServiceError
from .sse import StopAtText, StopOnceSet


def prompt_tokens(video: Any, question: str, max_new_tokens: int) -> int:
    """The question's prompt length in tokens, refused (413) when it and the answer do not fit the video (an
    `EncodedVideo` or `Stream`; the engine's one check, `StreamingPrefill.fit_question`); 0 for a simplestream
    stream, whose every question encodes its last frames afresh with room for it."""
    if getattr(video, "prefill", None) is None:
        return 0
    prompt = int(video.adapter.question_ids(question, video.state).shape[1])
    try:
        video.prefill.fit_question(prompt, max_new_tokens)
    except QuestionTooLong as error:
        raise ServiceError(413, f"the question is {prompt} tokens and its answer up to {max_new_tokens}: more than "
                           f"the {error.room} tokens kept for them; ask a shorter question") from None
    except HorizonError as error:  # bounded positions: the model's range holds no room for them
        raise ServiceError(413, f"the question is {prompt} tokens and its answer up to {max_new_tokens}: "
                           f"{error}") from None
    return prompt


class ClientLeft(ServiceError):
    """The client that asked went away: its answer was stopped (between two tokens) and is not recorded."""

    def __init__(self, tokens: int):
        super().__init__(499, f"the answer was stopped after {tokens} tokens: its client went away")


class ServerStopped(ServiceError):
    """The server stopped answering before this answer was whole (its graceful shutdown running out): the answer was
    stopped between two tokens (after ``tokens``; None: before it began) and is not recorded. The stream is
    unchanged, so the question can be asked again."""

    def __init__(self, tokens: int | None):
        what = "the question was not answered" if tokens is None else \
            f"the answer was stopped after {tokens} tokens and is not recorded"
        super().__init__(503, f"the server is stopping: {what}; ask again once the server is back",
                         headers={"Retry-After": "10"})


class StreamDeleted(ServiceError):
    """The stream was deleted while it answered: the answer was stopped between two tokens and is not recorded."""

    def __init__(self, stream_id: str, tokens: int | None):
        what = "" if tokens is None else f"; the answer was stopped after {tokens} tokens"
        super().__init__(404, f"stream {stream_id} was deleted while answering{what}")


class StopOnDeletion(StopOnceSet):
    """Stops an answer once its stream is deleted (``entry.deleting`` set), so a deletion waits for no answer."""

    def __init__(self, entry: Any):
        super().__init__(entry.deleting)
        self.stream_id = entry.id


def answer_arguments(stopping: threading.Event, streamer: Any = None, entry: Any = None) -> dict[str, Any]:
    """``generate``'s arguments for an answer over HTTP: a stop once ``stopping`` is set (the server can wait for
    answers no longer); asking a served stream (``entry``, a `StreamEntry`), a stop once it is deleted; and,
    answering token by token through ``streamer`` (a `sse.TokenStreamer`), the streamer, a stop once its client has
    gone away and one once its text meets a stop sequence."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    criteria = [StopOnceSet(stopping)] + ([StopOnDeletion(entry)] if entry is not None else [])
    if streamer is None:
        return {"stopping_criteria": StoppingCriteriaList(criteria)}
    stops = [StopAtText(streamer)] if streamer.stops.stops else []
    return {"streamer": streamer,
            "stopping_criteria": StoppingCriteriaList([*criteria, StopOnceSet(streamer.gone), *stops])}


def check_answer(kwargs: dict[str, Any], tokens: Any = None, model: Any = None) -> None:
    """`ClientLeft` when the client answered through ``kwargs``' streamer has gone away; `StreamDeleted` when the
    stream was deleted, or `ServerStopped` when the server stopped answering, before the answer (its token ids
    ``[1, N]``, once given, by ``model``) was whole: an answer that reached its ``max_new_tokens`` or one of
    ``model``'s end tokens is whole, even where the stop came as its last token was made. ``kwargs``: what
    `answer_arguments` made, among the answer's other arguments."""
    streamer = kwargs.get("streamer")
    if streamer is not None and streamer.gone.is_set():
        raise ClientLeft(streamer.tokens)
    server = kwargs["stopping_criteria"][0]
    deletion = next((stop for stop in kwargs["stopping_criteria"] if isinstance(stop, StopOnDeletion)), None)
    if tokens is None:
        if deletion is not None and deletion.event.is_set():
            raise StreamDeleted(deletion.stream_id, None)
        if server.event.is_set():
            raise ServerStopped(None)
        return
    count = int(tokens.shape[1])
    ended = count > 0 and int(tokens[0, -1]) in end_tokens(getattr(model, "generation_config", None))
    if count >= kwargs["max_new_tokens"] or ended:
        return
    if deletion is not None and deletion.stopped:
        raise StreamDeleted(deletion.stream_id, count)
    if server.stopped:
        raise ServerStopped(count)
