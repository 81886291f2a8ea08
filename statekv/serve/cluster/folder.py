"""A replica's files in the shared state folder (`SharedStreamFiles`): only those of streams whose lease it holds,
each write made beside the file and renamed over it under the lease's fencing (`Leases.fenced`).

Saved streams can live in object storage instead of the folder (``store``: an fsspec URL such as
``s3://bucket/statekv``): each save is a new object named by the stream, its lease's token and a sequence number,
and the stream's pointer in the folder (``streams/ID.state``, fenced like every write there) names the current
one, so an object written by a replica that lost its lease is never read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import InputError, StateKVError
from ...flushing import flush_file, write_flushed
from ..errors import ServiceError
from ..store import StreamFiles
from .leases import Lease, LeaseLost, Leases
from .objects import MissingObject, ObjectStore, StoreError

log = logging.getLogger("statekv.serve")

RENEW_FRACTION = 1 / 3  # a lease is renewed once this much of it is gone
CLOCK_MARGIN_SECONDS = 1.0  # how far apart the replicas' clocks may be
KILLED_SAVE = re.compile(r"\.[^/]+\.partial(\.[0-9a-f]{8}\.partial|\.lock)?")  # after a saved stream's name


def named_as_saved(error: BaseException, local: Path) -> None:
    """``error``, raised by the load of a save downloaded to ``local``, naming the save by its file's name rather
    than by the server's temporary copy (its reason is noted in the shared state and answered to clients)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (error.args[0].replace(str(local), local.name), *error.args[1:])


def _remove_killed_saves(final: Path) -> None:
    """Remove what saves of ``final`` cut short by a replica's death left (the save's partial file, the folder
    `statekv.Stream.save` writes it in, its lock file): called under the stream's lease, whose holder saves one at
    a time, so none is a live save's but a replica's that lost the lease, whose rename is refused anyway."""
    for path in final.parent.glob(f"{glob.escape(final.name)}.*"):
        if not KILLED_SAVE.fullmatch(path.name[len(final.name):]):
            continue
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


