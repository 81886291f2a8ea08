"""Watches: standing questions about a live stream, evaluated as frames arrive, telling you when the answer changes.

    stream = qa.stream()
    watch = stream.watch(question, every=4)        # evaluated after every 4 frames encoded (or every_seconds=)
    for image, t in camera:
        stream.push(image, t)
    watch.events                                   # [WatchEvent(frame=12, seconds=11.0, answer='B'), ...]
    watch.close()

A `Watch` holds a standing question (`statekv.core.watching`). Opening it evaluates it once (when the stream has
frames); each later evaluation reads only the stream's carried state, the frames streamed since the watch's last
evaluation and, with ``retrieve=K``, the K frames (per layer) that best match the question: it never re-reads the
stream, so it costs the same however long the stream has run. An evaluation whose answer differs from the one
before is an event: ``frame`` (frames encoded then), ``seconds`` (the stream time of the last of them) and
``answer``. While it is open, a watch also steers what the stream carries (``steer``, `statekv.core.rules.steering`):
the tokens its question attends to stay in the carried state, so later evaluations still see them.

Evaluations run once a push has streamed the frames that make them due, inside the push: the due watches of every
stream stepped together (`VideoQA.push_many`, pushes from several threads batched by the step scheduler) are
evaluated together, one forward per answer token for all of them. A watch without ``every``/``every_seconds`` is
evaluated only when asked (`Watch.evaluate`). A stream saves its watches with itself and `Stream.load` reopens
them (`statekv.api.watch_saving`), as they stood: their events, clocks and the queries that steer.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import re
import secrets
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.rules.steering import QuestionGuide
from ..core.watching.fitting import check_question_fits, most_carried
from ..core.watching.standing import Evaluation, evaluate, standing_question
from ..settings.methods import retrieval_rule
from ..errors import InputError, RetrievalTooWide, StateKVError
from ..stopping import whole
from ..settings.values import check_bool, check_int, check_number, check_question
from ..video.sampling import reaches
from .retrieved import fits_past_range, in_frames

log = logging.getLogger("statekv")

DEFAULT_NEW_TOKENS = 16
MAX_EVENTS = 10_000  # the events a watch keeps (the latest), so a watch that never closes stays bounded
# and the characters their answers take in JSON, shared by a stream's open watches (an answer may be
# `max_new_tokens` long): every save and disk-tier checkpoint writes a stream's watches' events whole, and a saved
# stream's metadata is bounded (`stream_file.MAX_METADATA_CHARS`), which the runs' step lists share
MAX_EVENT_CHARS = 16 << 20
KEPT_PLACES = 64  # the closed watches whose place among a stream's watches it remembers (the latest)


@dataclass(frozen=True)
class WatchEvent:
    """An evaluation whose answer differed from the one before: ``frame`` (frames the stream had encoded),
    ``seconds`` (the stream time of the last of them, None when unknown) and ``answer``."""

    frame: int
    seconds: float | None
    answer: str

    def to_dict(self) -> dict[str, Any]:
        return {"frame": self.frame, "seconds": self.seconds, "answer": self.answer}


Listener = Callable[["Watch", "WatchEvent | None"], None]
Failed = Callable[["Watch", Exception], None]  # told of an evaluation that failed, and why


class Watch:
    """A standing question about one stream (see the module docstring). Made by `Stream.watch`.

    Attributes: ``id``, ``question``, ``every`` (frames between evaluations) or ``every_seconds`` (stream seconds),
    ``max_new_tokens``, ``retrieve`` (frames per layer retrieved at each evaluation, None: none), ``retrieval`` (the
    rule's name), ``steer``, ``events`` (`WatchEvent` list, oldest first), ``answer`` (the latest, None before the
    first evaluation), ``evaluations``, ``closed``, ``error`` (why the last evaluation failed, None when it did not;
    logged when it starts or changes and once it ends, not at each failure), ``stream``. A watch does not keep its
    stream alive: a stream dropped without `Stream.close` is freed at once (its watches would otherwise hold it in a
    cycle until a full collection); its watches then keep their events, and only evaluating one says the stream is
    gone.
    """

    def __init__(self, stream: Any, question: str, *, every: int | None = None, every_seconds: float | None = None,
                 max_new_tokens: int = DEFAULT_NEW_TOKENS, retrieve: int | None = None, retrieval: str | None = None,
                 steer: bool = True, watch_id: str | None = None):
        check_question(question, "the watch's question")
        if every is not None and every_seconds is not None:
            raise InputError("give a watch every (frames) or every_seconds, not both")
        self._stream = weakref.ref(stream)
        self.id = watch_id if watch_id is not None else f"w_{secrets.token_hex(8)}"
        self.question = question
        self.every = None if every is None else check_int(every, "every (frames between evaluations)",
                                                         error=InputError)
        self.every_seconds = None if every_seconds is None else float(check_number(
            every_seconds, "every_seconds (stream seconds between evaluations)", error=InputError))
        self.max_new_tokens = check_int(max_new_tokens, "max_new_tokens", error=InputError)
        self.retrieve = None if retrieve is None else check_int(retrieve, "retrieve (frames per layer)",
                                                               error=InputError)
        self.retrieval = retrieval_rule(stream.qa.retrieval if retrieval is None else retrieval).name
        self.steer = check_bool(steer, "steer")
        self.events: list[WatchEvent] = []
        self.answer: str | None = None
        self.evaluations = 0
        self.closed = False
        self.error: str | None = None
        self.failing: tuple[str, int] | None = None  # the error last logged (digits aside), the failures in a row
        self.since = 0  # the first token its next evaluation reads as new
        self.last_frames = 0  # frames encoded at its last evaluation (or when it opened)
        self.last_seconds: float | None = None
        self.listeners: list[Listener] = []
        self.failure_listeners: list[Failed] = []
        self.standing = None  # the engine's StandingQuestion (None for a stream that keeps no cache)
        self.read_steps: set[int] = set()  # the steps its last evaluation retrieved (retrieve=K)
        self.answer_tokens: list[int] | None = None  # the tokens ``answer`` was decoded from
        self.answered_frames: int | None = None  # frames encoded when ``answer`` was given

    @property
    def stream(self) -> Any:
        """The stream it watches (`InputError` once that stream was dropped and freed)."""
        stream = self._stream()
        if stream is None:
            raise InputError(f"watch {self.id}: its stream is gone (it was dropped without close)")
        return stream

    # -- what it says --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``id``, ``question``, ``every``, ``every_seconds``, ``max_new_tokens``, ``retrieve``, ``answer``,
        ``evaluations``, ``error`` and ``events`` (each ``frame``, ``seconds``, ``answer``)."""
        return {"id": self.id, "question": self.question, "every": self.every, "every_seconds": self.every_seconds,
                "max_new_tokens": self.max_new_tokens, "retrieve": self.retrieve, "steer": self.steer,
                "answer": self.answer, "evaluations": self.evaluations, "error": self.error,
                "events": [event.to_dict() for event in self.events]}

    def __repr__(self) -> str:
        cadence = (f"every={self.every}" if self.every is not None else
                   f"every_seconds={self.every_seconds}" if self.every_seconds is not None else "on demand")
        return f"Watch({self.question!r}, {cadence}, answer={self.answer!r}, events={len(self.events)})"

    def subscribe(self, listener: Listener, failed: Failed | None = None) -> None:
        """Call ``listener(watch, event)`` after each evaluation (``event`` None when the answer did not change),
        on the thread whose push (or call) made it due, which holds the stream: a listener may ask the stream,
        close the watch or open another. ``failed(watch, error)``, the same way, after each evaluation that failed
        on its cadence (its ``error`` set; not one raised to its caller: `evaluate`, or the first, as it opens)."""
        self.listeners.append(listener)
        if failed is not None:
            self.failure_listeners.append(failed)

    # -- when -------------------------------------------------------------------------------------------------
    def due(self, frames: int, seconds: float | None) -> bool:
        """Whether an evaluation is due with ``frames`` encoded, the last at stream time ``seconds``."""
        if self.closed or frames == 0 or frames <= self.last_frames:
            return False
        if self.every is not None:
            return frames - self.last_frames >= self.every
        if self.every_seconds is not None:
            if self.last_seconds is None or seconds is None:
                return True
            return reaches(seconds, self.last_seconds + self.every_seconds)
        return False

    def evaluate(self) -> str:
        """Evaluate the question now (after encoding every complete step still waiting) and return its answer; an
        event is recorded when it changed. A watch evaluated since the last frame was encoded answers as it did
        (without telling its listeners again: one may call this)."""
        stream = self.stream
        with whole(), stream.lock:
            if self.closed:
                raise InputError(f"watch {self.id} is closed")
            evaluations = self.evaluations
            stream.flush_complete_steps()  # its due watches evaluated after the steps: this one perhaps
            if stream.frames == 0:
                raise InputError(f"{stream.name}: no frame has been encoded yet")
            fresh = self.answered_frames == stream.frames and self.error is None
            if (self.evaluations == evaluations and not fresh) or self.error is not None:
                run_evaluations([self], raise_errors=True)
            return self.answer

    def close(self) -> None:
        """Stop evaluating; the stream stops being steered by it. Its events stay readable."""
        stream = self._stream()
        if stream is None:  # nothing left to steer
            self.closed = True
            return
        with stream.lock:
            if self.closed:
                return
            self.closed = True
            watching = stream.watching
            if watching is not None:
                watching.remove(self)

    # -- saving --------------------------------------------------------------------------------------------
    def record(self, after: int | None = None) -> dict[str, Any]:
        """What a saved stream keeps of the watch (JSON-able): its settings, events and where it stands. ``after``:
        its events at that many frames or fewer are left out (kept elsewhere; None: every event)."""
        events = list(self.events)  # at once: a record may be written while the model's thread adds one
        first = 0 if after is None else bisect.bisect_right(events, after, key=lambda event: event.frame)
        return {"id": self.id, "question": self.question, "every": self.every, "every_seconds": self.every_seconds,
                "max_new_tokens": self.max_new_tokens, "retrieve": self.retrieve, "retrieval": self.retrieval,
                "steer": self.steer, "answer": self.answer, "evaluations": self.evaluations, "since": self.since,
                "last_frames": self.last_frames, "last_seconds": self.last_seconds,
                "start": None if self.standing is None or self.standing.queries is None else self.standing.start,
                "events": [[event.frame, event.seconds, event.answer] for event in events[first:]]}


