"""``statekv serve``: the HTTP service (see docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..serve.cluster.leases import LEASE_SECONDS
from ..settings.options import ModelOptions
from ..settings.values import NON_NEGATIVE_FLOAT, PATH_TEXT, POSITIVE_FLOAT, POSITIVE_INT, printable

SCALE_ON = ("streams", "requests")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve live video question answering over HTTP (OpenAI-compatible), with a page at /",
        description="Serve streams over HTTP: create a stream, push frames (images or a video file under "
                    "--media-root), ask at any time; OpenAI-compatible chat completions with video_url parts; "
                    "streams are kept in --state-dir and come back after a restart. Every /v1 route needs an "
                    "API key (Authorization: Bearer KEY).",
    )
    ModelOptions.add_arguments(parser, model_required=False)
    parser.set_defaults(model="builtin")
    group = parser.add_argument_group("service")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    group.add_argument("--state-dir", default=None, metavar="DIR", type=PATH_TEXT,
                       help="where streams are kept across restarts (default: ./statekv-state)")
    group.add_argument("--media-root", default=None, metavar="DIR", type=PATH_TEXT,
                       help="the folder server-side sources (JSON {\"source\": PATH}, file:// video URLs) may be "
                            "read from (default: none; server-side sources are refused)")
    group.add_argument("--max-streams", type=POSITIVE_INT, default=64, metavar="N",
                       help="streams held at once, all keys together; with --ray, by each replica (default: 64)")
    group.add_argument("--max-asks", type=POSITIVE_INT, default=32, metavar="N",
                       help="questions answered or waiting at once; more get 429 (default: 32)")
    group.add_argument("--max-followers", type=POSITIVE_INT, default=256, metavar="N",
                       help="clients following watch events at once, all keys together; more get 429 (default: 256)")
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="an accepted API key (repeatable; default: STATEKV_API_KEYS, comma-separated; without "
                            "either, a key is made the first time for the state folder, printed once and kept there "
                            "as a digest)")
    group.add_argument("--drop-unowned-streams", action="store_true",
                       help="delete the state folder's streams whose key is not accepted (without it the server "
                            "refuses to start over them)")
    group.add_argument("--max-body-mb", type=POSITIVE_FLOAT, default=16.0, metavar="MB",
                       help="largest request body (default: 16)")
    group.add_argument("--save-every-frames", type=POSITIVE_INT, default=256, metavar="N",
                       help="save a stream after N unsaved frames (default: 256)")
    group.add_argument("--save-every-seconds", type=POSITIVE_FLOAT, default=30.0, metavar="S",
                       help="save a stream whose frames have been unsaved for S seconds (default: 30)")
    group.add_argument("--no-page", dest="page", action="store_false", help="serve the API only, no page at /")
    group.add_argument("--no-quiet-catch-up", dest="quiet_catch_up", action="store_false",
                       help="replay a stream's handover backlog only in the push that passes the model's range "
                            "(default: also while no push or question waits, once it has taken half the range)")
    ray = parser.add_argument_group("on a Ray cluster (Ray Serve; see docs/serving.md)")
    ray.add_argument("--ray", default=None, metavar="ADDRESS",
                     help="run on the Ray cluster at ADDRESS (auto: the one this machine joined with `ray start`): "
                          "replicas behind Ray Serve's HTTP proxies on --host/--port, each stream's requests routed "
                          "to the replica holding it; give --state-dir, a folder every node reaches, or --store "
                          "alone to keep everything in an object store (one of the two is needed)")
    ray.add_argument("--replicas", type=POSITIVE_INT, default=None, metavar="N",
                     help="replicas, each one model with its streams (default: 1; the least, with --max-replicas)")
    ray.add_argument("--max-replicas", type=POSITIVE_INT, default=None, metavar="M",
                     help="autoscale between --replicas and M replicas (default: a fixed number)")
    ray.add_argument("--scale-on", choices=SCALE_ON, default=None,
                     help="what autoscaling follows: streams held (default) or requests under way per replica")
    ray.add_argument("--scale-target", type=POSITIVE_FLOAT, default=None, metavar="X",
                     help="streams per replica (default: half of --max-streams), or requests under way per replica "
                          "(default: Ray Serve's, 2), that autoscaling aims at")
    ray.add_argument("--lease-seconds", type=POSITIVE_FLOAT, default=None, metavar="S",
                     help="how long a replica's hold on a stream lasts unrenewed: a dead replica's streams come back "
                          f"on another after at most this (default: {LEASE_SECONDS:g})")
    ray.add_argument("--store", default=None, metavar="URL",
                     help="keep streams in object storage at this fsspec URL (s3://bucket/prefix, gs://..., az://..., "
                          "file://...): alone, everything the replicas share (keys, records, leases fenced by the "
                          "store's conditional writes, saved streams; no shared folder needed); with --state-dir, "
                          "the saved streams only (the folder holds keys, records and leases). Credentials and "
                          "endpoint come from the store's usual environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL...)")
    ray.add_argument("--replica-cpus", type=POSITIVE_FLOAT, default=None, metavar="C",
                     help="CPUs each replica reserves from Ray (default: 1)")
    ray.add_argument("--replica-gpus", type=NON_NEGATIVE_FLOAT, default=None, metavar="G",
                     help="GPUs each replica reserves from Ray (default: 1 with --device cuda, else 0)")
    parser.set_defaults(run=run)


RAY_FLAGS = ("replicas", "max_replicas", "scale_on", "scale_target", "lease_seconds", "store", "replica_cpus",
             "replica_gpus")


SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")  # what the server imports of the serve extra
PAGE_MODULES = ("nicegui",)  # and the page's (not imported under --no-page)


def run(args: argparse.Namespace) -> int:
    from ..console import check_extra, quiet_libraries

    # else a traceback, the page's only after the model has loaded
    check_extra("serve", SERVER_MODULES + (PAGE_MODULES if args.page else ()), "statekv serve")
    from ..serve import create_app
    from ..serve.server import AppServer

    cluster = cluster_settings(args)  # a flag refused before anything is bound, locked or made
    claim = DeploymentClaim(args.store) if cluster is not None else LoneServer(args.host, args.port)
    try:
        # a key the folder needs is kept only once everything that could refuse the start has passed
        config, made, keys, pending = serve_settings(args, claim)
        key_note = None if made or pending or keys else (
            f"statekv serve: using the API key made for {printable(config.state_dir or args.store)} when it was first "
            "served (shown then); the page remembers it, or pass --api-key to choose one")
        if cluster is not None:
            return _run_on_ray(args, config, cluster, made, pending, keys, key_note)
        quiet_libraries()
        logging.basicConfig(level=logging.WARNING, format="statekv serve: %(levelname)s %(name)s: %(message)s")
        app = create_app(replace(config, api_keys=config.api_keys + ((pending,) if pending else ())))
        made = keep_key(config.state_dir, pending) or made
        server = AppServer(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
        brought = _brought_back(app.state.service.registry, config.state_dir)
        _announce_when_up(server, args.host, made, key_note, brought)  # a key given is not printed: it goes to logs
        server.run(sockets=claim.sockets)
        return 0
    finally:
        claim.release()


class LoneServer:
    """What a server alone claims before it writes to its state folder or loads its model, and holds for its
    whole life: its listening sockets (a port in use stops it at once) and its state folder's locks (so does a
    second server on the folder, or a ``--ray`` deployment serving it). Replicas on Ray claim no socket: Ray
    Serve's proxies listen (`DeploymentClaim`)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sockets: list = []
        self.lock = None

    def __call__(self, state_dir: Path) -> None:
        from ..serve.listening import listening_sockets, shown_address
        from ..serve.store import hold_state_folder

        self.sockets = listening_sockets(self.host, self.port)
        port = self.sockets[0].getsockname()[1]
        self.lock = hold_state_folder(state_dir, holder=f"statekv serve on http://{shown_address(self.host, port)}")

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        for bound in self.sockets:
            bound.close()


