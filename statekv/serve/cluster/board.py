"""The replicas' board in the shared state folder: each replica posts, every few seconds, who it is (its process
and machine), how many streams it holds and its Prometheus metrics (``STATE/replicas/ID.json``); any replica
answers ``GET /metrics`` with every live replica's series, each labelled ``replica="ID"``. A replica that stopped
posting (dead, or gone) drops off after `STALE_SECONDS`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..store import write_atomic

REPLICAS = "replicas"
POST_SECONDS = 2.0
STALE_SECONDS = 10.0
FORGET_SECONDS = 600.0  # a replica silent this long (killed, its node gone) is removed from the board
# what a replica's id may be (Ray Serve's are letters and digits): it names files and its disk tier's folder
REPLICA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


class ReplicaBoard:
    """``STATE/replicas/``, as replica ``replica`` sees it."""

    def __init__(self, state_dir: Path | str, replica: str):
        self.folder = Path(state_dir) / REPLICAS
        self.folder.mkdir(parents=True, exist_ok=True)
        self.replica = replica
        self.path = self.folder / f"{replica}.json"
        self._posting = threading.Lock()
        self._removed = False

    def post(self, streams: int, exposition: bytes) -> None:
        with self._posting:
            if not self._removed:  # a post still under way when the replica stops must not outlive it
                write_atomic(self.path, json.dumps({
                    "replica": self.replica, "pid": os.getpid(), "node": socket.gethostname(),
                    "updated": time.time(), "streams": streams, "metrics": exposition.decode()}).encode())

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica that posted within `STALE_SECONDS`, by id."""
        return [posted for posted, age in self._posts() if age < STALE_SECONDS]

    def forget_silent(self) -> list[str]:
        """Remove the posts of replicas silent for `FORGET_SECONDS` (killed, their node gone); returns their ids."""
        forgotten = []
        for replica, age in self.ages().items():
            if age > FORGET_SECONDS and replica != self.replica:
                (self.folder / f"{replica}.json").unlink(missing_ok=True)
                forgotten.append(replica)
        return forgotten

    def ages(self) -> dict[str, float]:
        """Seconds since each replica's post, by the post's name (a replica's id, `REPLICA_NAME`), not by what it
        says."""
        found, now = {}, time.time()
        for path in sorted(self.folder.glob("*.json")):
            try:
                if REPLICA_NAME.fullmatch(path.stem):
                    found[path.stem] = now - float(json.loads(path.read_text())["updated"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def _posts(self) -> list[tuple[dict[str, Any], float]]:
        found, now = [], time.time()
        for path in sorted(self.folder.glob("*.json")):
            try:
                posted = json.loads(path.read_text())
                found.append((posted, now - float(posted["updated"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or removed at shutdown
        return found

    def exposition(self, own: bytes) -> bytes:
        """Every live replica's metrics, this one's as of now, each series labelled with its replica."""
        posted = {entry["replica"]: entry["metrics"] for entry in self.replicas() if entry.get("replica")}
        posted[self.replica] = own.decode()
        return merged(sorted(posted.items()))

    def remove(self) -> None:
        with self._posting:
            self._removed = True
            self.path.unlink(missing_ok=True)


def merged(expositions: list[tuple[str, str]]) -> bytes:
    """Prometheus text expositions of several replicas as one, each sample labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in expositions:
        for family in text_string_to_metric_families(text):
            into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                            family.unit))
            into.samples.extend(sample._replace(labels={**sample.labels, "replica": replica})
                                for sample in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class StoreBoard:
    """The replicas' board in an object store (``replicas/ID.json`` there), as replica ``replica`` sees it: the
    same posts as `ReplicaBoard`'s."""

    def __init__(self, store: Any, replica: str):
        self.store, self.replica = store, replica
        self.name = f"{REPLICAS}/{replica}.json"
        self._posting = threading.Lock()
        self._removed = False

    def post(self, streams: int, exposition: bytes) -> None:
        with self._posting:
            if not self._removed:
                self.store.put(self.name, json.dumps({
                    "replica": self.replica, "pid": os.getpid(), "node": socket.gethostname(),
                    "updated": time.time(), "streams": streams, "metrics": exposition.decode()}).encode())

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica that posted within `STALE_SECONDS`, by id."""
        return [posted for posted, age in self._posts() if age < STALE_SECONDS]

    def forget_silent(self) -> list[str]:
        """Remove the posts (and expired sessions) of replicas silent for `FORGET_SECONDS`; returns their ids."""
        forgotten = []
        for replica, age in self.ages().items():
            if age > FORGET_SECONDS and replica != self.replica:
                self.store.remove(f"sessions/{replica}.json")
                self.store.remove(f"{REPLICAS}/{replica}.json")
                forgotten.append(replica)
        return forgotten

    def ages(self) -> dict[str, float]:
        """Seconds since each replica's post, by the post's name (a replica's id, `REPLICA_NAME`)."""
        found, now = {}, time.time()
        for name in self.store.names(f"{REPLICAS}/"):
            replica = name.rsplit("/", 1)[-1].removesuffix(".json")
            if not REPLICA_NAME.fullmatch(replica):
                continue
            try:
                found[replica] = now - float(json.loads(self.store.read(name) or b"null")["updated"])
            except (ValueError, KeyError, TypeError):
                continue
        return found

    def _posts(self) -> list[tuple[dict[str, Any], float]]:
        found, now = [], time.time()
        for name in self.store.names(f"{REPLICAS}/"):
            try:
                posted = json.loads(self.store.read(name) or b"null")
                found.append((posted, now - float(posted["updated"])))
            except (ValueError, KeyError, TypeError):
                continue
        return found

    def exposition(self, own: bytes) -> bytes:
        posted = {entry["replica"]: entry["metrics"] for entry in self.replicas() if entry.get("replica")}
        posted[self.replica] = own.decode()
        return merged(sorted(posted.items()))

    def remove(self) -> None:
        with self._posting:
            self._removed = True
            try:
                self.store.remove(self.name)
            except OSError:
                pass
