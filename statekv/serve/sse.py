"""Answers token by token: a transformers streamer that hands text pieces from the model's thread to the event
loop, and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fastapi.responses import StreamingResponse
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class StopTexts:
    """OpenAI's ``stop`` sequences: an answer ends before the first of them in its text, which it does not hold."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stop for stop in stops if stop)

    def cut(self, text: str) -> tuple[str, bool]:
        """``text`` up to the first stop sequence in it, and whether it held one."""
        found = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        return (text[:min(found)], True) if found else (text, False)

    def settled(self, text: str) -> str:
        """``text`` less its longest end that could begin a stop sequence (shown once the next tokens tell)."""
        longest = min(len(text), max((len(stop) for stop in self.stops), default=1) - 1)
        for length in range(longest, 0, -1):
            if any(stop.startswith(text[-length:]) for stop in self.stops):
                return text[:-length]
        return text


class TokenStreamer(BaseStreamer):
    """Receives ``generate``'s new token ids on the model's thread; ``pieces`` yields the text they add.
    ``gone`` is set once the client has gone away (`StopOnceSet` then stops the generation at its next token);
    ``tokens``: the tokens generated so far. ``on_first_token(seconds)``, where given, is told the time from this
    streamer's making (the answer's start) to the first token generated, whether or not it shows text yet (a
    piece waits for the tokens that complete a character or a word). ``begun`` is set once ``generate`` hands
    over the prompt: the answer's checks have passed and its generation begins. ``stops`` (`StopTexts`): the text
    ends before the first of them, and ``halted`` is set once one is met (its generation then stops too); text that
    could begin one waits until the next tokens tell. ``whole``: the answer is given whole, its pieces never read
    (so not made, unless a stop sequence is looked for; `restart` may start it over whatever it generated)."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop,
                 on_first_token: Callable[[float], None] | None = None, stops: StopTexts | None = None,
                 whole: bool = False):
        self.tokenizer, self.loop, self.on_first_token, self.whole = tokenizer, loop, on_first_token, whole
        self.stops = stops or StopTexts()
        self.started_at = time.perf_counter()
        self.gone, self.halted = threading.Event(), threading.Event()
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.begun = asyncio.Event()
        self.ids: list[int] = []
        self.prompt_length = 0
        self.sent = ""
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen, self.prompt_length = True, int(value.shape[-1])
            self.loop.call_soon_threadsafe(self.begun.set)
            return
        new = [int(token) for token in value.reshape(-1).tolist()]
        if new and not self.ids and self.on_first_token is not None:
            self.on_first_token(time.perf_counter() - self.started_at)
        self.ids.extend(new)
        if self.halted.is_set() or (self.whole and not self.stops.stops):  # past a stop, or no piece to read
            return
        text, halted = self.stops.cut(self.text())
        if halted:  # the answer ends here, as it is given whole
            self.halted.set()
            self._show(text, final=True)
        else:  # trailing spaces wait for a word after them: an answer given whole is stripped
            self._show(self.stops.settled(text).rstrip())

    def text(self) -> str:
        """The text of the tokens generated so far, as the whole answer's."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True).lstrip()

    def _show(self, text: str, final: bool = False) -> None:
        """Send what ``text`` adds to the text sent; a character not yet complete (``\\ufffd``) waits, unless the
        answer ends there (``final``), where it is the whole answer's too."""
        if text.startswith(self.sent) and len(text) > len(self.sent) and (final or not text.endswith("\ufffd")):
            piece, self.sent = text[len(self.sent):], text
            self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def restart(self) -> bool:
        """Forget the answer's tokens, for it to be generated again from its prompt (`VideoQA.ask_many` answers a
        question whose batch failed again alone), where none of its text can have been read: an answer given whole,
        or one given token by token before its first token. Returns whether it was."""
        if self.ids and not self.whole:
            return False
        self.ids, self.sent, self._prompt_seen = [], "", False
        self.halted.clear()
        return True

    def end(self) -> None:
        if not self.halted.is_set() and not self.whole:
            self._show(self.text().rstrip(), final=True)  # what waited: a stop sequence's start, a last character
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def pieces(self):
        while (piece := await self.queue.get()) is not None:
            yield piece


class StopAtText(StoppingCriteria):
    """Stops ``generate`` at the token whose text meets one of ``streamer``'s stop sequences (`TokenStreamer.stops`),
    read from the ids it is given: ``generate`` asks its criteria before it hands that token to its streamer."""

    def __init__(self, streamer: TokenStreamer):
        self.streamer = streamer

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        streamer = self.streamer
        met = streamer.halted.is_set()
        if not met:
            answer = input_ids[0, streamer.prompt_length:].tolist()
            met = streamer.stops.cut(streamer.tokenizer.decode(answer, skip_special_tokens=True).lstrip())[1]
        return torch.full((input_ids.shape[0],), met, dtype=torch.bool, device=input_ids.device)


class StopOnceSet(StoppingCriteria):
    """Stops ``generate`` between two tokens once ``event`` is set (the client that asked went away, or the server
    is stopping), so the model is free for the next request; ``stopped``: whether it has stopped an answer."""

    def __init__(self, event: threading.Event):
        self.event, self.stopped = event, False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self.event.is_set()
        self.stopped = self.stopped or stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def event(data: Any, name: str | None = None) -> str:
    """One server-sent event (``data`` as JSON unless it is already text)."""
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events holding a slot until the response is over, however it ends: ``release`` (from
    `limits.Slots.take`) is called once the events are sent, the client left, or the response never started; so is
    the stop of the answer ``streamer`` gives, where one does (its generation, if still running, stops). An answer
    whose client left before its last event is counted as a 499 in ``metrics`` (a `metrics.Metrics`), as one not
    streamed is."""

    def __init__(self, events: Any, release: Any, streamer: TokenStreamer | None = None, metrics: Any = None):
        self.finished = False
        super().__init__(self._through(events), media_type="text/event-stream")
        self.release, self.streamer, self.metrics = release, streamer, metrics

    async def _through(self, events: Any):
        async with contextlib.aclosing(events):
            async for item in events:
                yield item
        self.finished = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.streamer is not None:
                self.streamer.gone.set()
                if not self.finished and self.metrics is not None:
                    self.metrics.error(499, scope)
            self.release()
