"""The service as a Ray Serve application: `StreamReplica` (a deployment whose replicas each load the model once and
host the whole app, FastAPI behind Ray Serve's ingress, over the shared state folder), `ClusterSettings` (replicas,
autoscaling, leases, where saves go, each replica's resources) and `application` (the deployment, its options and
its request router, bound and ready for ``serve.run``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ...errors import ConfigurationError
from ..config import ServeConfig
from .leases import LEASE_SECONDS
from .placing import PlacingLog, RecordPlacing
from .scaling import STREAMS_METRIC

ROUTER = "statekv.serve.cluster.router:StreamRouter"
SCALING = "statekv.serve.cluster.scaling:StreamsPolicy"
SCALE_ON = ("streams", "requests")
ROUTING_STATS_SECONDS = 1.0  # how often each replica tells the routers how many streams it holds


@dataclass(frozen=True)
class ClusterSettings:
    """replicas: how many (the least, with max_replicas); max_replicas: autoscale up to this many (None: a fixed
    number). scale_on: ``streams`` (None: the same; replicas for the streams held, ``scale_target`` per replica;
    default half of each replica's stream limit) or ``requests`` (Ray Serve's policy: ``scale_target`` requests
    under way per replica; default 2); either, or a ``scale_target``, only with max_replicas. lease_seconds: how
    long a replica's hold on a stream lasts unrenewed (a dead replica's streams come back after at most this).
    store: an fsspec URL for the saved streams (None: the state folder), or for everything the replicas share when
    there is no state folder.
    replica_cpus, replica_gpus: what each replica reserves from Ray. name: the Ray Serve application's name."""

    replicas: int = 1
    max_replicas: int | None = None
    scale_on: str | None = None
    scale_target: float | None = None
    lease_seconds: float = LEASE_SECONDS
    store: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    name: str = "statekv"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigurationError(f"--replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigurationError(f"--max-replicas {self.max_replicas} is fewer than --replicas {self.replicas}")
        if self.scale_on is not None and self.scale_on not in SCALE_ON:
            raise ConfigurationError(f"--scale-on must be one of {', '.join(SCALE_ON)}, got {self.scale_on!r}")
        if self.lease_seconds < 1:
            raise ConfigurationError(f"--lease-seconds must be at least 1, got {self.lease_seconds:g}")
        if self.max_replicas is None:
            alone = "--scale-on" if self.scale_on is not None else "--scale-target" if self.scale_target else None
            if alone:
                raise ConfigurationError(f"{alone} sets autoscaling: add --max-replicas M to autoscale between "
                                         "--replicas and M replicas")
        if not (math.isfinite(self.replica_cpus) and self.replica_cpus > 0):
            raise ConfigurationError(f"--replica-cpus must be a number greater than 0, got {self.replica_cpus}")
        if not (math.isfinite(self.replica_gpus) and self.replica_gpus >= 0):
            raise ConfigurationError(f"--replica-gpus must be a number of at least 0, got {self.replica_gpus}")


def deployment_options(config: ServeConfig, cluster: ClusterSettings) -> dict[str, Any]:
    """The deployment's Ray Serve options: resources, replicas or autoscaling, the request router, health
    checks and a graceful shutdown long enough to save every stream."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        # a replica answers many requests at once (each stream's pushes, questions, feeds, the page's connection)
        # and queues model work itself; these bound it instead of Ray Serve's default of 5
        "max_ongoing_requests": 4 * config.max_streams + config.max_asks + config.max_followers,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs=({"state_dir": str(config.state_dir), "max_streams": config.max_streams}
                                   if config.state_dir is not None else
                                   {"store": cluster.store, "max_streams": config.max_streams}),
            request_routing_stats_period_s=ROUTING_STATS_SECONDS, request_routing_stats_timeout_s=5.0),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_wait_loop_s": 2.0,
        "graceful_shutdown_timeout_s": 120.0,
    }
    if cluster.max_replicas is None:
        options["num_replicas"] = cluster.replicas
        return options
    scaling: dict[str, Any] = {"min_replicas": cluster.replicas, "initial_replicas": cluster.replicas,
                               "max_replicas": cluster.max_replicas}
    if cluster.scale_on in (None, "streams"):
        target = cluster.scale_target or max(1.0, config.max_streams / 2)
        scaling["policy"] = {"policy_function": SCALING, "policy_kwargs": {"target": target}}
    elif cluster.scale_target:
        scaling["target_ongoing_requests"] = cluster.scale_target
    options["autoscaling_config"] = scaling
    return options


@serve.deployment(name="statekv")
@serve.ingress()
class StreamReplica:
    """One replica: the model loaded once, its streams (stepped together with ``push_many`` by one worker), the
    whole HTTP app (API, OpenAI route, page, metrics) over the shared state folder."""

    def __init__(self, config: ServeConfig, cluster: ClusterSettings):
        from ...console import quiet_libraries
        from ..app import create_app
        from .hosting import ReplicaHosting

        quiet_libraries()
        logging.getLogger("statekv").setLevel(logging.INFO)
        replica = serve.get_replica_context().replica_id.unique_id
        config, tier_root = own_tier(config, replica)
        self.hosting = ReplicaHosting(config, replica, cluster.lease_seconds, cluster.store, tier_root,
                                      stopping=application_deleted())
        self.service_app = create_app(config, hosting=self.hosting)
        self.placing = PlacingLog()
        self.service_app.add_middleware(RecordPlacing, log=self.placing, held=self.hosting.holds)

    def __serve_build_asgi_app__(self) -> Any:
        return self.service_app

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the routers place new streams by: the streams held, and the requests that may have placed one here
        that have answered (`statekv.serve.cluster.placing`). Async, so that it runs on the app's event loop between
        two of its steps: a request listed has placed its stream, if it did, and the stream is among those held."""
        return {"answered": self.placing.recent(), "held": self.hosting.held()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {STREAMS_METRIC: float(self.hosting.streams)}

    def check_health(self) -> None:
        self.hosting.check()


def application_deleted() -> Callable[[], bool]:
    """What says whether Ray Serve is deleting this replica's application (a Ctrl-C or SIGTERM of `statekv serve
    --ray`, ``serve delete``), by the controller's status; an application the status does not list (a controller
    that cannot be reached answers with none) is not taken for one being deleted."""
    from ray.serve.schema import ApplicationStatus

    name = serve.get_replica_context().app_name

    def deleted() -> bool:
        application = serve.status().applications.get(name)
        return application is not None and application.status == ApplicationStatus.DELETING

    return deleted


def own_tier(config: ServeConfig, replica: str) -> tuple[ServeConfig, Path | None]:
    """With ``--offload disk``: the settings with the replica's own subfolder of ``--offload-dir`` for its
    streams' file sets, and that folder's parent; otherwise the settings as they are and None."""
    from dataclasses import replace

    options = config.options
    if options.offload != "disk":
        return config, None
    root = Path(options.offload_dir)
    return replace(config, options=options.with_changes(offload_dir=str(root / replica))), root


def application(config: ServeConfig, cluster: ClusterSettings) -> Any:
    """The Ray Serve application (for ``serve.run``): `StreamReplica` with `deployment_options`. The state folder
    must be one path every node reaches (a shared filesystem mounted at the same place); with none
    (``config.state_dir`` None), everything is in the object store ``cluster.store``, which every node reaches
    with the credentials of its environment."""
    config = _absolute(config)
    return StreamReplica.options(**deployment_options(config, cluster)).bind(config, cluster)


def _absolute(config: ServeConfig) -> ServeConfig:
    from dataclasses import replace

    media_root = None if config.media_root is None else Path(config.media_root).resolve()
    state_dir = None if config.state_dir is None else Path(config.state_dir).resolve()
    return replace(config, state_dir=state_dir, media_root=media_root)
