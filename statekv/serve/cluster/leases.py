"""Leases on streams in the shared state folder: which replica holds a stream, until when, and its fencing token.

``STATE/leases/ID`` holds one stream's lease: ``{"stream", "holder", "token", "expires", "handoff"}``. A replica
writes a stream's files only while it holds the stream's lease, and every write is committed under the lease
file's lock after checking that the lease still carries the writer's token (`Leases.fenced`). A replica takes a
stream only when its lease has expired or was let go, and each taking raises the token by one; so a replica that
stalled past its lease (while its death was being detected, say) finds its token gone and writes nothing: two
replicas never both write a stream. ``STATE/leases/ID.history`` keeps one line per taking and letting go (the last
`HISTORY_LINES`), each forced to the device before the lease it tells of is written (a taking) or once it is (a
letting go): after a power loss it still names every taking whose lease the folder holds.

The lock is a POSIX lock (`fcntl.lockf`) on the lease file itself, which NFS and the usual shared filesystems
honour across machines; within one process a thread lock per lease file stands in for it (POSIX locks do not exclude
a process's own threads). The lease decides which replica may open a stream; an exclusive lock on the stream's
own files, where the library takes one, is the last line of defence behind it. Expiry compares wall clocks, so
the machines' clocks must agree to well within ``seconds`` (NTP does).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...flushing import durable_end, flush_folder, write_whole
from ..errors import ServiceError

LEASES = "leases"
LEASE_SECONDS = 10.0
LEASE_BYTES = 512  # a lease is written whole, in one write of this size, over the one before
LOCK_WAIT_SECONDS = 10.0
HISTORY_LINES = 1000  # a stream's history keeps its last takings and lettings go, about 100 KB of them
HISTORY_BYTES = 2 * HISTORY_LINES * 160  # past this size the history is cut to its last lines (at most half of it)
THREAD_LOCKS: dict[str, list] = {}  # lease file -> [its thread lock, the threads holding or waiting for it]
THREAD_LOCKS_GUARD = threading.Lock()


class LeaseLost(ServiceError):
    """The stream is no longer this replica's (another took it over): the client retries and reaches the holder."""

    def __init__(self, stream_id: str):
        super().__init__(503, f"stream {stream_id} moved to another replica; retry", headers={"Retry-After": "1"})


@dataclass(frozen=True)
class Lease:
    """A stream held by ``holder`` (a replica's id) until ``expires`` (unix time), under fencing ``token``;
    ``handoff``: a replica that asked for the stream (the holder saves it and lets it go); ``lapsed``: it was
    taken after its previous holder's lease ran out rather than being let go (frames pushed there since its
    last save are lost)."""

    stream: str
    holder: str
    token: int
    expires: float
    handoff: str | None = None
    lapsed: bool = field(default=False, compare=False)  # taken from a holder that did not let go (not written)

    def live(self, now: float) -> bool:
        return self.expires > now


