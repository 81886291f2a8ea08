"""Replicas' sessions in an object store: how long each replica's hold on its streams lasts.

A replica writes ``sessions/REPLICA.json`` (``{"holder", "epoch", "expires"}``) once a third of its lease length has
gone, and a stream it holds (`versions.Version`: ``holder``, ``epoch``) is its own for as long as that session is
live: one write per replica keeps every stream it holds, rather than one per stream. A replica that could not
renew in time (dead, stalled, cut off from the store) has lost every stream it held: others may take them once
its session has expired by their clocks, and it stops serving them by its own clock before then (`Session.valid`).
Its next renewal starts a new epoch, so the streams it held under the old one are never its again unless taken
anew; so does a renewal whose write ends after the hold it renews ran out (another may have taken them
meanwhile). Expiry compares wall clocks, so the machines' clocks must agree within `CLOCK_MARGIN_SECONDS` or a
tenth of a lease, whichever is less (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable

from .objects import ObjectStore

SESSIONS = "sessions"
RENEW_FRACTION = 1 / 3  # a session is renewed once this much of it is gone
CLOCK_MARGIN_SECONDS = 1.0  # how far apart the replicas' clocks may be
READ_SECONDS = 0.5  # how long another replica's session, once read, is taken as it was


class Session:
    """Replica ``holder``'s session in ``store``, ``seconds`` long."""

    def __init__(self, store: ObjectStore, holder: str, seconds: float, clock: Callable[[], float] = time.time):
        self.store, self.holder, self.seconds, self.clock = store, holder, seconds, clock
        self.epoch: str | None = None
        self.expires = 0.0  # wall time, as written
        self._valid = 0.0  # monotonic time until which the session is surely live
        self._renewing = threading.Lock()
        self._others: dict[str, tuple[float, dict | None]] = {}

    def valid(self) -> bool:
        """Whether this replica surely still holds its session (renewed in time, by its own clock)."""
        return self.epoch is not None and time.monotonic() < self._valid

    def keep(self) -> str:
        """Renew the session when a third of it has gone (a new epoch when it had lapsed); returns its epoch."""
        with self._renewing:
            if self.valid() and self.expires - self.clock() > self.seconds * (1 - RENEW_FRACTION):
                return self.epoch
            renewing = self.valid()
            epoch = self.epoch if renewing else secrets.token_hex(6)
            held_until, asked = self._valid, time.monotonic()
            self._put(epoch)
            if renewing and time.monotonic() >= held_until:  # the hold ran out while the write hung: another
                epoch, asked = secrets.token_hex(6), time.monotonic()  # replica may have taken its streams
                self._put(epoch)
            self.epoch = epoch
            # timed from before the write, less a margin for the clocks: never later than another may take over
            self._valid = asked + self.seconds - min(CLOCK_MARGIN_SECONDS, self.seconds / 10)
            return epoch

    def _put(self, epoch: str) -> None:
        expires = self.clock() + self.seconds
        self.store.put(f"{SESSIONS}/{self.holder}.json", json.dumps(
            {"holder": self.holder, "epoch": epoch, "expires": expires}).encode())
        self.expires = expires

    def end(self) -> None:
        """At shutdown, its streams let go: remove the session (a failure only leaves it to expire)."""
        try:
            self.store.remove(f"{SESSIONS}/{self.holder}.json")
        except OSError:
            pass
        self.epoch = None

    def live(self, holder: str, epoch: str | None) -> bool:
        """Whether replica ``holder``'s session ``epoch`` is live (read from the store, at most every
        `READ_SECONDS`; this replica's own by its own clock)."""
        if holder == self.holder:
            return self.valid() and epoch == self.epoch
        return self.expiry(holder, epoch) > self.clock()

    def expiry(self, holder: str, epoch: str | None, fresh: bool = False) -> float:
        """When replica ``holder``'s session ``epoch`` expires (0 when it has none, or another epoch); read
        afresh with ``fresh`` (before taking a stream), else as read within `READ_SECONDS`."""
        read_at, session = self._others.get(holder, (0.0, None))
        if fresh or time.monotonic() - read_at > READ_SECONDS:
            data = self.store.read(f"{SESSIONS}/{holder}.json")
            try:
                session = json.loads(data) if data is not None else None
            except ValueError:
                session = None
            self._others[holder] = (time.monotonic(), session)
        if not isinstance(session, dict) or session.get("epoch") != epoch:
            return 0.0
        expires = session.get("expires")
        return float(expires) if isinstance(expires, (int, float)) else 0.0
