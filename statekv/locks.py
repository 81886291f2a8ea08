"""One owner at a time: locks on the files a stream writes, and on a served state folder.

A live stream on the disk tier holds the lock of its file set (``lock`` in its folder) for as long as it lives,
and a stream being saved holds the lock of the ``.partial`` file it writes until it is renamed into place. A
second owner (another `Stream.load` of the same file set, in this process or another; a second save to the same
file at the same time) is refused with one line naming the holder: the process, its host and, for a file set,
the stream.

A lock may also be shared (`FileLock.acquire` with ``shared``): any number of shared holders at once, none while
an exclusive one is held (the replicas of a ``--ray`` deployment share a state folder that a lone server would
hold alone).

The locks are the operating system's (``flock``, per open file): they go away with their process, so a killed
stream never leaves a stale lock, and two opens in one process exclude each other as two processes do. Where
``fcntl`` does not exist (Windows) nothing is locked.

A lock is on the file its holder opened, not on a name: removing or replacing a lock file under a live holder
would let a second opener lock the new file beside it. So a folder's owner (`FolderLock`: a disk tier's file set)
locks the folder itself, which no file removed or replaced in it can break; and a holder checks before it writes
that its path still names what it locked (`FileLock.owns`), refusing to write where it no longer owns.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import weakref
from pathlib import Path

from .errors import OutputError, StateKVError, os_reason

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

MAX_HOLDER_CHARS = 300
# what flock answers on a file system that has no locks (it then locks nothing); any other failure is said
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
# what a lock that cannot be taken for want of a resource answers: the files are fine, and it is taken once there
# is room again (an `OutputError`, never the caller's error, which may say the files are damaged or held)
OUT_OF_ROOM = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT})


class FileLock:
    """A ``flock`` on ``path`` (exclusive, or shared), held until `release` (or until the object is collected, or
    its process ends)."""

    def __init__(self, path: Path, fd: int, remove: bool = False, locked: bool = True):
        self.path, self.fd, self.remove, self.locked = path, fd, remove, locked
        self._finalizer = weakref.finalize(self, os.close, fd) if fd >= 0 else None

    @classmethod
    def acquire(cls, path: str | os.PathLike, *, what: str, holder: str | None = None,
                error: type[StateKVError] = StateKVError,
                advice: str = "one stream has one owner: close it there first",
                remove: bool = False, shared: bool = False, holders: str | None = None,
                note: Path | None = None) -> "FileLock":
        """Lock ``path`` (created if missing), writing ``holder`` (who holds it) into it when given; ``error``
        naming ``what``, the holder (``holders`` when given, else the note in the file) and ``advice`` when another
        open holds it. ``remove``: the file is removed when the lock is released (a lock file of its own, not a
        file others read). ``shared``: a shared lock, refused only while an exclusive one is held (its holder
        writes no note). A file system without locks locks nothing. ``path`` may be a folder, locked itself;
        ``note``: the file its holder's note is read from when it is refused (a folder holds no note)."""
        path = Path(path)
        if fcntl is None:
            return cls(path, -1, False, locked=False)
        for _ in range(100):  # another owner may remove or replace the file between our open and our lock
            fd = _open(path, what, error)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                held = holders or describe_holder(path, None if note is not None else fd, note)
                os.close(fd)
                raise error(f"{what} is in use by {held}; {advice}") from None
            except OSError as failure:
                if failure.errno not in NO_LOCKS:
                    os.close(fd)
                    raise _refusal(what, failure, error) from None
                return cls(path, fd, remove, locked=False)  # a file system without locks (some network ones)
            if _same_file(path, fd):  # not replaced or removed between the open and the lock
                break
            os.close(fd)
        else:
            raise error(f"cannot lock {what}: it keeps being replaced")
        if holder is not None and not shared:
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            text = f"{holder} (process {os.getpid()} on {socket.gethostname()}, since {stamp})"[:MAX_HOLDER_CHARS]
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{text}\n".encode(), 0)
            except OSError:
                pass  # the lock holds without the note
        return cls(path, fd, remove)

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def owns(self) -> bool:
        """Whether the lock still holds what its path names: False once the file (or folder) locked was removed,
        replaced or moved away, and another opener could lock what the path names now. True where nothing is
        locked (no ``fcntl``, a file system without locks)."""
        return not self.locked or (self.held and _same_file(self.path, self.fd))

    def release(self) -> None:
        if self._finalizer is None or not self._finalizer.alive:
            return
        if self.remove and _same_file(self.path, self.fd):
            try:  # removed while held: whoever opened it meanwhile finds it gone once it locks, and retries
                self.path.unlink()
            except OSError:
                pass
        self._finalizer()  # closes the file: the lock goes with it