class Watches:
    """A stream's open watches and its clock (the time of the last frame encoded), with the guide through which
    they steer its carried state. ``places``: where each watch opened on it stands in the order they were opened
    (an evaluation's watches are evaluated, and told of, in that order), the latest `KEPT_PLACES` closed ones
    too."""

    def __init__(self, stream: Any):
        self.open: list[Watch] = []
        self.seconds: float | None = stream.encoded_timestamp  # a frame pushed since may wait, or have been dropped
        self.guide = QuestionGuide()
        self.places: dict[str, int] = {}  # watch id -> place, in that order
        self.opened = 0

    def add(self, watch: Watch) -> None:
        self.places.pop(watch.id, None)  # placed before it is open: a reader of both never finds it unplaced
        self.places[watch.id] = self.opened
        self.opened += 1
        self.open.append(watch)
        engines = getattr(watch.stream, "engines", ())  # a successor is steered as its stream is
        if watch.steer and watch.standing is not None and engines and steerable(watch.stream):
            self.guide.add(watch.standing)
            for prefill in engines:
                prefill.cache.guide = self.guide

    def remove(self, watch: Watch) -> None:
        self.open = [each for each in self.open if each is not watch]
        if watch.standing is not None:
            self.guide.remove(watch.standing)
        self._forget()

    def placed_as(self, earlier: list[str]) -> None:
        """Take the order of an earlier run's watches (its `places`' ids, oldest first: what a restarted server's
        record kept), so the places of those closed since stay known; the open watches it lacks come after them.
        An order the open watches do not keep is not taken."""
        ids = list(dict.fromkeys(earlier))
        named = set(ids)
        ids += [watch.id for watch in self.open if watch.id not in named]
        places = {key: place for place, key in enumerate(ids)}
        ranks = [places[watch.id] for watch in self.open]
        if ranks == sorted(ranks):
            self.places, self.opened = places, len(ids)
            self._forget()

    def _forget(self) -> None:
        still = {each.id for each in self.open}
        closed = [key for key in self.places if key not in still]
        for key in closed[:max(0, len(closed) - KEPT_PLACES)]:  # the oldest closed ones go
            del self.places[key]


