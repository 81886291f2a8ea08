"""Where model work runs: every push, encode, question and save of the server's models runs on one thread, in
arrival order, so concurrent requests never step a model at once. Pushes are the exception that proves it:
pushes queued while the thread is busy are taken together, and the streams of one `VideoQA` among them step
together (`VideoQA.push_many`: one vision call, batched language-model steps). A drain takes each stream's
earliest queued push and leaves its later ones, in order, to the next drain, which is queued behind whatever work
arrived meanwhile: a stream that fell behind has its frames taken one per drain, each with every other stream's.
Pushes are queued without waiting for the stream's earlier ones (`queue_push`), so a backlog is always there to
batch. Streams that push one frame after another (a file being fed, a client waiting for each answer) have one
push in flight each, so they would take turns rather than meet: a drain that lacks such a stream, one that pushed
within the last `ACTIVE_SECONDS` and is not known to take longer (one of its last pushes came within `BACK_TO_BACK`
gathering waits of the answer before it), waits up to `GATHER_SECONDS` (the gathering wait) for its next push. A camera keeping up, whose next frame comes a frame period later however
fast it is answered, is not waited for; one that fell behind comes straight back, and is.

Questions are taken together the same way: questions queued while the thread is busy (`queue_ask`) are answered by
one drain, each stream's earliest (its later ones, in order, left to the next drain), and the questions to streams
of one `VideoQA` among them are answered as the rows of one batch where their shapes allow
(`VideoQA.ask_tokens_many`). Questions are not waited for: one that finds the thread free is answered at once.

Quiet moments replay handover backlogs: a bounded stream keeps each step's embeddings until it passes the model's
range, where its successor engine replays them all in the push that passes it (`statekv.api.handover`), a pause
for every stream stepped with it. Once a pushed stream has taken half the range (`Stream.catch_up_due`), the thread,
when it finds no push or question waiting, replays `CATCH_UP_STEPS` of its backlog, with those of other such
streams of its `VideoQA` (`VideoQA.catch_up_many`, batched as their pushes are), and looks again, so the push that
passes the range replays only what came since the last quiet moment (all of it where quiet moments were too few
to keep up). Pushes never wait for more than one such slice."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger("statekv.serve")
ACTIVE_SECONDS = 0.25  # a stream that pushed this recently is expected to push again...
BACK_TO_BACK = 4  # ...if one of its last pushes came within this many gathering waits of the answer before it
GAPS_KEPT = 8
IDLE_SECONDS = 30.0  # what is known of a stream that has not pushed for this long is forgotten
GATHER_SECONDS = 0.005  # the longest a drain waits for such a stream's next push
CATCH_UP_STEPS = 1  # backlog steps a quiet moment replays per stream before looking for work again
CATCH_UP_STREAMS = 16  # streams whose backlogs one quiet moment replays together, at most


class ModelExecutor(Protocol):
    """What the service needs from whatever runs model work."""

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``work(*args, **kwargs)`` with the model to itself; return its result or raise its error."""

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """The same from a thread that is not the event loop's (startup, shutdown)."""

    def close(self) -> None: ...


@dataclass
class _Push:
    stream: Any
    image: Any
    seconds: float | None
    before: Callable[[], Any]
    after: Callable[[Any, bool], Any]
    future: Future = field(default_factory=Future)
    context: Any = None


@dataclass
class _Question:
    stream: Any
    question: str
    kwargs: dict
    before: Callable[[], Any]
    after: Callable[[Any, Any], Any]
    future: Future = field(default_factory=Future)
    context: Any = None


def _settle_together(items: list, run_many: Callable[[Any, list], list],
                     settled: Callable[[Any], None] | None = None) -> None:
    """Pushes or questions taken together: each one's ``before``, then those of one `VideoQA` through ``run_many(qa,
    group)`` (a result or an exception per item), then each one's ``after``; each future is settled (just after
    ``settled(item)``, when given), one item's failure its own."""
    ready: dict[int, list] = {}
    group = results = item = result = outcome = None
    try:
        for item in items:
            try:
                item.context = item.before()
            except BaseException as error:
                item.future.set_exception(error)
                continue
            ready.setdefault(id(item.stream.qa), []).append(item)
        for group in ready.values():
            try:
                results = run_many(group[0].stream.qa, group)
            except BaseException as error:
                results = [error] * len(group)
            for item, result in zip(group, results):
                if isinstance(result, BaseException):
                    outcome = (item.future.set_exception, result)
                else:
                    try:
                        outcome = (item.future.set_result, item.after(item.context, result))
                    except BaseException as error:
                        outcome = (item.future.set_exception, error)
                if settled is not None:
                    settled(item)
                outcome[0](outcome[1])
    finally:  # an exception set on a future holds this frame in its traceback: the frame must not hold the streams
        items = ready = group = results = item = result = outcome = None


