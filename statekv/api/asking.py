"""`VideoQA.ask_many`: questions to several streams of one `VideoQA` answered together.

Each stream takes the steps of `Stream.ask_tokens` holding its lock (its complete pending steps encoded, the
question checked and laid out, `EncodedVideo.laid_out_question`); the questions whose shapes allow it
(`StreamingPrefill.question`) are answered as the rows of one batch (`statekv.core.answering.together`), the others
alone, as `Stream.ask_tokens` answers them. Either way each answer is the one its question gets asked alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..core.answering.together import answer_together, batches
from ..errors import InputError
from ..stopping import whole
from .encoded import METHOD_DEFAULT
from .recent import RecentFrames
from .stream import Stream

ASK_DEFAULTS = {"max_new_tokens": 64, "retrieve": METHOD_DEFAULT, "retrieval": None}  # `EncodedVideo.ask`'s


def ask_together(qa: Any, items: Iterable[Any], *, return_exceptions: bool = False) -> list:
    """Answer ``(stream, question)`` or ``(stream, question, ask_kwargs)`` items (``ask_kwargs``: what `Stream.ask`
    takes); return each answer's token ids ``[1, N]`` in order, or (``return_exceptions``) the error its question
    raised; otherwise the first error is raised once every other question is answered. The questions answered in
    one batch are counted by size in ``qa.question_batch_sizes`` (one asked alone: 1)."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise InputError(f"ask_many takes a list of (stream, question) items, got {type(items).__name__}")
    items = [_checked_item(qa, item) for item in items]
    results: list[Any] = [None] * len(items)
    streams = sorted({id(item[0]): item[0] for item in items}.values(), key=id)
    with whole():  # a stopping signal waits for every answer
        for stream in streams:  # one order for every caller: no two callers wait on each other's locks
            stream.lock.acquire()
        try:
            _ask_streams(qa, items, results)
        finally:
            for stream in streams:
                stream.lock.release()
    if not return_exceptions:
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return results


def _checked_item(qa: Any, item: Any) -> tuple:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        raise InputError("ask_many takes (stream, question) or (stream, question, ask_kwargs) items, got "
                         f"{type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else ""))
    if not isinstance(item[0], (Stream, RecentFrames)):
        hint = ": ask it with its own .ask" if type(item[0]).__name__ == "EncodedVideo" else ""
        raise InputError(f"ask_many asks streams (from VideoQA.stream), got {type(item[0]).__name__}{hint}")
    stream, question, kwargs = (*item, {}) if len(item) == 2 else item
    if stream.qa is not qa:
        raise InputError(f"ask_many: {stream.name} belongs to another VideoQA")
    if not isinstance(kwargs, dict):
        raise InputError(f"ask_many: an item's ask_kwargs must be a dict, got {type(kwargs).__name__}")
    return stream, question, kwargs


def _ask_streams(qa: Any, items: Sequence[tuple], results: list) -> None:
    rows, alone = [], []  # rows: (item index, its Asked, its Retrieval)
    for index, (stream, question, kwargs) in enumerate(items):
        if not isinstance(stream, Stream):  # keeps no cache (`RecentFrames`): answered as it answers
            alone.append(index)
            continue
        settings = {**ASK_DEFAULTS, **kwargs}
        max_new_tokens, retrieve, rule = (settings.pop(name) for name in ASK_DEFAULTS)
        try:
            stream.flush_complete_steps()
            prompt, retrieval = stream.laid_out_question(question, max_new_tokens, retrieve, rule)
            asked = stream.prefill.question(prompt, retrieve=retrieval, max_new_tokens=max_new_tokens, **settings)
        except Exception as error:  # noqa: BLE001 -- this question's error, not the others'
            results[index] = error
            continue
        if asked is None:
            alone.append(index)
        else:
            rows.append((index, asked, retrieval))
    for members in batches([asked for _, asked, _ in rows]):
        batch = [rows[member] for member in members]
        try:
            answers = answer_together([asked for _, asked, _ in batch])
        except Exception as error:  # noqa: BLE001 -- one row's failure is not its batch's: each again alone
            if len(batch) == 1:
                results[batch[0][0]] = error
                continue
            for index, asked, _ in batch:
                restart = getattr(asked.streamer, "restart", None)  # one whose text was read cannot start over
                if asked.streamer is None or not asked.told or restart is not None and restart():
                    alone.append(index)
                else:
                    results[index] = error
            continue
        qa.question_batch_sizes[len(batch)] += 1
        for (index, asked, retrieval), tokens in zip(batch, answers):
            if not isinstance(tokens, Exception):  # else its own streamer's or stopping criteria's error
                items[index][0].answered(retrieval, asked.read_steps, asked.layer_steps)
            results[index] = tokens
    for index in sorted(alone):
        stream, question, kwargs = items[index]
        try:
            results[index] = stream.ask_tokens(question, **kwargs)
        except Exception as error:  # noqa: BLE001 -- as above
            results[index] = error
            continue
        qa.question_batch_sizes[1] += 1

