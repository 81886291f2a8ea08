"""Timestamps made continuous where a source's times start again: MPEG-TS files joined end to end (``cat a.ts b.ts``), an
HLS or camera recording whose clock starts again in each part. A player shows such a file whole, one part after
the other; its raw times would put every part over the first one."""

from __future__ import annotations


class Continuous:
    """Turns times in a source's own order (a packet's decoding time, a decoded frame's time) into times that never
    go back: a time below the latest one so far continues ``period`` after it, and the times after it keep their
    spacing from it. ``restarts`` counts the times that went back."""

    def __init__(self) -> None:
        self.offset, self.latest, self.restarts = 0.0, None, 0

    def shift(self, time: float | None, period: float) -> float:
        """The seconds to add to a time whose order is given by ``time`` (None: unknown, the shift so far)."""
        if time is None:
            return self.offset
        if self.latest is not None and time + self.offset < self.latest:
            self.offset = self.latest + period - time
            self.restarts += 1
        moved = time + self.offset
        self.latest = moved if self.latest is None else max(self.latest, moved)
        return self.offset

    def __call__(self, time: float, period: float) -> float:
        """``time`` itself, continuous."""
        return time + self.shift(time, period)
