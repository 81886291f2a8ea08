"""API keys: ``Authorization: Bearer KEY``. A stream belongs to the key that created it; no key is ever written
down, only its digest (the stream's owner id).

The keys a server accepts (`KeyRing`) are the keys it was given (``--api-key``, else ``STATEKV_API_KEYS``) and
the key made for its state folder (`KeyFile`: ``DIR/keys.json``, the digest of a key made the first time a
server started on that folder without a key, shown once then). Several servers (replicas) sharing one state
folder read the same file, and only one of them can make the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

from fastapi import Request

from ..errors import ConfigurationError
from ..flushing import flush_folder, write_flushed
from .errors import ServiceError

log = logging.getLogger("statekv.serve")
KEYS_VARIABLE = "STATEKV_API_KEYS"
KEYS_FILE = "keys.json"


def owner_of(key: str) -> str:
    """The owner id kept with a key's streams: a digest, so the state folder does not reveal keys."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def configured_keys(given: list[str] | None) -> list[str]:
    """The keys from ``--api-key``, or, without any, from ``STATEKV_API_KEYS`` (comma-separated); maybe none. A
    one-line `ConfigurationError` naming where a key came from when it is not printable ASCII: an HTTP header
    carries no other, so no client could send it."""
    keys, source = [key.strip() for key in (given or []) if key.strip()], "--api-key"
    if not keys:
        keys = [key.strip() for key in os.environ.get(KEYS_VARIABLE, "").split(",") if key.strip()]
        source = KEYS_VARIABLE
    if not all(key.isascii() and key.isprintable() for key in keys):
        raise ConfigurationError(f"{source}: an API key must be printable ASCII (an HTTP header carries no other "
                                 "characters, so no client could send it)")
    return keys


class KeyFile:
    """``DIR/keys.json``: the digests of the keys made for a state folder, with when each was made."""

    def __init__(self, state_dir: Path | str):
        self.path = Path(state_dir) / KEYS_FILE

    def stored(self) -> list[dict]:
        """``[{"owner": digest, "made": unix time}]``; [] when no key was made here."""
        try:
            document = json.loads(self.path.read_text())
            keys = document["keys"]
            if not isinstance(keys, list):
                raise TypeError("keys is not a list")
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
            raise ConfigurationError(f"{self.path.name} in the state folder is unreadable ({type(error).__name__}); "
                                     "remove it to have a new key made, or pass --api-key") from None
        usable = [k for k in keys if isinstance(k, dict) and isinstance(k.get("owner"), str) and k["owner"]]
        if len(usable) < len(keys):  # one bad entry costs that key alone
            log.error("%s in the state folder: %d of its %d entries are malformed and ignored (their key is not "
                      "accepted)", self.path.name, len(keys) - len(usable), len(keys))
        return usable

    def make(self) -> str | None:
        """Make a key and store its digest, unless a key was made here already (by another server too): returns
        the new key (to show once), or None."""
        key = new_key()
        return key if self.keep(key) else None

    def keep(self, key: str) -> bool:
        """Store ``key``'s digest as the folder's key, unless a key was made here already (by another server too):
        whether it was stored."""
        document = {"keys": [{"owner": owner_of(key), "made": int(time.time())}]}
        partial = self.path.with_name(f"{KEYS_FILE}.{secrets.token_hex(4)}.partial")
        try:
            write_flushed(partial, (json.dumps(document, indent=1) + "\n").encode())  # on the disk before its name
            os.chmod(partial, 0o600)
            os.link(partial, self.path)  # fails when the file exists: one key per folder, whoever is first
            try:
                flush_folder(self.path.parent)  # the name too: a power loss cannot take back a key already shown
            except OSError:  # never shown: left, the next start would serve under a key nobody holds
                self.path.unlink(missing_ok=True)
                raise
        except FileExistsError:
            return False
        except OSError as error:
            raise ConfigurationError(f"cannot make a key for the state folder ({error.strerror or error}); pass "
                                     "--api-key, or give a folder this server can write") from None
        finally:
            partial.unlink(missing_ok=True)
        return True

    def withdraw(self, key: str) -> None:
        """Remove the folder's key file if it holds ``key`` alone (a start that kept it was refused after)."""
        if [entry.get("owner") for entry in self.stored()] == [owner_of(key)]:
            self.path.unlink(missing_ok=True)


def new_key() -> str:
    """A new API key (not stored anywhere yet), never starting with "-": a command line would read it as a flag."""
    while (key := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return key


class KeyRing:
    """Which owner a request's key belongs to: keys are compared by digest, in constant time."""

    def __init__(self, owners: Iterable[str]):
        self.owners = frozenset(owners)
        if not self.owners:
            raise ConfigurationError("no API key: pass --api-key KEY (or set STATEKV_API_KEYS), or start without "
                                     "one to have a key made for the state folder")

    @classmethod
    def for_folder(cls, state_dir: Path | str, keys: Iterable[str]) -> "KeyRing":
        """The ``keys`` given and the key made for ``state_dir`` (if any)."""
        stored = [entry["owner"] for entry in KeyFile(state_dir).stored()]
        return cls([*map(owner_of, keys), *stored])

    def owner(self, key: str | None) -> str | None:
        if not key:
            return None
        digest = owner_of(key)
        known = any(secrets.compare_digest(digest, owner) for owner in self.owners)
        return digest if known else None

    def require(self, request: Request) -> str:
        """The owner of the request's bearer key; 401 when it has none or an unknown one."""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise ServiceError(401, "no API key: send Authorization: Bearer KEY", headers={"WWW-Authenticate": "Bearer"})
        owner = self.owner(key.strip()) if scheme.lower() == "bearer" else None
        if owner is None:
            raise ServiceError(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})
        return owner
