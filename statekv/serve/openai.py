"""OpenAI-compatible routes: ``GET /v1/models`` (and ``/v1/models/{model}``) and ``POST /v1/chat/completions``.

A user message with a ``video_url`` part (a ``file://`` URL under ``--media-root``; the last user message's, or
else the latest earlier one's) is encoded with the server's default method settings and answered;
``"statekv": {"stream_id": ID}`` asks one of the caller's live streams instead. ``"stream": true`` sends
``chat.completion.chunk`` events and ``data: [DONE]``. ``usage`` counts the tokens the answer read (the video's
tokens and the prompt's) and the tokens it generated.

An answer reads the video and the last user message only: system messages and earlier turns are not read (a
stream's questions are answered from the video, each on its own). The response says so: its ``statekv`` object
(and a streamed answer's last chunk's) holds ``"read": "the video and the last user message"`` and, when the
request had any, ``"not_read"``: how many system messages and earlier turns were left out. Answers are decoded
greedily: sampling fields set to anything else are named in ``"not_applied"`` (with ``"decoding": "greedy"``);
``stop`` sequences end an answer before them (`sse.StopTexts`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..api.encoded import METHOD_DEFAULT
from ..core.answering.together import end_tokens
from ..errors import FrameDecodeError
from ..settings.values import is_finite_number
from .errors import ServiceError
from .healing import check_can_ask
from .limits import read_json
from .media import resolve_file_url
from .answering import ClientLeft, ServerStopped, answer_arguments, check_answer, prompt_tokens
from .routes import (DEFAULT_NEW_TOKENS, MAX_NEW_TOKENS, MAX_QUESTION_CHARS, Served, begin_answer, checked_retrieve,
                     pieces_until, streamed_outcome, whole_answer)
from .sse import EventStream, StopTexts, TokenStreamer, event
from .stream_settings import METHOD_FIELDS, shown


READ = "the video and the last user message"
READ_EARLIER = "the video of an earlier user message and the last user message"
# OpenAI's sampling fields and the value each has under greedy decoding, the only decoding an answer uses
GREEDY = {"temperature": 0, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
          "logprobs": False, "top_logprobs": None}


# OpenAI's ranges of its numeric sampling fields
RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
          "top_logprobs": (0, 20)}
MAX_MODEL_CHARS = 256
MAX_STOP_CHARS = 256
TOOLS = (("tools", "tool_choice"), ("functions", "function_call"))  # what a model may call, and how it must choose
EXTENSION = ("stream_id", "retrieve")  # a chat's own fields, under "statekv"


def not_applied(body: dict) -> list[str]:
    """The sampling fields of a chat request set to something greedy decoding does not do (absent, null or the
    greedy value: applied), and the tools it offers that the model may leave unused (they are not offered to it);
    ``n`` other than 1 is refused, one answer being all a question gets, and so is a value
    OpenAI refuses (a field of the wrong type or out of its range) and a field asking for what no answer here gives
    (a JSON answer, a tool call, audio)."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ServiceError(400, f"n must be 1 (an answer is decoded once), got {shown(n)}")
    check_sampling(body)
    refuse_unsupported(body)
    offered = [tools for tools, choice in TOOLS if body.get(tools) and body.get(choice) != "none"]
    return [name for name, greedy in GREEDY.items() if not _is_greedy(body.get(name), greedy)] + offered


