"""A stream's settings as a client asks for them: its method settings (the server's model shared, one `VideoQA` per
distinct choice), its horizon and frame rate, each checked against the server's model (`StreamSettings`)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..api.encoded import METHOD_DEFAULT
from ..errors import ConfigurationError
from ..settings.methods import METHODS, SIZES, refuse_unread
from ..settings.values import HIGHEST_FPS, LARGEST_INT, is_stream_rate
from .config import ServeConfig
from .errors import ServiceError

METHOD_FIELDS = ("method", "budget", "frames", "sinks", "window", "retrieve", "retrieval")
STREAM_FIELDS = METHOD_FIELDS + ("horizon_frames", "max_fps", "name")
IDLE_MODELS_KEPT = 4  # VideoQAs of settings no stream holds now, kept for the next stream that takes them


class StreamSettings:
    """The settings streams of one server may have: ``qa`` is its model with its default method settings.
    ``models``: the VideoQA of each distinct choice its streams hold (`qa_for`), in the order of their use, let go
    of once none does but the last few (`let_go_unused`), so a server whose clients choose ever other settings over
    weeks keeps only those in use and a few more;
    ``let_go``: what the models let go of had counted (``batched_steps``, ``batch_sizes``,
    ``question_batch_sizes``), so the metrics summed over the models never go back."""

    def __init__(self, config: ServeConfig, qa: Any):
        self.config, self.qa = config, qa
        self.models: dict[tuple, Any] = {}
        self.let_go: dict[str, Any] = {"batched_steps": 0, "batch_sizes": Counter(), "question_batch_sizes": Counter()}
        self.changing = threading.Lock()  # ``models`` and ``let_go`` change together, and are read together
        self._max_horizon: int | None = None

    def qa_for(self, settings: dict[str, Any], *, made: dict[str, Any] | None = None) -> Any:
        """The VideoQA of a stream's method settings (the server's model, shared). ``made``: to load a saved
        stream, the engine settings its record names (`made_with`; {} in a record written before them): it keeps
        the positions (as its file says) and the ``kv_cache_dtype`` it was made with, whatever the server's
        ``--positions`` and ``--kv-cache-dtype`` are now."""
        settings, engine = unread_cleared(settings), {}
        if made is not None:
            if self.qa.engine.positions is not None:
                engine["positions"] = None
            if made.get("kv_cache_dtype", self.qa.engine.kv_cache_dtype) != self.qa.engine.kv_cache_dtype:
                engine["kv_cache_dtype"] = made["kv_cache_dtype"]
        key = (*sorted(settings.items()), ("engine", *sorted(engine.items())))
        with self.changing:
            model = self.models.pop(key, None)  # put back last: the models are kept in the order of their use
            if model is None:
                model = self.qa.with_options(**settings, **engine)
            self.models[key] = model
        return model

    def let_go_unused(self, used: Iterable[Any]) -> None:
        """Let go of the VideoQAs of ``models`` that none of ``used`` (the VideoQAs of the streams held) is, once a
        stream is deleted or has left, but the `IDLE_MODELS_KEPT` used last (what they hold warm, a stream
        deleted and made again with the same settings finds): the counts of those let go of are kept in
        ``let_go``."""
        used_ids = {id(qa) for qa in used}
        with self.changing:
            unused = [key for key, model in self.models.items() if id(model) not in used_ids]
            for key in unused[:max(0, len(unused) - IDLE_MODELS_KEPT)]:  # the least recently used first
                self._add_counts(self.let_go, self.models.pop(key))

    def batched_steps(self) -> int:
        """Language-model forwards that stepped several streams together, over the server's models (those let go
        of included)."""
        return self._counts()["batched_steps"]

    def batch_sizes(self) -> Counter:
        """Language-model forwards by the stream steps each took, over the server's models (those let go of
        included)."""
        return self._counts()["batch_sizes"]

    def question_batch_sizes(self) -> Counter:
        """Questions answered together, by the questions each batch took, over the server's models (those let go
        of included)."""
        return self._counts()["question_batch_sizes"]

    def _counts(self) -> dict[str, Any]:
        with self.changing:  # the models and what those let go of had counted, read together
            models = [self.qa, *self.models.values()]
            counts = {name: (count.copy() if isinstance(count, Counter) else count)
                      for name, count in self.let_go.items()}
        for model in models:
            self._add_counts(counts, model)
        return counts

    @staticmethod
    def _add_counts(counts: dict[str, Any], model: Any) -> None:
        """Add what ``model`` counted (``batched_steps``, ``batch_sizes``, ``question_batch_sizes``) to ``counts``."""
        scheduler = getattr(model, "step_scheduler", None)
        counts["batched_steps"] += getattr(scheduler, "batched_steps", 0)
        counts["batch_sizes"].update(Counter(getattr(scheduler, "batch_sizes", {})))
        counts["question_batch_sizes"].update(Counter(getattr(model, "question_batch_sizes", {})))

    def check(self, body: dict[str, Any]) -> tuple[dict[str, Any], int, float | None, str]:
        """(method settings, horizon_frames, max_fps, name) of a creation's body, defaults filled in; a one-line
        400 (409 for a horizon the model cannot hold) naming the first that is wrong."""
        unknown = sorted(set(body) - set(STREAM_FIELDS))
        if unknown:
            raise ServiceError(400, f"unknown stream setting {shown(unknown[0])}; known: {', '.join(STREAM_FIELDS)}")
        if not isinstance(body.get("method", ""), str):
            raise ServiceError(400, f"method must be a method's name (text), got {shown(body['method'])}")
        defaults = self.qa.options
        settings = unread_cleared({name: body.get(name, getattr(defaults, name)) for name in METHOD_FIELDS})
        try:
            defaults.with_changes(**settings)  # checks every value, naming the bad one
        except ConfigurationError as error:
            raise ServiceError(400, spelt_as_json(str(error), body)) from None
        given = {name: body[name] for name in METHOD_FIELDS if name in body}
        if METHODS[settings["method"]].retrieves:  # its rule also picks the frames of a question giving a retrieve
            given.pop("retrieval", None)
        refuse_unread(settings["method"], given)
        horizon = body.get("horizon_frames", self.default_horizon_frames)
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int)
                                    or not 1 <= horizon <= 10**7):
            raise ServiceError(400, f"horizon_frames must be an integer from 1 to {10**7} or null (no horizon), got "
                               f"{shown(horizon)}")
        if horizon is not None and self.qa.engine.positions == "stream" and horizon > self.max_horizon_frames:
            raise ServiceError(409, f"horizon_frames {horizon} is more than this model can hold at positions=stream: "
                               f"at most {self.max_horizon_frames} frames (its RoPE covers {self.rope_tokens()} "
                               f"tokens, {self.qa.reserve_tokens} of them kept for questions and answers); serve "
                               "with --positions bounded, or give no horizon")
        max_fps = body.get("max_fps", self.config.default_max_fps)
        if max_fps is not None and not is_stream_rate(max_fps):
            raise ServiceError(400, f"max_fps must be a number above 0 and at most {HIGHEST_FPS:g}, or null, got "
                               f"{shown(max_fps)}")
        name = body.get("name", "stream")
        if not isinstance(name, str) or len(name) > 200:
            raise ServiceError(400, "name must be a string of at most 200 characters")
        return settings, horizon, None if max_fps is None else float(max_fps), name

    @property
    def max_horizon_frames(self) -> int:
        """The most frames a stream's horizon may hold: those whose tokens (plus the reserve for questions) fit
        the model's RoPE (10**7 when it has no limit)."""
        if self._max_horizon is None:
            capacity, low, high = self.rope_tokens(), 0, 10**7
            if capacity is not None and self.qa.horizon_for(high) > capacity:
                while low < high:  # the most frames whose horizon fits
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if self.qa.horizon_for(middle) <= capacity else (low, middle - 1)
            self._max_horizon = max(high, 1)
        return self._max_horizon

    @property
    def default_horizon_frames(self) -> int | None:
        """``default_horizon_frames`` (None: no horizon, the stream never ends), or fewer when the model's RoPE
        cannot hold that many."""
        if self.config.default_horizon_frames is None:
            return None
        return min(self.config.default_horizon_frames, self.max_horizon_frames)

    def rope_tokens(self) -> int | None:
        from ..core import rope_capacity

        return rope_capacity(self.qa.adapter.model.config.get_text_config())


