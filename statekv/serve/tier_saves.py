"""Where the server saves a stream: a disk-tier stream that this server's next start resumes from its own file set
(`StreamLoader.resume_tier`) is saved by making that file set durable up to now (`statekv.Stream.sync`), its record
noting ``tier_saved``; every other stream is saved whole into the state folder (`statekv.Stream.save`).

A whole save of a disk-tier stream would copy its detailed cache, which grows with the stream's age, at every save;
the file set already journals every push, so a save costs what the frames since the last save cost.
"""

from __future__ import annotations

from typing import Any


def saved_in_tier(entry: Any, resume_tiers: bool) -> bool:
    """Whether ``entry``'s save is its disk-tier file set made durable (``resume_tiers``: the placement's, False
    where file sets are each replica's own and a stream taken elsewhere loads from its save)."""
    return resume_tiers and entry.tier is not None


def save_stream(entry: Any, files: Any, in_tier: bool) -> frozenset[str]:
    """Save ``entry``'s stream (on the model's thread): its file set made durable when ``in_tier``, else whole
    through ``files`` (`StreamFiles.save_state`); nothing for a stream with no cache to save. The watches the
    state folder's save then holds (none but for a whole save: the record keeps the others' events)."""
    if in_tier:
        entry.stream.sync()
        return frozenset()
    if not getattr(entry.stream, "keeps_cache", True):
        return frozenset()
    watches = frozenset(watch.id for watch in entry.stream.watches)
    files.save_state(entry.id, entry.stream.save)
    return watches