class SharedStreamFiles(StreamFiles):
    """The state folder's stream files as one replica (``leases.holder``) may write them: a stream's only while
    it holds the stream's lease, each write made beside the file and renamed over it under `Leases.fenced`."""

    def __init__(self, state_dir: Path | str, leases: Leases, store: str | None = None):
        super().__init__(state_dir)
        self.leases = leases
        self.held: dict[str, Lease] = {}
        self._valid: dict[str, float] = {}  # stream -> monotonic time until which its lease is surely ours
        self.store = SavesInStore(store) if store else None

    @property
    def holder(self) -> str:
        return self.leases.holder

    @property
    def lease_seconds(self) -> float:
        return self.leases.seconds

    def holder_of(self, stream_id: str) -> str | None:
        """The replica holding a live lease on the stream, if any (read under the lease file's lock)."""
        lease = self.leases.peek(stream_id)
        return lease.holder if lease is not None and lease.live(self.leases.clock()) else None

    def listing(self) -> list[tuple[str, Any, dict[str, Any] | None, str | None]]:
        """Every stream's (id, record or why it cannot be used, quarantine note, live holder), in id order."""
        notes = self.notes()
        return [(stream_id, record, notes.get(stream_id),
                 None if isinstance(record, Exception) else self.holder_of(stream_id))
                for stream_id, record in self.records()]

    def ask_handoff(self, stream_id: str) -> None:
        """Ask the replica holding the stream to save it and let it go."""
        self.leases.ask_handoff(stream_id)

    def end(self) -> None:
        """At shutdown, once every stream is let go (each lease ends on its own: nothing more)."""

    # -- leases -----------------------------------------------------------------------------------------------
    def take(self, stream_id: str) -> Lease | None:
        """Acquire the stream's lease; None when another replica holds a live one."""
        started = time.monotonic()
        lease = self.leases.acquire(stream_id)
        if lease is not None:
            self._keep(lease, started)
        return lease

    def claim(self, stream_id: str) -> None:
        if not self.take(stream_id):
            raise ServiceError(409, f"stream id {stream_id} is taken; retry")

    def renew(self, stream_id: str) -> Lease | None:
        """The stream's lease, renewed once a third of it is gone; None when it was lost (taken over)."""
        lease = self.held.get(stream_id)
        if lease is None:
            return None
        started = time.monotonic()
        left = self.leases.seconds * (1 - RENEW_FRACTION)
        # due by either clock: the wall clock stepped back leaves the lease's expiry far off by it, while this
        # replica's own hold on it (monotonic) runs out all the same
        due = lease.expires - self.leases.clock() < left or self._valid.get(stream_id, 0.0) - started < left
        current = self.leases.renew(lease, extend=due)
        if current is None:
            self.held.pop(stream_id, None)
            self._valid.pop(stream_id, None)
            return None
        if due:
            self._keep(current, started)
        else:
            self.held[stream_id] = current
        return current

    def release(self, stream_id: str) -> None:
        lease = self.held.pop(stream_id, None)
        self._valid.pop(stream_id, None)
        if lease is not None:
            self.leases.release(lease)

    def withdraw(self, stream_id: str) -> None:
        """Remove the lease of a stream whose creation failed, rather than keep it for a next holder (a lease that
        cannot be removed either stays, let go when it was taken)."""
        self.held.pop(stream_id, None)
        self._valid.pop(stream_id, None)
        with contextlib.suppress(OSError, StateKVError):
            self.leases.withdraw(stream_id)

    def check(self, stream_id: str) -> None:
        """`LeaseLost` unless this replica surely still holds the stream (its lease renewed in time)."""
        if time.monotonic() >= self._valid.get(stream_id, 0.0):
            raise LeaseLost(stream_id)

    def lease(self, stream_id: str) -> Lease:
        try:
            return self.held[stream_id]
        except KeyError:
            raise LeaseLost(stream_id) from None

    def _keep(self, lease: Lease, asked: float) -> None:
        self.held[lease.stream] = lease
        # timed from before the lease was written, less a margin for the machines' clocks: never later than
        # the moment another replica may take the stream
        self._valid[lease.stream] = asked + self.leases.seconds - min(CLOCK_MARGIN_SECONDS, self.leases.seconds / 10)

    # -- writing ----------------------------------------------------------------------------------------------
    def write_record(self, record: dict[str, Any]) -> None:
        lease = self.lease(record["id"])
        document = {**record, "lease": {"holder": lease.holder, "token": lease.token}}
        self._commit(lease, self.record_path(record["id"]), json.dumps(document, indent=1).encode())

    def save_state(self, stream_id: str, write: Callable[[Path], Any]) -> None:
        lease = self.lease(stream_id)
        final = self.state_path(stream_id)
        partial = final.with_name(f"{final.name}.{self.holder}.partial")
        try:
            _remove_killed_saves(final)
            write(partial)
            flush_file(partial)
            if self.store is None:
                with self.leases.fenced(lease):
                    os.replace(partial, final)
                return
            name = self.store.put(partial, stream_id, lease.token)
            self._commit(lease, self.pointer_path(stream_id), json.dumps({"object": name}).encode())
            if self._pointed(stream_id) == name:  # else another replica took the stream since: its saves are its own
                self.store.prune(stream_id, keep=name, token=lease.token)
        finally:
            partial.unlink(missing_ok=True)

    def remove(self, stream_id: str) -> None:
        lease = self.lease(stream_id)
        with self.leases.fenced(lease):
            super().remove(stream_id)  # its record, its save or pointer, what was set aside, its quarantine
        if self.store is not None:
            self.store.prune(stream_id, keep=None, token=None)
        self.leases.forget(lease)
        self.held.pop(stream_id, None)
        self._valid.pop(stream_id, None)

    def forget_deletions(self) -> int:
        """Nothing: a stream deleted from a shared folder leaves nothing behind (its lease goes with it)."""
        return 0

    def begin_removal(self, stream_id: str, tier: Path | None) -> None:
        with self.leases.fenced(self.lease(stream_id)):
            super().begin_removal(stream_id, tier)

    def set_aside(self, stream_id: str) -> str:
        lease = self.lease(stream_id)
        with self.leases.fenced(lease):
            if self.store is None:
                return super().set_aside(stream_id)
            pointer = self.pointer_path(stream_id)
            aside = pointer.with_name(f"{pointer.name}.unreadable-{int(time.time())}")
            os.replace(pointer, aside)
            return aside.name

    def write_note(self, note: dict[str, Any]) -> None:
        self.quarantine.mkdir(exist_ok=True)
        self._commit(self.lease(note["id"]), self.note_path(note["id"]), json.dumps(note, indent=1).encode())

    def remove_note(self, stream_id: str) -> None:
        with self.leases.fenced(self.lease(stream_id)):
            super().remove_note(stream_id)

    def _commit(self, lease: Lease, path: Path, data: bytes) -> None:
        partial = path.with_name(f"{path.name}.{self.holder}.{secrets.token_hex(4)}.partial")
        try:
            write_flushed(partial, data)
            with self.leases.fenced(lease):
                os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    # -- reading ----------------------------------------------------------------------------------------------
    def pointer_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.state"

    def has_state(self, stream_id: str) -> bool:
        return (self.pointer_path(stream_id) if self.store else self.state_path(stream_id)).exists()

    def _pointed(self, stream_id: str) -> str | None:
        """The object the stream's pointer names now (None: none, or unreadable)."""
        try:
            return json.loads(self.pointer_path(stream_id).read_text())["object"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @contextlib.contextmanager
    def local_state(self, stream_id: str) -> Iterator[Path | None]:
        if self.store is None:
            with super().local_state(stream_id) as path:
                yield path
            return
        try:
            name = json.loads(self.pointer_path(stream_id).read_text())["object"]
        except FileNotFoundError:
            yield None
            return
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InputError(f"{stream_id}: its pointer to object storage is unreadable ({error})") from None
        folder = Path(tempfile.mkdtemp(prefix="statekv-load-"))
        try:
            local = folder / f"{stream_id}.safetensors"
            self.store.get(name, local)
            try:
                yield local
            except Exception as error:
                named_as_saved(error, local)
                raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class SavesInStore:
    """Saved streams in an object store (`objects.ObjectStore`) beside a shared state folder: each save a new object
    named by the stream, its lease's token and a sequence number."""

    def __init__(self, url: str):
        self.objects = ObjectStore(url)
        self._sequence = time.time_ns()

    def put(self, local: Path, stream_id: str, token: int) -> str:
        """Upload a saved stream as a new object; returns its name."""
        self._sequence += 1
        name = f"{stream_id}.{token}.{self._sequence}.safetensors"
        self.objects.upload(local, name)
        return name

    def get(self, name: str, local: Path) -> None:
        root = self.objects.root + "/"
        name = name[len(root):] if name.startswith(root) else name  # a pointer written as the whole path
        try:
            self.objects.download(name, local)
        except MissingObject as error:
            raise InputError(f"its save is not in the object store ({error})") from None
        except StoreError as error:  # the store failing, not the stream: a retry, never a quarantine
            raise ServiceError(503, f"the save cannot be read from the object store now ({error}); retry",
                               headers={"Retry-After": "1"}) from None

    def prune(self, stream_id: str, keep: str | None, token: int | None) -> None:
        """Remove the stream's other objects made under ``token`` or an earlier one (all of them with ``token``
        None): a later holder's are its own; a failure only leaves garbage."""
        try:
            for name in self.objects.names("", f"{stream_id}."):
                made = name.removeprefix(f"{stream_id}.").split(".", 1)[0]
                if name.endswith(".safetensors") and name != keep and \
                        (token is None or (made.isdigit() and int(made) <= token)):
                    self.objects.remove(name)
        except OSError as error:
            log.warning("cannot prune old objects of stream %s in %s: %s", stream_id, self.objects.url, error)


