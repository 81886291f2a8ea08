"""Answers token by token: a transformers streamer that hands text pieces from the model's thread to the event
loop, and server-sent events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from transformers.generation.streamers import BaseStreamer


class TokenStreamer(BaseStreamer):
    """Receives ``generate``'s new token ids on the model's thread; ``pieces`` yields the text they add."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop):
        self.tokenizer, self.loop = tokenizer, loop
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.ids: list[int] = []
        self.sent = ""
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        self.ids.extend(int(token) for token in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.sent) and len(text) > len(self.sent) and not text.endswith("\ufffd"):
            piece, self.sent = text[len(self.sent):], text
            self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def pieces(self):
        while (piece := await self.queue.get()) is not None:
            yield piece


def event(data: Any, name: str | None = None) -> str:
    """One server-sent event (``data`` as JSON unless it is already text)."""
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
