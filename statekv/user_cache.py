"""Where statekv keeps what it builds once per user: ``$STATEKV_CACHE``, else ``$XDG_CACHE_HOME/statekv``, else
``~/.cache/statekv`` (the demo's model and video, the Triton kernel's chosen tiles)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    root = os.environ.get("STATEKV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "statekv"
    return Path(root)
