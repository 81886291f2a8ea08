"""The note a stream's record keeps of each of its last answers (`StreamEntry.answers`), and the frames each read.

An answer that retrieved every step of a long stream read every frame it held: listed one by one, those indices
made the record grow with the stream's age, and the record is rewritten at every answer. A note keeps them as
``read_ranges``, ``[[start, stop], ...]`` (stop excluded), so a note stays small whatever the stream's length;
records written before kept the list itself, ``read_frames``, read back as ranges (`recalled`). The HTTP answer
still lists the frames (`ask`'s ``read_frames``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

NOTED = ("answer", "frames", "seconds", "latency")  # what a note copies of the answer as given


def frame_ranges(frames: Iterable[int]) -> list[list[int]]:
    """``frames`` (ascending indices) as ranges ``[[start, stop], ...]`` of consecutive ones, stop excluded."""
    ranges: list[list[int]] = []
    for frame in frames:
        if ranges and frame == ranges[-1][1]:
            ranges[-1][1] = frame + 1
        else:
            ranges.append([frame, frame + 1])
    return ranges


def answer_note(question: str, result: dict[str, Any]) -> dict[str, Any]:
    """The note of ``result`` (an answer as `StreamRegistry.ask` gives it) to ``question``."""
    read = result.get("read_frames")
    return {"question": question, "at": int(time.time()), **{key: result[key] for key in NOTED},
            "read_ranges": None if read is None else frame_ranges(read)}


def read_frames(note: dict[str, Any]) -> Iterator[int] | None:
    """The frames the answer of ``note`` read, in order (None: every frame it held)."""
    ranges = note.get("read_ranges")
    return None if ranges is None else itertools.chain.from_iterable(range(*pair) for pair in ranges)


def read_count(note: dict[str, Any]) -> int | None:
    """How many frames the answer of ``note`` read (None: every frame it held)."""
    ranges = note.get("read_ranges")
    return None if ranges is None else sum(stop - start for start, stop in ranges)


def _ranges(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(type(end) is int for end in pair) and 0 <= pair[0] < pair[1]
        for pair in value)


def recalled(notes: Any) -> list[dict[str, Any]]:
    """The notes a record kept that can be read, a record's list of frames (``read_frames``) read as its ranges."""
    kept = []
    for note in notes if isinstance(notes, list) else []:
        if not isinstance(note, dict) or not isinstance(note.get("question"), str):
            continue
        note = dict(note)
        if "read_frames" in note:
            listed = note.pop("read_frames")
            if listed is not None and not (isinstance(listed, list) and all(type(f) is int and f >= 0 for f in listed)):
                continue
            note["read_ranges"] = None if listed is None else frame_ranges(sorted(set(listed)))
        if note.get("read_ranges") is not None and not _ranges(note["read_ranges"]):
            continue
        kept.append(note)
    return kept