def steerable(stream: Any) -> bool:
    """Whether standing questions can steer ``stream``: its carry rule reads attention mass and its RoPE has one
    row of positions."""
    if getattr(stream, "prefill", None) is None:
        return False
    prompt = stream.adapter.prompt(stream.adapter.question_ids("?", stream.state), stream.state)
    return stream.prefill.policy.scores_needed(1 << 30) and prompt.position_ids is None


def default_retrieve(stream: Any) -> int | None:
    """What a watch on ``stream`` retrieves unless told: its VideoQA's ``retrieve``, except on a bounded-positions
    stream of an M-RoPE model, where a watch cannot retrieve (None: it reads the carried state and the frames since
    its last evaluation, as any watch does)."""
    prefill = getattr(stream, "prefill", None)
    if prefill is not None and prefill.positions.bounded and _prompt(stream, "?").position_ids is not None:
        return None
    return stream.qa.retrieve


def open_watch(stream: Any, question: str, *, evaluate_now: bool = True, check_fit: bool = True,
               **settings: Any) -> Watch:
    """A watch on ``stream`` (a started `Stream`, its lock held): the question laid out once and, when the stream
    has frames and ``evaluate_now``, evaluated at once (its first answer, from the carried state). check_fit: False
    reopens a saved watch whose question no longer fits (each evaluation then records its error)."""
    watch = Watch(stream, question, **settings)
    prefill = getattr(stream, "prefill", None)  # None: a stream that keeps no cache (`RecentFrames`)
    if prefill is not None:
        prompt = _prompt(stream, question)
        if watch.retrieve is not None and prefill.positions.bounded and prompt.position_ids is not None:
            raise InputError("a watch on a bounded-positions stream of this model (M-RoPE) cannot retrieve; "
                             "open it without retrieve")
        watch.standing = standing_question(prefill, prompt)
        carried = max(layer.carried_length for layer in prefill.cache.layers)
        # against the most it will carry: a watch opened before then must not fail at every evaluation after
        if check_fit:
            check_question_fits(prefill, watch.standing.length, watch.max_new_tokens,
                                most_carried(prefill, carried), getattr(stream, "reserve_tokens", None))
            if watch.retrieve is not None:
                fits_past_range(stream, prompt.input_ids.shape[1] + watch.max_new_tokens,
                                stream.retrieval(watch.retrieve, watch.retrieval), watch.retrieve)
        watch.since = prefill.seen_tokens
    watching = stream.watching
    if watching is None:
        watching = stream.watching = Watches(stream)
    watching.add(watch)
    if evaluate_now and holds_frames(stream):  # its first answer: what the stream holds now
        try:
            run_evaluations([watch], raise_errors=True)
        except BaseException:  # the caller gets no watch: none is left evaluating or steering
            watch.close()
            raise
    else:
        watch.last_frames, watch.last_seconds = stream.frames, watching.seconds
    return watch


