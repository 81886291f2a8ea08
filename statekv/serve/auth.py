"""API keys: ``Authorization: Bearer KEY``. A stream belongs to the key that created it; the key itself is never
written down, only a digest of it (its owner id)."""

from __future__ import annotations

import hashlib
import os
import secrets

from fastapi import Request

from .errors import ServiceError

KEYS_VARIABLE = "STATEKV_API_KEYS"


def owner_of(key: str) -> str:
    """The owner id kept with a key's streams: a digest, so the state folder does not reveal keys."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def configured_keys(given: list[str] | None) -> tuple[list[str], bool]:
    """The keys from ``--api-key`` (or, without any, ``STATEKV_API_KEYS``); a fresh key when none is given.
    Returns (keys, whether one was made)."""
    keys = [key.strip() for key in (given or []) if key.strip()]
    if not keys:
        keys = [key.strip() for key in os.environ.get(KEYS_VARIABLE, "").split(",") if key.strip()]
    if keys:
        return keys, False
    return [secrets.token_urlsafe(24)], True


class KeyRing:
    """Which owner a request's key belongs to."""

    def __init__(self, keys: tuple[str, ...] | list[str]):
        if not keys:
            raise ValueError("at least one API key is needed")
        self._owners = {owner_of(key): key for key in keys}

    def owner(self, key: str | None) -> str | None:
        if not key:
            return None
        owner = owner_of(key)
        known = self._owners.get(owner)
        return owner if known is not None and secrets.compare_digest(known, key) else None

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