class DeploymentClaim:
    """What ``statekv serve --ray`` claims before it writes to the state folder (a key) or starts a replica, and
    holds while it runs: the folder's lock shared with the replicas (`statekv.serve.store.join_state_folder`), so
    a lone server on the folder stops it at once, in one line naming that server. Each replica holds it too.
    With an object store alone (``store``, no state folder) there is no folder to lock and its leases order the
    replicas' writes. An object store given is checked either way (`statekv.serve.cluster.hosting.open_store`),
    before anything is written to it or the folder."""

    def __init__(self, store: str | None = None):
        self.store = store
        self.lock = None
        self.objects = None  # the object store, checked, when it alone keeps the streams

    def __call__(self, state_dir: Path | None) -> None:
        from ..serve.cluster.hosting import open_store

        if state_dir is None:
            self.objects = open_store(self.store)
            return
        if self.store is not None:
            open_store(self.store)  # the saves go there: a bucket that cannot be written is refused now
        from ..serve.store import join_state_folder

        self.lock = join_state_folder(state_dir)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def serve_config(args: argparse.Namespace, claim: Callable[[Path], None] | None = None):
    """The service's settings from the command line (``--budget`` defaulted to the model's own,
    `statekv.settings.options.default_budget`), with the key made for the state folder (printed at once) if it
    has none and none was given: ``(config, made, keys)``. ``claim`` is called with the state folder once the
    arguments are checked, before anything is written there (`LoneServer`, `DeploymentClaim`)."""
    config, made, keys, _ = serve_settings(args, claim, defer_key=False)
    return config, made, keys


