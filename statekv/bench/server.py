"""The server a benchmark drives: one it starts itself (`LocalServer`: ``statekv serve`` in its own process, on a
free loopback port, with a fresh state folder and key), and what its ``/metrics`` say of batching."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import StateKVError

LISTENING = "statekv serve: listening on "
BATCH_METRIC = "statekv_step_batch_size"
QUESTION_BATCH_METRIC = "statekv_question_batch_size"
FIRST_TOKEN_METRIC = "statekv_time_to_first_token_seconds"


class ServerError(StateKVError):
    """The server could not be started or reached, or stopped before it was ready."""

    kind = "server"


class _ServerBlock:
    """A server for the length of a ``with`` block: `_start` starts it, ``__exit__`` stops it and removes what it
    left; a start that fails or is stopped (a signal) leaves no server and no folder behind."""

    def __enter__(self):
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _start(self):
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        raise NotImplementedError


class LocalServer(_ServerBlock):
    """``statekv serve`` with ``options`` (its command-line flags) in a process of its own (``threads``: its torch
    threads), for the length of a ``with`` block: ``url`` and ``key`` once it listens. Its log is kept in its
    temporary folder (the last line is named if it fails to start). On Linux the server is sent SIGTERM if this
    process dies without stopping it (SIGKILL): the thread that starts it must live as long as it does."""

    def __init__(self, options: list[str], *, threads: int | None = None, start_timeout: float = 900.0):
        self.options, self.threads, self.start_timeout = options, threads, start_timeout
        self.key = secrets.token_hex(24)  # hex: never read as a flag (a key starting with "-" would be)
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def _start(self) -> "LocalServer":
        import statekv

        self._folder = tempfile.TemporaryDirectory(prefix="statekv-bench-")
        folder = Path(self._folder.name)
        log = folder / "serve.log"
        command = [sys.executable, "-m", "statekv.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--state-dir", str(folder / "state"), "--api-key", self.key, "--no-page", *self.options]
        source = str(Path(statekv.__file__).resolve().parents[1])  # this statekv, however it was found
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])))
        if self.threads is not None:  # torch's intra-op threads (more than the cores left to it only contend)
            env["OMP_NUM_THREADS"] = str(self.threads)
        with open(log, "w") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, preexec_fn=_ends_with_this_process())
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith(LISTENING):
                    self.url = line[len(LISTENING):].split()[0]
                    return self
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise ServerError(f"the server did not start: {self.last_said()}")

    def check_running(self) -> None:
        """A one-line `ServerError` with the server's last log line once it has exited (a run against it would only
        count failures)."""
        code = None if self.process is None else self.process.poll()
        if code is not None:
            raise ServerError(f"the server statekv bench serve started exited (status {code}) during the runs: "
                              f"{self.last_said()}")

    def last_said(self) -> str:
        """The last line the server wrote to its log."""
        lines = (Path(self._folder.name) / "serve.log").read_text(errors="replace").splitlines()
        return next((line for line in reversed(lines) if line.strip()), "no output")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None


def _ends_with_this_process():
    """A ``preexec_fn`` that has the child sent SIGTERM when this process dies, however it dies (SIGKILL, the OOM
    killer), so a server started for a benchmark is never left running, and holding its memory, behind it
    (Linux's ``PR_SET_PDEATHSIG``; None elsewhere: the child is then stopped only by ``__exit__``)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def ends_with_parent() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return ends_with_parent


def histogram_totals(url: str, metric: str = BATCH_METRIC) -> tuple[float, float] | None:
    """``(sum, count)`` of the server's ``metric`` histogram (``statekv_step_batch_size``: stream steps per
    language-model forward; ``statekv_question_batch_size``: questions per answering batch;
    ``statekv_time_to_first_token_seconds``: streamed answers' times to their first token), or None when its
    /metrics do not have it."""
    totals = metric_totals(url, metric, (f"{metric}_sum", f"{metric}_count"))
    if totals is None or len(totals) != 2:
        return None
    return totals[f"{metric}_sum"], totals[f"{metric}_count"]


def metric_totals(url: str, metric: str, samples: tuple[str, ...]) -> dict[str, float] | None:
    """The server's ``metric`` from its /metrics: each of its ``samples`` named there (e.g.
    ``statekv_quiet_catch_up_steps_total``), summed over labels; None when /metrics cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        reply = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:  # kept private (behind a proxy): the server's own counts are not known
        return None
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(reply.text):
            if family.name == metric:
                for sample in family.samples:
                    if sample.name in samples:
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:  # not Prometheus' text: whatever answers /metrics there is not the server
        return None
    return totals


def histogram_mean(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The mean of what a histogram observed between two readings of `histogram_totals` (stream steps per forward,
    questions per batch, seconds to a first token); None without both readings or with nothing observed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


class InProcessServer(_ServerBlock):
    """``statekv serve``'s application over a `VideoQA` already loaded (a model built in memory, as the GPU suite's
    random 8B), on a free loopback port, served by uvicorn on a thread of this process for the length of a ``with``
    block: ``url`` and ``key`` once it listens. Drive it from another process (``statekv bench serve --url``) so the
    load generator does not share this process's interpreter with the server."""

    def __init__(self, qa, *, max_streams: int = 1024, start_timeout: float = 120.0, quiet_catch_up: bool = True):
        self.qa, self.max_streams, self.start_timeout = qa, max_streams, start_timeout
        self.quiet_catch_up = quiet_catch_up
        self.key = secrets.token_hex(24)  # hex: never read as a flag (a key starting with "-" would be)
        self.url: str | None = None
        self._server = None
        self._thread = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def _start(self) -> "InProcessServer":
        import threading

        from ..serve import ServeConfig, create_app
        from ..serve.server import AppServer

        self._folder = tempfile.TemporaryDirectory(prefix="statekv-bench-")
        config = ServeConfig(options=self.qa.options, state_dir=self.state_dir,
                             api_keys=(self.key,), max_streams=self.max_streams, max_asks=self.max_streams * 4,
                             page=False, quiet_catch_up=self.quiet_catch_up)
        app = create_app(config, self.qa)
        self._server = AppServer(app, host="127.0.0.1", port=0, log_level="warning")
        self._thread = threading.Thread(target=self._server.run, name="statekv-bench-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServerError("the in-process server did not start")
            time.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    @property
    def state_dir(self) -> Path:
        """The server's state folder (in a temporary folder removed when the block ends)."""
        if self._folder is None:
            raise ServerError("the in-process server is not running")
        return Path(self._folder.name) / "state"

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=120)
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
