"""Watches saved and brought back: the records and tensors a saved stream keeps of its open watches (`records`,
`tensors`), checked (`check_record`) and reopened as they stood (`restore`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from typing import Any

import torch

from ..errors import ConfigurationError, InputError, QuestionTooLong, RetrievalTooWide
from ..video.sampling import slack
from .watch import Watch, WatchEvent, open_watch

log = logging.getLogger(__name__)


def records(stream: Any, saved: Collection[str] = (), frames: int = 0) -> list[dict[str, Any]]:
    """The records of ``stream``'s open watches (`Watch.record`), as a saved stream keeps them; of those in
    ``saved`` (ids), only their events after the first ``frames`` frames: a served stream's record, written at each
    answer, leaves the earlier ones to the save that holds them rather than rewrite every event a watch kept."""
    watching = getattr(stream, "watching", None)
    return [] if watching is None else [watch.record(frames if watch.id in saved else None)
                                        for watch in watching.open]


def tensors(stream: Any) -> dict[str, torch.Tensor]:
    """The tensors a saved stream keeps of its open watches: each one's latest queries per layer, named
    ``watches.{i}.queries.{layer}`` (``i`` its place in `records`)."""
    kept = {}
    for number, watch in enumerate([] if stream.watching is None else stream.watching.open):
        queries = None if watch.standing is None else watch.standing.queries
        for layer, tensor in enumerate(queries or []):
            kept[f"watches.{number}.queries.{layer}"] = tensor
    return kept


def restore(stream: Any, saved: list[dict[str, Any]], kept: dict[str, torch.Tensor] | None = None, *,
            where: str = "the saved stream") -> list[Watch]:
    """Reopen the watches ``saved`` (`records`) on ``stream`` as they stood: their events and clocks as recorded
    and, from ``kept`` (`tensors`, which a saved file holds for every watch that was evaluated), the queries they
    steer with (None: records alone, each watch steering again from its next evaluation). A malformed record is a
    one-line `InputError` naming it."""
    layers = 0 if getattr(stream, "prefill", None) is None else len(stream.prefill.cache.layers)
    records = [check_record(data, f"{where}: watches[{number}]") for number, data in enumerate(saved)]
    expected = {f"watches.{number}.queries.{layer}" for number, data in enumerate(saved)
                if isinstance(data, dict) and data.get("start") is not None for layer in range(layers)}
    if kept is None:
        kept = {}
    elif set(kept) != expected:
        name = sorted(set(kept) ^ expected)[0]
        raise InputError(f"{where}: the stream file {'lacks' if name in expected else 'holds an unexpected'} tensor "
                         f"{name}")
    opened: list[Watch] = []
    try:
        for number, record in enumerate(records):
            opened.append(_reopen(stream, record, kept, layers, f"{where}: watches[{number}]", number))
    except BaseException:  # all of them or none
        for watch in opened:
            watch.close()
        raise
    return opened


def _reopen(stream: Any, record: dict[str, Any], kept: dict[str, torch.Tensor], layers: int, name: str,
            number: int) -> Watch:
    """Watch ``number`` of a saved stream (its checked ``record``) opened again on ``stream``."""
    queries = [kept.get(f"watches.{number}.queries.{layer}") for layer in range(layers)]
    retrieve = record["retrieve"] if layers else None  # a server's default, once recorded for a simplestream stream
    settings = dict(evaluate_now=False, every=record["every"], every_seconds=record["every_seconds"],
                    max_new_tokens=record["max_new_tokens"], retrieve=retrieve, retrieval=record["retrieval"],
                    steer=record["steer"], watch_id=record["id"])
    try:
        watch = open_watch(stream, record["question"], **settings)
    except (ConfigurationError, InputError) as error:  # a setting no watch is opened with: named with its file
        raise InputError(f"{name}: {error}") from None
    except (QuestionTooLong, RetrievalTooWide) as error:  # opened before watches were refused for it: kept, as saved
        watch = open_watch(stream, record["question"], check_fit=False, **settings)
        fix = "one retrieving fewer frames" if isinstance(error, RetrievalTooWide) else "a shorter one"
        log.warning("%s: watch %s is reopened, but %s; close it and open %s", name, watch.id, error, fix)
    watch.answer, watch.evaluations = record["answer"], record["evaluations"]
    watch.since = 0 if layers == 0 else min(record["since"], stream.prefill.seen_tokens)
    watch.last_frames, watch.last_seconds = record["last_frames"], record["last_seconds"]
    watch.events = [WatchEvent(frame, seconds, answer) for frame, seconds, answer in record["events"]]
    if watch.last_frames > stream.frames:  # a record newer than the stream's save: its frames come again
        _rewound(watch, stream.frames, stream.last_timestamp)
        watch.since = _tokens_at(stream, watch.last_frames) if layers else 0
    if watch.standing is not None and record["start"] is not None and queries \
            and all(query is not None for query in queries):
        _check_queries(queries, watch.standing.length, stream, name)
        device = stream.prefill.device
        watch.standing.queries = [query.to(device, stream.prefill.dtype) for query in queries]
        watch.standing.start = record["start"]
    return watch


def _rewound(watch: Watch, frames: int, seconds: float | None) -> None:
    """``watch`` as it stood when its stream had encoded ``frames`` frames, the last at ``seconds``, from a record
    of it written later (a stream brought back from a save older than its watch's record): the events after that
    go, with the answer they gave, and so do the evaluations since, its clock turned back by whole periods, so the
    frames pushed again are evaluated as they were the first time (every so many seconds: as they were if the
    frames came at a steady rate). A watch opened after those frames, off its period, is evaluated on its period
    from the stream's start instead (its clock never goes below zero)."""
    kept = [event for event in watch.events if event.frame <= frames]
    watch.answer, watch.events = (kept[-1].answer if kept else None), kept
    if watch.every is not None:  # (never before the stream's start: one opened after the save is evaluated on
        again = -(-(watch.last_frames - frames) // watch.every)  # its period from there)
        watch.last_frames = max(0, watch.last_frames - again * watch.every)
    elif watch.every_seconds is not None and watch.last_seconds is not None and seconds is not None:
        since = max(0, watch.last_frames - frames)  # an evaluation since read a frame of its own
        periods = (watch.last_seconds - seconds - slack(watch.last_seconds, seconds)) / watch.every_seconds
        if periods <= 0:
            again = 0
        elif math.isfinite(periods):
            again = math.ceil(periods)
            watch.last_seconds -= again * watch.every_seconds
        else:  # a period too short to count in the time gone by: each frame pushed again is due, as the first time
            again, watch.last_seconds = since, seconds
        watch.last_frames, again = frames, min(again, since)
    else:
        again, watch.last_frames = 0, frames
    watch.evaluations = max(len(kept), watch.evaluations - again)


def _tokens_at(stream: Any, frames: int) -> int:
    """The tokens the stream had streamed once it had encoded ``frames`` frames (at the end of the last step that
    ends at or before them)."""
    totals = stream.step_frames.running_totals()  # as runs: no tensor of every step ever taken
    steps = int(totals.searched(torch.tensor([frames]))[0]) - 1
    return stream.prefill.cache.starts[steps]


def _check_queries(queries: list[torch.Tensor], length: int, stream: Any, name: str) -> None:
    heads = stream.prefill.config.num_attention_heads
    for layer, query in enumerate(queries):
        if query.dim() != 4 or query.shape[0] != 1 or query.shape[1] != heads or query.shape[2] != length \
                or not query.is_floating_point():
            raise InputError(f"{name}: its queries at layer {layer} are {tuple(query.shape)}, not [1, {heads}, "
                             f"{length}, D] floats for this question")


_FIELDS = {"id": str, "question": str, "every": (int, type(None)), "every_seconds": (int, float, type(None)),
           "max_new_tokens": int, "retrieve": (int, type(None)), "retrieval": str, "steer": bool,
           "answer": (str, type(None)), "evaluations": int, "since": int, "last_frames": int,
           "last_seconds": (int, float, type(None)), "start": (int, type(None)), "events": list}


def check_record(data: Any, name: str) -> dict[str, Any]:
    """A watch record (`Watch.record`) with every field of its type; a one-line `InputError` otherwise."""
    if not isinstance(data, dict):
        raise InputError(f"{name} must be an object, got {type(data).__name__}")
    for key, kind in _FIELDS.items():
        if key not in data:
            raise InputError(f"{name} lacks {key!r}")
        value = data[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise InputError(f"{name}.{key} has the wrong type ({type(value).__name__})")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise InputError(f"{name} has unknown field {unknown[0]!r}")
    for key in ("since", "last_frames", "evaluations"):
        if data[key] < 0:
            raise InputError(f"{name}.{key} must be >= 0, got {data[key]}")
    for number, event in enumerate(data["events"]):
        if (not isinstance(event, list) or len(event) != 3 or isinstance(event[0], bool)
                or not isinstance(event[0], int) or event[0] < 0
                or not (event[1] is None or isinstance(event[1], (int, float)) and not isinstance(event[1], bool)
                        and math.isfinite(event[1]))
                or not isinstance(event[2], str)):
            raise InputError(f"{name}.events[{number}] must be [frame, seconds, answer]")
    return data