def check_sampling(body: dict) -> None:
    """A 400 naming the first sampling field whose value OpenAI would refuse."""
    for name, (low, high) in RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        whole = name == "top_logprobs"
        if not is_finite_number(value) or (whole and not isinstance(value, int)) or not low <= value <= high:
            kind = "an integer" if whole else "a number"
            raise ServiceError(400, f"{name} must be {kind} from {low} to {high}, got {shown(value)}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 4 and all(isinstance(item, str) for item in stop)):
        raise ServiceError(400, f"stop must be a string or a list of at most 4 strings, got {shown(stop)}")
    if any(len(item) > MAX_STOP_CHARS for item in stop_sequences(body)):
        raise ServiceError(400, f"a stop sequence is at most {MAX_STOP_CHARS} characters")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise ServiceError(400, f"logprobs must be true or false, got {shown(body['logprobs'])}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ServiceError(400, f"seed must be an integer, got {shown(seed)}")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise ServiceError(400, f"logit_bias must be an object of token ids to biases, got {shown(bias)}")


def refuse_unsupported(body: dict) -> None:
    """A 400 for a field asking for an answer other than free text: answers here are text, decoded greedily."""
    form = body.get("response_format")
    if form is not None and not (isinstance(form, dict) and form.get("type") == "text"):
        raise ServiceError(400, f"response_format {shown(form)} is not supported: answers are free text "
                                "(give {\"type\": \"text\"} or leave it out)")
    for tools, choice in TOOLS:  # tools the model may leave unused are named in not_applied; a forced call is refused
        if body.get(tools) and (body.get(choice) == "required" or isinstance(body.get(choice), dict)):
            raise ServiceError(400, f"{tools} with {choice} {shown(body.get(choice))} are not supported: answers "
                                    f"are text, never a call (leave {choice} out or set it to \"auto\" or \"none\")")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ServiceError(400, f"modalities {shown(modalities)} is not supported: answers are text only")
    if body.get("audio") is not None:
        raise ServiceError(400, "audio output is not supported: answers are text only")


def model_name(body: dict, served: str) -> str:
    """The ``model`` a completion names: the served model's id (``served``), which a request may leave out. Another
    name is refused, as OpenAI's API and ``vllm serve`` refuse it, so a client never takes this model's answers for
    another's."""
    model = body.get("model")
    if model is None or model == "":
        return served
    if not isinstance(model, str) or len(model) > MAX_MODEL_CHARS:
        raise ServiceError(400, f"model must be a model's name (text of at most {MAX_MODEL_CHARS} characters), got "
                                f"{shown(model) if not isinstance(model, str) else f'{len(model)} characters'}")
    if model != served:
        raise not_served(model, served)
    return served


def not_served(model: str, served: str) -> ServiceError:
    """The 404 of a ``model`` other than the one served."""
    return ServiceError(404, f"model {shown(model)} is not served here: GET /v1/models names the one that is "
                             f"({shown(served)})")


def _is_greedy(value: Any, greedy: Any) -> bool:
    if value is None or (isinstance(value, (list, dict, str)) and not value):  # unset, or an empty stop list
        return True
    if isinstance(value, bool) or isinstance(greedy, bool):
        return value is greedy
    return value == greedy


def not_read(messages: list) -> dict[str, int]:
    """What an answer leaves out of ``messages``: ``{"system": n, "earlier_turns": m}`` (the messages before the
    last user message that are not system messages), empty when nothing is left out."""
    last = max(i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user")
    system = sum(1 for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer"))
    other = [i for i, m in enumerate(messages)
             if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
    earlier, later = sum(1 for i in other if i < last), sum(1 for i in other if i > last)
    return {key: count for key, count in (("system", system), ("earlier_turns", earlier), ("later_turns", later))
            if count}


def parse_messages(messages: Any) -> tuple[str, list[str], list[str]]:
    """The question (text of the last user message), its video URLs, and those of the latest earlier user message
    that gives any (a chat's later turns ask about the video its first one gave)."""
    if not isinstance(messages, list) or not messages:
        raise ServiceError(400, "messages must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ServiceError(400, "no user message")
    texts, videos = _parts(users[-1])
    question = " ".join(text.strip() for text in texts if text.strip())
    if not question:
        raise ServiceError(400, "the user message has no question text")
    if len(question) > MAX_QUESTION_CHARS:
        raise ServiceError(413, f"the question is {len(question)} characters, over the limit of {MAX_QUESTION_CHARS}")
    earlier = next((found for user in reversed(users[:-1]) if (found := _video_urls(user))), [])
    return question, videos, earlier


def _video_urls(message: dict) -> list[Any]:
    """The video URLs of an earlier user message (nothing else of it is read, so nothing else is checked)."""
    content = message.get("content")
    return [part["video_url"].get("url") for part in content if isinstance(part, dict)
            and part.get("type") == "video_url" and isinstance(part.get("video_url"), dict)] \
        if isinstance(content, list) else []


def _parts(message: dict) -> tuple[list[str], list[Any]]:
    """A user message's texts and video URLs."""
    content = message.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ServiceError(400, "a message's content is a string or a list of parts")
    texts, videos = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "video_url" and isinstance(part.get("video_url"), dict):
            videos.append(part["video_url"].get("url"))
        elif kind == "text":
            raise ServiceError(400, "a text part's text must be a string")
        elif kind == "video_url":
            raise ServiceError(400, "a video_url part's video_url must be an object, {\"url\": \"file:///...\"}")
        else:
            raise ServiceError(400, f"unsupported content part {shown(kind or part)}: give text and video_url parts")
    return texts, videos


router = APIRouter()


def model_card(service: Any) -> dict:
    """The served model as OpenAI's API describes a model."""
    return {"id": service.model_id, "object": "model", "created": service.started, "owned_by": "statekv"}


@router.get("/v1/models")
async def models(request: Request, service: Served) -> dict:
    service.keys.require(request)
    return {"object": "list", "data": [model_card(service)]}


@router.get("/v1/models/{model:path}")  # a path: a checkpoint's id (``org/name``, a folder) holds slashes
async def model(request: Request, service: Served, model: str) -> dict:
    """The served model (the ``openai`` client's ``models.retrieve``); another name is a 404 naming it."""
    service.keys.require(request)
    if model != service.model_id:
        raise not_served(model, service.model_id)
    return model_card(service)


def answer_length(body: dict[str, Any]) -> int:
    """The most tokens an answer may take: ``max_completion_tokens``, or ``max_tokens`` (its older name), or the
    native route's default when neither is given; a 400 when the two are given and differ."""
    given = {name: body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None}
    for name, max_new in given.items():
        if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= MAX_NEW_TOKENS:
            raise ServiceError(400, f"{name} must be an integer from 1 to {MAX_NEW_TOKENS}, got {shown(max_new)}")
    if len(set(given.values())) > 1:
        raise ServiceError(400, "max_tokens and max_completion_tokens differ; give one (max_tokens is its older name)")
    return next(iter(given.values()), DEFAULT_NEW_TOKENS)


@router.post("/v1/chat/completions")
async def chat(request: Request, service: Served):
    registry, config = service.registry, service.config
    owner = service.keys.require(request)
    body = await read_json(request, config.max_body_bytes)
    model = model_name(body, service.model_id)
    question, videos, earlier = parse_messages(body.get("messages"))
    reading = {"read": READ, **({"not_read": left} if (left := not_read(body["messages"])) else {}),
               **({"decoding": "greedy", "not_applied": ignored} if (ignored := not_applied(body)) else {})}
    max_new = answer_length(body)
    streamed = body.get("stream", False)
    if streamed is not None and not isinstance(streamed, bool):  # null: not streamed, as OpenAI takes it
        raise ServiceError(400, f"stream must be true or false, got {shown(streamed)}")
    extension = body.get("statekv") or {}
    if not isinstance(extension, dict):
        raise ServiceError(400, "statekv must be an object, e.g. {\"stream_id\": ID}")
    unknown = sorted(set(extension) - set(EXTENSION))
    if unknown:  # the request's own namespace: a misspelt stream_id is not a question about a video
        raise ServiceError(400, f"unknown statekv field {shown(unknown[0])}; known: {', '.join(EXTENSION)}")
    misplaced = [name for name in (*EXTENSION, *METHOD_FIELDS) if name in body]
    if misplaced:  # never ignored: an answer would read otherwise than the client asked
        name = misplaced[0]
        raise ServiceError(400, f'{name} goes under "statekv" ({{"statekv": {{"{name}": ...}}}})' if name in EXTENSION
                           else f"{name} is a stream's setting (POST /v1/streams), not a chat request's")
    retrieve = checked_retrieve(extension, "statekv.retrieve")
    stream_id = extension.get("stream_id")
    if stream_id is not None and not isinstance(stream_id, str):
        raise ServiceError(400, f"statekv.stream_id must be a stream's id (text), got {type(stream_id).__name__}")
    if stream_id is not None:
        if videos:
            raise ServiceError(400, "give either a video_url part or statekv.stream_id, not both")
        entry = await registry.find(owner, stream_id)
        if streamed:
            check_can_ask(entry)  # refused with its status, before the events start
        work = lambda streamer: registry.ask(entry, question, max_new, retrieve, streamer)  # noqa: E731
    else:
        if not videos and earlier:  # a later turn asks about the video an earlier one gave
            videos, reading["read"] = earlier, READ_EARLIER
        if len(videos) != 1:
            raise ServiceError(400, "give one video_url part (a file:// URL under the server's --media-root) "
                                    "or statekv.stream_id")
        if retrieve is not METHOD_DEFAULT:
            raise ServiceError(400, "statekv.retrieve is for a question to a stream (statekv.stream_id); a video "
                                    "file is answered as the server's method answers")
        path = resolve_file_url(config.media_root, videos[0])
        work = lambda streamer: service.worker.run(_answer_file, service, path, question, max_new, streamer)  # noqa: E731
    completion = f"chatcmpl-{secrets.token_hex(12)}"
    stops = StopTexts(stop_sequences(body))
    ends = end_tokens(getattr(service.qa.adapter.decoder, "generation_config", None))
    if streamed:
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        release = service.ask_slots.take()  # refused here (429), before the events start; held till they end
        try:
            streamer = TokenStreamer(service.qa.adapter.tokenizer, asyncio.get_running_loop(),
                                     service.metrics.first_token_seconds.observe, stops)
            task = await begin_answer(request, streamer, work(streamer))
        except BaseException:
            release()
            raise
        finish = lambda: _finish(streamer, max_new, ends)  # noqa: E731
        return EventStream(_chunks(service, request, streamer, task, completion, model, finish, include_usage, reading),
                           release, streamer, service.metrics)
    async with service.ask_slots.hold():
        streamer = TokenStreamer(service.qa.adapter.tokenizer, asyncio.get_running_loop(), stops=stops, whole=True)
        result = await whole_answer(request, streamer, work(streamer))
        service.answered("chat", time.perf_counter() - streamer.started_at)
    # cut where the streamer met the stop, as the streamed text is: the answer's text, stripped, may have lost a
    # stop's last whitespace, and the text before a stop keeps its own
    content = stops.cut(streamer.text())[0] if streamer.halted.is_set() else result["answer"]
    return JSONResponse({
        "id": completion, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": _finish(streamer, max_new, ends)}],
        "usage": result["usage"],
        "statekv": {**{key: result.get(key) for key in ("id", "frames", "seconds")}, **reading},
    })


def stop_sequences(body: dict) -> list[str]:
    """The request's ``stop``: a text or a list of texts (checked by `check_sampling`); [] when absent."""
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def _answer_file(service, path, question: str, max_new: int, streamer) -> dict[str, Any]:
    """Encode a file with the server's default settings and answer (on the model's thread). The room kept after
    the video is the server's reserve for the question, and the answer's ``max_new`` tokens beside it."""
    kwargs = {"max_new_tokens": max_new, **answer_arguments(service.registry.answers_stopping, streamer)}
    try:
        check_answer(kwargs)
        with service.qa.encode(str(path), max_fps=1.0, max_frames=service.config.max_chat_frames,
                               reserve_tokens=service.qa.reserve_tokens + max_new,
                               progress=lambda done, planned: check_answer(kwargs)) as video:  # stops between frames
            prompt = prompt_tokens(video, question, max_new)
            check_answer(kwargs)
            tokens = video.ask_tokens(question, **kwargs)
            check_answer(kwargs, tokens, video.adapter.decoder)
            context, completion = video.tokens + prompt, int(tokens.shape[1])
            return {"answer": video.adapter.decode(tokens), "frames": video.frames, "seconds": None, "id": None,
                    "usage": {"prompt_tokens": context, "completion_tokens": completion,
                              "total_tokens": context + completion}}
    except (ClientLeft, ServerStopped):
        service.metrics.stopped.inc()
        raise
    except FrameDecodeError as error:  # its message tells a Python caller to ask `error.encoded`: no use over HTTP
        if error.encoded is not None:
            error.encoded.close()
        raise FrameDecodeError(f"{error.reason}; a chat reads the whole file: re-encode it, or feed it to a stream "
                               "(POST /v1/streams/{id}/frames) to ask about the frames before it",
                               index=error.index, timestamp=error.timestamp) from None


def _finish(streamer: TokenStreamer, max_new: int, ends: tuple[int, ...]) -> str:
    """OpenAI's finish_reason: ``length`` when the answer used every token it was allowed without ending on one
    of the model's end tokens (``ends``) or meeting a stop sequence."""
    ended = streamer.halted.is_set() or bool(streamer.ids and streamer.ids[-1] in ends)
    return "length" if streamer.tokens >= max_new and not ended else "stop"


async def _chunks(service, request: Request, streamer: TokenStreamer, task: asyncio.Future, completion: str, model: str,
                  finish_reason: Callable[[], str], include_usage: bool, reading: dict[str, Any]):
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, **more: Any) -> str:
        return event({"id": completion, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **more})

    yield chunk({"role": "assistant", "content": ""})
    async for piece in pieces_until(streamer, task):
        yield chunk({"content": piece})
    result, failure = await streamed_outcome(service, request, task, f"the streamed completion {completion}")
    if failure is not None:
        yield event(failure)
        return
    service.answered("chat", time.perf_counter() - streamer.started_at)
    yield chunk({}, finish_reason(), statekv=reading)
    if include_usage:
        yield event({"id": completion, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [], "usage": result["usage"]})
    yield event("[DONE]")