def _prompt(stream: Any, question: str):
    adapter = stream.adapter
    return adapter.prompt(adapter.question_ids(question, stream.state), stream.state)


def output_head(stream: Any, prompt: Any) -> torch.nn.Module:
    """The module that turns ``stream``'s model's last hidden states into logits (the decoding model's)."""
    model = prompt.model if prompt.model is not None else stream.adapter.model
    head = model.get_output_embeddings()
    if head is None:
        raise StateKVError(f"{type(model).__name__} has no output embeddings to read a watch's answer from")
    return head


def end_tokens(stream: Any) -> tuple[int, ...]:
    """The token ids that end an answer of ``stream``'s model: those of the module that decodes it, as `ask` decodes
    (Eagle's language model, whose generation config may name other end tokens than the whole model's)."""
    model = stream.adapter.decoder
    config = getattr(model, "generation_config", None)
    ends = getattr(config, "eos_token_id", None)
    if ends is None:
        ends = model.config.get_text_config().eos_token_id
    return tuple(ends if isinstance(ends, (list, tuple)) else [] if ends is None else [ends])


def evaluate_due(jobs: Iterable[Any]) -> None:
    """After a batch of steps (`statekv.steps.jobs.StepScheduler`): move each stepped stream's clock to its last
    frame encoded and evaluate every due watch of those streams together. A failure is the watch's ``error``,
    never the push's. Listeners are told on the thread that pushed each stream (its job's ``after``): the thread
    running the batch holds only its own streams, and a listener waiting for another stream would wait forever."""
    jobs, due = list(jobs), []
    for job in jobs:
        watching = getattr(job.video, "watching", None)
        if watching is None or job.streamed == 0:
            continue
        last = _last_frame(job)
        if last is not None:
            watching.seconds = last.timestamp
        stream = job.video
        due.extend(watch for watch in watching.open if watch.due(stream.frames, watching.seconds))
    if not due:
        return
    notices: list[tuple[Watch, WatchEvent | Exception | None]] = []
    run_on_cadence(due, notices)
    told = set()
    for job in jobs:
        if id(job.video) not in told:
            told.add(id(job.video))
            mine = [notice for notice in notices if notice[0].stream is job.video]
            if mine:
                job.after.append(lambda mine=mine: tell(mine))