def describe_holder(path: Path, fd: int | None = None, note: Path | None = None) -> str:
    """Who holds the lock of ``path``: the note its holder wrote in it (or in ``note``, if that file is locked too:
    a note nobody holds may be anyone's), else the process the system names (Linux; this one, said so), else "another
    process"."""
    try:
        if fd is not None:
            note = os.pread(fd, MAX_HOLDER_CHARS, 0)
        elif note is not None:
            note = _held_note(Path(note))
        else:
            note = path.read_bytes()[:MAX_HOLDER_CHARS]
        note = note.decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):
        note = []
    if note and note[0].strip() and note[0].isprintable():
        return note[0].strip()
    pid = _locking_pid(path)
    if pid == os.getpid():  # flock refuses a second open of the same process too
        return f"process {pid} on {socket.gethostname()}: this process, from another of its threads"
    return f"process {pid} on {socket.gethostname()}" if pid is not None else "another process"


class FolderLock:
    """The one owner of a folder: the exclusive lock of the folder itself, held on its open descriptor, so no file
    removed or replaced in it can break it; and of its lock file ``name`` in it, which holds the holder's note (and
    is what a statekv before this one locked, so the two exclude each other too). `owns`: whether the folder's path
    still names the folder locked (not moved away, or replaced)."""

    def __init__(self, folder: FileLock, file: FileLock):
        self.folder, self.file = folder, file

    @classmethod
    def acquire(cls, folder: str | os.PathLike, *, what: str, holder: str | None = None,
                error: type[StateKVError] = StateKVError, name: str = "lock",
                advice: str = "one stream has one owner: close it there first") -> "FolderLock":
        """Lock ``folder`` (which must exist) for ``holder`` (its note, written into ``name``); ``error`` naming
        ``what`` and the holder when another open holds it."""
        folder = Path(folder)
        own = FileLock.acquire(folder, what=what, error=error, advice=advice, note=folder / name)
        try:
            file = FileLock.acquire(folder / name, what=what, holder=holder, error=error, advice=advice)
        except BaseException:
            own.release()
            raise
        return cls(own, file)

    @property
    def held(self) -> bool:
        return self.folder.held

    def owns(self) -> bool:
        return self.folder.owns()

    def release(self) -> None:
        self.file.release()
        self.folder.release()


def _held_note(path: Path) -> bytes:
    """The note in ``path`` if an exclusive lock holds the file, else nothing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, MAX_HOLDER_CHARS, 0)
        return b""  # nobody holds it: whatever it says is not the holder's word
    finally:
        os.close(fd)


def _open(path: Path, what: str, error: type[StateKVError]) -> int:
    if path.is_dir():
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as failure:
            raise _refusal(what, failure, error) from None
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as failure:
        problem = failure
    try:  # a read-only file (or folder) can still be locked
        return os.open(path, os.O_RDONLY)
    except OSError:
        raise _refusal(what, problem, error) from None


def _refusal(what: str, failure: OSError, error: type[StateKVError]) -> StateKVError:
    """Why the lock of ``what`` cannot be taken: an `OutputError` when a resource ran out (too many open files, naming
    the limit and ``ulimit -n``; a full disk), else ``error``."""
    if failure.errno not in OUT_OF_ROOM:
        return error(f"cannot lock {what}: {failure.strerror or failure}")
    return OutputError(f"cannot lock {what}: {os_reason(failure)}")


def _same_file(path: Path, fd: int) -> bool:
    try:
        given, opened = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (given.st_dev, given.st_ino) == (opened.st_dev, opened.st_ino)


def _locking_pid(path: Path) -> int | None:
    """The process holding an exclusive flock on ``path``, from /proc/locks (None where it cannot be told)."""
    try:
        info = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4].isdigit():
            return int(fields[4])
    return None
