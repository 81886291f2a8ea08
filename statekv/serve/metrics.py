"""Prometheus metrics of one server: frames streamed (and their rate), streams held, cache bytes, ask latency, the
time to a streamed answer's first token (``statekv_time_to_first_token_seconds``), and
how many streams' steps each language-model forward took (``statekv_step_batch_size``), how many questions each
answering batch took (``statekv_question_batch_size``) and how many handover backlog steps quiet moments replayed
(``statekv_quiet_catch_up_steps_total``)."""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

RATE_WINDOW_SECONDS = 10.0


class Metrics:
    def __init__(self, streams: Callable[[], int], cache_bytes: Callable[[], int],
                 batched_steps: Callable[[], int] | None = None, batch_sizes: Callable[[], Tally] | None = None,
                 question_batch_sizes: Callable[[], Tally] | None = None,
                 quiet_catch_up_steps: Callable[[], int] | None = None, unsaved: Callable[[], int] = lambda: 0,
                 damaged: Callable[[], int] = lambda: 0, queued: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        if batched_steps is not None:
            self.registry.register(_ReadCounter(BATCHED_STEPS, batched_steps))
        if quiet_catch_up_steps is not None:
            self.registry.register(_ReadCounter(QUIET_CATCH_UP, quiet_catch_up_steps))
        if batch_sizes is not None:
            self.registry.register(_BatchSizes(batch_sizes, STEP_BATCH))
        if question_batch_sizes is not None:
            self.registry.register(_BatchSizes(question_batch_sizes, QUESTION_BATCH))
        self.frames = Counter("statekv_frames", "frames encoded into streams (kept frames)", registry=self.registry)
        self.asks = Counter("statekv_asks", "questions answered", ["route"], registry=self.registry)
        self.stopped = Counter("statekv_answers_stopped", "answers stopped between tokens (or not begun): their "
                               "client went away, their stream was deleted, or the server stopped",
                               registry=self.registry)
        self.errors = Counter("statekv_errors", "requests answered with an error, by status and the route they took",
                              ["status", "route"], registry=self.registry)
        self.ask_seconds = Histogram("statekv_ask_seconds", "time from a question's arrival to its full answer",
                                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=self.registry)
        self.first_token_seconds = Histogram(
            FIRST_TOKEN[0], FIRST_TOKEN[1], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry)
        streams_gauge = Gauge("statekv_streams", "streams held", registry=self.registry)
        streams_gauge.set_function(lambda: float(streams()))
        cache_gauge = Gauge("statekv_cache_bytes", "bytes of detailed cache held by all streams", registry=self.registry)
        cache_gauge.set_function(lambda: float(cache_bytes()))
        self.save_failures = Counter("statekv_save_failures", "saves of a stream that failed (a timed one tried again a "
                                     "save period later)", registry=self.registry)
        unsaved_gauge = Gauge("statekv_streams_unsaved", "streams whose last save failed",
                              registry=self.registry)
        unsaved_gauge.set_function(lambda: float(unsaved()))
        damaged_gauge = Gauge("statekv_streams_damaged", "streams found damaged: listed, never served, their files "
                              "kept", registry=self.registry)
        damaged_gauge.set_function(lambda: float(damaged()))
        queued_gauge = Gauge("statekv_queued", "pushes and questions waiting for the model's thread",
                             registry=self.registry)
        queued_gauge.set_function(lambda: float(queued()))
        rate = Gauge("statekv_frames_per_second", f"frames encoded per second over the last {RATE_WINDOW_SECONDS:g} s",
                     registry=self.registry)
        rate.set_function(self.frames_per_second)
        self._recent: deque[float] = deque()  # when each frame of the last window was encoded
        self._counting = threading.Lock()

    def error(self, status: int, scope: dict) -> None:
        """Count a request answered with ``status`` (an error), by the route its ASGI ``scope`` took."""
        self.errors.labels(str(status), route_label(scope)).inc()

    def frame_done(self) -> None:
        self.frames.inc()
        now = time.monotonic()
        with self._counting:  # trimmed here too: a server nobody scrapes must not keep every frame's time
            self._recent.append(now)
            self._trim(now)

    def frames_per_second(self) -> float:
        with self._counting:
            self._trim(time.monotonic())
            return len(self._recent) / RATE_WINDOW_SECONDS

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0] < now - RATE_WINDOW_SECONDS:
            self._recent.popleft()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def route_label(scope: dict) -> str:
    """The route a request took, as its method and path template (``POST /v1/streams/{stream_id}/frames``), or
    ``unmatched``: a label's values must stay few, and a request's path (a stream's id) and method (any word a client
    sends) are not."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if not path:
        return "unmatched"
    methods = getattr(route, "methods", None)
    if methods is None:  # a mount: the page
        return path
    return f"{scope.get('method')} {path}" if scope.get("method") in methods else "unmatched"


FIRST_TOKEN = ("statekv_time_to_first_token_seconds", "time from a streamed answer's start to its first generated "
               "token, whether or not that token shows text yet")
BATCHED_STEPS = ("statekv_batched_steps", "language-model forwards that stepped several streams together")
QUIET_CATCH_UP = ("statekv_quiet_catch_up_steps", "handover backlog steps replayed while no push or question waited")


class _ReadCounter:
    """A counter read when scraped (``name``, ``help``): ``statekv_batched_steps_total`` from the models' step
    schedulers, ``statekv_quiet_catch_up_steps_total`` from the model worker."""

    def __init__(self, named: tuple[str, str], count: Callable[[], int]):
        self.named, self.count = named, count

    def describe(self):
        return [CounterMetricFamily(*self.named)]

    def collect(self):
        family = CounterMetricFamily(*self.named)
        family.add_metric([], float(self.count()))
        yield family


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
STEP_BATCH = ("statekv_step_batch_size", "stream steps per language-model forward (streams stepped together in one "
              "batch)")
QUESTION_BATCH = ("statekv_question_batch_size", "questions per answering batch (questions of several streams "
                  "answered together: one forward for their prompts, then one per answer token)")


class _BatchSizes:
    """A histogram of batch sizes read when scraped: ``statekv_step_batch_size``, the stream steps each
    language-model forward took (1: a stream stepped alone), from the models' step schedulers;
    ``statekv_question_batch_size``, the questions each answering batch took (1: a question answered alone), from
    the models' ``question_batch_sizes``. Its ``_sum`` over its ``_count`` is the mean batch."""

    def __init__(self, sizes: Callable[[], Tally], named: tuple[str, str]):
        self.sizes = sizes
        self.name, self.help = named

    def describe(self):
        return [HistogramMetricFamily(self.name, self.help)]

    def collect(self):
        sizes = self.sizes()
        buckets = [(floatToGoString(bound), float(sum(n for size, n in sizes.items() if size <= bound)))
                   for bound in BATCH_BUCKETS]
        buckets.append(("+Inf", float(sum(sizes.values()))))
        family = HistogramMetricFamily(self.name, self.help)
        family.add_metric([], buckets, sum_value=float(sum(size * n for size, n in sizes.items())))
        yield family
