"""An object store as statekv uses it (`ObjectStore`): named objects under one URL's prefix, read, written whole,
listed and removed through fsspec (``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``file://...``), and the
one conditional write every store offers: create an object only if no object has its name (S3's and Azure's
``If-None-Match: *``, GCS's ``ifGenerationMatch=0``; fsspec's ``mode="create"``), which is what leases are fenced
by (`versions.StreamVersions`). Nothing here locks a file.

A failure of the store is an `StoreError` (an `OSError`) whose message is one line naming the store, what was
being done and why (``AccessDenied``, no such bucket, unreachable, no credentials), never the store's whole answer:
whatever the store's client raises (botocore's ``NoCredentialsError`` and ``EndpointConnectionError`` are not
`OSError`), a request that fails is the store's failure.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from ...console import one_line
from ...flushing import flush_file, write_flushed, write_whole
from ..errors import StorageError

log = logging.getLogger("statekv.serve")
CONFLICTS = ("PreconditionFailed", "ConditionalRequestConflict")  # S3: another writer created the name first
ANSWER_SECONDS = 10.0  # the longest one try of a request waits for the store to connect, or to send the next bytes
TRIES = 2  # tries of one request (a throttled or dropped one is tried again), so a silent store fails it in 20 s
SLOWEST_UPLOAD = 2**20  # bytes a second: an upload slower than this is given up


class StoreError(StorageError):
    """The object store refused or failed a request: ``strerror`` is one line saying which and why."""


class MissingObject(StoreError):
    """The object asked for is not in the store (the store answered: not a failure to reach it)."""


class ObjectStore:
    """The objects under ``url`` (an fsspec URL; its filesystem's package installed: s3fs, gcsfs, adlfs).
    Names are relative to the URL, ``/``-separated. Listings are never cached: every replica sees every other's
    writes at once (S3, GCS and Azure list with read-after-write consistency). On S3 a request is given up (a
    `StoreError`) after ``tries`` tries each waiting at most ``answer_seconds`` to connect or for the store's next
    bytes: the client's own limits (a minute a read, tried again for minutes) would hold a push, a question behind
    it and the replica's health check that long on a store that accepts connections and never answers."""

    def __init__(self, url: str, *, answer_seconds: float = ANSWER_SECONDS, tries: int = TRIES):
        import fsspec

        self.url = url.rstrip("/")
        try:
            bounded = _bounded(self.url, answer_seconds, tries)
            self.fs, root = fsspec.core.url_to_fs(self.url, use_listings_cache=False, skip_instance_cache=True,
                                                  **bounded)
        except Exception as error:  # noqa: BLE001 - see the module's doc
            raise StoreError(f"fsspec cannot open {self.url} ({_first_line(error)})") from None
        if bounded:
            self.fs.retries = 1  # s3fs's own loop of tries around botocore's: left at one, so they do not multiply
        # A write waits for the store's "100 Continue" before its body, a wait aiohttp bounds by nothing: each write
        # is given a whole time (fsspec's ``timeout``), past which it is cancelled.
        self.write_seconds = answer_seconds * tries + 2.0 if getattr(self.fs, "async_impl", False) else None
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        self.quiet = False

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _within(self, size: int) -> dict[str, float]:
        """The whole time a write of ``size`` bytes is given, as fsspec takes it (none for a synchronous store)."""
        return {} if self.write_seconds is None else {"timeout": self.write_seconds + size / SLOWEST_UPLOAD}

    # -- writing --------------------------------------------------------------------------------------------
    def create(self, name: str, data: bytes) -> bool:
        """Write ``data`` as ``name`` only if no object has that name; False (nothing written) when one has."""
        if self.local:
            return self._create_local(name, data)
        try:
            self.fs.pipe_file(self.path(name), data, mode="create", **self._within(len(data)))
        except FileExistsError:
            return False
        except Exception as error:  # noqa: BLE001 - see the module's doc
            if _code(error) in CONFLICTS:
                return False
            raise self.error("write", name, error) from None
        return True

    def put(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name``, over whatever was there (only for objects one writer owns)."""
        if self.local:
            self._put_local(name, data)
            return
        try:
            self.fs.pipe_file(self.path(name), data, **self._within(len(data)))
        except Exception as error:  # noqa: BLE001 - see the module's doc
            raise self.error("write", name, error) from None

    def upload(self, local: Path, name: str) -> None:
        """Copy a local file to ``name`` (a new name: saved streams are never overwritten). In a local folder the
        copy is on the disk before it has its name, as a version naming it will be (`_create_local`)."""
        if self.local:
            self._upload_local(local, name)
            return
        try:
            self.fs.put_file(str(local), self.path(name), **self._within(local.stat().st_size))
        except Exception as error:  # noqa: BLE001 - see the module's doc
            raise self.error("write", name, error) from None

    def remove(self, name: str) -> None:
        """Remove ``name`` (nothing to do when there is none)."""
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass
        except Exception as error:  # noqa: BLE001 - see the module's doc
            raise self.error("remove", name, error) from None

    # -- reading --------------------------------------------------------------------------------------------
    def read(self, name: str) -> bytes | None:
        """The object's bytes; None when there is none."""
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 - see the module's doc
            if _code(error) in ("NoSuchKey", "404"):
                return None
            raise self.error("read", name, error) from None

    def download(self, name: str, local: Path) -> None:
        """Copy ``name`` to a local file: `MissingObject` when the store has no such object, `StoreError` when it
        could not be read."""
        try:
            self.fs.get_file(self.path(name), str(local))
        except Exception as error:  # noqa: BLE001 - see the module's doc
            failure = self.error("read", name, error)
            if isinstance(error, FileNotFoundError) or _code(error) in ("NoSuchKey", "404"):
                raise MissingObject(failure.strerror) from None
            raise failure from None

    def names(self, prefix: str, start: str = "") -> list[str]:
        """Every object's name under ``prefix`` (a folder's name, ending in ``/``; "": every object) that begins
        with ``prefix + start``, sorted. The store lists only those where it can (S3, GCS and Azure take a prefix):
        a listing is billed and paged by the objects it returns."""
        folder = self.path(prefix.strip("/")) if prefix.strip("/") else self.root
        try:
            found = self.fs.find(folder, **({"prefix": start} if start else {}))
        except FileNotFoundError:
            return []
        except Exception as error:  # noqa: BLE001 - see the module's doc
            raise self.error("list", prefix + start, error) from None
        begins = f"{folder}/{start}"
        return sorted(path[len(self.root) + 1:] for path in found if not path.endswith("/") and path.startswith(begins))

    # -- checking -------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Write, read back and remove a probe object: a `StoreError` when the store cannot be used (no such
        bucket, no permission, unreachable), before anything else is written there."""
        name = f"probes/{secrets.token_hex(8)}"
        self.quiet = True  # its one line says why: the log would say it twice, where a start is refused
        try:
            if self.local:
                try:
                    os.makedirs(self.root, exist_ok=True)
                except OSError as error:
                    raise self.error("write", name, error) from None
            self.put(name, b"statekv")
            if self.read(name) != b"statekv":
                raise StoreError(f"the object store {self.url} did not give back what was written to it")
            self.remove(name)
        finally:
            self.quiet = False

    def error(self, doing: str, name: str, error: BaseException) -> StoreError:
        """A failed request as one line; the store's whole answer goes to the log (not while `check` runs)."""
        if not self.quiet:
            log.error("object store %s: cannot %s %s: %r", self.url, doing, name, error)
        return StoreError(f"the object store {self.url} cannot {doing} {name} ({_reason(error)})")

    # -- a local folder (file://): the same writes, made atomic by the file system ---------------------------
    def _create_local(self, name: str, data: bytes) -> bool:
        target = Path(self.path(name))
        partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_flushed(partial, data)
            os.link(partial, target)  # fails when the name exists: the first writer wins, whole
        except FileExistsError:
            return False
        except OSError as error:
            raise self.error("write", name, error) from None
        finally:
            partial.unlink(missing_ok=True)
        return True

    def _upload_local(self, local: Path, name: str) -> None:
        target = Path(self.path(name))
        partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, partial)
            flush_file(partial)
            os.replace(partial, target)
        except OSError as error:
            partial.unlink(missing_ok=True)
            raise self.error("write", name, error) from None

    def _put_local(self, name: str, data: bytes) -> None:
        target = Path(self.path(name))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_whole(target, data, partial=target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial"))
        except OSError as error:
            raise self.error("write", name, error) from None


def _bounded(url: str, answer_seconds: float, tries: int) -> dict[str, Any]:
    """The options that bound each request to ``url``'s store (S3's: botocore's timeouts and tries); none for
    another store."""
    import fsspec

    if fsspec.core.split_protocol(url)[0] not in ("s3", "s3a"):
        return {}
    return {"config_kwargs": {"connect_timeout": answer_seconds, "read_timeout": answer_seconds,
                              "retries": {"total_max_attempts": tries, "mode": "standard"}}}


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _code(error: BaseException) -> str | None:
    """The store's error code behind an fsspec error (botocore's ``Error.Code``), if it says one."""
    for cause in (error, error.__cause__, error.__context__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code") or "") or None
    return None


def _reason(error: BaseException) -> str:
    from fsspec.exceptions import FSTimeoutError

    if isinstance(error, FSTimeoutError):
        return "timed out: no answer in the time a write is given"
    code = _code(error)
    if isinstance(error, PermissionError) or code in ("AccessDenied", "403", "AllAccessDisabled"):
        return f"{code or 'permission denied'}: the credentials may not do this"
    if code == "NoSuchBucket":
        return "NoSuchBucket: no such bucket"
    text = _first_line(error)
    return f"{code}: {text}" if code and code not in text else text


def _first_line(error: BaseException) -> str:
    return one_line(getattr(error, "strerror", None) or error)[:200]