def run_on_cadence(due: list[Watch], notices: list | None = None) -> None:
    """Evaluate ``due`` (come due by their cadence) as `run_evaluations` does, each ``every`` clock kept on its
    grid: a batch of steps may pass the frame a watch was due at, and the next is still due ``every`` frames after
    that frame, not after the batch."""
    before = [watch.last_frames for watch in due]
    run_evaluations(due, notices=notices)
    for watch, start in zip(due, before):
        if watch.every is not None and watch.last_frames != start and watch.last_frames == watch.stream.frames:
            watch.last_frames = start + (watch.stream.frames - start) // watch.every * watch.every


def _last_frame(job: Any):
    if job.groups:
        group = job.groups[job.streamed - 1]
        return group[-1] if group else None
    if job.encoded:
        return job.encoded[job.streamed - 1].step.frames[-1]
    return None


def run_evaluations(watches: list[Watch], raise_errors: bool = False, notices: list | None = None) -> None:
    """Evaluate ``watches`` (of streams whose turn it is: their locks held or their steps being run) as rows of
    batches, record their answers and events, and tell their listeners (or, given ``notices``, add each
    ``(watch, event)`` there, or ``(watch, error)`` for a failure, for `tell` to tell later). A stream that keeps no cache (`RecentFrames`) answers each
    of its watches as it answers a question, from its last frames."""
    live = [watch for watch in watches if not watch.closed]
    results: list[tuple[Watch, Evaluation | None, Any]] = []
    engine, evaluations = [], []
    for watch in live:
        if watch.standing is not None:
            try:
                evaluations.append(_evaluation(watch))
                engine.append(watch)
            except Exception as error:  # noqa: BLE001 -- a watch that cannot be evaluated: its error alone
                results.append((watch, None, error))
    if engine:
        head = output_head(engine[0].stream, evaluations[0].prompt)
        try:
            outcomes = evaluate(evaluations, head)
        except Exception as error:  # noqa: BLE001 -- one row's failure is not its batch's: each again alone
            outcomes = [error] if len(engine) == 1 else [_evaluate_alone(one, head) for one in evaluations]
        results[:0] = zip(engine, evaluations, outcomes)
    for watch in live:
        if watch.standing is None:
            try:
                outcome = watch.stream.ask_tokens(watch.question, max_new_tokens=watch.max_new_tokens,
                                                  retrieve=watch.retrieve)
            except Exception as error:  # noqa: BLE001 -- as above
                outcome = error
            results.append((watch, None, outcome))
    for watch, evaluation, outcome in results:
        if isinstance(outcome, RetrievalTooWide) and evaluation is not None:  # the engine counts steps
            outcome = in_frames(outcome, watch.stream, evaluation.retrieval, watch.retrieve)
        if isinstance(outcome, Exception):
            watch.error = (str(outcome).strip().splitlines() or [type(outcome).__name__])[0]
            if raise_errors:
                raise outcome
            # after the pushes that made it due were taken: the watch's error, never theirs
            _log_failure(watch, outcome)
            if notices is None:
                tell([(watch, outcome)])
            else:
                notices.append((watch, outcome))
            continue
        if watch.failing is not None:
            log.warning("statekv: watch %s is evaluated again, after %d failed evaluation(s)", watch.id,
                        watch.failing[1])
            watch.failing = None
        event = _record(watch, outcome, set() if evaluation is None else evaluation.retrieved)
        if notices is None:
            tell([(watch, event)])
        else:
            notices.append((watch, event))


