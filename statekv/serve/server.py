"""uvicorn's server for an app of `statekv.serve.app.create_app`. As it stops, it first ends every client's feed
of watch events (``GET /v1/streams/{id}/events``), which never ends of itself and would otherwise hold uvicorn's
graceful shutdown until its timeout, then be cancelled with a traceback; and every feed of a video file, which
ends at its next frame, answering how to go on. Answers being given may finish until shortly before the graceful
shutdown's timeout (`ANSWER_MARGIN_SECONDS`); those still running then stop at their next token, answering with a
one-line 503, rather than be cancelled; a second Ctrl-C (or one after a SIGTERM) stops them at once, and the streams
are still saved as the app shuts down. A SIGHUP (the terminal closed) stops it as uvicorn's SIGTERM does, gracefully,
unless it was started ignoring SIGHUP (``nohup``); a second SIGTERM or SIGHUP changes nothing. It exits as stopped by
the first SIGTERM or SIGHUP it caught (143, 129), a Ctrl-C after or before it notwithstanding; else 130."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

# answers still running this long before the graceful shutdown's timeout (or at half of it, if shorter) are stopped,
# so that their 503s are written before uvicorn cancels what is left
ANSWER_MARGIN_SECONDS = 2.0


class AppServer(uvicorn.Server):
    """``uvicorn.Server(uvicorn.Config(app, **options))`` for ``app`` (a statekv app)."""

    def __init__(self, app: Any, **options: Any):
        super().__init__(uvicorn.Config(app, **options))
        self.watch_hub, self.registry = app.state.service.watch_hub, app.state.service.registry

    async def shutdown(self, sockets: list | None = None) -> None:
        self.watch_hub.close()
        self.registry.feeds.stop_all()  # a feed's request ends at its next frame, answered, not cancelled
        timeout = self.config.timeout_graceful_shutdown
        stop = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout - min(ANSWER_MARGIN_SECONDS, timeout / 2), self.registry.stop_answers)
        try:
            await super().shutdown(sockets=sockets)
        finally:  # ended, or cut short by a second Ctrl-C: no client is left to wait for an answer
            if stop is not None:
                stop.cancel()
            self.registry.stop_answers()
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            # a second Ctrl-C has uvicorn skip the app's shutdown: the streams are still saved and closed, by the
            # app's own shutdown now, rather than as its task is cancelled when the loop ends (a traceback logged)
            await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's (SIGINT and SIGTERM end the serving loop, then are raised again once it has ended), and SIGHUP
        alike: raised inside the loop, it would cut the requests under way with a traceback. A signal the server
        was started ignoring stays ignored (uvicorn's own would catch it)."""
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        numbers = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]
        ignored = [number for number in numbers if signal.getsignal(number) is signal.SIG_IGN]
        with super().capture_signals():
            previous = {number: signal.signal(number, signal.SIG_IGN if number in ignored else self.handle_exit)
                        for number in numbers}
            try:
                yield
            finally:  # before uvicorn puts its own back and raises what it captured again
                for number, handler in previous.items():
                    signal.signal(number, handler)
                # uvicorn raises them again last first, and the first raised is the stop: a SIGTERM or SIGHUP outranks
                # a Ctrl-C (one pressed after it to cut the graceful wait short), as in every statekv command
                stopping = [number for number in self._captured_signals if number != signal.SIGINT]
                self._captured_signals[:] = stopping[:1] or self._captured_signals[:1]
