"""Re-owning a stream's files on this installation (``statekv reown``): what to do with a saved stream or a disk-tier
file set whose owner another installation recorded (its secret is not this one's, `statekv.user_cache`), or an
earlier statekv did (before owner digests were keyed), or that was saved with another owner or none.

A saved file is verified first as loading verifies it (a damaged file is refused); a file set's manifest,
description, journal and last checkpoint's carried state are (a file set one of whose files another stream's set
holds is refused too), its cache's rows are checked against their checksums when it is loaded. A file set of format
2 is checked as that format (its journal and last checkpoint's carried state: a damaged one is refused with nothing
written), then bound as format 4 binds its files (`statekv.core.disk.files.upgrade_file_set`) and verified. Then who
owns it is recorded anew under this installation's secret: ``owner`` (None: no owner). Its id and creation are kept
(given ones where it recorded none). Whoever runs it vouches for the file: re-own only what you trust.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.disk.files import (FILE_SET, MANIFEST, READ_VERSIONS as SET_VERSIONS, check_file_set, hold, read_checked,
                               read_file_set, read_manifest, upgrade_file_set, write_checked)
from ..core.disk.resume import check_checkpoint, check_durable
from ..core.disk.successor import finish_handover
from ..errors import InputError, OutputError
from ..settings.values import is_folder, printable
from .stream_disk import FORMAT as SETUP_FORMAT, FORMAT_VERSION as SETUP_VERSION, SETUP, read_stream_setup
from .stream_file import FORMAT_VERSION as STREAM_VERSION, read_verified, write_verified
from .stream_identity import check_owner, new_created, new_stream_id, ownership


def reown(path: str | Path, owner: str | None = None) -> Path:
    """Record ``owner`` (None: no owner) as the owner of the saved stream or disk-tier file set at ``path``, under
    this installation's secret; return ``path``. One-line errors: an `InputError` for a file that is damaged or not
    a stream's, an `OutputError` for one that cannot be written (nothing is changed then)."""
    check_owner(owner)
    path = Path(path)
    if is_folder(path):
        return _reown_file_set(path, owner)
    metadata, tensors = read_verified(path)
    metadata.pop("checksums")  # written afresh
    metadata["version"] = STREAM_VERSION  # written in this statekv's format (its per-step lists in runs)
    metadata.update(ownership(metadata.get("stream_id") or new_stream_id(), metadata.get("created") or new_created(),
                              owner))
    return write_verified(path, tensors, metadata)


def _reown_file_set(folder: Path, owner: str | None) -> Path:
    if not (folder / MANIFEST).is_file():  # before a lock file is made in it
        raise InputError(f"{printable(folder)}: not a saved stream or a statekv disk cache (no {MANIFEST})")
    lock = hold(folder, "statekv reown")  # no stream lives in it meanwhile
    try:
        finish_handover(folder)  # a handover stopped midway: the file set is its successor's
        try:
            version = json.loads((folder / MANIFEST).read_text()).get("version")
        except (OSError, ValueError, AttributeError):
            version = None
        setup = read_checked(folder / f"{SETUP}.json")
        if setup.get("format") != SETUP_FORMAT or setup.get("version") not in (1, SETUP_VERSION):
            raise InputError(f"{printable(folder)}: not a disk-tier stream's file set ({SETUP}.json)")
        if version == 2:  # checked before the upgrade writes: a damaged folder is refused as it was found
            journal = read_file_set(folder, format_2=True)
            check_durable(folder, journal)
            check_checkpoint(folder, journal)
            for described in sorted(folder.glob("layer*.bin.json")):
                read_checked(described)
        try:
            manifest = upgrade_file_set(folder) if version == 2 else read_manifest(folder)
        except OSError as error:
            raise OutputError(f"cannot re-own {printable(folder)}: {error.strerror or error}") from None
        if version in SET_VERSIONS:
            check_file_set(folder, f"{SETUP}.json", setup, manifest[FILE_SET])
        journal = read_file_set(folder)
        check_durable(folder, journal)
        check_checkpoint(folder, journal)
        setup.update(version=SETUP_VERSION, file_set=manifest[FILE_SET],
                     **ownership(setup.get("stream_id") or new_stream_id(), setup.get("created") or new_created(),
                                 owner))
        try:
            write_checked(folder / f"{SETUP}.json", setup)
        except OSError as error:
            raise OutputError(f"cannot re-own {printable(folder)}: {error.strerror or error}") from None
        read_stream_setup(folder)  # as loading reads it
    finally:
        lock.release()
    return folder
