"""The tiles first-use tuning chose, kept on disk per device so later processes skip the tuning.

One JSON file per device model (``<cache>/kernels/scored_attention-<device>.json``, the cache folder from
`statekv.user_cache`): ``{"identity": {...}, "choices": {bucket key: {"flash": tile, "mass": tile}}}``. The
identity (device name and compute capability, Triton version, a hash of the kernels' source) must match, or
the file's choices are ignored and replaced: a new Triton or an edited kernel is tuned afresh. Writes merge
with what other processes wrote meanwhile and replace the file atomically; a cache that cannot be read or
written only costs the tuning again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from statekv.flushing import write_whole
from statekv.user_cache import cache_dir

from .tuning import Tile

KERNEL_SOURCES = ("flash_forward.py", "key_mass.py", "tiles.py", "tuning.py")


def source_hash() -> str:
    """A short hash of the kernels' source files (an edit invalidates the cached choices)."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).with_name(name)).read_bytes())
    return digest.hexdigest()[:16]


def default_path(device_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "device"
    return cache_dir() / "kernels" / f"scored_attention-{slug}.json"


class TileCache:
    """Chosen (flash, mass) tiles by bucket key, for one device identity, backed by ``path`` (None: memory only)."""

    def __init__(self, path: Path | None, identity: dict[str, Any]):
        self.path, self.identity = path, identity
        self.choices: dict[str, tuple[Tile, Tile]] = self._read()

    def get(self, key: str) -> tuple[Tile, Tile] | None:
        return self.choices.get(key)

    def put(self, key: str, tiles: tuple[Tile, Tile]) -> None:
        self.choices[key] = tiles
        if self.path is None:
            return
        merged = {**self._read(), key: tiles}  # keep what other processes added since we read
        document = {"identity": self.identity,
                    "choices": {k: {"flash": list(flash), "mass": list(mass)} for k, (flash, mass) in merged.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(self.path, json.dumps(document, indent=1, sort_keys=True).encode(),
                        partial=self.path.with_name(f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"))
        except OSError:  # not cached: the next process tunes again
            pass

    def _read(self) -> dict[str, tuple[Tile, Tile]]:
        if self.path is None:
            return {}
        try:
            document = json.loads(self.path.read_text())
            if document.get("identity") != self.identity:
                return {}
            return {key: (Tile(*value["flash"]), Tile(*value["mass"])) for key, value in document["choices"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}
