"""Writing benchmark results into ``docs/benchmarks.md``, one ``## section`` per benchmark."""

from __future__ import annotations

import re
from pathlib import Path


def write_section(path: Path, title: str, body: str, level: int = 2) -> None:
    """Replace the ``## title`` section of the markdown file at ``path`` (``###`` with ``level`` 3: up to the next
    heading of that level or above), or append it if absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    header = f"{'#' * level} {title}\n"
    section = f"{header}\n{body.strip()}\n"
    if header not in text:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    before, rest = text.split(header, 1)
    found = re.search(rf"^#{{2,{level}}} ", rest, re.MULTILINE)  # "# " lines are comments in code blocks
    after = "\n" + rest[found.start():] if found else ""
    path.write_text(before + section + after)
