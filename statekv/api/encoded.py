"""A video encoded through the model: its steps streamed into its engine, and answers from what it holds.

`VideoQA.encode` makes one for a video file; `VideoQA.stream` makes a `Stream` (a subclass fed frame by frame).

A step goes through one protocol, whoever drives it (`append_steps` on this thread, `VideoQA.encode`'s overlapped
threads, or several streams stepped together, `statekv.steps.jobs`): ``plan_steps`` prepares its frames after the
layout state, ``lay_out`` makes a vision-encoded step the engine's request, and ``record_step`` books it once the
engine has streamed it. A question is laid out by the adapter (``VideoAdapter.prompt``) and generated, checked,
by the engine (`StreamingPrefill.generate`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core import Retrieval, StreamingPrefill
from ..core.step.batching import StepBatcher, StepRequest
from ..core.storage.step_values import StepValues
from ..core.positions.placing import choose_positions
from ..settings.engine import EngineSettings
from ..settings.methods import retrieval_rule
from .durability import Durability
from .handover import (CATCH_UP_SHARE, PUT_OFF_TRIES, Backlog, cannot_place, handing_over, held_at_handover,
                       over_cap, own_engine, passing, refusal_reason, successor_engine, why_alone)
from .retrieved import fit_in_frames
from .stats import AnswerInfo, EncodingStats
from ..errors import HandoverError, InputError, OutputError, StateKVError
from ..core.answering.decoding import Prompt
from ..core.disk.successor import BACKLOG
from ..core.disk.tier import remove_unclosed
from ..models import Chunk, LayoutState, PreparedFrames, VideoAdapter
from ..steps.jobs import LaidOutStep, StepJob, catch_up_together, stream_jobs
from ..steps.overlap import EncodedStep
from ..stopping import whole
from ..settings.values import check_int, check_question
from ..weak import weakly
from ..video import Frame

log = logging.getLogger("statekv")

METHOD_DEFAULT = object()  # ask(retrieve=...) not given: the VideoQA's setting


class EncodedVideo:
    """A video streamed through the model: its detailed cache, its prompt state and its stats.

    Making one streams nothing: `start` streams the adapter's prompt prefix (`VideoQA.encode` and
    `VideoQA.stream` return videos already started; the streaming calls and `ask` start one that is not yet).
    Read ``state`` to lay out a step only after `start`.

    ``ask`` decodes from the detailed cache without changing it, so any number of questions can be asked. Its
    steps, questions and `close` from different threads take turns (``lock``).
    """

    RECORDS_FRAMES = False  # whether a step's durable record names its last frame (what a stream resumes after)
    KEEPS_FILES = False  # whether its disk-tier file set outlives it (a stream's, which `Stream.load` resumes)

    def __init__(self, qa: Any, horizon: int | None, *, num_frames: int | None = None, fps: float | None = None,
                 name: str = "video", prefix_tokens: int | None = None, engine: EngineSettings | None = None,
                 disk_tier: Any = None, reserve_tokens: int | None = None):
        """prefix_tokens: given when resuming a stream whose prompt prefix was already streamed (then `start`
        has nothing to stream); None: `start` streams the adapter's prefix. engine: the engine's settings
        (default: the VideoQA's; positions None: decided here for ``horizon``, see
        `statekv.core.positions.placing.choose_positions`). horizon: None: no horizon (bounded positions). disk_tier: the file set a resumed disk-tier stream continues in
        (`statekv.core.disk.tier.DiskTier`). reserve_tokens: the part of ``horizon`` kept for the question and
        answer (default: the VideoQA's), which no step takes."""
        self.qa = qa
        self.adapter: VideoAdapter = qa.adapter
        self.name = name
        # steps, questions and close from different threads take turns: an answer is decoded into the detailed
        # cache's room past its end, where another answer or a step meanwhile would overwrite it
        self.lock = threading.RLock()
        self.horizon = horizon
        self.state: LayoutState = self.adapter.start(num_frames, fps)
        prefix = self.adapter.prefix(self.state) if prefix_tokens is None else None
        self.prefix_tokens = prefix.num_tokens if prefix is not None else prefix_tokens or 0
        policy = qa.policy.for_prefix(self.prefix_tokens)
        engine = qa.engine if engine is None else engine
        positions = choose_positions(engine.positions, self.adapter.model.config.get_text_config(), horizon)
        self.engine = engine if engine.positions == positions else engine.with_changes(positions=positions)
        protect = max(self.prefix_tokens, policy.sink_tokens)
        self.prefill = StreamingPrefill(self.adapter.model, policy, own_engine(self.engine), horizon=horizon,
                                        protect_tokens=protect, name=name, disk_tier=disk_tier)
        self.successor: StreamingPrefill | None = None  # `statekv.api.handover`: the engine it continues with
        self.backlog = self.new_backlog()  # the steps the successor has yet to replay
        self.replay_put_off = False  # a replay refused by the disk tier, said once until one goes through
        self.handover: str | None = None  # what the handover layout made of it (None: not that layout)
        reserve = qa.reserve_tokens if reserve_tokens is None else reserve_tokens
        self._video_tokens = None if horizon is None else horizon - reserve  # the most its steps take
        self._engine_args = dict(policy=policy, horizon=horizon, protect_tokens=protect, name=name)
        self.durability = Durability(self.prefill.disk, records_frames=self.RECORDS_FRAMES)
        disk = self.prefill.disk  # dropped unclosed, an encoding's files go with it: nothing resumes them
        self._unclosed = (weakref.finalize(self, remove_unclosed, disk.folder, disk.lock)
                          if disk is not None and not self.KEEPS_FILES else None)
        self.durability.watch(weakly(self, lambda video: video.waiting_frames, []))
        if handing_over(self.engine):
            alone = why_alone(self.engine, policy, self.prefill.config, self._video_tokens)
            self.handover = "beside" if alone is None else f"alone: {alone}"
            if alone is None:
                self.successor = self.new_successor()
        self._placed_span = 0  # the frame step's span last checked by `cannot_place`
        self.stats = EncodingStats()
        self.step_frames = ()  # frames of each step streamed (0 for the prompt prefix)
        self.answer_info: AnswerInfo | None = None  # what the last answer could see
        self._step_started = time.perf_counter()  # when the step being encoded began (for frame_seconds)
        self._device = self.adapter.device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._prefix = prefix  # streamed by start()

    def new_successor(self) -> StreamingPrefill:
        """The successor engine (`statekv.api.handover`), empty; on the disk tier its file set goes in a subfolder
        of the stream's (those left by an earlier run of the stream are removed first)."""
        args = self._engine_args
        engine = successor_engine(self.engine)
        if self.durability.enabled:
            self.durability.remove_successors()
            engine = engine.with_changes(offload_dir=str(self.durability.folder))
        return StreamingPrefill(self.adapter.model, args["policy"], engine, horizon=args["horizon"],
                                protect_tokens=args["protect_tokens"], name=f"{args['name']} (successor)")

    @property
    def step_frames(self) -> StepValues:
        """The frames of each step streamed, 0 for the prompt prefix (as runs: a steady stream's take a few)."""
        return self._step_frames

    @step_frames.setter
    def step_frames(self, frames: Sequence[int]) -> None:
        self._step_frames = StepValues(frames)

    @property
    def started(self) -> bool:
        """Whether the prompt prefix is streamed (or there was none to stream)."""
        return self._prefix is None

    def start(self) -> "EncodedVideo":
        """Stream the prompt prefix, once (later calls do nothing); returns the video itself."""
        if self._prefix is not None:
            self._stream_chunk(self._prefix)
            self._prefix = None
        return self

    # -- answering --------------------------------------------------------------------------------------
    def ask(self, question: str, *, max_new_tokens: int = 64, retrieve: int | None | object = METHOD_DEFAULT,
            retrieval: str | None = None, **generate_kwargs: Any) -> str:
        """Answer ``question`` from everything encoded so far (greedy unless ``generate_kwargs`` say otherwise).

        retrieve: answer from the ``retrieve`` frames per layer that best match the question (plus the prompt
            prefix and any sinks) instead of the whole detailed cache; None: the whole cache; by default, the
            VideoQA's setting (the method's own for ``rekv``).
        retrieval: the rule that picks the frames (``attention``, ``rekv``, ``recent``; see
            `statekv.core.answering.retrieval`); None: the VideoQA's.
        """
        tokens = self.ask_tokens(question, max_new_tokens=max_new_tokens, retrieve=retrieve, retrieval=retrieval,
                                 **generate_kwargs)
        return self.adapter.decode(tokens)

    def ask_tokens(self, question: str, *, max_new_tokens: int = 64, retrieve: int | None | object = METHOD_DEFAULT,
                   retrieval: str | None = None, **generate_kwargs: Any) -> torch.Tensor:
        """As `ask`, but return the answer's token ids ``[1, N]`` (what ``generate`` produced, undecoded). A
        stopping signal waits for the answer (`statekv.stopping.whole`)."""
        with whole(), self.lock:
            return self._answer(question, max_new_tokens=max_new_tokens, retrieve=retrieve, retrieval=retrieval,
                                **generate_kwargs)

    def _answer(self, question: str, *, max_new_tokens: int, retrieve: int | None | object,
                retrieval: str | None, **generate_kwargs: Any) -> torch.Tensor:
        prompt, retrieval = self.laid_out_question(question, max_new_tokens, retrieve, retrieval)
        answer = self.prefill.generate(prompt, max_new_tokens=max_new_tokens, retrieve=retrieval, **generate_kwargs)
        self.answered(retrieval, self.prefill.last_read_steps, self.prefill.last_layer_steps)
        return answer

    def laid_out_question(self, question: str, max_new_tokens: int, retrieve: int | None | object,
                          retrieval: str | None) -> tuple[Prompt, Retrieval | None]:
        """`ask`'s checks and the question laid out after the video: its `Prompt` and the `Retrieval` it reads by
        (None: the whole cache), as the one check that it fits (`StreamingPrefill.fit_question`) plans it."""
        self.prefill.check_open()
        self.start()
        if self.state.frames == 0:
            raise InputError(f"{self.name}: no frame has been encoded yet")
        check_question(question)
        check_int(max_new_tokens, "max_new_tokens")
        if retrieval is not None:  # checked whether or not this question retrieves
            retrieval_rule(retrieval)
        prompt = self.adapter.prompt(self.adapter.question_ids(question, self.state), self.state)
        rule, frames = retrieval, self.qa.retrieve if retrieve is METHOD_DEFAULT else retrieve
        retrieval = self.retrieval(frames, retrieval)
        plan = fit_in_frames(self, prompt.input_ids.shape[1], max_new_tokens, retrieval, frames)
        if plan is not None and not plan.whole and retrieval is None:  # the whole cache does not fit the range
            retrieval = self.retrieval(plan.retrieve * self.adapter.frames_per_step, rule)
        return prompt, retrieval

    def answered(self, retrieval: Retrieval | None, read_steps: tuple[int, ...] | None,
                 layer_steps: tuple[tuple[int, ...], ...] | None) -> None:
        """Book an answer read by ``retrieval`` (None: the whole cache) from ``read_steps`` (each layer's retrieval
        choosing ``layer_steps``): the stats and ``answer_info``."""
        self.stats.peak_cache_device_bytes = max(self.stats.peak_cache_device_bytes, self.peak_device_bytes)
        evicted = self.stats.evicted_frames
        self.answer_info = AnswerInfo(frames=self.frames, evicted_frames=evicted,
                                      unseen_fraction=evicted / self.frames if self.frames else 0.0,
                                      retrieved_frames=None if retrieval is None else max(
                                          (len(self.frames_of(steps)) for steps in layer_steps or ()), default=0),
                                      context="whole" if retrieval is None else "retrieved",
                                      read_frames=self.frames_of(read_steps))

    def frames_of(self, steps: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The frames (0-based, in encoding order) the streamed ``steps`` hold (None: None)."""
        if steps is None:
            return None
        frames = self.step_frames
        firsts = frames.totals_at(steps)
        return tuple(frame for step in steps if step in firsts
                     for frame in range(firsts[step], firsts[step] + frames[step]))

    def retrieval(self, frames: int | None, rule: str | None = None) -> Retrieval | None:
        """How a question retrieving ``frames`` frames per layer by ``rule`` (None: the VideoQA's) is answered
        (None: from the whole cache).

        The prompt prefix and the policy's sinks are always kept; frames become steps (two per step for
        Qwen3-VL)."""
        if frames is None:
            return None
        check_int(frames, "retrieve (frames per layer)")
        chosen = retrieval_rule(self.qa.retrieval if rule is None else rule)
        keep = max(self.prefix_tokens, self.prefill.policy.sink_tokens)
        return Retrieval(math.ceil(frames / self.adapter.frames_per_step), keep_tokens=keep, rule=chosen)

    @property
    def engines(self) -> tuple[StreamingPrefill, ...]:
        """The engines that hold this video's steps: its own and, under the handover layout while the stream fits
        the range, its successor (which holds those it replayed, `catch_up`)."""
        return (self.prefill,) if self.successor is None else (self.prefill, self.successor)

    @property
    def peak_device_bytes(self) -> int:
        """The detailed caches' peak bytes on the model's device (the engines' together while two hold steps),
        with the successor's backlog when it is there."""
        return self._peak_device_bytes([prefill.stats for prefill in self.engines])

    def new_backlog(self) -> Backlog:
        """An empty backlog, kept where the detailed cache is (where it is offloaded to, if it is)."""
        return Backlog(self.prefill.tier.device)

    def book_engines(self) -> None:
        """The engines' figures into ``stats``: carried tokens, the caches' bytes (the backlog's with them) and
        peaks (each engine's stats are read once: each read walks every layer)."""
        engines = [prefill.stats for prefill in self.engines]
        self.stats.carried_tokens = engines[0].max_carried_tokens
        self.stats.cache_bytes = sum(engine.detailed_bytes for engine in engines) + self.backlog.nbytes
        self.stats.peak_cache_device_bytes = max(self.stats.peak_cache_device_bytes, self._peak_device_bytes(engines))
        if self._device.type == "cuda":
            self.stats.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self._device))

    def _peak_device_bytes(self, engines: list) -> int:
        """`peak_device_bytes` from each engine's stats (``engines``, read once: each read walks every layer)."""
        backlog = self.backlog.nbytes if self.backlog.home is None else 0
        return sum(engine.peak_device_bytes for engine in engines) + backlog

    @torch.no_grad()
    def catch_up(self, steps: int | None = None) -> None:
        """The successor replays its backlog now (`statekv.api.handover`): every step the stream took since its
        last replay, in order, or the first ``steps`` of them. The stream does it by itself at the step that
        passes the range; calling it earlier (a quiet moment of a live stream, `catch_up_due`) spreads that work,
        and the steps pushed after it join the backlog again. A passing fault (a full disk, a backlog file unreadable
        now, memory short) stops it with an `OutputError` (`statekv.steps.jobs.ReplayPutOff`), the successor and its
        backlog as they were, to go on later (`PUT_OFF_TRIES` refused in a row drop it); any other failure, or a
        refusal of the successor's first step (which closes it), drops the successor: own-then-cache goes on alone."""
        if steps is not None:
            check_int(steps, "steps", minimum=1)
        with self.lock:
            catch_up_together([self], steps)  # (its count is `VideoQA.catch_up_many`'s to return)

    @property
    def catch_up_due(self) -> bool:
        """Whether a quiet moment should be spent on `catch_up`: the successor has steps to replay and the stream
        has taken at least `statekv.api.handover.CATCH_UP_SHARE` of the model's range (replaying from the start
        would hold the second detailed cache all along, for a stream that may never leave the range)."""
        return (self.successor is not None and not self.prefill.closed and self.backlog.retry_due
                and bool(self.backlog.steps)
                and self.prefill.seen_tokens >= CATCH_UP_SHARE * self.prefill.positions.limit)

    @property
    def handover_due(self) -> bool:
        """Whether the successor is to take over: the stream's engine placed a step away from its own position."""
        return self.successor is not None and self.prefill.positions.moved

    def replay_request(self) -> StepRequest | None:
        """The successor's next step to replay (the backlog's first), or None when there is none. Raises what
        reading it met (an `OutputError`: its backlog file unreadable now; memory short), for `replayed` to book; a
        file not holding the step as journaled drops the successor."""
        if self.successor is None or not self.backlog.steps:
            return None
        try:
            inputs_embeds = self.backlog.first().to(self._device)
        except OutputError:
            raise
        except StateKVError as error:  # read back from the disk tier's backlog file: damaged
            self.drop_successor(f"its backlog cannot be replayed ({error})")
            return None
        return StepRequest(self.successor, inputs_embeds, None, durable_record=self.backlog.records[0])

    def replayed(self, outcome: Any) -> bool:
        """Book the outcome of `replay_request`'s step: replayed, it leaves the backlog; refused by the successor's
        disk tier (a full disk) or out of memory (the step not taken, the successor as it was), it stays there, for
        a later replay (True: put off; memory short again after a step streamed is not, `passing`); any other
        error, which the same step would meet again, drops the successor."""
        if self.successor is not None and not self.successor.closed and passing(outcome, self.backlog):
            return True
        if isinstance(outcome, Exception):
            self.drop_successor(self.backlog.why_dropped(outcome))
        else:
            self.backlog.replayed_first()
        return False

    def put_off(self, refusal: OutputError) -> str:
        """What a replay put off by ``refusal`` (`replayed`) leaves, in one line."""
        stopped = (f"its successor's replay stopped {len(self.backlog.steps)} steps short of the handover"
                   if self.backlog.steps else "its handover stopped before it was marked")
        return (f"{self.name}: {stopped}, the successor and the stream as they were, to go on at a later push (tried "
                f"again after 1, 2, 4, ... steps, {PUT_OFF_TRIES} times at most) or catch_up: "
                f"{refusal_reason(refusal)}")

    def adopt_successor(self) -> None:
        """The successor, its backlog replayed (`catch_up`), becomes this video's engine (`statekv.api.handover`);
        the first is closed."""
        if self.successor is None:
            return
        self.book_engines()  # the peak: both detailed caches held at once
        if self.backlog.steps:
            self.drop_successor(f"the successor has {len(self.backlog.steps)} steps left to replay")
            return
        if self.successor.seen_tokens != self.prefill.seen_tokens:  # it missed a step: it is not this stream
            self.drop_successor(f"the successor holds {self.successor.seen_tokens} tokens, the stream "
                                f"{self.prefill.seen_tokens}")
            return
        first = self.prefill
        if self.durability.enabled:  # the stream's folder goes to the successor's file set
            try:
                engine = self.durability.hand_over(first, self.successor, self.engine_on)
            except HandoverError:  # both engines closed; the successor's files finish the handover on resuming
                for closed in (self.successor, first):
                    self.qa.step_scheduler.release(closed)
                self.successor = None
                raise
            engine.cache.guide = self.successor.cache.guide  # the open watches steer it as they steered both
            self.qa.step_scheduler.release(self.successor)
            self.prefill, self.successor = engine, None
        else:
            self.prefill, self.successor = self.successor, None
        self.handover = "handed over"
        self.prefill.evictions = []  # none: the cap holds both engines (`keep_to_cap`)
        self.qa.step_scheduler.release(first)
        first.close()
        self.book_engines()

    def engine_on(self, tier: Any) -> StreamingPrefill:
        """The stream's engine past its handover, over the disk tier's file set ``tier`` (to be resumed from it)."""
        args = self._engine_args
        return StreamingPrefill(self.adapter.model, args["policy"], successor_engine(self.engine),
                                horizon=args["horizon"], protect_tokens=args["protect_tokens"], name=args["name"],
                                disk_tier=tier)

    @property
    def waiting_frames(self) -> list[Frame]:
        """The frames kept but not yet streamed (a `Stream`'s pending frames; a video file has none)."""
        return []

    def keep_to_cap(self, span: int = 0) -> None:
        """Under a cache cap, drop the successor when the cap could not hold both engines at the handover after a
        step of ``span`` tokens (0: as they are; `statekv.api.handover.over_cap`). Checked before each step, so
        the cap holds whatever the successor replays meanwhile."""
        why = self._over_cap(span)
        if why is not None:
            self.drop_successor(why)

    def can_wait_for_handover(self, steps: int) -> bool:
        """Whether the cache cap (if any) would still hold both engines at a handover put off by ``steps`` more
        steps, each as long as the last (`statekv.steps.jobs.stream_jobs` puts it off to the end of a
        vision-tower call on the disk tier)."""
        lengths = self.prefill.cache.chunk_lengths
        return not steps or self._over_cap(steps * (lengths[-1] if len(lengths) else 0), steps) is None

    def _over_cap(self, span: int, steps: int = 1) -> str | None:
        """`over_cap` after ``steps`` more steps of ``span`` tokens in all (0: as the engines are)."""
        keeper = self.prefill.keeper
        if self.successor is None or keeper is None:
            return None
        held = keeper.held_bytes
        if span:
            held += span * keeper.bytes_per_token + steps * (keeper.bytes_per_step + keeper.other_bytes()[1])
        return over_cap(keeper.limit, held, (self.prefill.seen_tokens + span) * self._embedding_bytes)

    @property
    def _embedding_bytes(self) -> int:
        """Bytes of one token's embeddings, as the backlog keeps them."""
        weight = self.adapter.language_embeddings.weight
        return weight.shape[1] * weight.element_size()

    def drop_successor(self, why: str, *, warn: bool = True) -> None:
        """The video streams on as ``own-then-cache`` alone (``handover`` says ``why``), its successor closed;
        ``warn``: log it (a successor lost, not one known up front to be of no use)."""
        if self.successor is not None:
            if warn:
                log.warning("%s: streams on without its successor engine: %s", self.name, why)
            self.qa.step_scheduler.release(self.successor)
            self.close_successor()
            self.backlog = self.new_backlog()
            self.handover = f"alone: {why}"

    @property
    def folder(self) -> Path | None:
        """The folder of its disk-tier file set (under ``offload_dir``), what `Stream.load` resumes it from; None
        off the disk tier."""
        return self.durability.folder

    @property
    def tokens(self) -> int:
        return self.prefill.seen_tokens

    @property
    def frames(self) -> int:
        return self.state.frames

    def close_successor(self) -> None:
        """Close the successor; on the disk tier its file set goes too, unwritten (a resumed stream rebuilds it
        from the backlog)."""
        successor, self.successor = self.successor, None
        try:
            if successor.disk is not None:
                successor.disk.discard()
        finally:
            successor.close()

    def close(self) -> None:
        """Release the caches and the backlog, and give the model back its own RoPE; on the disk tier, an encoding's
        file set goes too (nothing resumes it: `Stream.load` takes a stream's). A question under way in another
        thread is answered first."""
        with self.lock:
            if self._unclosed is not None:
                self._unclosed.detach()
            try:
                if self.successor is not None:
                    self.close_successor()
            finally:
                try:
                    if self.prefill.disk is not None and not self.KEEPS_FILES:
                        self.prefill.disk.discard()
                    self.prefill.close()
                finally:
                    self.durability.close()
                    self.backlog = self.new_backlog()

    def __enter__(self) -> "EncodedVideo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, frames={self.frames}, tokens={self.tokens}, "
                f"carried={self.stats.carried_tokens})")

    # -- streaming --------------------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, frames: Sequence[Frame]) -> None:
        """Stream one step's frames (at most ``frames_per_step``) on this thread."""
        self.append_steps([frames], vision_batch=len(frames))

    @torch.no_grad()
    def append_steps(self, groups: Sequence[Sequence[Frame]], *, vision_batch: int) -> None:
        """Stream several steps on this thread, their frames vision-encoded in one call (``vision_batch``: the
        batch size asked for, for the stats): a job of one video through `statekv.steps.jobs.stream_jobs`. A
        failure leaves the steps before it streamed (``stats.chunks`` tells how many)."""
        with self.lock:
            self.start()
            job = StepJob(self, [list(frames) for frames in groups], vision_batch)
            stream_jobs([job], StepBatcher())
            job.raise_error()

    @torch.no_grad()
    def stream_steps(self, steps: Iterable[EncodedStep], *, vision_batch: int,
                     on_step: Callable[[], None] | None = None) -> None:
        """Stream steps already vision-encoded elsewhere (`statekv.steps.overlap.overlapped_steps`), in order, each as
        a job of one step; each frame's time runs from when the previous step finished (the first: from this
        call). ``on_step`` is called after each step (for progress)."""
        self.start()
        self._step_started = time.perf_counter()
        batcher = StepBatcher()
        for encoded in steps:
            job = StepJob(self, vision_batch=vision_batch, encoded=[encoded])
            with self.lock:
                stream_jobs([job], batcher)
            job.raise_error()
            if on_step is not None:
                on_step()

    @torch.no_grad()
    def stream_chunk(self, chunk: Chunk) -> None:
        """Stream one chunk already laid out by the adapter (`VideoAdapter.features_chunk` or ``prefix``; lay
        it out from ``state`` after `start`)."""
        self.start()
        self._stream_chunk(chunk)

    @torch.no_grad()
    def _stream_chunk(self, chunk: Chunk) -> None:
        """Stream ``chunk`` (laid out after ``state``) on this thread: a job of one step laid out already."""
        job = StepJob(self, chunks=[chunk])
        with self.lock:
            stream_jobs([job], StepBatcher())
        job.raise_error()

    # -- the step protocol ------------------------------------------------------------------------------
    def plan_steps(self, groups: Sequence[Sequence[Frame]]) -> list[PreparedFrames]:
        """Each group's frames prepared for the vision tower (CPU only), each after the state the previous
        one leaves; the time of these steps runs from now."""
        self._step_started = time.perf_counter()
        steps, state = [], self.state
        for frames in groups:
            steps.append(self.adapter.prepare_frames(frames, state))
            state = state.updated(steps[-1].state_update)
        return steps

    def lay_out(self, encoded: EncodedStep) -> LaidOutStep:
        """The vision-encoded step that follows ``state``, laid out by the adapter as the engine's request."""
        return self.step_of(self.adapter.features_chunk(encoded.step, encoded.features, self.state), encoded)

    def step_of(self, chunk: Chunk, encoded: EncodedStep | None = None) -> LaidOutStep:
        """``chunk`` (laid out after ``state``) as the engine's request, with what the disk tier journals."""
        last = encoded.step.frames[-1] if encoded is not None else None
        record = self.durability.step_record(self.state.after(chunk), chunk.frames, last)
        span = chunk.inputs_embeds.shape[1]
        if self.successor is not None and chunk.frames and span != self._placed_span:
            unplaced = cannot_place(self.successor.policy, self.successor.config, span, self._video_tokens)
            keeper = self.prefill.keeper
            if unplaced is None and keeper is not None:  # what it holds at its handover, known now
                unplaced = over_cap(keeper.limit, *held_at_handover(self.prefill.config, span, self.prefix_tokens,
                                                                    keeper.bytes_per_token, keeper.bytes_per_step,
                                                                    self._embedding_bytes))
            self._placed_span = span
            if unplaced is not None:
                self.drop_successor(unplaced, warn=False)
        self.keep_to_cap(span)
        if (self.successor is not None and record is not None and chunk.position_ids is None
                and not chunk.forward_kwargs):  # kept durable for a resumed stream to rebuild its successor
            try:
                record[BACKLOG] = self.durability.backlog_written(chunk.inputs_embeds)
            except OutputError as error:
                raise OutputError(f"{error}; the step was not taken: the stream holds its {self.tokens} tokens as "
                                  "before it") from None
        return LaidOutStep(chunk, StepRequest(self.prefill, chunk.inputs_embeds, chunk.position_ids,
                                              forward_kwargs=dict(chunk.forward_kwargs), durable_record=record),
                           encoded)

    def record_step(self, step: LaidOutStep, started: float | None = None, finished: float | None = None, *,
                    vision_batch: int | None = None) -> None:
        """Book ``step`` once the engine streamed it: the layout state, the step's frames and evictions, the
        engine's figures and, for a step of frames laid out at ``started`` and streamed by ``finished``, each
        stage's time per frame. Under the handover layout the step joins the successor's backlog (once the
        stream's engine placed a step away from its own position, ``handover_due``: `stream_jobs` then has the
        successor replay it and take over, `adopt_successor`)."""
        chunk, stats = step.chunk, self.stats
        if self.successor is not None:
            if chunk.position_ids is not None or chunk.forward_kwargs:
                self.drop_successor("its steps carry positions or inputs of their own, which a replay would lose")
            else:
                record, kept = step.request.durable_record, chunk.inputs_embeds
                if record is not None and BACKLOG in record:  # stored in the folder: not held in RAM too
                    self.durability.backlog_booked(record[BACKLOG])
                    kept = self.durability.backlog_step(record[BACKLOG], kept)
                    record = {key: value for key, value in record.items() if key != BACKLOG}
                self.backlog.add(kept, record)
        self.state = self.state.after(chunk)
        self.step_frames.append(chunk.frames)
        evicted, self.prefill.evictions = self.prefill.evictions, []  # taken: a long stream keeps no list of them
        if evicted:
            stats.evicted_frames += sum(self.step_frames[s] for s in evicted)
        stats.chunks += 1
        stats.tokens = self.prefill.seen_tokens
        stats.frames += chunk.frames
        self.book_engines()
        if step.encoded is None or started is None or finished is None:
            return
        per_frame = 1 / chunk.frames
        stats.frame_seconds.extend([(finished - self._step_started) * per_frame] * chunk.frames)
        stats.decode_seconds.extend([step.encoded.decode_seconds * per_frame] * chunk.frames)
        stats.vision_seconds.extend([step.encoded.vision_seconds * per_frame] * chunk.frames)
        stats.language_seconds.extend([(finished - started) * per_frame] * chunk.frames)
        stats.trim()
        stats.vision_batch = vision_batch
        self._step_started = finished
