"""`StreamRouter`: Ray Serve's request router for the statekv deployment (run by Ray Serve's proxies and handles;
a `ray.serve.request_router.RequestRouter`).

Each HTTP request is sent to a replica chosen by what it is about:

- one stream (``/v1/streams/ID...``, or Ray Serve's ``serve_multiplexed_model_id`` header naming the stream, which
  an OpenAI client can send with a chat completion about a live stream): the replica holding the stream's lease in
  the shared state folder (or, with an object store alone, the replica its holder's note there names); when no
  live replica holds it (new, let go, or its replica died), the least-loaded one,
  which takes it from its last save;
- a new stream (``POST /v1/streams``): the least-loaded replica (fewest streams held, as each replica reports in
  its routing stats, plus those this router sent it that its reports do not count yet:
  `statekv.serve.cluster.placing`), replicas at their stream limit last; a stream to place goes to a fuller
  replica only when the least-loaded have not taken it for a few seconds (`StreamRouter.patient`);
- the page (``/`` and ``/ui/...``): one replica, the same for every tab (the page's live connection is kept by the
  replica that served it), which brings a stream to itself when a tab opens it;
- anything else: Ray Serve's choice among all replicas (the shortest queue).
"""

from __future__ import annotations

import asyncio
import pickle
import re
import time
from collections import defaultdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..store import STREAM_ID
from .leases import Leases
from .objects import ObjectStore
from .store_files import holder_hint

STREAM_PATH = re.compile(r"^/v1/streams/([^/]+)")
PLACING_KEPT = 10_000  # requests remembered between their routing and Ray's callback, at most
PLACING_SECONDS = 60.0  # a request sent to place a stream counts this long at most, unless its replica lists it
PLACING_PATIENCE_SECONDS = 3.0  # a stream to place waits this long for the least-loaded replicas before any other


def request_target(pending_request: PendingRequest) -> tuple[str, str | None]:
    """What a request is about: ``("stream", ID)``, ``("create", None)``, ``("page", None)`` or ``("any", None)``."""
    scope = http_scope(pending_request)
    return scope_target(scope.get("path", ""), scope.get("method", ""), pending_request.metadata.multiplexed_model_id)


def scope_target(path: str, method: str, named: str | None) -> tuple[str, str | None]:
    """`request_target` of an HTTP request by its path, method and the stream its multiplexed id names, if any."""
    match = STREAM_PATH.match(path)
    if match and STREAM_ID.match(match.group(1)):
        return "stream", match.group(1)
    if named and STREAM_ID.match(named):
        return "stream", named
    if path == "/v1/streams" and method == "POST":
        return "create", None
    if path == "/" or path == "/ui" or path.startswith("/ui/"):
        return "page", None
    return "any", None


def http_scope(pending_request: PendingRequest) -> dict[str, Any]:
    """The ASGI scope of an HTTP request as Ray Serve's proxy hands it on (its first argument: the pickled request
    it built itself); {} for anything else (a call through a handle)."""
    arguments = pending_request.args
    if not arguments or not isinstance(arguments[0], bytes):
        return {}
    try:
        scope = getattr(pickle.loads(arguments[0]), "asgi_scope", None)
    except Exception:  # not a request the proxy built
        return {}
    return scope if isinstance(scope, dict) else {}


