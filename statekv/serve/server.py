"""uvicorn's server for an app of `statekv.serve.app.create_app`: as it stops, it first ends every client's feed
of watch events (``GET /v1/streams/{id}/events``), which never ends of itself and would otherwise hold uvicorn's
graceful shutdown until its timeout, then be cancelled with a traceback."""

from __future__ import annotations

from typing import Any

import uvicorn


class AppServer(uvicorn.Server):
    """``uvicorn.Server(uvicorn.Config(app, **options))`` for ``app`` (a statekv app)."""

    def __init__(self, app: Any, **options: Any):
        super().__init__(uvicorn.Config(app, **options))
        self.watch_hub = app.state.service.watch_hub

    async def shutdown(self, sockets: list | None = None) -> None:
        self.watch_hub.close()
        await super().shutdown(sockets=sockets)