def _log_failure(watch: Watch, error: Exception) -> None:
    """Log ``watch``'s failed evaluation when its error starts or changes, not at each evaluation (a watch on a
    stream that runs for weeks would log every few frames): an error that differs only in its numbers (the frames
    retrieved grow with the stream) is the same one."""
    kind = re.sub(r"\d+", "N", f"{type(error).__name__}: {watch.error}")
    before, failures = watch.failing or (None, 0)
    watch.failing = (kind, failures + 1)
    if kind == before:
        return
    log.warning("statekv: watch %s could not be evaluated: %s (logged again when its error changes or ends)",
                watch.id, watch.error, exc_info=not isinstance(error, (StateKVError, RuntimeError, ValueError)))


def _evaluate_alone(evaluation: Evaluation, head: Any) -> Any:
    """One evaluation's answer ``[1, N]``, or its error."""
    try:
        return evaluate([evaluation], head)[0]
    except Exception as error:  # noqa: BLE001 -- the caller books it as the watch's error
        return error


def _evaluation(watch: Watch) -> Evaluation:
    stream = watch.stream
    retrieval = None if watch.retrieve is None else stream.retrieval(watch.retrieve, watch.retrieval)
    prompt = stream.adapter.prompt(watch.standing.ids, stream.state)  # laid out after the stream as it is now
    return Evaluation(stream.prefill, watch.standing, prompt, watch.since, watch.max_new_tokens,
                      end_tokens(stream), retrieval)


@functools.lru_cache(maxsize=4096)
def json_chars(answer: str) -> int:
    """The characters ``answer`` takes in a save's JSON (a non-ASCII character as its escape)."""
    return len(json.dumps(answer))


def keep_latest(events: list[WatchEvent], budget: int = MAX_EVENT_CHARS) -> None:
    """Cut ``events`` to the latest `MAX_EVENTS`, and to the latest whose answers take ``budget`` characters of JSON
    (the newest one kept whatever its length)."""
    del events[:-MAX_EVENTS]
    if sum(json_chars(event.answer) for event in events) <= budget:
        return
    chars, first = 0, len(events)
    while first > 0 and (first == len(events) or chars + json_chars(events[first - 1].answer) <= budget):
        first -= 1
        chars += json_chars(events[first].answer)
    del events[:first]


def _record(watch: Watch, tokens: torch.Tensor, retrieved: set[int]) -> WatchEvent | None:
    """Book an evaluation's answer ``tokens`` ``[1, N]``: the watch's clock, its answer, an event when it changed
    (returned)."""
    stream = watch.stream
    watch.error = None
    watch.evaluations += 1
    prefill = getattr(stream, "prefill", None)
    watch.since = 0 if prefill is None else prefill.seen_tokens
    watch.last_frames = watch.answered_frames = stream.frames
    seconds = stream.watching.seconds if stream.watching is not None else None
    watch.last_seconds = seconds
    watch.read_steps = retrieved
    ids = tokens.flatten().tolist()
    answer = watch.answer if ids == watch.answer_tokens else stream.qa.adapter.decode(tokens)  # decoded once
    watch.answer_tokens = ids
    event = None
    if answer != watch.answer:
        event = WatchEvent(stream.frames, seconds, answer)
        watch.events.append(event)
        keep_latest(watch.events, MAX_EVENT_CHARS // max(1, len(stream.watches)))
    watch.answer = answer
    return event


def tell(notices: list[tuple[Watch, WatchEvent | Exception | None]]) -> None:
    """Call each watch's listeners with its evaluation's event (None: the answer did not change), or its failure
    listeners with its evaluation's error."""
    for watch, event in notices:
        failed = isinstance(event, Exception)
        for listener in list(watch.failure_listeners if failed else watch.listeners):
            try:
                listener(watch, event)
            except Exception:  # noqa: BLE001 -- a listener's failure is its own; the watch goes on
                log.exception("statekv: a listener of watch %s failed", watch.id)


def holds_frames(stream: Any) -> bool:
    """Whether a question to ``stream`` has frames to read now (a simplestream stream that went on from its counts
    has none until one is pushed)."""
    return bool(getattr(stream, "held_frames", stream.frames))
