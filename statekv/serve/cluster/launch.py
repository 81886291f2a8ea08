"""``statekv serve --ray ADDRESS``: connect to a Ray cluster, run the service on it with Ray Serve until Ctrl-C or
SIGTERM, then delete the application (each replica saves its streams and lets them go) and disconnect."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable

from ...errors import ConfigurationError
from ..config import ServeConfig
from ..listening import shown_address
from .deployment import ClusterSettings, application

CONNECT_SECONDS = 5.0


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine belongs to) as a driver."""
    import ray

    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:  # a head's host:port: Ray would wait minutes for it
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as error:
            raise ConfigurationError(f"--ray {address}: no Ray cluster answers there ({error.strerror or error}); "
                                     "give the address of its head (ray start --head prints it)") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigurationError(f"--ray {address}: cannot join a Ray cluster there ({reason}); start one with "
                                 "`ray start --head` (or give the address of its head)") from None


def run_on_ray(config: ServeConfig, cluster: ClusterSettings, address: str, host: str, port: int,
               ready: Callable[[str], None]) -> None:
    """Serve on the cluster at ``address`` behind Ray Serve's HTTP proxies on ``host:port``; ``ready(url)`` is called
    once every replica is up. Returns after Ctrl-C or SIGTERM, the application deleted."""
    import ray
    from ray import serve

    if not 1 <= port <= 65535:
        raise ConfigurationError(f"--port {port}: with --ray, give the port Ray Serve's proxies listen on")
    connect(address)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    started = not _serve_running()
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
        except Exception as error:  # a port the proxy cannot bind comes back as its actor's failure
            if "Failed to bind" not in str(error):
                raise
            raise ConfigurationError(f"cannot listen on {shown_address(host, port)}: Ray Serve's proxy could not "
                                     "bind it (in use, or not an address of this machine); give --host and --port "
                                     "free ones") from None
        if not started:  # Ray Serve keeps the HTTP options it was started with; its public API does not say them
            print(f"statekv serve: Ray Serve already runs on this cluster: its proxies listen where they were started "
                  f"to, which --host {host} --port {port} cannot change", flush=True)
        try:
            serve.run(application(config, cluster), name=cluster.name, route_prefix="/")
        except RuntimeError as error:
            raise ConfigurationError(f"the replicas did not start on the Ray cluster: {str(error).splitlines()[0]}; "
                                     "their logs are in the cluster's session folder") from None
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{port}")
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            serve.delete(cluster.name)  # graceful: every replica saves its streams, then lets them go
            if started:
                serve.shutdown()  # Ray Serve was started here: leave the cluster as it was found
        except Exception as error:  # noqa: BLE001 - the driver disconnects whatever happened
            logging.getLogger("statekv.serve").error("stopping the application failed: %s", error)
        finally:
            ray.shutdown()


def _serve_running() -> bool:
    """Whether Ray Serve already runs on the cluster (its proxies or applications are up)."""
    from ray import serve

    status = serve.status()
    return bool(status.proxies or status.applications)