def serve_settings(args: argparse.Namespace, claim: Callable[[Path], None] | None = None, defer_key: bool = True):
    """`serve_config`'s settings, ``(config, made, keys, pending)``: with ``defer_key``, a key the state folder or
    object store needs is only made (``pending``), to be kept once the start can no longer be refused (`keep_key`;
    under ``--ray``, just before the replicas start); without, it is kept at once (``made``)."""
    from ..serve import ServeConfig
    from ..serve.auth import KeyFile, configured_keys, new_key
    from ..serve.store import check_state_folder

    options = ModelOptions.from_args(args)
    alone_in_store = getattr(args, "store", None) is not None and args.state_dir is None
    if args.state_dir is not None and "://" in args.state_dir:  # a path would make a local folder named "s3:"
        raise ConfigurationError(f"--state-dir {printable(args.state_dir)}: a URL, and --state-dir is a folder "
                                 "(local or mounted); to keep streams in object storage: --ray with --store URL")
    state_dir = None if alone_in_store else Path(args.state_dir or "statekv-state")
    media_root = None
    if args.media_root is not None:
        media_root = Path(args.media_root)
        if not media_root.is_dir():
            raise ConfigurationError(f"--media-root {printable(media_root)}: not a folder")
    if not 0 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: not a port number")
    keys = configured_keys(args.api_key)  # a key no client could send is refused before the folder is claimed
    if claim is not None:
        claim(state_dir)
    if state_dir is None:  # everything in the object store, checked by the claim
        from ..serve.cluster.hosting import open_store
        from ..serve.cluster.store_files import StoreKeyFile

        stored, place = StoreKeyFile(getattr(claim, "objects", None) or open_store(args.store)), args.store
    else:
        check_state_folder(state_dir)  # one line, before anything is written there
        stored, place = KeyFile(state_dir), state_dir
    made = pending = None
    if not keys and not stored.stored():
        if defer_key:
            pending = new_key()
        else:
            made = stored.make()
    if made:  # at once: a start that fails later must not lose the only sight of the key
        print(f"statekv serve: API key {made} (made for {printable(place)} and shown this once: "
              f"{'the folder' if state_dir is not None else 'the store'} keeps only its digest; it stays valid across "
              "restarts)", flush=True)
    config = ServeConfig(options=options, state_dir=state_dir, api_keys=tuple(keys), media_root=media_root,
                         drop_unowned_streams=args.drop_unowned_streams, max_streams=args.max_streams,
                         max_asks=args.max_asks, max_followers=args.max_followers,
                         max_body_bytes=int(args.max_body_mb * 2**20),
                         save_every_frames=args.save_every_frames, save_every_seconds=args.save_every_seconds,
                         page=args.page, quiet_catch_up=args.quiet_catch_up)
    return config, made, keys, pending


def keep_key(state_dir: Path | None, key: str | None) -> str | None:
    """Store ``key`` as the state folder's (None: nothing to store) and print it, once: the folder keeps only its
    digest. Returns it; refused (one line) when the folder had a key made meanwhile."""
    from ..serve.auth import KeyFile

    if key is None:
        return None
    if not KeyFile(state_dir).keep(key):
        raise ConfigurationError(f"another server made a key for {printable(state_dir)} meanwhile; start again to "
                                 "use it")
    print(f"statekv serve: API key {key} (made for {printable(state_dir)} and shown this once: the folder keeps "
          "only its digest; it stays valid across restarts)", flush=True)
    return key


