"""Where statekv keeps what it builds once per user: ``$STATEKV_CACHE``, else ``$XDG_CACHE_HOME/statekv``, else
``~/.cache/statekv`` (the demo's model and video, the Triton kernel's chosen tiles); without a home folder, one
in the temporary folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    if os.environ.get("STATEKV_CACHE"):
        return Path(os.environ["STATEKV_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "statekv"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):  # no HOME and no password entry (containers, daemons)
        home = None
    if home is None or not str(home).strip() or str(home) == ".":
        return Path(tempfile.gettempdir()) / f"statekv-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return home / ".cache" / "statekv"