class StreamRouter(RequestRouter):
    """Routes each stream's requests to the replica holding it (see the module). ``state_dir``: the shared state
    folder (its leases are read, never written); ``store``: the object store, when there is no folder (its
    holders' notes are read); ``max_streams``: each replica's stream limit."""

    def initialize_state(self, state_dir: str = "", max_streams: int = 0, store: str = "", **_: Any) -> None:
        self.leases = Leases(state_dir) if state_dir else None
        self.store = ObjectStore(store) if store and not state_dir else None
        self.max_streams = max_streams
        # replica -> {request: (the stream it is about, None for a new one; when it was sent there)}
        self.placed: dict[str, dict[str, tuple[str | None, float]]] = defaultdict(dict)
        self.placing: dict[str, str | None] = {}  # requests routed to place a stream, until Ray reports where they went

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # a full replica is waited for, not looped over
        kind, stream_id = request_target(pending_request)
        if kind == "stream":
            holder = await asyncio.to_thread(self.holder_of, stream_id)
            holding = [replica for replica in candidate_replicas if replica.replica_id.unique_id == holder]
            if holding:
                return [holding]
            self._placing(pending_request, stream_id)
            return self.patient(self.by_load(candidate_replicas), pending_request)
        if kind == "create":
            self._placing(pending_request, None)
            return self.patient(self.by_load(candidate_replicas), pending_request)
        if kind == "page":
            return [[min(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)]]
        return [candidate_replicas]

    def holder_of(self, stream_id: str) -> str | None:
        """The replica holding the stream, as the shared state says (None: none, or it cannot be read)."""
        if self.leases is not None:
            return self.leases.holder_of(stream_id)
        return holder_hint(self.store, stream_id) if self.store is not None else None

    def load(self, replica: RunningReplica) -> int:
        """Streams the replica holds, as it last reported, plus those sent there to be placed that its report does
        not count yet: a request it has not listed as answered, about a stream it does not list as held (several
        about one stream count once)."""
        stats = replica.routing_stats or {}
        name = replica.replica_id.unique_id
        answered, held = set(stats.get("answered", ())), set(stats.get("held", ()))
        oldest = time.time() - PLACING_SECONDS
        pending = {request: (stream_id, when) for request, (stream_id, when) in self.placed.get(name, {}).items()
                   if request not in answered and stream_id not in held and when > oldest}
        self.placed[name] = pending
        return len(held) + len({stream_id or request for request, (stream_id, _) in pending.items()})

    def by_load(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Ranks of replicas, least-loaded first; replicas at their stream limit last."""
        oldest = time.time() - PLACING_SECONDS
        for other in set(self.placed) - {replica.replica_id.unique_id for replica in replicas}:  # gone, or not asked
            self.placed[other] = {request: sent for request, sent in self.placed[other].items() if sent[1] > oldest}
            if not self.placed[other]:
                del self.placed[other]
        loads = {replica.replica_id.unique_id: self.load(replica) for replica in replicas}

        def rank(replica: RunningReplica) -> tuple[bool, int]:
            load = loads[replica.replica_id.unique_id]
            return bool(self.max_streams) and load >= self.max_streams, load

        ranks: list[list[RunningReplica]] = []
        for replica in sorted(replicas, key=rank):
            if ranks and rank(ranks[-1][0]) == rank(replica):
                ranks[-1].append(replica)
            else:
                ranks.append([replica])
        return ranks

    @staticmethod
    def patient(ranks: list[list[RunningReplica]], pending_request: PendingRequest) -> list[list[RunningReplica]]:
        """The least-loaded rank alone while the request is younger than `PLACING_PATIENCE_SECONDS`, then every
        rank. Ray Serve takes the next rank when none of a rank's replicas answers its probe of their queues in
        time (``RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S`` at first), which a busy replica, or one just started,
        may not: the stream would then go to a fuller replica, which would hand it over again once idle. Ray
        retries the rank, with longer probes, meanwhile."""
        if time.time() - pending_request.created_at < PLACING_PATIENCE_SECONDS:
            return ranks[:1]
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request = pending_request.metadata.internal_request_id
        if request in self.placing:
            self.placed[replica_id.unique_id][request] = (self.placing.pop(request), time.time())

    def _placing(self, pending_request: PendingRequest, stream_id: str | None) -> None:
        request = pending_request.metadata.internal_request_id
        if not request:  # no id to be listed by: counted by the replica's next report alone
            return
        if len(self.placing) > PLACING_KEPT:
            self.placing.clear()
        self.placing[request] = stream_id
