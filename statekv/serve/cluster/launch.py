"""``statekv serve --ray ADDRESS``: connect to a Ray cluster, run the service on it with Ray Serve until Ctrl-C or
SIGTERM, then delete the application (each replica saves its streams and lets them go) and disconnect."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import ConfigurationError
from ...stopping import Stopped
from ..config import ServeConfig
from ..listening import shown_address
from .deployment import ClusterSettings, application

CONNECT_SECONDS = 5.0
CLAIM_SECONDS = 15.0  # how long a driver that has just ended may still hold the application's claim
ACTOR_START_SECONDS = 120.0


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine belongs to) as a driver."""
    import ray

    host, _, port = address.rpartition(":")
    answered = False
    if host and port.isdigit() and "://" not in address:  # a head's host:port: Ray would wait minutes for it
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
        except OSError as error:
            raise ConfigurationError(f"--ray {address}: no Ray cluster answers there ({error.strerror or error}); "
                                     "give the address of its head (ray start --head prints it)") from None
        answered = True
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if answered:  # something listens there: most often a cluster that wants a token this driver lacks
            raise ConfigurationError(f"--ray {address}: something answers there but this driver could not join it "
                                     f"({reason}); a cluster started with token authentication needs RAY_AUTH_MODE="
                                     "token and RAY_AUTH_TOKEN set here as on its nodes") from None
        raise ConfigurationError(f"--ray {address}: cannot join a Ray cluster there ({reason}); start one with "
                                 "`ray start --head` (or give the address of its head)") from None


