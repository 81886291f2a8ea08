"""A stream's shared state in an object store as a chain of versions (`StreamVersions`), fenced by the store's one
conditional write: create a name only if it is free.

``streams/ID/v000000000042.json`` is version 42 of stream ID: everything replicas share of it (the event that
made it, who holds it and under which fencing token, its record, the name of its current save, its quarantine
note, whether it was deleted), whole. The current state is the highest version. A change is a new version numbered
one past the version it was made from, created only if that number is free: of two replicas changing a stream at
once, one creates the number and the other finds it taken, reads the new current version and decides again
(`commit`). The name holds the number alone, so the conditional write fences the number whatever the change (a
save and a taking of the same number cannot both be created). Names of an earlier statekv, which also held the
event (``v000000000042-EVENT.json``), are read as the same versions. A replica writes
a stream only while the current version names it as holder under its own token, so once another replica has taken
the stream (a version with the next token), every later write of the old holder finds the chain moved on and is
refused: two replicas never both write a stream. No file is locked, and the same code runs on S3, GCS, Azure and
a local folder.

Older versions are removed once a few newer ones exist, except takings and lettings-go (the stream's history, its
last `HISTORY_LINES`). A writer that stalled between reading version N and creating N+1 might create a number
removed long ago; it then finds a higher number present whose version does not follow its own, and counts its write
as refused (`commit` checks the chain after every creation). A deleted stream keeps its last version (a tombstone),
so no late writer brings it back, for a month (`store_files.TOMBSTONE_SECONDS`): then it goes too.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ServiceError
from .leases import HISTORY_LINES
from .objects import ObjectStore

log = logging.getLogger("statekv.serve")

STREAMS = "streams"
KEEP = 4  # versions kept below the newest, besides the history
PRUNED_BACK = 4  # how far below those a commit looks for versions to prune (earlier commits pruned the rest)
CHECK_WAITS = (0.0, 0.2, 1.0)  # seconds waited before each check that a created version follows its chain
HISTORY_EVENTS = ("taken", "let-go")
NAME = re.compile(r"^streams/(st_[0-9A-Za-z_]+)/v(\d{12})(-[a-z-]+)?\.json$")  # the event: an earlier statekv's


@dataclass(frozen=True)
class Version:
    """One version of a stream's shared state: ``number`` in its chain, ``nonce`` (its own) and ``base`` (the
    nonce of the version it was made from), the ``event`` that made it, who holds the stream (``holder``, under
    its session ``epoch``, with fencing ``token``), its ``record``, ``state`` (its current save's object name),
    ``note`` (why it is quarantined), ``deleted``, and for a taking, who held it ``before``."""

    stream: str
    number: int
    nonce: str
    base: str | None
    event: str
    at: float
    holder: str | None = None
    epoch: str | None = None
    token: int = 0
    record: dict[str, Any] | None = None
    state: str | None = None
    note: dict[str, Any] | None = None
    deleted: bool = False
    before: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return version_name(self.stream, self.number)

    def held_by(self, holder: str, token: int) -> bool:
        return self.holder == holder and self.token == token and not self.deleted


def version_name(stream_id: str, number: int, event: str | None = None) -> str:
    """The object a version is stored as (``event``: as an earlier statekv named it)."""
    return f"{STREAMS}/{stream_id}/v{number:012d}{'' if event is None else '-' + event}.json"


class StreamVersions:
    """The version chains of every stream in ``store``."""

    def __init__(self, store: ObjectStore, clock: Callable[[], float] = time.time):
        self.store, self.clock = store, clock
        self._read: dict[str, Version] = {}  # name -> version (a version never changes once written)

    # -- reading ----------------------------------------------------------------------------------------------
    def numbers(self, stream_id: str) -> list[tuple[int, str]]:
        """(number, name) of the stream's versions in the store, lowest first."""
        return _parsed_names(self.store.names(f"{STREAMS}/{stream_id}/"))

    def current(self, stream_id: str) -> Version | None:
        """The stream's newest version; None when it has none."""
        for _ in range(3):  # the newest removed as it was listed: only by a deletion's pruning, read again
            found = self.numbers(stream_id)
            if not found:
                return None
            version = self.read(found[-1][1])
            if version is not None:
                return version
        raise ServiceError(503, f"stream {stream_id}'s versions in the object store kept changing; retry",
                           headers={"Retry-After": "1"})

    def read(self, name: str) -> Version | None:
        """The version stored as ``name`` (None: gone); a 503 when it cannot be read."""
        if name in self._read:
            return self._read[name]
        data = self.store.read(name)
        if data is None:
            return None
        try:
            fields = json.loads(data)
            version = Version(**{key: fields.get(key) for key in Version.__dataclass_fields__
                                 if key in fields})
            if name not in (version.name, version_name(version.stream, version.number, version.event)):
                raise ValueError("its name does not match its content")
        except (ValueError, TypeError) as error:
            raise ServiceError(503, f"version {name} in the object store is unreadable ({error})") from None
        if len(self._read) > 50_000:
            self._read.clear()
        self._read[name] = version
        return version

    def every_current(self) -> dict[str, Version | ServiceError]:
        """Every stream's newest version, by stream id (one listing; a version read once is kept), or why it
        cannot be read: one damaged version does not hide the others."""
        newest: dict[str, tuple[int, str]] = {}
        for number, name in _parsed_names(self.store.names(f"{STREAMS}/")):
            stream_id = name.split("/")[1]
            if stream_id not in newest or number > newest[stream_id][0]:
                newest[stream_id] = (number, name)
        found = {}
        for stream_id, (_, name) in sorted(newest.items()):
            try:
                version = self.read(name)
            except ServiceError as error:
                found[stream_id] = error
                continue
            if version is not None:
                found[stream_id] = version
        return found

    def counts(self) -> Counter:
        """How many versions the store keeps of each stream, by stream id (one listing)."""
        return Counter(name.split("/")[1] for _, name in _parsed_names(self.store.names(f"{STREAMS}/")))

    def history(self, stream_id: str) -> list[dict[str, Any]]:
        """Every taking and letting go of the stream still stored, oldest first (as `leases.Leases.history`)."""
        lines = []
        for _, name in self.numbers(stream_id):
            version = self.read(name)
            if version is not None and version.event in HISTORY_EVENTS:
                taken = version.event == "taken"  # a letting go names who let go in ``before``
                line = {"event": version.event.replace("-", " "), "token": version.token, "at": version.at,
                        "holder": version.holder if taken else (version.before or {}).get("holder")}
                if taken and version.before is not None:
                    line["before"] = version.before
                lines.append(line)
        return lines

    # -- changing ---------------------------------------------------------------------------------------------
    def commit(self, base: Version | None, stream_id: str, event: str, **changes: Any) -> Version | None:
        """A new version made from ``base`` (None: the stream's first) with ``changes``; None when another
        writer created that number first, or the chain had moved past it (nothing of it stays). A creation the
        store made but did not answer (or that the client retried, finding the name its own) is this one: the
        store's error is raised only when the version is not there, or the store cannot say."""
        fields = {**(asdict(base) if base is not None else {"stream": stream_id}), "before": None, **changes}
        version = Version(**{**fields, "number": (base.number if base else 0) + 1, "nonce": secrets.token_hex(8),
                             "base": base.nonce if base else None, "event": event, "at": self.clock()})
        data = json.dumps(asdict(version), separators=(",", ":")).encode()
        try:
            created = self.store.create(version.name, data)
        except OSError:
            if not self._holds(version.name, data):
                raise
            created = True
        if not created and not self._holds(version.name, data):
            return None
        if not self._checked_follows(version):
            self.store.remove(version.name)  # a number removed long ago: a write of a writer that stalled
            return None
        self._read[version.name] = version
        self._prune(stream_id, version.number)
        return version

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether the store holds ``data`` (a version's, its nonce its own) as ``name``, asked again while the store
        fails to answer; False when it holds another or nothing, or cannot say."""
        for wait in CHECK_WAITS:
            time.sleep(wait)
            try:
                return self.store.read(name) == data
            except OSError:
                continue
        return False

    def _checked_follows(self, version: Version) -> bool:
        """`_follows`, asked again while the store fails to answer. A created version that still cannot be checked
        counts as written: counted as refused it would be removed though it may name a save or take a stream, while
        a stalled writer's version counted as written is refused at that writer's next write (the chain names
        another token), and a save prunes only saves of its own token or older (`StoreStreamFiles.save_state`)."""
        failure: Exception | None = None
        for wait in CHECK_WAITS:
            time.sleep(wait)
            try:
                return self._follows(version)
            except (OSError, ServiceError) as error:
                failure = error
        log.warning("cannot check that version %s follows its chain (%s); counted as written", version.name, failure)
        return True

    def _follows(self, version: Version) -> bool:
        """Whether ``version`` is in its stream's chain: the newest, or followed by a version made from it, and
        the one version of its number (an earlier statekv's name of it may hold it already)."""
        found = self.numbers(version.stream)
        if any(number == version.number and name != version.name for number, name in found):
            return False
        later = [(number, name) for number, name in found if number > version.number]
        if not later:
            return True
        follower = self.read(later[0][1]) if later[0][0] == version.number + 1 else None
        return follower is not None and follower.base == version.nonce

    def _prune(self, stream_id: str, newest: int) -> None:
        """Remove the versions that fell `KEEP` below ``newest`` with the last few commits, but the history (a
        failure only leaves them): read each, so the few just fall out, never the whole kept history; and of the
        history, the takings and lettings-go before its last `HISTORY_LINES` (what lies below those few is
        history, or a version a failure left, which goes as well)."""
        try:
            numbers = self.numbers(stream_id)
            for number, name in numbers:
                if number >= newest - KEEP:
                    break
                if number < newest - KEEP - PRUNED_BACK:
                    continue  # pruned by an earlier commit (or history)
                version = self.read(name)
                if version is not None and version.event not in HISTORY_EVENTS:
                    self.store.remove(name)
                    self._read.pop(name, None)
            below = [name for number, name in numbers if number < newest - KEEP - PRUNED_BACK]
            for name in below[:max(0, len(below) - HISTORY_LINES)]:
                self.store.remove(name)
                self._read.pop(name, None)
        except (OSError, ServiceError):
            pass

    def remove_chain(self, stream_id: str) -> None:
        """Remove every version of the stream (one whose creation failed); an `OSError` when the store refuses."""
        for _, name in self.numbers(stream_id):
            self.store.remove(name)
            self._read.pop(name, None)

    def remove_all_but(self, version: Version) -> None:
        """Remove every version of the stream but ``version`` (a deletion's tombstone); a failure only leaves
        them."""
        try:
            for _, name in self.numbers(version.stream):
                if name != version.name:
                    self.store.remove(name)
                    self._read.pop(name, None)
        except OSError:
            pass


    def forget(self, version: Version) -> None:
        """Remove ``version`` (a tombstone past its time); an `OSError` when the store refuses."""
        self.store.remove(version.name)
        self._read.pop(version.name, None)


def _parsed_names(names: list[str]) -> list[tuple[int, str]]:
    """(number, name) of each version's name among ``names``, lowest number first."""
    return sorted((int(match.group(2)), name) for name in names if (match := NAME.match(name)))