def cluster_settings(args: argparse.Namespace):
    """The Ray settings (`statekv.serve.cluster.deployment.ClusterSettings`) with ``--ray``; None without it (then
    no Ray flag may be given)."""
    given = [name for name in RAY_FLAGS if getattr(args, name, None) is not None]
    if args.ray is None:
        if given:
            raise ConfigurationError(f"--{given[0].replace('_', '-')} is for a Ray cluster: add --ray auto (or the "
                                     "cluster's address)")
        return None
    try:
        from ..serve.cluster.deployment import ClusterSettings
    except ImportError as error:
        raise ConfigurationError(f"--ray needs Ray Serve ({error.name or error} is missing): pip install "
                                 "'statekv[ray]' (in a checkout: pip install -c constraints.txt -e '.[ray]')") from None
    if args.store is not None:
        _check_store(args.store)
    if args.state_dir is None and args.store is None:
        raise ConfigurationError("--ray needs --state-dir (a folder every node mounts) or --store (an object store): "
                                 "the default ./statekv-state is this machine's own folder")
    if args.max_replicas is not None and args.scale_on in (None, "streams") and args.scale_target is not None \
            and args.scale_target >= args.max_streams:
        raise ConfigurationError(f"--scale-target {args.scale_target:g} streams per replica must be fewer than "
                                 f"--max-streams {args.max_streams}: a replica never holds more, so no replica would "
                                 "ever be added")
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(args.device or "").startswith("cuda") else 0.0
    return ClusterSettings(
        replicas=args.replicas or 1, max_replicas=args.max_replicas, scale_on=args.scale_on,
        scale_target=args.scale_target, lease_seconds=args.lease_seconds or LEASE_SECONDS, store=args.store,
        replica_cpus=args.replica_cpus or 1.0, replica_gpus=gpus)


PRIVATE_STORES = ("memory",)  # fsspec file systems held by one process


def _check_store(url: str) -> None:
    """``--store``: a URL fsspec can open (its filesystem's package installed), naming a bucket or folder (a path
    with no scheme, or a scheme with nothing after it, is a mistyped URL, not a folder to make here)."""
    scheme, separator, rest = url.partition("://")
    if not separator or not scheme:
        raise ConfigurationError(f"--store {url}: not a URL; give one such as s3://bucket/prefix (or "
                                 "file:///shared/folder for a folder every node mounts)")
    if not rest.strip("/"):
        raise ConfigurationError(f"--store {url}: names no bucket or folder; give one such as {scheme}://bucket/prefix")
    if scheme in PRIVATE_STORES:
        raise ConfigurationError(f"--store {url}: a {scheme}:// store lives in one process, so replicas would not "
                                 "share it and it ends with the process; give a bucket (s3://, gs://, az://) or a "
                                 "folder every node mounts (file:///shared/folder)")
    if "::" in url:
        raise ConfigurationError(f"--store {url}: a chained URL (fsspec's caching wrappers) serves an object another "
                                 "replica replaced as this one first read it, and its create-if-absent is not atomic; "
                                 "give the store's own URL")
    if scheme in ("file", "local") and not rest.startswith("/"):
        raise ConfigurationError(f"--store {url}: a relative folder is each process's own (from its working "
                                 "directory); give the folder's whole path, as in file:///shared/folder")
    try:
        import fsspec

        fsspec.core.url_to_fs(url)
    except (ImportError, ValueError, OSError) as error:
        raise ConfigurationError(f"--store {url}: fsspec cannot open it ({str(error).splitlines()[0]})") from None