def run_on_ray(config: ServeConfig, cluster: ClusterSettings, address: str, host: str, port: int,
               ready: Callable[[str], None], starting: Callable[[], None] = lambda: None,
               refused: Callable[[], None] = lambda: None) -> None:
    """Serve on the cluster at ``address`` behind Ray Serve's HTTP proxies on ``host:port``; ``ready(url)`` is called
    once every replica is up. Returns after Ctrl-C or SIGTERM, the application deleted. ``starting()`` is called
    once nothing but the replicas can refuse the start (the cluster joined, no other driver serving the
    application), before they start; ``refused()`` when the start ends before ``ready`` (refused or stopped).
    Until the replicas are up a SIGTERM stops the start as Ctrl-C does."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    if not 1 <= port <= 65535:
        raise ConfigurationError(f"--port {port}: with --ray, give the port Ray Serve's proxies listen on")
    previous = signal.getsignal(signal.SIGTERM)  # the command's: ray.init replaces it with one exiting at once
    connect(address)
    stop, serving, claim, started, stopped_by = threading.Event(), False, None, False, []

    def on_sigterm(number: int, frame: object) -> None:
        if not serving:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut short what the stop does
            stopped_by.append(number)
            raise Stopped(number)  # the start is stopped as Ctrl-C stops it
        stop.set()  # the service is: the loop below ends, then the application is deleted

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
        started = not _serve_running()
        claim = claim_application(cluster.name, f"statekv serve on http://{shown_address(host, port)}")
        try:
            serve.start(http_options={"host": host, "port": port})
        except Exception as error:  # a port the proxy cannot bind comes back as its actor's failure
            if "Failed to bind" not in str(error):
                raise
            raise ConfigurationError(f"cannot listen on {shown_address(host, port)}: Ray Serve's proxy could not "
                                     "bind it (in use, or not an address of this machine); give --host and --port "
                                     "free ones") from None
        url = f"http://{shown_address(host, port)}"
        if not started:  # Ray Serve keeps the HTTP options it was started with
            note, url = proxies_note(host, port, proxies_address())
            if note:
                print(f"statekv serve: {note}", flush=True)
        starting()
        try:
            serve.run(application(config, cluster), name=cluster.name, route_prefix="/")
        except RuntimeError as error:
            raise ConfigurationError(f"the replicas did not start on the Ray cluster: {str(error).splitlines()[0]}; "
                                     "their logs are in the cluster's session folder") from None
        except RayServeException as error:  # e.g. another application serves the route
            raise ConfigurationError(f"Ray Serve refused the application: {serve_reason(error)}") from None
        serving = True
        ready(url)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    except KeyboardInterrupt as interrupt:  # Ray's waits re-raise a stop they catch as a plain KeyboardInterrupt
        if stopped_by and not isinstance(interrupt, Stopped):
            raise Stopped(stopped_by[0]) from None
        raise
    finally:
        try:
            if claim is not None:  # another driver's application is not this one's to delete
                if not serving:  # replicas still waiting for room would hold the deletion for their graceful timeout
                    serve.delete(cluster.name, _blocking=False)
                    try:
                        end_unplaced_replicas(cluster.name)
                    except Exception as error:  # noqa: BLE001 - the deletion below still ends them, only later
                        logging.getLogger("statekv.serve").warning("cannot end the replicas not started: %s", error)
                serve.delete(cluster.name)  # graceful: every replica saves its streams, then lets them go
                if started:
                    serve.shutdown()  # Ray Serve was started here: leave the cluster as it was found
                ray.kill(claim)  # the application is free for the next driver at once
        except Exception as error:  # noqa: BLE001 - the driver disconnects whatever happened
            logging.getLogger("statekv.serve").error("stopping the application failed: %s", error)
        finally:
            if not serving:
                refused()
            ray.shutdown()
            if previous is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signal.SIGTERM, previous)


DRIVERS_NAMESPACE = "statekv"
SERVE_NAMESPACE = "serve"  # where Ray Serve names its replicas, "SERVE_REPLICA::<application>#<deployment>#<id>"
SERVE_CONTROLLER = "SERVE_CONTROLLER_ACTOR"  # the name of Ray Serve's controller, in SERVE_NAMESPACE
# a replica of the application being deleted that is not ready this long after is taken as not started
PLACED_SECONDS = 5.0


def end_unplaced_replicas(name: str) -> int:
    """End the replicas of application ``name`` that have not started (Ray found no room for them, or their process
    is still coming up), once its deletion has begun: Ray Serve would wait out each one's graceful timeout before
    ending one it never placed (ray-project/ray#50426), yet none of them ever held a stream. Replicas that run
    answer at once and are left to stop gracefully. Returns how many were ended."""
    import ray

    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor.get("namespace") == SERVE_NAMESPACE and actor["name"].startswith(f"SERVE_REPLICA::{name}#")]
    handles = []
    for actor_name in names:
        with contextlib.suppress(ValueError):  # ended meanwhile
            handles.append(ray.get_actor(actor_name, namespace=SERVE_NAMESPACE))
    ready = {handle.__ray_ready__.remote(): handle for handle in handles}
    placed, _ = ray.wait(list(ready), num_returns=len(ready), timeout=PLACED_SECONDS) if ready else ([], [])
    unplaced = [handle for ref, handle in ready.items() if ref not in placed]
    for handle in unplaced:
        ray.kill(handle, no_restart=True)
    return len(unplaced)


def claim_application(name: str, holder: str) -> Any:
    """Claim the Ray Serve application ``name`` for this driver, for as long as it is connected: a named actor
    that Ray ends with the driver's job (a driver killed with -9 too), so a second ``statekv serve --ray`` on the
    cluster is refused in one line naming the first, instead of replacing its application under its clients. An
    application left by a driver that is gone is taken over, as a restart should. Returns the actor's handle (keep
    it while serving)."""
    import ray

    @ray.remote(num_cpus=0)
    class Driver:
        def __init__(self, holder: str):
            self.holder = holder

        def describe(self) -> str:
            return self.holder

    actor_name = f"{name}-driver"
    deadline = time.monotonic() + CLAIM_SECONDS
    while True:
        try:  # a taken name is refused at once, or (registered meanwhile) when the actor would start
            claim = Driver.options(name=actor_name, namespace=DRIVERS_NAMESPACE).remote(
                f"{holder} (pid {os.getpid()} on {socket.gethostname()})")
            ray.get(claim.describe.remote(), timeout=ACTOR_START_SECONDS)
            return claim
        except ray.exceptions.GetTimeoutError:
            raise ConfigurationError(f"the Ray cluster started no process for this driver's claim of the application "
                                     f"in {ACTOR_START_SECONDS:g} s (a Ray worker of no CPU); see its logs") from None
        except ValueError:  # the name is taken: another driver is connected, or its end is not yet known
            pass
        except ray.exceptions.RayActorError:
            pass
        try:
            other = ray.get(ray.get_actor(actor_name, namespace=DRIVERS_NAMESPACE).describe.remote(),
                            timeout=CONNECT_SECONDS)
        except Exception:  # noqa: BLE001 - gone meanwhile, or ending with its driver: claim it again
            other = None
        if other is not None or time.monotonic() > deadline:
            raise ConfigurationError(f"{other or 'another statekv serve'} already serves the application {name!r} on "
                                     "this Ray cluster; stop it first (its streams are kept), or send requests to "
                                     "it") from None
        time.sleep(0.5)


def proxies_note(host: str, port: int, proxies: tuple[str, int] | None) -> tuple[str | None, str]:
    """What to say when Ray Serve already ran (its proxies listen where they were started: at ``proxies``, None
    when unknown) and the address to show, given the ``--host`` and ``--port`` asked for."""
    if proxies is None:
        return (f"Ray Serve already runs on this cluster: its proxies listen where they were started to, which "
                f"--host {host} --port {port} cannot change"), f"http://{shown_address(host, port)}"
    url = f"http://{shown_address(*proxies)}"
    if proxies == (host, port):
        return None, url
    return (f"Ray Serve already runs on this cluster, its proxies on {shown_address(*proxies)}: --host {host} "
            f"--port {port} cannot change that"), url


def serve_reason(error: BaseException) -> str:
    """A Ray Serve refusal's own words: the last line of its message (a refusal raised in the controller comes
    after the task's header and traceback), without the exception's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1].rpartition("RayServeException: ")[2]


def proxies_address() -> tuple[str, int] | None:
    """Where the running Ray Serve's proxies listen, as its controller (the actor Ray Serve names
    `SERVE_CONTROLLER`) says; None when it does not say."""
    import ray

    try:
        controller = ray.get_actor(SERVE_CONTROLLER, namespace=SERVE_NAMESPACE)
        options = ray.get(controller.get_http_config.remote(), timeout=CONNECT_SECONDS)
        return str(options.host), int(options.port)
    except Exception:  # noqa: BLE001 - the controller's methods are Ray Serve's own: the note falls back to unknown
        return None


def _serve_running() -> bool:
    """Whether Ray Serve already runs on the cluster (its proxies or applications are up)."""
    from ray import serve

    status = serve.status()
    return bool(status.proxies or status.applications)
