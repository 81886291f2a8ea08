"""Bringing a recorded stream back (`StreamLoader`): from its disk-tier file set when its record names one, else
from its last save, else empty (a simplestream stream, whose frames are never saved, going on from its record's
counts); a file that cannot be loaded, or names another stream or owner, raises, so the stream is quarantined
(`DamagedStream`) with a one-line reason that names no server path and no other stream."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

from ..api.stream import Stream
from ..core.disk.files import hold
from ..errors import ForeignFilesError, InputError, OtherSetupError, OutputError, StateKVError
from ..settings.values import is_finite_number
from ..user_cache import secret_path
from .answer_notes import recalled
from .entries import ANSWERS, DamagedStream, Quarantined, StreamEntry, lost_at_start
from .errors import public_message, reason_of
from .page_record import recall_page
from .stream_settings import StreamSettings
from .watches import kept_runs, new_run, recall, with_saved_events

log = logging.getLogger("statekv.serve")


class StreamLoader:
    """Loads the streams recorded in ``files`` with the models of ``settings``. ``resume_tiers``: resume a stream
    in the disk-tier file set its record names (False where file sets are each replica's own: from the save)."""

    def __init__(self, files: Any, settings: StreamSettings, resume_tiers: bool = True):
        self.files, self.settings, self.resume_tiers = files, settings, resume_tiers

    def load(self, data: dict[str, Any], *, healing: bool = False) -> StreamEntry:
        """Load one recorded stream: from its disk-tier file set when it has one (the same folder again, every
        push it journaled), else from its last save, else empty when it was never saved. A file that cannot be
        loaded, or names another stream or owner, raises (the stream is quarantined), as does a stream whose
        file set was moved into the quarantine (`Quarantined`); a quarantine note left from an earlier failure is
        removed once it loads. ``healing``: a served stream brought back in place (`StreamRegistry.heal`): from its
        own file set only, whatever ``resume_tiers`` says (one that is not there raises `Quarantined`, never a
        fallback to its save or an empty stream); one that cannot be written now (an `OutputError`: a full disk)
        raises that, the file set left where it is."""
        moved = self.files.quarantined(data["id"])
        if moved:  # its journaled pushes are there, not in its save: never served without them
            note = self.files.read_note(data["id"])
            where = f"quarantine/{moved[-1]}"
            raise Quarantined(note["reason"] if note is not None and where in note["reason"] else
                              f"its disk-tier file set was moved to {where} in the state folder")
        qa = self.settings.qa_for(data["settings"], made=data.get("engine") or {})
        ids = {"stream_id": data["id"], "owner": data["owner"]} if data.get("owned") else {}
        stream, saved = self.resume_tier(qa, data, ids, healing), {"pushed": 0, "frames": 0, "seconds": None}
        saved_watches = frozenset()  # those of a file set: the next save holds them
        from_save, tier_saved = False, stream is not None and data.get("tier_saved") is True
        claimed = (data.get("saved") or {}).get("pushed")
        source = ("its disk-tier file set" if stream is not None else
                  f"nothing (its save, which its record says held {claimed} frames pushed, is missing from "
                  f"{self.files.where})"
                  if type(claimed) is int and claimed > 0 else "nothing (it was never saved)")
        if stream is None:
            with self.files.local_state(data["id"]) as state:
                stream = None if state is None else Stream.load(state, qa, **ids)
            if stream is not None:
                saved_watches, from_save = frozenset(watch.id for watch in stream.watches), True
                source = "its last save"
        if stream is not None:
            recorded = data.get("saved") or {}
            try:
                check_described(data, stream)
            except InputError:
                stream.close()
                raise
            resumed_at = recorded.get("seconds") if recorded.get("pushed") == stream.pushed else None
            if not (is_finite_number(resumed_at) and resumed_at >= 0):  # resumed elsewhere than its last save (a
                # kill on the disk tier), or a record's time that is no stream time: its own clock
                resumed_at = getattr(stream, "last_timestamp", None)
            saved = {"pushed": stream.pushed, "frames": stream.frames, "seconds": resumed_at}
        else:
            qa = self.settings.qa_for(data["settings"])  # never saved: made anew, as the server makes streams now
            stream = qa.stream(data["horizon_frames"], max_fps=data["max_fps"], name=data["name"], **ids)
            if not getattr(stream, "keeps_cache", True):  # its counts alone were kept: it goes on from them
                saved = counted(stream, data, saved)
                source = "its record's counts (its method keeps no frames)"
        answers = recalled(data.get("answers"))[-ANSWERS:]
        lost = None if healing else lost_at_start(data, stream)  # healing: the server runs on, its loss said there
        if lost is not None:  # a kill (or a lost save or file set) after its record last saw more
            log.error("stream %s came back without %d frames pushed (%d kept frames) that it had taken before the "
                      "server stopped%s; it holds %d frames, resumed from %s: push them again from resume_from=%d",
                      data["id"], max(lost["pushed"], lost["frames"]), lost["frames"],
                      f", nor {lost['answers']} answers' frames" if lost["answers"] else "",
                      stream.frames, source, stream.pushed)
        entry = StreamEntry(data["id"], data["owner"], data["settings"], data["horizon_frames"], data["max_fps"],
                            data["name"], data["created"], stream, last_seconds=saved["seconds"], saved=saved,
                            answers=answers, owned=bool(data.get("owned")), saved_watches=saved_watches,
                            from_save=from_save, tier_saved=tier_saved, lost=lost)
        if self.files.read_note(entry.id) is not None:  # repaired since it was quarantined
            try:
                self.files.remove_note(entry.id)
            except (OSError, StateKVError) as error:
                log.error("cannot remove stream %s's quarantine note: %s", entry.id, error)
        return entry

    def bring_back(self, entry: StreamEntry, data: dict[str, Any], listener: Any, healing: bool = False) -> bool:
        """Reopen the watches (`recall`, their saved events put back: `with_saved_events`) and page of ``entry``, a
        stream just loaded from its record ``data``; then, for one in another disk-tier file set than ``data``
        names, write its record so that it names the new one (a failure is logged); whether its record names its file
        set. A stream whose watches cannot be brought back now (its save not readable: a retry) is closed again,
        letting go of its file set."""
        try:
            recall(entry, with_saved_events(entry, data, self.files), listener)
            recall_page(entry, data)
        except BaseException:
            with contextlib.suppress(Exception):
                entry.stream.close()
            raise
        runs = kept_runs(data.get("event_runs"))
        # a server killed may have sent events of frames it lost: made again, they are a new run's (`new_run`)
        entry.event_runs = runs if healing else new_run(runs, entry.stream)
        if not healing:
            moved = entry.record()["tier"] != data.get("tier")
            try:  # its new file set named; a stop's mark cleared, since pushes from now on are its file set's alone;
                # a loss said once: the counts it notes are the stream's now; a new run of its events numbered
                entry.write_record(self.files)
            except (OSError, StateKVError) as error:
                entry.run_unrecorded = True  # its events wait for a record that numbers their run
                log.error("cannot record stream %s's new disk-tier folder, or that it runs again: %s", entry.id,
                          error)
                return not moved
        return True

    def resume_tier(self, qa: Any, data: dict[str, Any], ids: dict[str, Any], healing: bool = False) -> Stream | None:
        """The stream resumed in its own disk-tier file set, when its record names one that is there (None:
        none, or its save holds every frame it took: the server stopped after saving it, its record ``stopped``).
        One a server without a disk tier cannot read raises `Quarantined`: its frames since its save would be lost;
        one missing from ``--offload-dir`` (lost with its disk, or elsewhere) comes back from its save, the loss
        logged. A stream whose saves made its file set durable (its record ``tier_saved``) has no save to come
        back from: it raises `Quarantined` wherever its file set is not resumed. A file set that cannot be resumed
        raises `Quarantined`, once it is moved into the state folder's quarantine (left where it is when another
        process holds it, or it cannot be moved): it holds the pushes since the last save, so the stream is not
        served from a save without them; one that cannot be read now (an `OutputError`: too many open files, a disk
        that fails) raises `Quarantined` with the file set left where it is. ``healing``: as `load`."""
        alone = data.get("tier_saved") is True  # no save of its own: its frames are in its file set alone
        kept = (f"its frames are kept in its disk-tier file set {data.get('tier')} alone" if alone else
                f"the frames it took since its last save are journaled in its disk-tier file set {data.get('tier')}")
        if not data.get("tier") or (qa.engine.offload != "disk" and healing) or not (self.resume_tiers or healing):
            if healing:
                raise Quarantined("it has no disk-tier file set to be brought back from")
            if alone and data.get("tier"):
                raise Quarantined(f"{kept}, which servers sharing a state folder do not resume: start one server "
                                  "alone with --offload disk and the --offload-dir it was served with")
            return None
        if qa.engine.offload != "disk":
            if data.get("stopped") and not alone:
                return None
            raise Quarantined(f"{kept}, which a server without --offload disk does not read: start the server with "
                              "--offload disk and the --offload-dir it was served with")
        root = Path(qa.engine.offload_dir)
        folder = root / data["tier"]
        if not folder.is_dir():
            if healing:
                raise Quarantined(f"its disk-tier file set {folder.name} is missing")
            if alone:  # nothing else to serve it from: never served without its frames
                raise Quarantined(f"{kept}, which is not in --offload-dir: start the server with the --offload-dir "
                                  "it was served with")
            if not data.get("stopped"):  # lost with its disk, or in another folder: said, the stream served
                log.error("stream %s: its disk-tier file set %s is not in --offload-dir: it comes back from its last "
                          "save (%s frames) in a new file set, without the frames journaled in %s since (a file "
                          "set of that name elsewhere is left as it is)", data["id"], folder.name,
                          (data.get("saved") or {}).get("frames", 0), folder.name)
            return None
        try:
            return Stream.load(folder, qa, **ids)
        except OtherSetupError as error:  # sound files, another model or settings: left for a start with them
            why = public_message(str(error), _server_paths(root, folder))[:200]
            refused = Quarantined(f"its disk-tier file set {folder.name} was saved with another setup ({why}); left "
                                  "where it is: start the server with the model and settings it was saved with")
            refused.sound = True
            raise refused from None
        except ForeignFilesError as error:  # sound files, another stream's (a copied record) or to be re-owned
            why = public_message(str(error), _server_paths(root, folder))[:200]
            raise Quarantined(f"its disk-tier file set {folder.name} is not this stream's as it is ({why}); left "
                              "where it is") from None
        except Exception as error:  # noqa: BLE001 -- whatever a damaged file set raises, the stream is quarantined
            if healing and isinstance(error, OutputError):
                raise  # not damage: tried again once the folder can be written
            why = public_message(reason_of(error), _server_paths(root, folder))[:160]
            problem = f"its disk-tier file set {folder.name} cannot be resumed ({why})"
            if isinstance(error, OutputError):  # not damage (too many open files, a disk that fails): kept in place
                raise Quarantined(f"{problem}; left where it is, tried again at the next start") from None
        try:
            lock = hold(folder, None)  # the folder's own lock, as a stream living in it holds it
        except InputError:  # a live process holds it: not this server's to move
            raise Quarantined(f"{problem}; left where it is, since its lock cannot be taken (another process holds "
                              "it)") from None
        except OutputError as failure:  # too many open files, a full disk: tried again at the next start
            why = public_message(reason_of(failure), _server_paths(root, folder))[:160]
            raise Quarantined(f"{problem}; left where it is, since its lock cannot be taken now ({why}); tried again "
                              "at the next start") from None
        try:
            where = self.files.move_to_quarantine(data["id"], folder)
        except OSError as failure:
            raise Quarantined(f"{problem}; left where it is, since it cannot be moved into the state folder's "
                              f"quarantine ({failure.strerror or type(failure).__name__})") from None
        finally:
            if lock is not None:
                lock.release()
        raise Quarantined(f"{problem}; moved to {where} in the state folder")

    def damaged(self, stream_id: str, owner: str | None, reason: str, record: dict[str, Any]) -> DamagedStream:
        """A quarantined stream, its reason one line that names no server path and no other stream."""
        reason = public_message(reason, {**self.files.places(), **_server_paths(None)})
        reason = reason.strip().splitlines()[0][:300] if reason.strip() else "unreadable"
        # another stream's id is not this stream's owner's to see
        reason = re.sub(r"(stream )?'?st_[0-9a-f]{24}'?",
                        lambda m: m.group(0) if stream_id in m.group(0) else "another stream", reason)
        return DamagedStream(stream_id, owner, reason, record)


def _server_paths(root: Path | None, folder: Path | None = None) -> dict[str, str]:
    """What a damaged stream's reason shows of the server's paths: ``root`` (--offload-dir) left out, the file set
    ``folder`` its reason names already as the error's head left out (so its advice is not cut short), and the
    installation's secret (named by an ownership check: `statekv.api.stream_identity.check_ownership`)."""
    paths = {} if root is None else {str(root.resolve()) + "/": "", str(root) + "/": ""}
    if folder is not None:
        paths.update({str(folder.resolve()) + ": ": "", str(folder) + ": ": ""})
    return {**paths, str(secret_path().absolute()): "the server's secret file"}


def check_described(record: dict[str, Any], stream: Stream) -> None:
    """Refuse (one-line `InputError`) a record that does not describe the saved stream ``stream`` it names: its
    horizon or frame rate differs, or it says more frames were saved than the save holds (a save may hold more:
    one written just before a kill, the record not yet). Its method settings are checked as the save is loaded."""
    for name in ("horizon_frames", "max_fps"):
        if record[name] != getattr(stream, name):
            raise InputError(f"its record says {name} {_shown(record[name])}, but its save holds a stream made with "
                             f"{_shown(getattr(stream, name))}")
    saved = record.get("saved") if isinstance(record.get("saved"), dict) else {}
    for name, held in (("pushed", stream.pushed), ("frames", stream.frames)):
        claimed = saved.get(name, 0)
        if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed > held:
            raise InputError(f"its record says {_shown(claimed)} {'frames pushed' if name == 'pushed' else name} "
                             f"were saved, but its save holds {held}")


def _shown(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)[:40]


def unreadable(name: str, error: Exception) -> str:
    """Why a stream whose record (its file's name) cannot be read is damaged."""
    return f"its record {name} is unreadable: {error}"


def counted(stream: Any, data: dict[str, Any], empty: dict[str, Any]) -> dict[str, Any]:
    """What the record ``data`` of a stream whose frames are never saved (simplestream) says was pushed, with
    ``stream`` (new) going on from it; ``empty`` when the record's counts are not a stream's."""
    recorded = data.get("saved") or {}
    try:
        stream.continue_from(recorded.get("pushed", 0), recorded.get("frames", 0), recorded.get("seconds"))
    except StateKVError as error:
        log.error("stream %s starts from its first frame again: its record's counts are malformed (%s)", data["id"],
                  error)
        return empty
    return {"pushed": stream.pushed, "frames": stream.frames, "seconds": stream.last_timestamp}
