"""Writing benchmark results into ``docs/benchmarks.md``, one ``## section`` per benchmark."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, title: str, body: str) -> None:
    """Replace the ``## title`` section of the markdown file at ``path`` (append it if absent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    header = f"## {title}\n"
    section = f"{header}\n{body.strip()}\n"
    if header not in text:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    before, rest = text.split(header, 1)
    next_section = rest.find("\n## ")
    after = rest[next_section:] if next_section >= 0 else ""
    path.write_text(before + section + after)