def made_with(stream: Any) -> dict[str, Any]:
    """The engine settings ``stream`` was made with that a saved stream must be loaded with, and the server's
    flags may change between starts (its ``positions`` its file records)."""
    return {"kv_cache_dtype": stream.qa.engine.kv_cache_dtype}


def unread_cleared(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the server's default ``retrieve`` and ``retrieval`` under a method that retrieves
    nothing (a record written before names it): a watch opened on such a stream would pass it on, and be
    refused."""
    spec = METHODS.get(settings.get("method")) if isinstance(settings.get("method"), str) else None
    if spec is None or spec.retrieves:
        return settings
    return {**settings, "retrieve": None, **({"retrieval": None} if "retrieval" in settings else {})}


def read_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as a client is shown them: without the sizes their method does not read (the server's defaults
    for another method), so that settings read back create the same stream again."""
    spec = METHODS.get(settings.get("method")) if isinstance(settings.get("method"), str) else None
    if spec is None:
        return dict(settings)
    return {name: value for name, value in settings.items()
            if (name not in SIZES or name in spec.uses) and (name != "retrieval" or spec.retrieves)}


def spelt_as_json(message: str, body: dict[str, Any]) -> str:
    """A settings check's ``message``, whose value (written last, as Python writes it) is written as the client
    sent it: ``true``, not ``True``."""
    for name in METHOD_FIELDS:
        if name in body and message.endswith(f"got {body[name]!r}"):
            return message[:-len(repr(body[name]))] + shown(body[name])
        unknown = f" {body.get(name)!r}; choose one of "  # a name not among the choices, written mid-message
        if name in body and unknown in message:
            return message.replace(unknown, f" {shown(body[name])}; choose one of ", 1)
    return message


def shown(value: Any) -> str:
    """A client's value in a message: as JSON would write it (no Python repr), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def checked_retrieve(body: dict[str, Any], name: str = "retrieve") -> Any:
    """A question's or a watch's ``retrieve`` (frames per layer, null: every frame for a question, none for a watch;
    absent: the stream's, `METHOD_DEFAULT`), checked."""
    retrieve = body.get("retrieve", METHOD_DEFAULT)
    if retrieve is not METHOD_DEFAULT and retrieve is not None and (
            isinstance(retrieve, bool) or not isinstance(retrieve, int) or not 1 <= retrieve <= LARGEST_INT):
        raise ServiceError(400, f"{name} must be a positive integer (frames per layer, at most {LARGEST_INT:,}) "
                           f"or null, got {shown(retrieve)}")
    return retrieve
