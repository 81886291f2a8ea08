"""Where the server saves a stream: a disk-tier stream that this server's next start resumes from its own file set
(`StreamLoader.resume_tier`) is saved by making that file set durable up to now (`statekv.Stream.sync`), its record
noting ``tier_saved``; every other stream is saved whole into the state folder (`statekv.Stream.save`).

A whole save of a disk-tier stream would copy its detailed cache, which grows with the stream's age, at every save;
the file set already journals every push, so a save costs what the frames since the last save cost.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..api.stream_disk import read_stream_setup
from ..errors import InputError
from .store import removable_tier

log = logging.getLogger("statekv.serve")


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


def not_written(entry: Any, error: BaseException, files: Any) -> str:
    """The folder a failed save of ``entry`` could not write, in messages: its disk-tier file set's (the offload
    folder: a save forces it first, whole or not) when ``error`` names that file set, else where ``files`` keep it."""
    return "the offload folder (--offload-dir)" if entry.tier is not None and str(entry.tier) in str(error) \
        else files.where


def drop_whole_save(stream_id: str, files: Any) -> None:
    """Remove the whole save a stream saved in its disk-tier file set (its record, written, says ``tier_saved``) may
    still have in the state folder (saved whole before: an older server, or a run with another placement); a kill
    before the removal leaves it to the next start. A failure is logged, the save kept (it is never read)."""
    try:
        if files.remove_state(stream_id):
            log.info("stream %s: its whole save in %s is removed (its disk-tier file set holds every frame it took; "
                     "its record says so)", stream_id, files.where)
    except OSError as error:
        log.warning("stream %s: cannot remove its older whole save from %s (%s); it is never read, and removed at "
                    "its next save or start", stream_id, files.where, error.strerror or error)


def tier_kept(record: Any, stream_id: str, files: Any, offload_dir: str | None) -> tuple[str | None, bool | None]:
    """For a damaged stream's deletion: the file set its ``record`` says holds its frames alone (None: it has a save
    of its own), and whether that file set is reached: True when it was moved into the state folder's quarantine or
    is in ``offload_dir`` (None: this server resumes no file sets), False when it is not there (lost with its disk,
    or another folder given), None when this server cannot reach it."""
    tier = record.get("tier") if isinstance(record, dict) and record.get("tier_saved") is True else None
    if not tier:
        return None, None
    if files.quarantined(stream_id):
        return tier, True
    return tier, None if offload_dir is None else (Path(offload_dir) / tier).exists()


def tier_in_place(record: Any, stream_id: str, files: Any, offload_dir: str | None) -> Path | None:
    """For a damaged stream's deletion: the disk-tier file set its ``record`` names where a start left it in
    ``offload_dir`` (saved with another setup, held by another process, or not movable into the quarantine); None
    when there is none there, when it is another stream's (named by a copied record; or, where the file set does not
    say whose it is, named by another stream's record too), or when this server resumes no file sets (``offload_dir``
    None)."""
    tier = record.get("tier") if isinstance(record, dict) else None
    if not isinstance(tier, str) or not tier or offload_dir is None or files.quarantined(stream_id):
        return None
    folder = Path(offload_dir) / tier
    if folder.is_symlink():  # never followed: what it names may be anything, anywhere
        log.warning("a deletion of stream %s leaves its disk-tier file set %s where it is: it is a link (to %s) in "
                    "--offload-dir, and neither it nor what it names is removed: remove them by hand", stream_id,
                    tier, os.readlink(folder)[:200])
        return None
    if not (removable_tier(str(folder), offload_dir) and folder.is_dir()):
        return None
    try:
        named = read_stream_setup(folder).get("stream_id")
    except (InputError, OSError):  # damaged: nothing tells whose it is but the records naming it
        named = None
    if named is not None:
        return folder if named == stream_id else None  # a copied record's: its stream keeps it
    shared = [other for other, data in files.records() if other != stream_id and isinstance(data, dict)
              and data.get("tier") == tier]
    if shared:  # another stream's record names it too (one of them copied): left to the stream deleted last
        log.warning("a deletion of stream %s leaves its disk-tier file set %s where it is: stream %s's record names it "
                    "too", stream_id, tier, shared[0])
        return None
    return folder
