"""``statekv serve``: live video question answering over HTTP (FastAPI + uvicorn), with durable per-key streams
and a page for people.

    app = create_app(ServeConfig(options=ModelOptions(model="builtin"), state_dir=Path("state"), ...))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Modules: `config` (settings), `auth` (API keys), `media` (paths under --media-root), `limits` (body, image and
concurrency limits), `worker` (where model work runs), `registry` (streams and their durability), `metrics`
(Prometheus), `routes` and `openai` (the HTTP API), `page` (the page at /), `app` (putting them together).
"""

from .config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(config: ServeConfig, qa=None):
    """The FastAPI application for ``config`` (``qa``: a loaded `VideoQA` to serve instead of loading one)."""
    from .app import create_app as _create

    return _create(config, qa)
