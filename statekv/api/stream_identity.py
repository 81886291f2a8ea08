"""Who a saved stream is: its id, when it was made, and its owner, recorded in its files as a digest keyed by this
installation's secret (never the owner itself), and checked when the files are loaded (`check_ownership`). The
fields a file records are `statekv.api.stream_file.OWNERSHIP`."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import uuid
from typing import Any

from ..errors import ConfigurationError, ForeignFilesError
from ..settings.values import printable
from ..user_cache import installation_secret, secret_path

MAX_ID_CHARS = 200


def new_stream_id() -> str:
    return uuid.uuid4().hex


def check_stream_id(value: Any, name: str = "stream_id") -> str:
    """A stream's id: non-empty printable text of at most `MAX_ID_CHARS` characters."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise ConfigurationError(f"{name} must be non-empty printable text of at most {MAX_ID_CHARS} characters, "
                                 f"got {value!r}"[:300])
    return value


def new_created() -> str:
    """When a stream is made: UTC, to the microsecond (part of who it is, with its id)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def check_owner(owner: Any) -> str | None:
    """``owner``: any non-empty text naming who owns a stream (e.g. an API key's id), or None."""
    if owner is not None and not isinstance(owner, str):
        raise ConfigurationError(f"owner must be a non-empty string (or None), got {type(owner).__name__}")
    if owner is not None and not owner.strip():
        raise ConfigurationError("owner is empty: name who owns the stream, or give None for no owner")
    return owner


def installation_id(secret: bytes) -> str:
    """What a file records of the installation whose secret keyed its owner digest (not the secret)."""
    return hashlib.sha256(b"statekv-installation\0" + secret).hexdigest()[:16]


def owner_digest(owner: str | None, stream_id: str, created: str | None, *, secret: bytes | None = None) -> str | None:
    """What a stream's files record of its ``owner``: an HMAC-SHA256 under this installation's secret
    (`statekv.user_cache.installation_secret`, made on first use) of the owner bound to the stream's id and
    creation, never the owner itself. Without the secret no file can be made to name an owner, and a digest taken
    from another stream's file does not fit this one. None: no owner."""
    if check_owner(owner) is None:
        return None
    secret = installation_secret(create=True) if secret is None else secret
    text = f"statekv-owner\0{stream_id}\0{created or ''}\0{owner}"
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def ownership(stream_id: str, created: str, owner: str | None) -> dict[str, Any]:
    """The identity fields a stream's files record (`OWNERSHIP`): its id, creation, owner digest and the
    installation that keyed it (None without an owner)."""
    digest = owner_digest(owner, stream_id, created)
    installation = None if digest is None else installation_id(installation_secret(create=False))
    return {"stream_id": stream_id, "created": created, "owner_digest": digest, "installation": installation}


def check_ownership(path: str | os.PathLike, recorded: dict[str, Any], stream_id: str | None,
                    owner: str | None) -> None:
    """Refuse (one line) a saved stream that is not ``stream_id`` (None: any) or not ``owner``'s (None: one with no
    owner); ``recorded``: its identity fields (`OWNERSHIP`; absent in files saved before they were). An owner
    recorded by another installation (or before digests were keyed) proves nothing here: re-own the file
    (``statekv reown``) if you trust it."""
    where = printable(path)
    saved_id, saved_owner = recorded.get("stream_id"), recorded.get("owner_digest")
    if stream_id is not None and saved_id != check_stream_id(stream_id):
        held = "records no stream id" if saved_id is None else f"holds stream {saved_id!r}"
        raise ForeignFilesError(f"{where}: {held}, not {stream_id!r}; it was saved by another stream")
    if check_owner(owner) is None:
        if saved_owner is not None:
            raise ForeignFilesError(f"{where}: the stream belongs to an owner; give its owner to load it "
                                    f"(Stream.load(..., owner=...)), or re-own it to load it without one: "
                                    f"statekv reown {where}")
        return
    if saved_owner is None:
        raise ForeignFilesError(f"{where}: the stream belongs to no owner, not to the owner given")
    made_by, secret = recorded.get("installation"), installation_secret(create=False)
    reown = f"if you trust the file, re-own it: statekv reown {where} --owner NAME"
    if made_by is None:
        raise ForeignFilesError(f"{where}: its owner was recorded by an earlier statekv, without an installation's "
                                f"secret, so it proves nothing; {reown}")
    if secret is None or made_by != installation_id(secret):
        here = "has none" if secret is None else "is another"
        raise ForeignFilesError(f"{where}: its owner was recorded by another statekv installation (this one's "
                                f"secret, {secret_path()}, {here}); {reown}")
    if saved_owner != owner_digest(owner, saved_id or "", recorded.get("created"), secret=secret):
        raise ForeignFilesError(f"{where}: the stream belongs to another owner, not to the owner given")
