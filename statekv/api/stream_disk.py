"""A disk-tier stream's own description in its file set (``stream.json``), what `Stream.load` resumes it from.

The file set itself (the layers' files, the journal, the carried-state slots) is `statekv.core.disk.tier`'s. Beside it a
stream writes, once, the setup it was made with: its name, horizon, sampling, reserve and prompt prefix, the model
(family, layout, dtype, the weights' fingerprint), the method and the engine's settings. Resuming checks that setup
against the `VideoQA` given, as a saved stream's is (`statekv.api.stream_file`), so a foreign file set is refused
with one line before anything is built from it; who the stream is (its id, creation and owner's digest); and the
file set it belongs to (``file_set``, its manifest's: another stream's ``stream.json`` copied in is refused). The
file records the SHA-256 of its fields (`statekv.core.disk.files.read_checked`).

A stream closed with frames waiting for their vision batch keeps them beside it (``waiting.safetensors``, vouched
for by a ``waiting`` journal record naming each frame and the file's CRC-32: `write_waiting`), so resuming the
folder takes them back (`read_waiting`) instead of counting them lost. Its open watches are kept the same way
(``watches.safetensors``: their records and the queries they steer with, vouched for by a ``watches`` record:
`write_watches`, `read_watches`); a folder resumed after a kill, whose last checkpoint comes after no close,
reopens none.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors, save as save_tensors

from ..core.disk.files import read_description
from ..errors import InputError
from ..flushing import write_whole
from ..settings.values import HIGHEST_FPS, printable
from ..video import Frame
from .json_checks import integer_check, number_check, optional_check, record_check
from .stream_file import BOOLEAN, OWNERSHIP, SETTINGS, TEXT

FORMAT = "statekv-disk-stream"
FORMAT_VERSION = 2  # 1: named no file set
SETUP = "stream"  # the file's name in the file set: stream.json
WAITING = "waiting"  # a journal record's field: the frames kept beside the file set at its close
WAITING_FILE = "waiting.safetensors"
WATCHES = "watches"  # a journal record's field: the open watches kept beside the file set (checkpoint, close)
# written in turn, so the file the last record vouches for stays whole while the next is written
WATCHES_FILES = ("watches.0.safetensors", "watches.1.safetensors")
WATCHES_FILE = "watches.safetensors"  # what a record naming no file vouches for (the one file of statekv 0.x before)
CLOCK = "clock"  # a journal record's field at close: ``[pushed, last_timestamp]`` (frames dropped after the last kept)

SCHEMA = record_check({
    "format": TEXT, "version": integer_check(1), "name": TEXT,
    "model": record_check({"family": TEXT, "layout": TEXT, "model_type": TEXT, "name_or_path": TEXT,
                           "layers": integer_check(1), "hidden_size": integer_check(1), "dtype": TEXT,
                           "weights": TEXT}),
    "engine": record_check({"method": TEXT, "policy": TEXT, "attention": TEXT, "cuda_graph": BOOLEAN,
                            "reserve_tokens": integer_check(1)}, optional={"settings": SETTINGS}),
    "horizon": optional_check(integer_check(1)), "horizon_frames": optional_check(integer_check(1)),  # null: none
    "max_fps": optional_check(number_check(positive=True, highest=HIGHEST_FPS)), "prefix_tokens": integer_check(0),
    "vision_batch": integer_check(1), "kv_cache_dtype": optional_check(TEXT),
    "file_set": TEXT,  # the file set it belongs to: its manifest's
}, optional=OWNERSHIP)


def stream_setup(name: str, model: dict[str, Any], engine: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The ``stream.json`` fields of a new disk-tier stream."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "name": name, "model": model, "engine": engine, **fields}


def read_stream_setup(folder: str | Path) -> dict[str, Any]:
    """The verified ``stream.json`` of a disk-tier stream's file set; a one-line `InputError` otherwise."""
    setup = read_description(Path(folder), f"{SETUP}.json", FORMAT, FORMAT_VERSION, "disk-tier stream")
    try:
        SCHEMA(setup, "stream")
    except InputError as error:
        raise InputError(f"{printable(folder)}: malformed {SETUP}.json: {error}") from None
    return setup


