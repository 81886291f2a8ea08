"""``statekv serve``: the HTTP service (see docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..errors import ConfigurationError
from ..settings.methods import MethodSettings
from ..settings.options import ModelOptions
from ..values import POSITIVE_FLOAT, POSITIVE_INT
from .defaults import BUILTIN_BUDGET, builtin_budget


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve live video question answering over HTTP (OpenAI-compatible), with a page at /",
        description="Serve streams over HTTP: create a stream, push frames (images or a video file under "
                    "--media-root), ask at any time; OpenAI-compatible chat completions with video_url parts; "
                    "streams are kept in --state-dir and come back after a restart. Every /v1 route needs an "
                    "API key (Authorization: Bearer KEY).",
    )
    model_group = ModelOptions.add_arguments(parser, model_required=False)
    for action in model_group._group_actions:  # argparse keeps a group's actions only there
        if action.dest == "budget":
            action.help = (f"statekv, keynorm: tokens carried per layer and KV head (default: {BUILTIN_BUDGET} for "
                           f"the built-in model, else {MethodSettings.budget})")
    parser.set_defaults(model="builtin", budget=None)
    group = parser.add_argument_group("service")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    group.add_argument("--state-dir", default=None, metavar="DIR",
                       help="where streams are kept across restarts (default: ./statekv-state)")
    group.add_argument("--media-root", default=None, metavar="DIR",
                       help="the folder server-side sources (JSON {\"source\": PATH}, file:// video URLs) may be "
                            "read from (default: none; server-side sources are refused)")
    group.add_argument("--max-streams", type=POSITIVE_INT, default=64, metavar="N",
                       help="streams held at once, all keys together (default: 64)")
    group.add_argument("--max-asks", type=POSITIVE_INT, default=32, metavar="N",
                       help="questions answered or waiting at once; more get 429 (default: 32)")
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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..console import quiet_libraries
    from ..serve import ServeConfig, create_app
    from ..serve.auth import KeyFile, configured_keys

    args.budget = builtin_budget(args.model, args.budget, MethodSettings.budget)
    options = ModelOptions.from_args(args)
    state_dir = Path(args.state_dir or "statekv-state")
    media_root = None
    if args.media_root is not None:
        media_root = Path(args.media_root)
        if not media_root.is_dir():
            raise ConfigurationError(f"--media-root {media_root}: not a folder")
    if not 0 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: not a port number")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigurationError(f"--state-dir {state_dir}: {error.strerror or error}") from None
    keys = configured_keys(args.api_key)
    stored = KeyFile(state_dir)
    made = stored.make() if not keys and not stored.stored() else None
    if made:  # at once: a start that fails later must not lose the only sight of the key
        print(f"statekv serve: API key {made} (made for {state_dir} and shown this once: the folder keeps only "
              "its digest; it stays valid across restarts)", flush=True)
    config = ServeConfig(options=options, state_dir=state_dir, api_keys=tuple(keys), media_root=media_root,
                         drop_unowned_streams=args.drop_unowned_streams, max_streams=args.max_streams,
                         max_asks=args.max_asks, max_body_bytes=int(args.max_body_mb * 2**20),
                         save_every_frames=args.save_every_frames, save_every_seconds=args.save_every_seconds,
                         page=args.page)
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="statekv serve: %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=10))
    key_note = None if made or keys else (
        f"statekv serve: using the API key made for {state_dir} when it was first served (shown then); the page "
        "remembers it, or pass --api-key to choose one")
    _announce_when_up(server, args.host, made or (keys[0] if keys else None), key_note)
    server.run()
    return 0


def _announce_when_up(server, host: str, key: str | None, key_note: str | None) -> None:
    """Print the address (with the key when it is known, as Jupyter prints its token) once the socket is bound."""
    started = server.startup

    async def startup(sockets=None):
        await started(sockets=sockets)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else "?"
        shown = f"[{host}]" if ":" in host else host
        print(f"statekv serve: listening on http://{shown}:{port}", flush=True)
        if key_note:
            print(key_note, flush=True)
        print(f"statekv serve: open http://{shown}:{port}/" + (f"?key={key}" if key else ""), flush=True)
        print(f"statekv serve: ready (pid {os.getpid()})", file=sys.stderr, flush=True)

    server.startup = startup
