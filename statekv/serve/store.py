"""The state folder's streams on disk: what `StreamRegistry` writes and reads back, nothing of the model.

Layout of ``--state-dir``: ``keys.json`` (`auth.KeyFile`), ``streams/ID.json`` (the stream's record: id, owner
digest, settings, what was last saved, its last answers), written atomically before the stream's creation is
answered, and ``streams/ID.safetensors``, the stream in the verified saved-stream format (`statekv.Stream.save`),
replaced atomically. Every write goes to a new file that is fsynced and renamed over the old one, so a kill at
any moment leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

RECORD_FIELDS = ("id", "owner", "settings", "horizon_frames", "max_fps", "name", "created")


class StreamFiles:
    """The ``streams/`` folder of a state folder (created)."""

    def __init__(self, state_dir: Path | str):
        self.folder = Path(state_dir) / "streams"
        self.folder.mkdir(parents=True, exist_ok=True)

    def record_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.json"

    def state_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.safetensors"

    def write_record(self, record: dict[str, Any]) -> None:
        write_atomic(self.record_path(record["id"]), json.dumps(record, indent=1).encode())

    def records(self) -> list[tuple[Path, dict[str, Any] | Exception]]:
        """Every record, read (or the error that kept it from being read), in id order."""
        found: list[tuple[Path, dict[str, Any] | Exception]] = []
        for path in sorted(self.folder.glob("st_*.json")):
            try:
                record = json.loads(path.read_text())
                missing = [name for name in RECORD_FIELDS if name not in record]
                if missing:
                    raise ValueError(f"no {missing[0]!r} field")
                found.append((path, record))
            except (OSError, ValueError) as error:
                found.append((path, error))
        return found

    def owners(self) -> Counter:
        """How many streams each owner digest holds, over the records that can be read."""
        return Counter(record["owner"] for _, record in self.records() if isinstance(record, dict))

    def remove(self, stream_id: str) -> None:
        for path in (self.record_path(stream_id), self.state_path(stream_id)):
            path.unlink(missing_ok=True)

    def set_aside(self, stream_id: str) -> str:
        """Rename a stream's unreadable state file out of the way; returns its new name."""
        state = self.state_path(stream_id)
        aside = state.with_name(f"{state.name}.unreadable-{int(time.time())}")
        os.replace(state, aside)
        return aside.name


def write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
