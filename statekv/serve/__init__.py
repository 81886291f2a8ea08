"""``statekv serve``: live video question answering over HTTP (FastAPI + uvicorn), with durable per-key streams
and a page for people.

    app = create_app(ServeConfig(options=ModelOptions(model="builtin", budget=64), state_dir=Path("state"),
                                 api_keys=("a-key",)))
    AppServer(app, host="127.0.0.1", port=8000).run()  # statekv.serve.server: uvicorn's, ending event feeds as it stops

Modules: `config` (settings), `auth` (API keys: those given and the key made for the state folder), `media`
(paths under --media-root), `limits` (body, image and concurrency limits), `worker` (where model work runs),
`registry` (the one stream service: per owner, pushing, feeding files, asking, saving; with `entries`,
`stream_settings`, `loading`, `answering`), `placement` (where its streams are held, a strategy it is given),
`store` (their files in the state folder, and its lock), `listening` (the sockets a server alone binds first),
`metrics` (Prometheus), `routes` and `openai` (the HTTP API, thin layers over the registry), `page` and
`page_parts` (the page at /), `app` (putting them together; `create_app` refuses a state folder holding streams no
accepted key owns); `cluster` (replicas on Ray, sharing a folder or an object store).
"""

from .config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(config: ServeConfig, qa=None):
    """The FastAPI application for ``config`` (``qa``: a loaded `VideoQA` to serve instead of loading one)."""
    from .app import create_app as _create

    return _create(config, qa)
