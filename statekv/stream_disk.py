"""A disk-tier stream's own description in its file set (``stream.json``), what `Stream.load` resumes it from.

The file set itself (the layers' files, the journal, the carried-state slots) is `statekv.core.disk`'s. Beside
it a stream writes, once, the setup it was made with: its name, horizon, sampling, reserve and prompt prefix,
the model (family, layout, dtype, the weights' fingerprint) and the method. Resuming checks that setup against
the `VideoQA` given, as a saved stream's is (`statekv.stream_file`), so a foreign file set is refused with one
line before anything is built from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .core.disk import read_description
from .errors import InputError
from .stream_file import BOOLEAN, TEXT, _integer, _number, _optional, _record

FORMAT = "statekv-disk-stream"
FORMAT_VERSION = 1
SETUP = "stream"  # the file's name in the file set: stream.json

SCHEMA = _record({
    "format": TEXT, "version": _integer(1), "name": TEXT,
    "model": _record({"family": TEXT, "layout": TEXT, "model_type": TEXT, "name_or_path": TEXT,
                      "layers": _integer(1), "hidden_size": _integer(1), "dtype": TEXT, "weights": TEXT}),
    "engine": _record({"method": TEXT, "policy": TEXT, "attention": TEXT, "cuda_graph": BOOLEAN,
                       "reserve_tokens": _integer(1)}),
    "horizon": _optional(_integer(1)), "horizon_frames": _optional(_integer(1)),  # null: no horizon
    "max_fps": _optional(_number(positive=True)), "prefix_tokens": _integer(0), "vision_batch": _integer(1),
    "kv_cache_dtype": _optional(TEXT),
}, optional={"positions": TEXT})  # absent: stream positions (file sets made before bounded positions)


def stream_setup(name: str, model: dict[str, Any], engine: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The ``stream.json`` fields of a new disk-tier stream."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "name": name, "model": model, "engine": engine, **fields}


def read_stream_setup(folder: str | Path) -> dict[str, Any]:
    """The verified ``stream.json`` of a disk-tier stream's file set; a one-line `InputError` otherwise."""
    setup = read_description(Path(folder), f"{SETUP}.json", FORMAT, FORMAT_VERSION, "disk-tier stream")
    try:
        SCHEMA(setup, "stream")
    except InputError as error:
        raise InputError(f"{folder}: malformed {SETUP}.json: {error}") from None
    return setup


def frames_lost(records: list[dict[str, Any]], pushed: int) -> int:
    """Frames pushed at or after index ``pushed`` according to the journal's ``push`` records: kept but not
    streamed when the process stopped."""
    return sum(1 for record in records if isinstance(record.get("push"), int) and record["push"] >= pushed)
