"""The state folder's streams on disk: what `StreamRegistry` writes and reads back, nothing of the model.

Layout of ``--state-dir``: ``keys.json`` (`auth.KeyFile`), ``streams/ID.json`` (the stream's record: id, owner
digest, settings, what was last saved, its last answers), written atomically before the stream's creation is
answered, and ``streams/ID.safetensors``, the stream in the verified saved-stream format (`statekv.Stream.save`),
replaced atomically. Every write goes to a new file that is fsynced and renamed over the old one, so a kill at
any moment leaves either the old file or the new one. A record that cannot be read (`check_record`) is reported,
never removed: its stream is quarantined (`StreamRegistry.damaged`) and its files stay where they are.

``quarantine/`` holds what is known of the quarantined streams: ``quarantine/ID.json``, a note of why (its owner,
the reason; read by every server and replica sharing the folder), and ``quarantine/ID-TIME/``, a disk-tier file
set that could not be resumed, moved there whole (moved, never deleted: only `remove`, the stream's DELETE,
removes it).

``server.lock`` and ``replicas.lock``: a server alone holds both, exclusively, for its whole life
(`hold_state_folder`), its note naming it in each; the replicas of a ``--ray`` deployment, and the command that
started them, share ``replicas.lock`` for theirs (`join_state_folder`; leases order their writes). So a lone server
and a deployment never serve one folder at once, whichever starts first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, InputError, StateKVError
from ..flushing import flush_file, flush_folder, write_whole
from ..locks import FileLock
from ..settings.values import is_finite_number, is_stream_rate, printable, too_long

log = logging.getLogger("statekv.serve")

RECORD_FIELDS = ("id", "owner", "settings", "horizon_frames", "max_fps", "name", "created")
STREAM_ID = re.compile(r"^st_[0-9a-f]{24}$")
TIER_NAME = re.compile(r"^[\w-]{1,80}$")  # a disk-tier folder's name under offload_dir (no path; letters of any
# script: folders made before their names were kept to ASCII)
QUARANTINE = "quarantine"  # the state folder's subfolder of quarantine notes and moved file sets
UPLOADS = "uploads"  # the state folder's subfolder of the videos the page is feeding
REPLICA_UPLOADS = "replicas"  # its subfolder of each replica's (`statekv.serve.cluster.uploads`)
SERVER_LOCK = "server.lock"
REPLICAS_LOCK = "replicas.lock"
SAVE_PARTIAL = re.compile(r"\.safetensors\.[0-9a-f]{8}\.partial$")  # a saved stream's partial folder (Stream.save)
# the longest path a server writes under its state folder: a stream's save in its partial folder (`Stream.save`)
DEEPEST = f"streams/st_{'0' * 24}.safetensors.{'0' * 8}.partial/st_{'0' * 24}.safetensors"


def removable_tier(tier: str, offload_dir: str | os.PathLike | None) -> bool:
    """Whether the folder ``tier`` is a disk-tier file set a server with ``offload_dir`` made (one of its folders)."""
    folder = Path(tier)
    return (offload_dir is not None and TIER_NAME.fullmatch(folder.name) is not None
            and folder.parent.resolve() == Path(offload_dir).resolve())


def _removed_unheld(folder: Path) -> str | None:
    """Remove the disk-tier folder ``folder`` under its lock, as a DELETE does (`Placement.remove_files`); or
    leave it as it is when its lock cannot be taken (another process holds it): why, then."""
    if not folder.is_dir() or folder.is_symlink():  # gone, or a link: never followed (rmtree leaves it)
        return None
    from ..core.disk.files import hold  # the engine loads with the first stream, not with `statekv serve --help`

    try:
        lock = hold(folder, None)
    except InputError as error:
        return str(error)
    try:
        remove_folder(folder)
    except OSError as error:
        return f"its disk-tier folder {folder.name} cannot be removed whole: {error.strerror or error}"
    finally:
        lock.release()
    return None


def _copied_forced(source: str, target: str) -> str:
    """``shutil.copy2`` of ``source`` to ``target``, then ``target`` forced to the device."""
    shutil.copy2(source, target)
    try:
        flush_file(target)
    except PermissionError:  # a read-only file (its mode copied): Linux forces one opened for reading too
        handle = os.open(target, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
    return target


def remove_folder(folder: Path) -> None:
    """Remove ``folder`` and everything in it, as much of it as can go; the `OSError` that left a part of it is
    raised (a deletion then keeps its note, so the next start finishes it rather than forget what is left)."""
    try:
        shutil.rmtree(folder)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)  # the rest of it, past the file that would not go
        if os.path.lexists(folder):
            raise


def check_record(record: object, stream_id: str) -> dict[str, Any]:
    """A stream's record as read from ``streams/ID.json``, every field of the right kind; a one-line
    `ValueError` naming the first that is not."""
    if not isinstance(record, dict):
        raise ValueError(f"the record is {type(record).__name__}, not an object")
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        raise ValueError(f"no {missing[0]!r} field")
    checks = {
        "id": lambda v: v == stream_id,
        "owner": lambda v: isinstance(v, str) and 0 < len(v) <= 128,
        "settings": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
        "horizon_frames": lambda v: v is None or (not isinstance(v, bool) and isinstance(v, int) and 1 <= v <= 10**7),
        "max_fps": lambda v: v is None or is_stream_rate(v),
        "name": lambda v: isinstance(v, str) and len(v) <= 200,
        "created": is_finite_number,
        "saved": lambda v: isinstance(v, dict),
        "answers": lambda v: isinstance(v, list),
        "tier": lambda v: v is None or isinstance(v, str) and TIER_NAME.fullmatch(v) is not None,
        "engine": lambda v: isinstance(v, dict) and set(v) <= {"kv_cache_dtype"},
        "stopped": lambda v: isinstance(v, bool),
        "tier_saved": lambda v: isinstance(v, bool),
    }
    for name, check in checks.items():
        if name in record and not check(record[name]):
            shown = json.dumps(record[name])[:60] if name != "id" else f"{str(record[name])[:40]!r}, not {stream_id!r}"
            raise ValueError(f"its {name!r} field is malformed ({shown})")
    return record


def readable_owner(record: object) -> str | None:
    """The owner a damaged record still names, if it names one at all."""
    owner = record.get("owner") if isinstance(record, dict) else None
    return owner if isinstance(owner, str) and 0 < len(owner) <= 128 else None


def check_state_folder(state_dir: Path | str) -> None:
    """Refuse (one-line `ConfigurationError`) a state folder this server cannot list or write: not a folder,
    unreadable, read-only, full, its ``streams/`` not a folder, or so deep that the system would refuse the paths
    of the streams' saves in it as too long (every save would fail, its frames lost at the server's stop)."""
    folder = Path(state_dir)
    if (why := too_long(folder.absolute())) is not None:
        raise ConfigurationError(f"--state-dir {printable(state_dir)}: {why}")
    if (why := too_long(folder.absolute() / DEEPEST)) is not None:
        raise ConfigurationError(f"--state-dir {printable(state_dir)}: too deep for the streams' saves in it ({why} "
                                 f"with {DEEPEST}); give a folder of a shorter path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "streams").mkdir(exist_ok=True)
        list(os.scandir(folder / "streams"))
        probe = folder / "streams" / f".probe-{os.getpid()}.partial"
        try:
            handle = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(handle, b"statekv")
                os.fsync(handle)
            finally:
                os.close(handle)
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as error:
        where = error.filename if isinstance(error.filename, str) else folder
        raise ConfigurationError(f"--state-dir {printable(state_dir)}: cannot use it as the state folder "
                                 f"({error.strerror or type(error).__name__}: {printable(where)}); give a folder this "
                                 "server can read and write") from None


def hold_state_folder(state_dir: Path | str, holder: str) -> "FolderLocks":
    """The exclusive locks a server alone holds on its state folder (``server.lock``, ``replicas.lock``) for its
    whole life, taken before it writes anything there: a second server on the folder, or a ``--ray`` deployment
    serving it, is refused (one-line `ConfigurationError` naming the folder and the holder: the other server's
    note, its address, process and host) without writing anything. A folder never served is checked first
    (`check_state_folder`), so one that cannot be used says so as ever."""
    folder = Path(state_dir)
    if not (folder / SERVER_LOCK).exists():
        check_state_folder(folder)
    what = f"the state folder {printable(state_dir)}"
    server = FileLock.acquire(folder / SERVER_LOCK, what=what, holder=holder, error=ConfigurationError,
                              advice="one state folder has one server: stop that one, or give this one another "
                                     "--state-dir")
    try:
        replicas = FileLock.acquire(folder / REPLICAS_LOCK, what=what, holder=holder, error=ConfigurationError,
                                    holders="the replicas of a --ray deployment",
                                    advice="a folder served on Ray is served by its replicas alone: stop the "
                                           "deployment, or give this server another --state-dir")
    except BaseException:
        server.release()
        raise
    return FolderLocks((server, replicas))


def join_state_folder(state_dir: Path | str) -> "FolderLocks":
    """The shared lock (``replicas.lock``) a ``--ray`` deployment's replicas and the command that started them hold
    on the state folder for their whole life: refused, in one line naming the server, while a lone server holds
    the folder (`hold_state_folder`); any number of replicas share it."""
    folder = Path(state_dir)
    if not (folder / REPLICAS_LOCK).exists():
        check_state_folder(folder)
    return FolderLocks((FileLock.acquire(
        folder / REPLICAS_LOCK, what=f"the state folder {printable(state_dir)}", error=ConfigurationError, shared=True,
        advice="a folder served by one server is served by it alone: stop it, or give the deployment another "
               "--state-dir"),))


class FolderLocks:
    """The locks a server or a replica holds on its state folder, released together."""

    def __init__(self, locks: tuple[FileLock, ...]):
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


class StreamFiles:
    """The ``streams/`` folder of a state folder (created)."""

    def __init__(self, state_dir: Path | str):
        self.folder = Path(state_dir) / "streams"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.quarantine = Path(state_dir) / QUARANTINE
        self.where = "the state folder"  # in messages (never the server's path)

    def record_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.json"

    def removal_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.deleting"

    def state_path(self, stream_id: str) -> Path:
        return self.folder / f"{stream_id}.safetensors"

    def write_record(self, record: dict[str, Any]) -> None:
        write_atomic(self.record_path(record["id"]), json.dumps(record, indent=1).encode())

    def read_record(self, stream_id: str) -> dict[str, Any] | None:
        """One stream's record; None when there is none (or it cannot be read, or the stream is being deleted)."""
        if self.removal_path(stream_id).exists():
            return None
        try:
            return check_record(_parsed(self.record_path(stream_id).read_text()), stream_id)
        except (OSError, ValueError, RecursionError):
            return None

    def claim(self, stream_id: str) -> None:
        """Make a new stream's files this server's to write (one server alone owns its folder: nothing to do)."""

    def release(self, stream_id: str) -> None:
        """Let another server write the stream's files (one server alone: nothing to do)."""

    def withdraw(self, stream_id: str) -> None:
        """Forget a claim on a stream that was never made (its creation failed): nothing of it is kept."""

    def save_state(self, stream_id: str, write: Callable[[Path], Any]) -> None:
        """Save a stream's state: ``write(path)`` writes it (`statekv.Stream.save`, atomic itself)."""
        write(self.state_path(stream_id))

    def has_state(self, stream_id: str) -> bool:
        return self.state_path(stream_id).exists()

    def remove_state(self, stream_id: str) -> bool:
        """Remove the stream's whole save, once its record says its disk-tier file set holds every frame it took
        (``tier_saved``: the save is never read again), the removal flushed to the disk; whether there was one.
        An `OSError` when it cannot be removed (it stays, unread, until the stream's next save or start)."""
        path = self.state_path(stream_id)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            return False
        flush_folder(self.folder)
        return True

    @contextlib.contextmanager
    def local_state(self, stream_id: str) -> Iterator[Path | None]:
        """The saved state as a local file to load (None when the stream was never saved)."""
        path = self.state_path(stream_id)
        yield path if path.exists() else None

    def records(self) -> list[tuple[str, dict[str, Any] | Exception]]:
        """Every stream's id with its record, read (or the error that kept it from being read), in id order."""
        found: list[tuple[str, dict[str, Any] | Exception]] = []
        for path in sorted(self.folder.glob("st_*.json")):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile, or being deleted
                found.append((path.stem, self.record_or_error(path.stem)))
        return found

    def unrecorded_saves(self) -> list[str]:
        """The names of the saves in the folder that no record names (a record removed or lost by hand, a restore
        that left it out): never served, left as they are."""
        return [path.name for path in sorted(self.folder.glob("st_*.safetensors"))
                if STREAM_ID.match(path.stem) and not self.record_path(path.stem).exists()
                and not self.removal_path(path.stem).exists()]

    def record_or_error(self, stream_id: str) -> dict[str, Any] | Exception:
        """The stream's record, read, or the error that kept it from being read (`FileNotFoundError` raised when
        there is none, or the stream is being deleted)."""
        if self.removal_path(stream_id).exists():
            raise FileNotFoundError(stream_id)
        try:
            return check_record(_parsed(self.record_path(stream_id).read_text()), stream_id)
        except FileNotFoundError:
            raise
        except (OSError, ValueError, RecursionError) as error:
            return error if isinstance(error, ValueError) else ValueError(_reason(error))

    def record_name(self, stream_id: str) -> str:
        """The record's name, for messages."""
        return self.record_path(stream_id).name

    def owner_named(self, stream_id: str) -> str | None:
        """The owner a record names, when it names one even though it cannot be used (damaged)."""
        try:
            return readable_owner(json.loads(self.record_path(stream_id).read_text()))
        except (OSError, ValueError, RecursionError):
            return None

    def places(self) -> dict[str, str]:
        """The folder's paths as a message may not show them, each with what it shows instead."""
        return {str(self.folder.resolve()) + "/": "", str(self.folder) + "/": ""}

    def owners(self) -> Counter:
        """How many streams each owner digest holds, over the records that can be read."""
        return Counter(record["owner"] for _, record in self.records() if isinstance(record, dict))

    def files_of(self, stream_id: str) -> list[str]:
        """The names of a stream's files in the folder (its record, its save, what was set aside, what is in the
        quarantine, relative to the state folder), for messages."""
        names = sorted(path.name for path in self.folder.glob(f"{stream_id}.*") if not path.name.endswith(".partial"))
        return names + [f"{QUARANTINE}/{name}" for name in [*self.quarantined(stream_id), f"{stream_id}.json"]
                        if (self.quarantine / name).exists()]

    def begin_removal(self, stream_id: str, tier: Path | None) -> None:
        """Note that the stream is being deleted (``streams/ID.deleting``, naming its disk-tier folder ``tier``),
        before anything of it is removed: from then on it is never listed or loaded, and a deletion cut short
        (a kill, a crash) is finished at the next start (`removals`). An `OSError` when the folders its files are
        in cannot be changed (read-only, full, no permission): then nothing was changed."""
        for folder in [self.folder, *([self.quarantine] if self.quarantined(stream_id) else []),
                       *([tier.parent] if tier is not None and tier.exists() else [])]:
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), folder.name)
        note = {"id": stream_id, "tier": None if tier is None else str(tier.absolute()), "at": time.time()}
        write_atomic(self.removal_path(stream_id), json.dumps(note).encode())

    def removals(self) -> list[dict[str, Any]]:
        """The deletions begun and not finished (`begin_removal`): ``{"id", "tier"}`` each."""
        found = []
        for path in sorted(self.folder.glob("st_*.deleting")):
            if not STREAM_ID.match(path.stem):  # not a stream's: its name would reach other streams' files
                log.warning("%s in the state folder names no stream; left as it is", path.name[:120])
                continue
            try:
                note = json.loads(path.read_text())
                why = None if isinstance(note, dict) else f"a {type(note).__name__}, not an object"
            except FileNotFoundError:  # finished meanwhile
                continue
            except (OSError, ValueError, RecursionError) as error:
                note, why = None, _reason(error)
            if why is not None:  # its name alone says the deletion was begun: finished, as any other
                log.warning("%s in the state folder cannot be read (%s): the deletion it notes is finished without "
                            "the disk-tier folder it would name (if the stream had one, remove it by hand)",
                            path.name, why)
            tier = note.get("tier") if isinstance(note, dict) else None
            found.append({"id": path.stem, "tier": tier if isinstance(tier, str) else None})
        return found

    def finish_removals(self, offload_dir: str | os.PathLike | None) -> None:
        """Finish the deletions begun and cut short (`removals`), removing each one's disk-tier folder when it is
        one of ``offload_dir``'s (a note naming another folder is not followed there, and said)."""
        for removal in self.removals():
            try:
                if removal["tier"] and removable_tier(removal["tier"], offload_dir):
                    refused = _removed_unheld(Path(removal["tier"]))
                    if refused is not None:  # its files kept, the stream still never served
                        log.error("cannot finish deleting stream %s yet (%s); tried again at the next start",
                                  removal["id"], refused)
                        continue
                elif removal["tier"]:
                    log.warning("stream %s: its deletion note names %s, not a disk-tier folder under this server's "
                                "offload_dir; left as it is", removal["id"], removal["tier"][:200])
                self.remove(removal["id"])
                log.info("finished deleting stream %s", removal["id"])
            except (OSError, StateKVError) as error:  # still never served; tried again at the next start
                log.error("cannot finish deleting stream %s: %s", removal["id"], error)

    def remove(self, stream_id: str) -> None:
        """Remove every file of the stream in the folder: its quarantine note and moved file sets, then its save,
        what was set aside and what saves killed midway left, its record, and last the note that it is being
        deleted (a removal cut short is done again at the next start, `removals`)."""
        self.remove_quarantined(stream_id)
        record, removal = self.record_path(stream_id), self.removal_path(stream_id)
        for path in sorted(self.folder.glob(f"{stream_id}.*")):
            if path in (record, removal):
                continue
            if path.is_dir() and not path.is_symlink():  # a save's partial folder, left by a replica killed in it
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        removal.unlink(missing_ok=True)

    # -- the quarantine ---------------------------------------------------------------------------------------
    def note_path(self, stream_id: str) -> Path:
        return self.quarantine / f"{stream_id}.json"

    def write_note(self, note: dict[str, Any]) -> None:
        """Record why a stream is quarantined (``id``, ``owner``: None when none can be read, ``reason``, ``name``,
        ``created``), for every server sharing the folder."""
        self.quarantine.mkdir(exist_ok=True)
        write_atomic(self.note_path(note["id"]), json.dumps(note, indent=1).encode())

    def read_note(self, stream_id: str) -> dict[str, Any] | None:
        """The stream's quarantine note; None when it has none (or it cannot be read: it only says why)."""
        try:
            return check_note(json.loads(self.note_path(stream_id).read_text()), stream_id)
        except (OSError, ValueError, RecursionError):
            return None

    def notes(self) -> dict[str, dict[str, Any]]:
        """Every quarantine note that can be read, by stream id."""
        found = {}
        for path in sorted(self.quarantine.glob("st_*.json")):
            note = self.read_note(path.stem)
            if note is not None:
                found[path.stem] = note
        return found

    def remove_note(self, stream_id: str) -> None:
        """Forget why a stream was quarantined (it loads again)."""
        self.note_path(stream_id).unlink(missing_ok=True)

    def sweep_partials(self) -> None:
        """Remove what writes cut short left (a kill before a write's rename): the partial files of `write_atomic`
        (each write has its own) and the partial folders of saved streams (`statekv.Stream.save`); a moved file
        set's partial copy stays; and the videos the page was feeding when the server stopped (``uploads/``: a feed
        removes its own when it ends; ``uploads/replicas/``, those of replicas that served the folder before). Only
        for a server that holds the folder alone, as it starts."""
        uploads = self.folder.parent / UPLOADS
        for path in uploads.iterdir() if uploads.is_dir() and not uploads.is_symlink() else ():
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    log.warning("removed %s/%s, a video the page was feeding when the server stopped (the stream "
                                "keeps the frames it saved)", UPLOADS, path.name)
                elif path.name == REPLICA_UPLOADS and path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)  # no replica serves a folder a server holds alone
        for folder in (self.folder, self.quarantine):
            for path in folder.glob("*.partial") if folder.is_dir() else ():
                with contextlib.suppress(OSError):
                    if path.is_file():
                        path.unlink()
                    elif folder == self.folder and SAVE_PARTIAL.search(path.name) and not path.is_symlink():
                        shutil.rmtree(path)

    def quarantined(self, stream_id: str) -> list[str]:
        """The names of the stream's file sets moved into ``quarantine/``, oldest first."""
        if not self.quarantine.is_dir():
            return []
        found = [path for path in self.quarantine.glob(f"{stream_id}-*")
                 if path.is_dir() and not path.name.endswith(".partial")]
        return [path.name for path in sorted(found, key=lambda path: path.name)]

    def move_to_quarantine(self, stream_id: str, folder: Path) -> str:
        """Move a stream's disk-tier file set ``folder`` whole into ``quarantine/ID-TIME/`` (renamed; on another
        file system copied whole, then the original removed); returns where, relative to the state folder. An
        `OSError` leaves the folder where it was. A rename the device would not take for sure (its folders' flush
        failed) is logged, not raised: it is done, and a power loss undoing it leaves the folder where it was, for
        the next start to find again."""
        self.quarantine.mkdir(exist_ok=True)
        target = self.quarantine / f"{stream_id}-{int(time.time())}"
        while target.exists() or target.with_name(target.name + ".partial").exists():
            target = target.with_name(f"{target.name}-1")
        try:
            os.rename(folder, target)
        except OSError as error:
            if error.errno != errno.EXDEV:
                raise
            partial = target.with_name(target.name + ".partial")  # never taken for a moved file set
            try:
                shutil.copytree(folder, partial, symlinks=True, copy_function=_copied_forced)
                for inner, _, _ in os.walk(partial):
                    flush_folder(inner, strict=True)
                os.rename(partial, target)
                flush_folder(self.quarantine, strict=True)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)  # the copy, not the original
                raise
            # the copy is whole and on the device (a power loss cannot leave it zero-filled with the original gone):
            # whatever is left of the original is spare
            shutil.rmtree(folder, ignore_errors=True)
        try:
            for parent in {self.quarantine, folder.parent}:
                flush_folder(parent)
        except OSError as error:
            log.warning("stream %s's file set was moved into the quarantine, but the move could not be forced to "
                        "the device (%s): a power loss may move it back", stream_id, error.strerror or error)
        return f"{QUARANTINE}/{target.name}"

    def remove_quarantined(self, stream_id: str) -> None:
        """Remove the stream's moved file sets and its quarantine note; an `OSError` when a file set cannot be
        removed whole (the note then stays)."""
        if not self.quarantine.is_dir():
            return
        for path in self.quarantine.glob(f"{stream_id}-*"):
            remove_folder(path)
        self.note_path(stream_id).unlink(missing_ok=True)

    def set_aside(self, stream_id: str) -> str:
        """Rename a stream's unreadable state file out of the way; returns its new name."""
        state = self.state_path(stream_id)
        aside = state.with_name(f"{state.name}.unreadable-{int(time.time())}")
        os.replace(state, aside)
        return aside.name


def check_note(note: object, stream_id: str) -> dict[str, Any]:
    """A quarantine note as read from ``quarantine/ID.json``; a `ValueError` when it is not one of ``stream_id``."""
    if not isinstance(note, dict) or note.get("id") != stream_id:
        raise ValueError("not a quarantine note of this stream")
    owner, reason = note.get("owner"), note.get("reason")
    if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= 128):
        raise ValueError("its owner is malformed")
    if not isinstance(reason, str) or not reason:
        raise ValueError("its reason is malformed")
    return note


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(f"not JSON ({str(error).splitlines()[0]})") from None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError):
        return f"cannot be read: {error.strerror or type(error).__name__}"
    if isinstance(error, RecursionError):
        return "nested too deeply to read"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: nothing is left beside it when the write fails (a full disk). Each write
    has a partial file of its own, so two at once never rename each other's."""
    write_whole(path, data, partial=path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial"))