def _run_on_ray(args: argparse.Namespace, config, cluster, made: str | None, pending: str | None, keys: list[str],
                key_note: str | None) -> int:
    from ..serve.app import check_owners
    from ..serve.auth import KeyFile, KeyRing
    from ..serve.cluster.launch import run_on_ray

    accepted = config.api_keys + ((pending,) if pending else ())
    if config.state_dir is None:  # before any replica starts
        from ..serve.cluster.hosting import open_store, store_keys
        from ..serve.cluster.store_files import StoreKeyFile, StoreStreamFiles

        store = open_store(cluster.store)
        files = StoreStreamFiles(store, f"statekv-serve-{os.getpid()}")
        try:
            check_owners(config, store_keys(store, accepted), files)
        finally:
            files.end()
        key_file = StoreKeyFile(store)
    else:
        check_owners(config, KeyRing.for_folder(config.state_dir, accepted))
        key_file = KeyFile(config.state_dir)
    key = pending or made  # a key given is not printed: it would go to the logs at every start
    kept = []

    def starting() -> None:  # the replicas read the key: kept before they start, only once nothing else refuses
        if pending is not None:
            place = printable(config.state_dir or cluster.store)
            if not key_file.keep(pending):
                raise ConfigurationError(f"another server made a key for {place} meanwhile; start again to use it")
            kept.append(pending)
            print(f"statekv serve: API key {pending} (made for {place} and shown this "
                  f"once: {'the folder' if config.state_dir is not None else 'the store'} keeps only its digest; it "
                  "stays valid across restarts)", flush=True)  # at once: a start killed later must not lose it

    def refused() -> None:  # a refused start leaves no key: the next start makes and shows the only one
        for withdrawn in kept:
            try:
                key_file.withdraw(withdrawn)
            except (ConfigurationError, OSError) as error:  # the refusal is what is said; this goes to the log
                logging.getLogger("statekv.serve").error("the key kept for a refused start stays: %s", error)
            else:
                print("statekv serve: the start did not finish: the key above was not kept (the next start makes "
                      "one)", flush=True)

    def ready(url: str) -> None:
        replicas = f"{cluster.replicas} to {cluster.max_replicas}" if cluster.max_replicas else str(cluster.replicas)
        print(f"statekv serve: listening on {url} (Ray Serve, {replicas} replica{'s' * (replicas != '1')})",
              flush=True)
        if key_note:
            print(key_note, flush=True)
        print(f"statekv serve: open {url}/" + (f"?key={key}" if key else ""), flush=True)
        print(f"statekv serve: ready (pid {os.getpid()})", file=sys.stderr, flush=True)

    run_on_ray(config, cluster, args.ray, args.host, args.port, ready, starting, refused)
    return 0


def ray_app(args: dict[str, Any]) -> Any:
    """The service as a Ray Serve application, for Ray's own tools: ``serve run statekv.commands.serve:ray_app
    state_dir=/shared/statekv replicas=2``, or a Serve config file's ``import_path`` with these ``args``. Every
    option of ``statekv serve`` is an argument (its flag's name with underscores; a list for one given several
    times, true for a switch); ``ray``, ``host`` and ``port`` are Ray Serve's own business (``http_options``)."""
    from ..serve.cluster.deployment import application

    argv = ["serve"]
    for name, value in (args or {}).items():
        flag = "--" + str(name).replace("_", "-")
        if name in ("ray", "host", "port"):
            raise ConfigurationError(f"{name} is set by Ray Serve (http_options, the cluster's address), not here")
        for item in value if isinstance(value, list) else [value]:
            if item is True:
                argv.append(flag)
            elif item not in (False, None):
                argv += [flag, str(item)]
    from ..settings.options import normalize_argv

    parser = _Refusing(prog="statekv")
    register(parser.add_subparsers(dest="command", required=True, parser_class=_Refusing))
    parsed = parser.parse_args(normalize_argv([*argv, "--ray", "auto"]))
    claim = DeploymentClaim(parsed.store)  # a folder a lone server holds is refused before a key is made there
    try:
        config, _, _ = serve_config(parsed, claim)  # a key made for the folder is printed where the app is built
    finally:
        claim.release()  # the replicas hold the folder from here (`ReplicaHosting`)
    return application(config, cluster_settings(parsed))


class _Refusing(argparse.ArgumentParser):
    """A parser whose refusal is a `ConfigurationError` (raised where a Ray Serve application is built)."""

    def error(self, message: str):
        raise ConfigurationError(f"the application's args are not options of statekv serve: {message} (see "
                                 "statekv serve --help)")


def _brought_back(registry, state_dir) -> str | None:
    """The line saying which streams a start brought back from its state folder (None: none)."""
    held, damaged = len(registry.entries), len(registry.damaged)
    if not held and not damaged:
        return None
    found = f" ({damaged} found damaged: quarantined, listed, not served)" if damaged else ""
    return f"statekv serve: brought back {held} stream{'s' * (held != 1)} from {printable(state_dir)}{found}"


def _announce_when_up(server, host: str, key: str | None, key_note: str | None, brought: str | None) -> None:
    """Print the address once the socket is bound (with the key when it was made by this start, as Jupyter prints
    its token: shown once, it is never printed again)."""
    started = server.startup

    async def startup(sockets=None):
        await started(sockets=sockets)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else "?"
        shown = f"[{host}]" if ":" in host else host
        print(f"statekv serve: listening on http://{shown}:{port}", flush=True)
        if brought:
            print(brought, flush=True)
        if key_note:
            print(key_note, flush=True)
        print(f"statekv serve: open http://{shown}:{port}/" + (f"?key={key}" if key else ""), flush=True)
        print(f"statekv serve: ready (pid {os.getpid()})", file=sys.stderr, flush=True)

    server.startup = startup
