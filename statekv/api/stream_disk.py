"""A disk-tier stream's own description in its file set (``stream.json``), what `Stream.load` resumes it from.

The file set itself (the layers' files, the journal, the carried-state slots) is `statekv.core.disk.tier`'s. Beside it a
stream writes, once, the setup it was made with: its name, horizon, sampling, reserve and prompt prefix, the model
(family, layout, dtype, the weights' fingerprint), the method and the engine's settings. Resuming checks that setup
against the `VideoQA` given, as a saved stream's is (`statekv.api.stream_file`), so a foreign file set is refused
with one line before anything is built from it; who the stream is (its id, creation and owner's digest); and the
file set it belongs to (``file_set``, its manifest's: another stream's ``stream.json`` copied in is refused). The
file records the SHA-256 of its fields (`statekv.core.disk.files.read_checked`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.disk.files import read_description
from ..errors import InputError
from .stream_file import (BOOLEAN, OWNERSHIP, SETTINGS, TEXT, integer_check, number_check, optional_check,
                          record_check)

FORMAT = "statekv-disk-stream"
FORMAT_VERSION = 2  # 1: named no file set
SETUP = "stream"  # the file's name in the file set: stream.json

SCHEMA = record_check({
    "format": TEXT, "version": integer_check(1), "name": TEXT,
    "model": record_check({"family": TEXT, "layout": TEXT, "model_type": TEXT, "name_or_path": TEXT,
                           "layers": integer_check(1), "hidden_size": integer_check(1), "dtype": TEXT,
                           "weights": TEXT}),
    "engine": record_check({"method": TEXT, "policy": TEXT, "attention": TEXT, "cuda_graph": BOOLEAN,
                            "reserve_tokens": integer_check(1)}, optional={"settings": SETTINGS}),
    "horizon": optional_check(integer_check(1)), "horizon_frames": optional_check(integer_check(1)),  # null: none
    "max_fps": optional_check(number_check(positive=True)), "prefix_tokens": integer_check(0),
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
        raise InputError(f"{folder}: malformed {SETUP}.json: {error}") from None
    return setup


def frames_lost(records: list[dict[str, Any]], pushed: int) -> int:
    """Frames pushed at or after index ``pushed`` according to the journal's ``push`` records: kept but not
    streamed when the process stopped (a frame journaled twice, as after a push that failed and was retried,
    counts once)."""
    return len({record["push"] for record in records if isinstance(record.get("push"), int) and record["push"] >= pushed})