class ModelWorker:
    """One thread for all model work, first come first served; pushes that wait together step together, and
    questions that wait together are answered together.

    ``batches``: times the thread took more than one queued push at once. ``quiet_catch_up``: replay handover
    backlogs when nothing waits (see the module docstring); ``quiet_catch_up_steps``: backlog steps so replayed."""

    def __init__(self, gather_seconds: float = GATHER_SECONDS, quiet_catch_up: bool = True):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="statekv-model")
        self.queued = 0
        self.batches = 0
        self.gather_seconds = gather_seconds
        self._pushes: list[_Push] = []
        self._drain_queued = False
        self._questions: list[_Question] = []
        self._answers_queued = False
        self._arrived = threading.Condition()
        self._last_push: dict[int, float] = {}  # id(stream) -> when its last push arrived, if it pushes back to back
        self._answered_at: dict[int, float] = {}  # id(stream) -> when its last push was answered
        self._gaps: dict[int, deque] = {}  # id(stream) -> its last pushes' times from the answer before them
        self.quiet_catch_up = quiet_catch_up
        self.quiet_catch_up_steps = 0
        self._catching_up: dict[int, Any] = {}  # id(stream) -> a stream whose backlog quiet moments replay
        self._quiet_queued = False

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.queued += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(work, *args, **kwargs))
        finally:
            self.queued -= 1

    def run_blocking(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(work, *args, **kwargs).result()

    async def push(self, stream: Any, image: Any, seconds: float | None, *, before: Callable[[], Any],
                   after: Callable[[Any, bool], T]) -> T:
        """Push a frame to ``stream`` on the model's thread, with the pushes that wait with it: ``before()`` runs
        first (its error fails this push only), then the push, then ``after(before's result, kept)``, whose
        result is returned."""
        return await self.queue_push(stream, image, seconds, before=before, after=after)

    def queue_push(self, stream: Any, image: Any, seconds: float | None, *, before: Callable[[], Any],
                   after: Callable[[Any, bool], T]) -> "asyncio.Future[T]":
        """`push`, queued now (after the stream's pushes queued before it) and answered by the future returned (on
        the running event loop)."""
        push = _Push(stream, image, seconds, before, after)
        with self._arrived:
            self._pushes.append(push)
            now, answered = time.monotonic(), self._answered_at.pop(id(stream), None)
            gaps = self._gaps.setdefault(id(stream), deque(maxlen=GAPS_KEPT))
            if answered is not None:
                gaps.append(now - answered)
            if not gaps or min(gaps) <= BACK_TO_BACK * self.gather_seconds:  # it may come straight back
                self._last_push[id(stream)] = now
            else:
                self._last_push.pop(id(stream), None)
            self._arrived.notify_all()
            self._queue_drain()
        self.queued += 1
        answer = asyncio.wrap_future(push.future)
        answer.add_done_callback(self._answered)
        return answer

    async def ask(self, stream: Any, question: str, kwargs: dict, *, before: Callable[[], Any],
                  after: Callable[[Any, Any], T]) -> T:
        """Answer ``question`` of ``stream`` (``kwargs``: what `Stream.ask_tokens` takes) on the model's thread, with
        the questions that wait with it: ``before()`` runs first (its error fails this question only), then the
        answer, then ``after(before's result, the answer's token ids [1, N])``, whose result is returned."""
        return await self.queue_ask(stream, question, kwargs, before=before, after=after)

    def queue_ask(self, stream: Any, question: str, kwargs: dict, *, before: Callable[[], Any],
                  after: Callable[[Any, Any], T]) -> "asyncio.Future[T]":
        """`ask`, queued now (after the stream's questions queued before it) and answered by the future returned
        (on the running event loop)."""
        asked = _Question(stream, question, kwargs, before, after)
        with self._arrived:
            self._questions.append(asked)
            if not self._answers_queued:
                self._answers_queued = True
                self._pool.submit(self._answer_questions)
        self.queued += 1
        answer = asyncio.wrap_future(asked.future)
        answer.add_done_callback(self._answered)
        return answer

    def _answered(self, answer: asyncio.Future) -> None:
        self.queued -= 1
        if not answer.cancelled():
            answer.exception()  # read here: a push whose caller went away leaves no unread error behind

    def _queue_drain(self) -> None:
        """Queue a drain unless one is queued that has not started (it takes every push queued until it starts).
        Called with ``_arrived`` held."""
        if self._pushes and not self._drain_queued:
            self._drain_queued = True
            self._pool.submit(self._drain)

    def _gathered(self) -> list[_Push]:
        """Each stream's earliest waiting push, once every recently active stream has one or `gather_seconds` have
        passed; the later ones stay queued, in order, for the next drain (queued here, behind what came meanwhile)."""
        with self._arrived:
            deadline = time.monotonic() + self.gather_seconds
            while True:
                now = time.monotonic()
                for key in [key for key, when in self._last_push.items() if now - when >= ACTIVE_SECONDS]:
                    del self._last_push[key]
                for key in [key for key, when in self._answered_at.items() if now - when >= IDLE_SECONDS]:
                    del self._answered_at[key]
                for key in set(self._gaps) - set(self._answered_at) - {id(push.stream) for push in self._pushes}:
                    del self._gaps[key]  # neither answered lately nor waiting: idle or gone
                if set(self._last_push) <= {id(push.stream) for push in self._pushes} or now >= deadline:
                    break
                self._arrived.wait(deadline - now)
            taken, left, streams = [], [], set()
            for push in self._pushes:
                (left if id(push.stream) in streams else taken).append(push)
                streams.add(id(push.stream))
            self._pushes, self._drain_queued = left, False
            self._queue_drain()
        return taken

    def _drain(self) -> None:
        pushes = self._gathered()
        if len(pushes) > 1:
            self.batches += 1

        def answered(push: _Push) -> None:
            with self._arrived:
                self._answered_at[id(push.stream)] = time.monotonic()

        _settle_together(pushes, lambda qa, group: qa.push_many(
            [(push.stream, push.image, push.seconds) for push in group], return_exceptions=True), answered)
        if self.quiet_catch_up:  # the streams to catch up, those pushed now with them, less any no longer due
            streams = {**self._catching_up, **{id(push.stream): push.stream for push in pushes}}
            with self._arrived:
                self._catching_up = {key: stream for key, stream in streams.items()
                                     if getattr(stream, "catch_up_due", False)}  # closed, handed over: let go
                self._queue_quiet()

    def _taken_questions(self) -> list[_Question]:
        """Each stream's earliest waiting question; the later ones stay queued, in order, for the next drain."""
        with self._arrived:
            taken, left, streams = [], [], set()
            for asked in self._questions:
                (left if id(asked.stream) in streams else taken).append(asked)
                streams.add(id(asked.stream))
            self._questions, self._answers_queued = left, bool(left)
            if left:
                self._pool.submit(self._answer_questions)
        return taken

    def _answer_questions(self) -> None:
        _settle_together(self._taken_questions(), lambda qa, group: qa.ask_tokens_many(
            [(asked.stream, asked.question, asked.kwargs) for asked in group], return_exceptions=True))
        with self._arrived:
            self._queue_quiet()

    def _queue_quiet(self) -> None:
        """Queue a quiet moment's replay when a stream has backlog to replay, none is queued and nothing waits.
        Called with ``_arrived`` held."""
        if self._catching_up and not self._quiet_queued and not self._pushes and not self._questions:
            self._quiet_queued = True
            self._pool.submit(self._catch_up_quietly)

    def _catch_up_quietly(self) -> None:
        """If nothing waits, replay `CATCH_UP_STEPS` of the backlogs of up to `CATCH_UP_STREAMS` streams of one
        `VideoQA` together (`VideoQA.catch_up_many`: batched as pushes are; the streams take turns), then queue the
        next quiet moment."""
        with self._arrived:
            self._quiet_queued = False
            if self._pushes or self._questions or not self._catching_up:
                return  # the drain that takes what waits queues the next one
            self._catching_up = {key: stream for key, stream in self._catching_up.items()
                                 if getattr(stream, "catch_up_due", False)}  # closed since its last push, say
            if not self._catching_up:
                return
            qa = next(iter(self._catching_up.values())).qa
            group = [key for key, stream in self._catching_up.items() if stream.qa is qa][:CATCH_UP_STREAMS]
            streams = [self._catching_up.pop(key) for key in group]
        try:
            self.quiet_catch_up_steps += qa.catch_up_many(streams, CATCH_UP_STEPS)
        except Exception as error:  # noqa: BLE001 -- each stream's next push replays what is left, or says why
            put_off = getattr(error, "put_off", None)  # `statekv.steps.jobs.ReplayPutOff`: the others replayed
            if put_off is not None:
                if not error.said:
                    log.warning("%s", error)
                self.quiet_catch_up_steps += error.replayed
            else:
                log.warning("the replay of %d streams' backlogs in a quiet moment failed: %s", len(streams), error)
            # those that failed are not tried again until pushed again: an error that stays would spin here
            streams = [stream for stream in streams if put_off is not None and id(stream) not in put_off]
        with self._arrived:
            for stream in streams:
                if getattr(stream, "catch_up_due", False):
                    self._catching_up[id(stream)] = stream  # behind the others
            self._queue_quiet()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