class Leases:
    """The leases of the state folder ``state_dir``, as seen by ``holder`` (a replica's id; None: read only)."""

    def __init__(self, state_dir: Path | str, holder: str | None = None, seconds: float = LEASE_SECONDS,
                 clock: Callable[[], float] = time.time):
        self.folder = Path(state_dir) / LEASES
        self.holder, self.seconds, self.clock = holder, seconds, clock
        if holder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, stream_id: str) -> Path:
        return self.folder / stream_id

    # -- reading ----------------------------------------------------------------------------------------------
    def read(self, stream_id: str) -> Lease | None:
        """The stream's lease as last written, read without the lock: for a process that takes no lease (a
        router), since closing a file lets go of the POSIX locks its process holds on it. None when there is
        none or it cannot be read."""
        try:
            return _parse(self.path(stream_id).read_bytes())
        except OSError:
            return None

    def peek(self, stream_id: str) -> Lease | None:
        """The stream's lease, read under the lock (how a replica reads one); None when there is none."""
        with self._locked(stream_id, create=False) as handle:
            return None if handle is None else _current(handle, stream_id)

    def holder_of(self, stream_id: str) -> str | None:
        """The replica holding a live lease on the stream, if any."""
        lease = self.read(stream_id)
        return lease.holder if lease is not None and lease.live(self.clock()) else None

    # -- changing (under the lease file's lock) ---------------------------------------------------------------
    def acquire(self, stream_id: str) -> Lease | None:
        """Take the stream: a new lease with the next token when none is live (or this holder's own has lapsed);
        this holder's live lease renewed as it is; None when another replica holds a live lease."""
        with self._locked(stream_id) as handle:
            current, now = _current(handle, stream_id), self.clock()
            if current is not None and current.live(now):
                if current.holder != self.holder:
                    return None
                lease = replace(current, expires=now + self.seconds, handoff=None)
            else:
                lease = Lease(stream_id, self.holder, (current.token if current else 0) + 1, now + self.seconds,
                              lapsed=current is not None and current.expires > 0)
                self._note(stream_id, "taken", lease, current)
            _write(handle, lease)
            return lease

    def renew(self, lease: Lease, *, extend: bool = True) -> Lease | None:
        """The lease as it stands (``handoff`` included), extended unless ``extend`` is False; None when its
        token has moved on (the stream was taken over)."""
        with self._locked(lease.stream, create=False) as handle:
            current = None if handle is None else _current(handle, lease.stream)
            if not self._ours(current, lease):
                return None
            if extend:
                current = replace(current, expires=self.clock() + self.seconds)
                _write(handle, current)
            return current

    def release(self, lease: Lease) -> None:
        """Let the stream go now (it stays on disk; whoever takes it next gets the next token)."""
        with self._locked(lease.stream, create=False) as handle:
            current = None if handle is None else _current(handle, lease.stream)
            if self._ours(current, lease):
                released = replace(current, expires=0.0, handoff=None)
                _write(handle, released)
                self._note(lease.stream, "let go", released)

    def ask_handoff(self, stream_id: str) -> None:
        """Ask the replica holding the stream to save it and let it go (it does at its next lease check)."""
        with self._locked(stream_id, create=False) as handle:
            current = None if handle is None else _current(handle, stream_id)
            if current is not None and current.live(self.clock()) and current.holder != self.holder \
                    and current.handoff is None:
                _write(handle, replace(current, handoff=self.holder))

    @contextlib.contextmanager
    def fenced(self, lease: Lease) -> Iterator[None]:
        """Hold the lease file's lock while the caller commits a write (a rename); `LeaseLost` when the lease no
        longer carries ``lease``'s token, so nothing is written."""
        with self._locked(lease.stream, create=False) as handle:
            if handle is None or not self._ours(_current(handle, lease.stream), lease):
                raise LeaseLost(lease.stream)
            yield

    def forget(self, lease: Lease) -> None:
        """Remove a deleted stream's lease (fenced: only its holder may)."""
        with self._locked(lease.stream, create=False) as handle:
            if handle is None or not self._ours(_current(handle, lease.stream), lease):
                raise LeaseLost(lease.stream)
            _write(handle, replace(lease, expires=0.0, handoff=None), deleted=True)
            self.path(lease.stream).unlink(missing_ok=True)
            _remove_history(self.path(lease.stream))

    def withdraw(self, stream_id: str) -> None:
        """Remove the lease file and history of a stream this holder failed to make, whatever they hold (a lease
        half taken, or none), unless another holder's lease is there."""
        with self._locked(stream_id, create=False) as handle:
            if handle is not None:
                with contextlib.suppress(ServiceError):  # unreadable: what this holder's failed taking left
                    current = _current(handle, stream_id)
                    if current is not None and current.holder != self.holder:
                        return
                self.path(stream_id).unlink(missing_ok=True)
            _remove_history(self.path(stream_id))

    def history(self, stream_id: str) -> list[dict]:
        """Every taking and letting go of the stream (the last `HISTORY_LINES`), oldest first."""
        try:
            data = self.path(stream_id).with_suffix(".history").read_bytes()
        except OSError:
            return []
        # a line a power loss or a full disk cut short (or zero-filled) is not one: the next note cuts it
        lines = data[:durable_end(data)].decode(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    # -- the lock ---------------------------------------------------------------------------------------------
    def _ours(self, current: Lease | None, lease: Lease) -> bool:
        return current is not None and current.token == lease.token and current.holder == self.holder

    @contextlib.contextmanager
    def _thread_lock(self, stream_id: str) -> Iterator[None]:
        # one per lease file in the process, whichever `Leases` asks: POSIX locks do not exclude a process's own
        # threads, and two replicas may share a process (tests, a router beside a replica); kept while a thread
        # holds or waits for it, so a process serving streams for weeks keeps none of those long gone
        key = str(self.path(stream_id).absolute())
        with THREAD_LOCKS_GUARD:
            entry = THREAD_LOCKS.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with THREAD_LOCKS_GUARD:
                entry[1] -= 1
                if not entry[1]:
                    del THREAD_LOCKS[key]

    @contextlib.contextmanager
    def _locked(self, stream_id: str, create: bool = True) -> Iterator[int | None]:
        """The stream's lease file, open and locked (made if missing; with ``create`` False, None when missing:
        changing a lease never makes an empty file for a stream deleted or withdrawn)."""
        if self.holder is None:
            raise RuntimeError("a read-only Leases cannot change a lease")
        with self._thread_lock(stream_id):
            try:
                handle = os.open(self.path(stream_id), os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            except FileNotFoundError:
                if create:
                    raise
                yield None
                return
            try:
                deadline = time.monotonic() + LOCK_WAIT_SECONDS
                while True:
                    try:
                        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as error:
                        if error.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() > deadline:
                            raise ServiceError(503, f"the shared state folder kept stream {stream_id}'s lease "
                                               "locked; retry shortly", headers={"Retry-After": "2"}) from None
                        time.sleep(0.01)
                yield handle  # closing the file (below) lets the lock go
            finally:
                os.close(handle)

    def _note(self, stream_id: str, event: str, lease: Lease, before: Lease | None = None) -> None:
        line = {"event": event, "holder": lease.holder, "token": lease.token, "at": self.clock()}
        if before is not None:
            line["before"] = {"holder": before.holder, "token": before.token, "expires": before.expires}
        path = self.path(stream_id).with_suffix(".history")
        made = _whole_lines(path)
        with open(path, "a") as history:
            history.write(json.dumps(line) + "\n")
            history.flush()
            os.fsync(history.fileno())
            long = history.tell() > HISTORY_BYTES
        if made:  # its name on the device too, before the lease it tells of
            flush_folder(self.folder)
        if long:  # under the lease's lock: no other writer
            lines = path.read_text().splitlines(keepends=True)[-HISTORY_LINES:]
            size = 0
            for first in range(len(lines) - 1, -1, -1):  # at most half the cap: cut again only after as much again
                size += len(lines[first])
                if size > HISTORY_BYTES // 2:
                    lines = lines[first + 1:]
                    break
            write_whole(path, "".join(lines).encode(), partial=path.with_suffix(".history.kept"))


def _whole_lines(history: Path) -> bool:
    """Cut ``history``'s end past its last whole line (a power loss, a full disk), so the next line starts on one
    of its own; whether there is no such file yet."""
    try:
        data = history.read_bytes()
    except FileNotFoundError:
        return True
    end = durable_end(data)
    if end < len(data):
        os.truncate(history, end)
    return False


def _remove_history(lease_file: Path) -> None:
    """Remove a stream's history, and the cut history a crash may have left beside it."""
    for suffix in (".history", ".history.kept"):
        lease_file.with_suffix(suffix).unlink(missing_ok=True)


def _current(handle: int, stream_id: str) -> Lease | None:
    """The lease in an open, locked lease file: None when there is none yet (or its stream was deleted); a
    503 when it cannot be read, rather than a fresh lease that would reuse a token."""
    data = os.pread(handle, LEASE_BYTES, 0)
    lease = _parse(data)
    if lease is None and data.strip(b"\x00 \n") and b'"deleted"' not in data:
        raise ServiceError(503, f"stream {stream_id}'s lease in the shared state folder is unreadable")
    return lease


def _parse(data: bytes) -> Lease | None:
    try:
        fields = json.loads(data.rstrip(b"\x00 \n") or b"null")
        if not isinstance(fields, dict) or fields.get("deleted"):
            return None
        return Lease(str(fields["stream"]), str(fields["holder"]), int(fields["token"]), float(fields["expires"]),
                     fields.get("handoff"))
    except (ValueError, KeyError, TypeError):
        return None


def _write(handle: int, lease: Lease, *, deleted: bool = False) -> None:
    fields = {name: value for name, value in asdict(lease).items() if name != "lapsed"}
    data = json.dumps({**fields, **({"deleted": True} if deleted else {})}).encode()
    os.pwrite(handle, data.ljust(LEASE_BYTES), 0)  # one write of a fixed size: never a torn or shorter lease
    os.fsync(handle)
