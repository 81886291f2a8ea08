"""A replica's streams in an object store, with no shared folder (`StoreStreamFiles`): the same interface as the
shared folder's `folder.SharedStreamFiles`, so `shared.LeasedPlacement` places streams the same way over either.

Layout under the store's URL: ``keys.json`` (`StoreKeyFile`), ``streams/ID/vN-EVENT.json`` (each stream's chain of
versions: its holder and fencing token, its record, its current save's name, its quarantine note;
`versions.StreamVersions`), ``saves/ID/TOKEN-TIME.safetensors`` (saved streams, each a new object; the current
one is the one the newest version names), ``sessions/REPLICA.json`` (`sessions.Session`), ``asks/ID.json`` (a
replica asking the holder to hand the stream over), ``holders/ID.json`` (who holds it, for the request routers:
a hint, written after each taking) and ``replicas/REPLICA.json`` (`board.StoreBoard`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError, InputError, StateKVError
from ..auth import new_key, owner_of
from ..errors import ServiceError
from ..store import check_record, readable_owner
from .folder import named_as_saved
from .leases import LEASE_SECONDS, Lease, LeaseLost
from .objects import MissingObject, ObjectStore, StoreError
from .sessions import Session
from .versions import STREAMS, StreamVersions, Version

log = logging.getLogger("statekv.serve")
SAVES, ASKS, HOLDERS = "saves", "asks", "holders"
ASK_SECONDS = 15.0  # how long an ask to hand a stream over stands (the asker asks again while it waits)
COMMIT_TRIES = 20  # new versions tried before a write gives up (each try follows another writer's version)
# a deleted stream's last version (its tombstone) fences a writer that stalled this long; then it is removed
TOMBSTONE_SECONDS = 30 * 24 * 3600.0


class StoreStreamFiles:
    """The streams of the object store ``store`` as replica ``holder`` may write them: a stream's only while the
    newest version of its chain names this replica (under its live session) with the token it took it under."""

    def __init__(self, store: ObjectStore, holder: str, seconds: float = LEASE_SECONDS,
                 clock: Callable[[], float] = time.time):
        self.store, self.holder, self.clock = store, holder, clock
        self.versions = StreamVersions(store, clock)
        self.session = Session(store, holder, seconds, clock)
        self.held: dict[str, Lease] = {}
        self._epochs: dict[str, str] = {}  # stream -> the session epoch it was taken under
        self._writing: dict[str, list] = {}  # stream -> [its lock, the threads holding or waiting for it]
        self._guard = threading.Lock()
        self._asks: tuple[float, dict[str, dict]] = (0.0, {})
        self._asking = threading.Lock()  # one reading of the asks at a time: a pass renews its leases at once
        self.where = "the object store"  # in messages

    @property
    def lease_seconds(self) -> float:
        return self.session.seconds

    # -- leases -----------------------------------------------------------------------------------------------
    def take(self, stream_id: str) -> Lease | None:
        """Take the stream: a new version naming this replica with the next token, when nobody holds it live;
        None when another replica does."""
        with self._lock(stream_id):
            epoch = self.session.keep()
            for _ in range(COMMIT_TRIES):
                current = self.versions.current(stream_id)
                if current is not None and current.deleted:
                    raise ServiceError(404, f"no stream {stream_id!r}")
                if current is not None and current.holder == self.holder and current.epoch == epoch:
                    return self._keep(current)
                if current is not None and current.holder is not None and current.holder != self.holder and \
                        self.session.expiry(current.holder, current.epoch, fresh=True) > self.clock():
                    return None
                before = None if current is None or current.holder is None else {
                    "holder": current.holder, "token": current.token,
                    "expires": self.session.expiry(current.holder, current.epoch)}
                taken = self.versions.commit(current, stream_id, "taken", holder=self.holder, epoch=epoch,
                                             token=(current.token if current else 0) + 1, before=before)
                if taken is not None:
                    self._hint(stream_id, self.holder)
                    with contextlib.suppress(OSError):
                        self.store.remove(f"{ASKS}/{stream_id}.json")
                    return self._keep(taken, lapsed=before is not None)
        return None

    def claim(self, stream_id: str) -> None:
        if not self.take(stream_id):
            raise ServiceError(409, f"stream id {stream_id} is taken; retry")

    def withdraw(self, stream_id: str) -> None:
        """Remove what taking a stream whose creation failed wrote: its versions (a new id's chain holds this
        replica's alone) and its hint; where the store refuses, the stream is let go as `release` lets it go, or
        forgotten (never served, the caller's own error is the one to raise)."""
        lease = self.held.get(stream_id)
        if lease is None:
            return
        try:
            with self._lock(stream_id):
                current = self.versions.current(stream_id)
                ours = current is None or current.held_by(self.holder, lease.token)
                if ours:
                    self.versions.remove_chain(stream_id)
            if ours:
                self._hint(stream_id, None)
            self._forget(stream_id)
        except (OSError, ServiceError):
            try:
                self.release(stream_id)
            except (OSError, StateKVError) as error:  # a stream never made: nothing here to serve or hand over
                log.warning("cannot withdraw stream %s from the store (%s); its version lapses with this replica's "
                            "session", stream_id, error)
                self._forget(stream_id)

    def renew(self, stream_id: str) -> Lease | None:
        """The stream's lease as it stands (``handoff``: a replica asked for it), the session renewed when due;
        None when it was lost (the session lapsed, so another replica may have taken it)."""
        lease = self.held.get(stream_id)
        if lease is None:
            return None
        if not self.session.valid() or self._epochs.get(stream_id) != self.session.epoch:
            self._forget(stream_id)
            return None
        self.keep_session()
        ask = self._asks_now().get(stream_id)
        asker = ask.get("by") if ask is not None and ask.get("by") != self.holder else None
        self.held[stream_id] = current = Lease(stream_id, self.holder, lease.token, self.session.expires, asker)
        return current

    def keep_session(self) -> None:
        """Renew the session when due (`ReplicaHosting` also calls this on a loop of its own, so a pass over the
        leases waiting on the store, reading the asks, does not hold the renewal up)."""
        try:
            self.session.keep()
        except OSError as error:  # the store out of reach: kept until the session lapses, then lost
            log.error("cannot renew the session of replica %s: %s", self.holder, error)

    def release(self, stream_id: str) -> None:
        """Let the stream go now (a version naming no holder): whoever takes it next gets the next token. Where the
        store refuses, the stream stays held, for the caller to let it go again: forgotten while the store names
        this replica its holder, it could be taken by no other replica while this one's session lives."""
        lease = self.held.get(stream_id)
        if lease is None:
            return
        try:
            self._commit(stream_id, "let-go", holder=None, epoch=None,
                         before={"holder": self.holder, "token": lease.token})
        except LeaseLost:  # another replica holds it now
            self._forget(stream_id)
            return
        self._forget(stream_id)
        self._hint(stream_id, None)

    def check(self, stream_id: str) -> None:
        """`LeaseLost` unless this replica surely still holds the stream (its session renewed in time)."""
        if stream_id not in self.held or not self.session.valid() or \
                self._epochs.get(stream_id) != self.session.epoch:
            raise LeaseLost(stream_id)

    def lease(self, stream_id: str) -> Lease:
        self.check(stream_id)
        return self.held[stream_id]

    def holder_of(self, stream_id: str) -> str | None:
        """The replica holding the stream under a live session, if any."""
        current = self.versions.current(stream_id)
        if current is None or current.holder is None or current.deleted:
            return None
        return current.holder if self.session.live(current.holder, current.epoch) else None

    def ask_handoff(self, stream_id: str) -> None:
        """Ask the replica holding the stream to save it and let it go (it does at its next pass)."""
        self.store.put(f"{ASKS}/{stream_id}.json", json.dumps({"by": self.holder, "at": self.clock()}).encode())

    def history(self, stream_id: str) -> list[dict[str, Any]]:
        return self.versions.history(stream_id)

    def end(self) -> None:
        """At shutdown, once every stream is let go: the session ends."""
        self.session.end()

    # -- writing ----------------------------------------------------------------------------------------------
    def write_record(self, record: dict[str, Any]) -> None:
        lease = self.lease(record["id"])
        self._commit(record["id"], "recorded", record={**record, "lease": {"holder": lease.holder,
                                                                            "token": lease.token}})

    def save_state(self, stream_id: str, write: Callable[[Path], Any]) -> None:
        lease = self.lease(stream_id)
        name = f"{SAVES}/{stream_id}/{lease.token}-{time.time_ns()}.safetensors"
        folder = Path(tempfile.mkdtemp(prefix="statekv-save-"))
        try:
            write(folder / "stream.safetensors")
            self.store.upload(folder / "stream.safetensors", name)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            self._commit(stream_id, "saved", state=name)
        except LeaseLost:
            with contextlib.suppress(OSError):
                self.store.remove(name)  # never named by a version: nobody reads it
            raise
        # any other failure keeps it: a store that failed to answer may have created the version naming it (the
        # next save of this token or a later one prunes it)
        self._prune_saves(stream_id, keep=name, token=lease.token)

    def begin_removal(self, stream_id: str, tier: Path | None) -> None:
        """Delete the stream at once: a last version saying so (kept, so no late writer brings it back); what
        else of it is in the store is garbage from then on (`remove` clears it). Deleted already (a deletion asked
        again, whose first the store made without answering) is deleted."""
        try:
            self._commit(stream_id, "deleted", holder=None, epoch=None, record=None, state=None, note=None,
                         deleted=True)
        except LeaseLost:
            if not self._deleted(stream_id):
                raise
        self._forget(stream_id)

    def _deleted(self, stream_id: str) -> bool:
        """Whether the stream's newest version says it is deleted (False when the store cannot say)."""
        try:
            current = self.versions.current(stream_id)
        except (OSError, ServiceError):
            return False
        return current is not None and current.deleted

    def removals(self) -> list[dict[str, Any]]:
        """The deletions cut short: streams whose last version says they are deleted (a deletion is whole once
        it is written) but whose saves or older versions are still in the store, ``{"id", "tier": None, "deleted":
        True}`` each (no lease needed: nobody can take a deleted stream), for `remove` to clear. None when the store
        cannot be listed (tried again at the next start)."""
        try:
            deleted = self._deletions()
        except OSError as error:
            log.warning("cannot list the deletions left unfinished in the store: %s", error)
            return []
        return [{"id": version.stream, "tier": None, "deleted": True} for version, whole in deleted if not whole]

    def forget_deletions(self) -> int:
        """Remove the tombstones of streams deleted more than `TOMBSTONE_SECONDS` ago whose deletion is whole (that
        last version alone is left, no save): a store that serves for months keeps no trace of the streams it
        deleted, and its listings do not grow with them. Until then a tombstone keeps a writer that stalled from
        bringing its stream back. How many were removed (0 when the store cannot be listed: tried again later)."""
        try:
            deleted = self._deletions()
        except OSError as error:
            log.warning("cannot list the deleted streams in the store: %s", error)
            return 0
        now, forgotten = self.clock(), 0
        for version in (version for version, whole in deleted if whole and now - version.at > TOMBSTONE_SECONDS):
            try:
                self.versions.forget(version)
            except OSError as error:
                log.warning("cannot remove the tombstone of stream %s deleted long ago: %s", version.stream, error)
                continue
            forgotten += 1
        return forgotten

    def _deletions(self) -> list[tuple[Version, bool]]:
        """Each deleted stream's last version, and whether its deletion is whole (that version alone is left, no
        save); an `OSError` when the store cannot be listed."""
        saved = {name.split("/")[1] for name in self.store.names(f"{SAVES}/")}
        kept = self.versions.counts()
        return [(version, stream_id not in saved and kept[stream_id] == 1)
                for stream_id, version in self.versions.every_current().items()
                if isinstance(version, Version) and version.deleted]

    def remove(self, stream_id: str) -> None:
        """Delete the stream (`begin_removal`, unless begun), then remove its saves, its older versions, its ask
        and hint."""
        tombstone = self.versions.current(stream_id)
        if tombstone is None or not tombstone.deleted:
            tombstone = self._commit(stream_id, "deleted", holder=None, epoch=None, record=None, state=None,
                                     note=None, deleted=True)
        self._forget(stream_id)
        self._prune_saves(stream_id, keep=None, token=None)
        self.versions.remove_all_but(tombstone)
        for name in (f"{ASKS}/{stream_id}.json", f"{HOLDERS}/{stream_id}.json"):
            with contextlib.suppress(OSError):
                self.store.remove(name)

    def write_note(self, note: dict[str, Any]) -> None:
        self._commit(note["id"], "noted", note=note)

    def remove_note(self, stream_id: str) -> None:
        self._commit(stream_id, "unnoted", note=None)

    def _commit(self, stream_id: str, event: str, **changes: Any) -> Version:
        """A new version of a stream this replica holds; `LeaseLost` (nothing written) once it holds it no more."""
        with self._lock(stream_id):
            lease = self.lease(stream_id)
            for _ in range(COMMIT_TRIES):
                current = self.versions.current(stream_id)
                if current is None or not current.held_by(self.holder, lease.token):
                    self._forget(stream_id)
                    raise LeaseLost(stream_id)
                self.check(stream_id)
                version = self.versions.commit(current, stream_id, event, **changes)
                if version is not None:
                    return version
        raise ServiceError(503, f"stream {stream_id} kept changing in the object store; retry",
                           headers={"Retry-After": "1"})

    # -- reading ----------------------------------------------------------------------------------------------
    def read_record(self, stream_id: str) -> dict[str, Any] | None:
        """One stream's record; None when there is none (or it cannot be read)."""
        try:
            record = self.record_or_error(stream_id)
        except FileNotFoundError:
            return None
        return None if isinstance(record, Exception) else record

    def record_or_error(self, stream_id: str) -> dict[str, Any] | Exception:
        """The stream's record, checked, or the error that kept it from being read (`FileNotFoundError` raised
        when it has none)."""
        return _checked(self._current(stream_id), stream_id)

    def records(self) -> list[tuple[str, dict[str, Any] | Exception]]:
        """Every stream's id with its record, checked (or why it cannot be used), in id order."""
        found = []
        for stream_id, version in self.versions.every_current().items():
            with contextlib.suppress(FileNotFoundError):
                found.append((stream_id, _checked(version, stream_id)))
        return found  # an unreadable version as its record's error: listed damaged, the others served

    def listing(self) -> list[tuple[str, Any, dict[str, Any] | None, str | None]]:
        """Every stream's (id, record or why it cannot be used, quarantine note, live holder), in id order, from
        one listing of the store."""
        found = []
        for stream_id, version in self.versions.every_current().items():
            try:
                record = _checked(version, stream_id)
            except FileNotFoundError:
                continue
            if not isinstance(version, Version):
                found.append((stream_id, record, None, None))
                continue
            holder = version.holder if version.holder is not None and self.session.live(
                version.holder, version.epoch) else None
            found.append((stream_id, record, version.note if isinstance(version.note, dict) else None, holder))
        return found

    def record_name(self, stream_id: str) -> str:
        return f"{STREAMS}/{stream_id}"

    def owner_named(self, stream_id: str) -> str | None:
        try:
            version = self._current(stream_id)
        except ServiceError:  # its version unreadable: no owner to name
            return None
        return readable_owner(version.record) if version is not None else None

    def owners(self) -> Counter:
        return Counter(record["owner"] for _, record in self.records() if isinstance(record, dict))

    def places(self) -> dict[str, str]:
        return {self.store.url + "/": ""}

    def has_state(self, stream_id: str) -> bool:
        version = self._current(stream_id)
        return version is not None and version.state is not None

    @contextlib.contextmanager
    def local_state(self, stream_id: str) -> Iterator[Path | None]:
        """The current save, downloaded to a local file to load (None when the stream was never saved)."""
        version = self._current(stream_id)
        if version is None or version.state is None:
            yield None
            return
        folder = Path(tempfile.mkdtemp(prefix="statekv-load-"))
        try:
            local = folder / f"{stream_id}.safetensors"
            try:
                self.store.download(version.state, local)
            except MissingObject as error:
                raise InputError(f"its save is not in the object store ({error})") from None
            except StoreError as error:  # the store failing, not the stream: a retry, never a quarantine
                raise ServiceError(503, f"stream {stream_id}'s save cannot be read from the object store now "
                                   f"({error}); retry", headers={"Retry-After": "1"}) from None
            try:
                yield local
            except Exception as error:
                named_as_saved(error, local)
                raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def files_of(self, stream_id: str) -> list[str]:
        """The names of a stream's objects in the store (for messages)."""
        return [name for prefix in (f"{STREAMS}/{stream_id}/", f"{SAVES}/{stream_id}/")
                for name in self.store.names(prefix)]

    def read_note(self, stream_id: str) -> dict[str, Any] | None:
        version = self._current(stream_id)
        return version.note if version is not None and isinstance(version.note, dict) else None

    def notes(self) -> dict[str, dict[str, Any]]:
        return {stream_id: version.note for stream_id, version in self.versions.every_current().items()
                if isinstance(version, Version) and isinstance(version.note, dict) and not version.deleted}

    def quarantined(self, stream_id: str) -> list[str]:
        return []  # file sets are each replica's own, never moved into the store

    def move_to_quarantine(self, stream_id: str, folder: Path) -> str:
        raise OSError("file sets are not moved into an object store")

    # -- helpers ----------------------------------------------------------------------------------------------
    def _current(self, stream_id: str) -> Version | None:
        version = self.versions.current(stream_id)
        return None if version is None or version.deleted else version

    def _keep(self, version: Version, lapsed: bool = False) -> Lease:
        lease = Lease(version.stream, self.holder, version.token, self.session.expires, lapsed=lapsed)
        self.held[version.stream] = lease
        self._epochs[version.stream] = version.epoch
        return lease

    def _forget(self, stream_id: str) -> None:
        self.held.pop(stream_id, None)
        self._epochs.pop(stream_id, None)

    @contextlib.contextmanager
    def _lock(self, stream_id: str) -> Iterator[None]:
        """One commit at a time per stream in this replica (re-entrant), its lock kept while a thread holds or waits
        for it: a replica serving for weeks keeps none of the streams long gone."""
        with self._guard:
            entry = self._writing.setdefault(stream_id, [threading.RLock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._writing[stream_id]

    def _asks_now(self) -> dict[str, dict]:
        """The asks to hand streams over that stand, read at most once a second."""
        with self._asking:
            read_at, asks = self._asks
            if time.monotonic() - read_at >= 1.0:
                asks = {}
                for name in self.store.names(f"{ASKS}/"):
                    data = self.store.read(name)
                    with contextlib.suppress(ValueError, TypeError):
                        ask = json.loads(data) if data is not None else None
                        if isinstance(ask, dict) and self.clock() - float(ask.get("at", 0)) < ASK_SECONDS:
                            asks[name.rsplit("/", 1)[-1].removesuffix(".json")] = ask
                self._asks = (time.monotonic(), asks)
            return asks

    def _hint(self, stream_id: str, holder: str | None) -> None:
        """Tell the routers who holds the stream (a failure only routes a request the long way)."""
        try:
            if holder is None:
                self.store.remove(f"{HOLDERS}/{stream_id}.json")
            else:
                self.store.put(f"{HOLDERS}/{stream_id}.json", json.dumps({"holder": holder}).encode())
        except OSError as error:
            log.warning("cannot note who holds stream %s for the routers: %s", stream_id, error)

    def _prune_saves(self, stream_id: str, keep: str | None, token: int | None) -> None:
        """Remove the stream's saves but ``keep`` made under ``token`` or an earlier one (None: every save, for a
        deleted stream), once the stream's newest version names ``keep``: a later holder's saves, and the save it
        took the stream from, are its own whatever this replica believes (a failure only leaves garbage)."""
        try:
            if keep is not None and getattr(self.versions.current(stream_id), "state", None) != keep:
                return
            for name in self.store.names(f"{SAVES}/{stream_id}/"):
                if name != keep and (token is None or _save_token(name) <= token):
                    self.store.remove(name)
        except (OSError, ServiceError) as error:
            log.warning("cannot remove old saves of stream %s: %s", stream_id, error)


def _save_token(name: str) -> float:
    """The fencing token a save was made under (``saves/ID/TOKEN-TIME.safetensors``); infinity for another name,
    which no pruning removes."""
    token = name.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(token) if token.isdigit() else math.inf


def _checked(version: Version | ServiceError | None, stream_id: str) -> dict[str, Any] | Exception:
    if isinstance(version, ServiceError):
        return ValueError(str(version))
    if version is None or version.deleted or version.record is None:
        raise FileNotFoundError(stream_id)
    try:
        return check_record(version.record, stream_id)
    except ValueError as error:
        return error


def holder_hint(store: ObjectStore, stream_id: str) -> str | None:
    """Who holds the stream, as its hint says (for a request router); None when none is noted."""
    try:
        data = store.read(f"{HOLDERS}/{stream_id}.json")
        holder = json.loads(data).get("holder") if data is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return holder if isinstance(holder, str) else None


class StoreKeyFile:
    """``keys.json`` in the object store: the digests of the keys made for it (as `auth.KeyFile` in a folder)."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def stored(self) -> list[dict]:
        try:
            data = self.store.read("keys.json")
        except StoreError as error:
            raise ConfigurationError(f"--store {self.store.url}: {error}") from None
        if data is None:
            return []
        try:
            keys = json.loads(data)["keys"]
            if not isinstance(keys, list):
                raise TypeError("keys is not a list")
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigurationError(f"keys.json in the object store {self.store.url} is unreadable "
                                     f"({type(error).__name__}); remove it to have a new key made, or pass "
                                     "--api-key") from None
        return [k for k in keys if isinstance(k, dict) and isinstance(k.get("owner"), str) and k["owner"]]

    def make(self) -> str | None:
        """Make a key and store its digest, unless a key was made for the store already: the new key, or None."""
        key = new_key()
        return key if self.keep(key) else None

    def keep(self, key: str) -> bool:
        """Store ``key``'s digest as the store's key, unless a key was made for it already: whether it was stored."""
        document = {"keys": [{"owner": owner_of(key), "made": int(time.time())}]}
        try:
            return self.store.create("keys.json", (json.dumps(document, indent=1) + "\n").encode())
        except StoreError as error:
            raise ConfigurationError(f"cannot make a key for the object store ({error}); pass --api-key") from None

    def withdraw(self, key: str) -> None:
        """Remove the store's key object if it holds ``key`` alone (a start that kept it was refused after)."""
        if [entry.get("owner") for entry in self.stored()] == [owner_of(key)]:
            self.store.remove("keys.json")