def frames_lost(records: list[dict[str, Any]], pushed: int, streamed: int = 0) -> int:
    """Frames pushed at or after index ``pushed`` according to the journal's ``push`` records: kept but not
    streamed when the process stopped (a frame journaled twice, as after a push that failed and was retried,
    counts once); and those below ``streamed``, streamed by steps whose records a power loss left after a gap."""
    kept = {record["push"] for record in records if isinstance(record.get("push"), int) and record["push"] >= pushed}
    return max(0, streamed - pushed) + sum(index >= streamed for index in kept)


def write_waiting(folder: Path, frames: list[Frame]) -> dict[str, Any]:
    """Write ``frames`` (waiting for their batch) to ``folder``'s `WAITING_FILE` (replaced atomically, flushed);
    returns the journal record vouching for it. An `OSError` when it cannot be written (nothing replaced)."""
    data = save_tensors({f"frame.{n}": torch.from_numpy(np.ascontiguousarray(frame.image))
                         for n, frame in enumerate(frames)})
    write_whole(folder / WAITING_FILE, data)
    return {WAITING: [[frame.index, frame.timestamp] for frame in frames], "file_crc": zlib.crc32(data)}


def read_waiting(folder: Path, record: dict[str, Any], pushed: int) -> list[Frame] | None:
    """The frames the ``waiting`` ``record`` names, from ``folder``'s `WAITING_FILE`, if they follow the frame
    ``pushed - 1`` in order and the file is the one it vouches for; None otherwise (they count as lost)."""
    named = record.get(WAITING)
    if (not isinstance(named, list) or not named
            or not all(isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                       and type(item[1]) in (int, float) for item in named)
            or named[0][0] < pushed or any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(named, named[1:]))):
        return None
    try:
        data = (folder / WAITING_FILE).read_bytes()
        if zlib.crc32(data) != record.get("file_crc"):
            return None
        tensors = load_tensors(data)
    except Exception:  # noqa: BLE001 -- unreadable, however safetensors says so: the frames count as lost
        return None
    images = [tensors.get(f"frame.{n}") for n in range(len(named))]
    if any(image is None or image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3
           or not image.shape[0] or not image.shape[1] for image in images):
        return None
    return [Frame(index, float(timestamp), image.numpy()) for (index, timestamp), image in zip(named, images)]


def write_watches(folder: Path, name: str, records: list[dict[str, Any]],
                  tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write a stream's open watches, at a checkpoint or its close (``records``, `statekv.api.watch_saving.records`, and
    the queries they steer with, ``tensors``, `statekv.api.watch_saving.tensors`) to ``folder / name`` (one of
    `WATCHES_FILES`; replaced atomically, flushed); returns the journal record vouching for it. An `OSError` when
    it cannot be written (nothing replaced)."""
    data = save_tensors({key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()},
                        metadata={WATCHES: json.dumps(records)})
    write_whole(folder / name, data)
    return {WATCHES: len(records), "file": name, "file_crc": zlib.crc32(data)}


def watches_file(record: dict[str, Any]) -> str | None:
    """The file a ``watches`` record vouches for (None: a name no writer gives)."""
    name = record.get("file", WATCHES_FILE)
    return name if name in (*WATCHES_FILES, WATCHES_FILE) else None


def kept_watches_files(folder: Path) -> list[Path]:
    """The files of watches in ``folder``, whichever record vouches for them."""
    return [folder / name for name in (*WATCHES_FILES, WATCHES_FILE) if (folder / name).is_file()]


def read_watches(folder: Path, record: dict[str, Any]) -> tuple[list, dict[str, torch.Tensor]] | str:
    """The watches the ``watches`` ``record`` vouches for, from the file it names in ``folder``: their records and
    tensors (for `statekv.api.watch_saving.restore`), or why they cannot be read."""
    name = watches_file(record)
    if name is None:
        return "its record names no file of watches"
    try:
        data = (folder / name).read_bytes()
    except OSError as error:
        return f"{name} cannot be read ({error.strerror or error})"
    if zlib.crc32(data) != record.get("file_crc"):
        return f"{name} is not the file its record vouches for"
    try:  # the safetensors header: its length in 8 bytes, then its JSON, the metadata in it
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        records = json.loads(header["__metadata__"][WATCHES])
        tensors = load_tensors(data)
    except Exception:  # noqa: BLE001 -- however safetensors or json says so, the file does not read
        return f"{name} does not read"
    if not isinstance(records, list) or len(records) != record.get(WATCHES):
        return f"{name} does not hold the watches its record names"
    return records, tensors


