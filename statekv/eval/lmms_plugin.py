"""lmms-eval plugin: ``lmms-eval --model statekv --model_args pretrained=...,method=statekv,budget=4096``.

statekv registers itself in lmms-eval's entry-point group ``lmms_eval.models`` (see `manifest`) as the chat
model ``statekv``. Model args (``--model_args key=value,...``, parsed strictly by `MODEL_ARGS`)::

    pretrained       checkpoint folder or hub id (required)
    max_num_frames   at most this many frames per video             (default 512)
    max_fps          at most this many frames per second            (default 1)
    device           e.g. cuda:0, cpu    (default: cuda:<LOCAL_RANK> under a launcher, else cuda if available)
    and every other `statekv.ModelOptions` field, by the same name: method (any registered method: statekv,
    full, recency, rekv, keynorm, simplestream), budget, frames, sinks, window, retrieve, retrieval, layout,
    attention, dtype, offload, kv_cache_dtype (auto, int8, int4), trust_remote_code, cuda_graph, compile_step,
    positions, bounded_layout, question_span, vision_batch; booleans are true/false, 1/0, yes/no, on/off (not
    reserve_tokens: the room after a video is sized from its own requests)

A request is lmms-eval 0.7's chat request: ``Instance.args = (context, doc_to_messages, gen_kwargs, doc_id,
task, split)``, where ``doc_to_messages(task_dict[task][split][doc_id])`` gives the chat messages: one
user turn holding one video (``{"type": "video", "url": path}``) and the prompt text. Requests about the same
video are answered from one encoding. ``gen_kwargs`` give ``max_new_tokens``, ``until`` (stop strings) and
``temperature`` (0: greedy), ``top_p``, ``do_sample`` (false: greedy; true without a temperature: 1) and
``num_beams`` (1 only); any other transformers generation setting (``top_k``, ``repetition_penalty``, ...) goes to
`generate` as given, and a key that is none (another model's, lmms-eval's own, a misspelling) is named in one
warning line, once a run, and ignored.

Streaming benchmarks (lmms-eval's ``ovo_*`` tasks): a document naming its source ``video`` and a query time
(``realtime``; a multi-round document: one per round in ``test_info``) is asked on one live stream per source
video (a multi-round one: per document, its watches steering only it), at its time, in time order, cache reused.
The stream is fed from the documents' own clips, which are prefixes of the source cut at the query time: each
question pushes the frames of its clip the stream has not seen yet. `generate_until_multi_round` (``ovo_forward``)
takes each document's rounds from the task up front (``doc_to_messages(doc, round_idx=i, ...)``, until it says
the rounds have ended; OVO-Bench's do not depend on earlier answers) and returns one answer per round. An
OVO-Bench document is read by `statekv eval`'s own loader (`statekv.eval.ovobench.row_questions`), so the plugin
takes the rows `statekv eval` takes and refuses, in one line, those it refuses.

Multi-process runs (``torchrun``, ``accelerate launch``): lmms-eval gives each rank every ``world_size``-th
document; each rank loads its own model (on ``cuda:<LOCAL_RANK>`` when CUDA is available) and encodes the
videos of its own requests; lmms-eval gathers the answers on rank 0. The model reports ``rank``,
``world_size`` and ``device`` (lmms-eval's collectives put tensors on it) and answers the padding requests
lmms-eval adds to even out the ranks with nothing (lmms-eval discards them).

lmms-eval logs an exception raised by a model and still exits 0 (and in a multi-process run the other
ranks then wait at the next collective). The statekv model therefore ends the process itself on an error:
exit status 2 with one line for bad model args (read strictly: `statekv.eval.lmms_inputs`), requests or missing
videos, 1 with the traceback for anything else. A video that exists but cannot be read is the data's fault: its
questions are answered empty, with one line (`report_unreadable`), and the run goes on.

lmms-eval is optional: without it this module still imports (the class then has a stand-in base with the
same request contract), so the request handling is usable and testable on its own.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statekv.errors import ConfigurationError, InputError, StateKVError, VideoError
from statekv.eval import ovobench
from statekv.eval.answering import discarded, room_for_prompts
from statekv.eval.distributed import RankContext
from statekv.eval.lmms_inputs import DEFAULT_MAX_NEW_TOKENS  # noqa: F401  the plugin's name for it too
from statekv.eval.lmms_inputs import (before_stops, feed_clip, greedy_only, max_new_tokens,
                                     messages_of, model_args_from_string, passed_on, report_unreadable, sampling,
                                     stop_strings, unread)
from statekv.eval.watching import VideoWatches
from statekv.settings.options import ModelOptions
from statekv.settings.values import (Option, check_question, integer, optional_text, parse_options, positive_int,
                                     required_text, shown, stream_rate)

MODEL_ID = "statekv"
PADDING_KEY = "__padding_only__"  # lmms-eval 0.7 marks the requests it adds to even out ranks with this
MAX_ROUNDS = 10_000  # a multi-round document that never ends is refused

# lmms-eval's own names; every other model arg is a `statekv.ModelOptions` field (``model`` is ``pretrained``)
PLUGIN_ARGS = (
    Option("pretrained", required_text, None, "checkpoint folder or hub id"),
    Option("max_num_frames", positive_int, 512),
    Option("max_fps", stream_rate, 1.0),  # a live stream's too (the ovo_* tasks)
    # lmms-eval's own --batch_size and --max_batch_size arrive as model args too
    Option("batch_size", integer, 1),
    Option("max_batch_size", lambda value, name: value, None),  # only for --batch_size auto: unused
)
SIZED_HERE = ("model", "reserve_tokens")  # the room after a video is sized from its requests (`room_for_prompts`)
MODEL_ARGS = PLUGIN_ARGS[:1] + tuple(option for option in ModelOptions.string_options()
                                     if option.name not in SIZED_HERE) + PLUGIN_ARGS[1:]


def manifest():
    """The entry point's payload: the ``statekv`` chat model for lmms-eval's registry."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, chat_class_path=f"{__name__}.StateKV")


try:
    from lmms_eval.api.model import lmms as _Base

    LMMS_EVAL_AVAILABLE = True
except ImportError:  # the optional dependency is absent: keep the same contract without it
    LMMS_EVAL_AVAILABLE = False

    class _Base:  # type: ignore[no-redef]
        """What `StateKV` uses of ``lmms_eval.api.model.lmms``."""

        is_simple = True

        def __init__(self) -> None:
            self._rank, self._world_size = 0, 1
            self.task_dict: dict[str, Any] = {}
            self.cache_hook = None

        @property
        def rank(self) -> int:
            return self._rank

        @property
        def world_size(self) -> int:
            return self._world_size

        def clean(self) -> None:
            pass


@contextmanager
def exit_on_error(what: str) -> Iterator[None]:
    """End the process when the body raises: lmms-eval would log the error and exit 0 (see the module
    docstring). statekv's own errors (bad model args, malformed requests, missing videos) give one line
    and status 2, anything else its traceback and status 1."""
    try:
        yield
    except StateKVError as error:
        print(f"statekv (lmms-eval model): error while {what}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from error
    except Exception as error:
        traceback.print_exc()
        print(f"statekv (lmms-eval model): failed while {what}: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from error


class StateKV(_Base):
    """A statekv `VideoQA` as an lmms-eval chat model (see the module docstring).

    ``qa`` (an already loaded `VideoQA`) replaces loading ``pretrained``; model args are then still checked.
    """

    is_simple = False

    def __init__(self, qa=None, **model_args: Any) -> None:
        super().__init__()
        with exit_on_error("loading the model"):
            self._setup(qa, model_args)

    @classmethod
    def create_from_arg_string(cls, arg_string: Any, additional_config: dict[str, Any] | None = None) -> "StateKV":
        """lmms-eval's way to make the model from ``--model_args`` and its own flags, read strictly
        (`statekv.eval.lmms_inputs`): a malformed pair, a key given twice or empty, or one a flag contradicts, is
        refused in one line."""
        with exit_on_error("reading the model args"):
            model_args = model_args_from_string(arg_string, additional_config)
        return cls(**model_args)

    def _setup(self, qa, model_args: dict[str, Any]) -> None:
        from statekv.api.videoqa import VideoQA

        if qa is not None:
            model_args.setdefault("pretrained", "<given VideoQA>")
        elif optional_text(model_args.get("pretrained"), "pretrained") is None:
            raise ConfigurationError("the statekv model needs pretrained=<checkpoint folder or hub id>")
        if "reserve_tokens" in model_args:
            raise ConfigurationError("reserve_tokens is not a statekv model arg: the room after each video is sized "
                                     "from that video's own requests; leave it out")
        args = parse_options(model_args, MODEL_ARGS, what="statekv model arg")
        plugin = {option.name for option in PLUGIN_ARGS}
        if args["batch_size"] != 1:
            raise ConfigurationError(f"the statekv model answers one request at a time; use --batch_size 1, not "
                                     f"{model_args['batch_size']}")
        context = RankContext.from_env()
        self._rank, self._world_size = context.rank, context.world_size
        if context.world_size > 1:
            atexit.register(_leave_process_group)
        self.max_num_frames, self.max_fps = args["max_num_frames"], args["max_fps"]
        self.unread_said: set[tuple[str, ...]] = set()
        # a setting its method never reads is refused, as on the command line
        options = ModelOptions.given(model=args["pretrained"], **{name: args[name] for name in model_args
                                                                  if name not in plugin})
        self.qa = qa if qa is not None else VideoQA.from_options(
            options.with_changes(device=_device(options.device, context)))

    @property
    def device(self):
        """The model's ``torch.device`` (lmms-eval places the tensors of its cross-rank collectives on it)."""
        return self.qa.adapter.device

    @property
    def tokenizer(self):
        return self.qa.adapter.tokenizer

    def clean(self) -> None:
        """lmms-eval's hook to free the model's memory once all requests are answered."""
        self.qa = None
        super().clean()

    # -- lmms-eval's request entry points ---------------------------------------------------------------
    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Answer chat requests, in their order; requests about one video share one encoding.

        lmms-eval's rank-padding requests get ``""`` without any work."""
        with exit_on_error("answering"):
            return self._generate_until(requests)

    def _generate_until(self, requests: Sequence[Any]) -> list[str]:
        from tqdm.auto import tqdm

        answers: list[str | None] = ["" if _is_padding(request) else None for request in requests]
        prepared = {index: self._prepare(request) for index, request in enumerate(requests)
                    if answers[index] is None}
        timed = {index: ask for index, request in enumerate(requests) if index in prepared
                 for ask in [self._timed_ask(index, request, prepared[index])] if ask is not None}
        by_video: dict[str, list[int]] = {}
        for index, (video, _, _) in prepared.items():
            if index not in timed:
                by_video.setdefault(video, []).append(index)
        rooms = self._rooms(requests, [prepared[index] for index in prepared if index not in timed])
        with tqdm(total=len(prepared), disable=self.rank != 0, desc="statekv answering") as bar:
            for video, indices in by_video.items():
                try:
                    room = room_for_prompts(self.qa, *rooms[video])
                    with self.qa.encode(video, max_fps=self.max_fps, max_frames=self.max_num_frames,
                                        reserve_tokens=room, protocol=True) as encoded:
                        for index in indices:
                            _, prompt, gen_kwargs = prepared[index]
                            answers[index] = self._answer(encoded, prompt, gen_kwargs)
                            if self.cache_hook is not None:
                                self.cache_hook.add_partial("generate_until", (requests[index].args[0], gen_kwargs),
                                                            answers[index])
                            bar.update(1)
                except VideoError as error:  # the data's fault, not the model's: that video's answers only
                    left = [index for index in indices if answers[index] is None]
                    report_unreadable(error, len(left))
                    for index in left:
                        answers[index] = ""
                    bar.update(len(left))
            for index, text in self._stream_asks(requests, list(timed.values())):
                answers[index] = text
                bar.update(1)
        return answers  # type: ignore[return-value]

    def generate_until_multi_round(self, requests: Sequence[Any]) -> list[list[str]]:
        """Answer multi-round chat requests (lmms-eval's ``ovo_forward``): one answer per round, in round order.

        A document with a source ``video`` and a ``realtime`` per round (``test_info``) is asked on its source's
        stream at each round's time; any other document's rounds are each answered from their own video."""
        with exit_on_error("answering multi-round requests"):
            return self._generate_until_multi_round(requests)

    def _generate_until_multi_round(self, requests: Sequence[Any]) -> list[list[str]]:
        answers: list[list[str | None]] = [[] for _ in requests]
        asks: list[_Ask] = []
        for index, request in enumerate(requests):
            if _is_padding(request):
                continue
            doc_to_messages, gen_kwargs, doc_id, task, split = _chat_args(request)
            doc = self._doc(task, split, doc_id)
            rounds = task_rounds(doc_to_messages, doc, where=f"{task} doc {doc_id}")
            times = round_times(doc, len(rounds), where=f"{task} doc {doc_id}")
            answers[index] = [None] * len(rounds)
            for number, (video, prompt) in enumerate(rounds):
                if times is None:
                    answers[index][number] = self._answer_alone(video, prompt, gen_kwargs)
                else:
                    asks.append(_Ask((index, number), str(doc["video"]), times[number], video, prompt, gen_kwargs))
        for (index, number), text in self._stream_asks(requests, asks):
            answers[index][number] = text
        return answers  # type: ignore[return-value]

    def _answer_alone(self, video: str, prompt: str, gen_kwargs: dict[str, Any]) -> str:
        """One question about ``video``, encoded for it alone; ``""`` (and a line saying so) when the video cannot
        be read."""
        try:
            room = room_for_prompts(self.qa, [prompt], max_new_tokens(gen_kwargs))
            with self.qa.encode(video, max_fps=self.max_fps, max_frames=self.max_num_frames, reserve_tokens=room,
                                protocol=True) as encoded:
                return self._answer(encoded, prompt, gen_kwargs)
        except VideoError as error:
            report_unreadable(error, 1)
            return ""

    # -- streaming ----------------------------------------------------------------------------------------
    def _timed_ask(self, index: int, request: Any, prepared: tuple[str, str, dict[str, Any]]) -> "_Ask | None":
        """Request ``index`` as an ask on its source's stream, when its document names a source and a query time."""
        _, _, doc_id, task, split = _chat_args(request)
        seconds = query_time(self._doc(task, split, doc_id), where=f"{task} doc {doc_id}")
        if seconds is None:
            return None
        video, prompt, gen_kwargs = prepared
        return _Ask(index, str(self._doc(task, split, doc_id)["video"]), seconds, video, prompt, gen_kwargs)

    def _stream_asks(self, requests: Sequence[Any], asks: Sequence["_Ask"]) -> Iterator[tuple[Any, str]]:
        """``(key, answer)`` of every ask: one stream per source video (per forward document), its asks in time
        order, each after the frames of its clip up to its time. A round of a multi-round document (``ovo_forward``'s
        polls) is an evaluation of its prompt's watch on the stream, as ``statekv eval --mode streaming`` answers
        forward polls (`statekv.eval.watching`): opened at its first round, closed after its last."""
        by_stream: dict[Any, list[_Ask]] = {}
        for ask in asks:  # a forward document's watches steer its stream: one of its own, as if it were asked alone
            by_stream.setdefault((ask.source, ask.key[0]) if isinstance(ask.key, tuple) else ask.source, []).append(ask)
        plans = self._stream_plans(requests, {ask.source for ask in asks})
        for source_asks in by_stream.values():
            source, done = source_asks[0].source, set()
            try:
                for key, text in self._ask_source(source, source_asks, plans[source]):
                    done.add(key)
                    yield key, text
            except VideoError as error:  # a clip of the source cannot be read: its stream's later asks get ""
                left = [ask.key for ask in source_asks if ask.key not in done]
                report_unreadable(error, len(left), f"on the stream of {source}")
                yield from ((key, "") for key in left)

    def _ask_source(self, source: str, source_asks: Sequence["_Ask"], plan: tuple[float, list[str], int]
                    ) -> Iterator[tuple[Any, str]]:
        """``(key, answer)`` of ``source_asks``, on one stream of ``source`` planned by ``plan`` (`_stream_plans`)."""
        last_second, prompts, longest = plan
        frames = max(1, math.ceil(math.ceil(last_second) * self.max_fps)) + 1  # clips end at ceil(time)
        stream = self.qa.stream(frames, max_fps=self.max_fps, name=source,
                                reserve_tokens=room_for_prompts(self.qa, prompts, longest))
        pushed = -math.inf
        watches = VideoWatches([], None)
        left = Counter((ask.key[0], ask.prompt) for ask in source_asks if isinstance(ask.key, tuple))
        with discarded(stream):
            try:
                for ask in sorted(source_asks, key=lambda ask: ask.seconds):  # stable: ties keep request order
                    pushed = feed_clip(stream, ask.video, pushed, self.max_fps, math.ceil(ask.seconds))
                    if not isinstance(ask.key, tuple):
                        yield ask.key, self._answer(stream, ask.prompt, ask.gen_kwargs)
                        continue
                    key = (ask.key[0], ask.prompt)
                    greedy_only(ask.gen_kwargs)
                    self._say_unread(ask.gen_kwargs)
                    text, _, _ = watches.evaluate(stream, key, ask.prompt, max_new_tokens(ask.gen_kwargs))
                    text = before_stops(text, stop_strings(ask.gen_kwargs))  # as `_answer` cuts its answers
                    left[key] -= 1
                    if left[key] <= 0:
                        watches.close(key)
                    yield ask.key, text
            finally:
                watches.close_all()

    def _stream_plans(self, requests: Sequence[Any], sources: set[str]) -> dict[str, tuple[float, list[str], int]]:
        """``source -> (last query time, prompts, longest answer)`` over every document of the requests' tasks
        about it, so a stream is planned the same on every rank (see `_rooms`)."""
        plans: dict[str, tuple[float, list[str], int]] = {}
        tasks: dict[tuple[str, str], tuple[Any, dict[str, Any], bool]] = {}
        for request in requests:
            doc_to_messages, gen_kwargs, _, task, split = _chat_args(request)
            multi_round = getattr(request, "request_type", None) == "generate_until_multi_round"
            tasks.setdefault((task, split), (doc_to_messages, gen_kwargs, multi_round))
        for (task, split), (doc_to_messages, gen_kwargs, multi_round) in tasks.items():
            for doc in self.task_dict[task][split]:
                source = doc.get("video") if isinstance(doc, dict) else None
                if source not in sources:
                    continue
                try:
                    rounds = task_rounds(doc_to_messages, doc) if multi_round else \
                        [video_and_prompt(doc_to_messages(doc))]
                except (Exception, SystemExit):  # noqa: BLE001 -- fails where it is asked, if it is (a missing
                    continue  # clip: lmms-eval's ovobench task asserts, its videomme task exits); it plans nothing
                where = f"{task} document of {source}"
                try:
                    times = round_times(doc, len(rounds), where=where) if multi_round else \
                        [query_time(doc, where=where)]
                except StateKVError:  # a malformed time: refused where the document is asked, if it is
                    continue
                last, prompts, longest = plans.get(source, (0.0, [], 0))
                plans[source] = (max([last, *(t for t in times or [] if t is not None)]),
                                 prompts + [prompt for _, prompt in rounds],
                                 max(longest, max_new_tokens(gen_kwargs)))
        return plans

    def _rooms(self, requests: Sequence[Any], prepared: Iterable[tuple[str, str, dict[str, Any]]]
               ) -> dict[str, tuple[list[str], int]]:
        """``video -> (prompts, longest answer)`` to plan each encoding with: every question about the video in
        the requests' tasks, not only this call's.

        The room after a video sets its RoPE horizon (`room_for_prompts`), which changes the answers of models
        with dynamic RoPE. lmms-eval gives each rank every ``world_size``-th document, so a video's questions
        are spread over the ranks; planning from the whole task keeps every rank's encoding (and so every
        answer) identical to a single-process run's, as `statekv eval` plans from all of a video's questions.
        """
        rooms: dict[str, tuple[list[str], int]] = {}
        for video, prompt, gen_kwargs in prepared:
            prompts, longest = rooms.get(video, ([], 0))
            rooms[video] = ([*prompts, prompt], max(longest, max_new_tokens(gen_kwargs)))
        if not rooms:
            return rooms
        tasks: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        for request in requests:  # padding requests too: they name a task this rank may have no other doc of
            doc_to_messages, gen_kwargs, _, task, split = _chat_args(request)
            tasks.setdefault((task, split), (doc_to_messages, gen_kwargs))
        for (task, split), (doc_to_messages, gen_kwargs) in tasks.items():
            for doc in self.task_dict[task][split]:
                try:
                    video, prompt = video_and_prompt(doc_to_messages(doc))
                except (Exception, SystemExit):  # noqa: BLE001 -- fails where it is asked, if it is (`--limit`
                    continue  # asks some documents only: a missing video's task may exit or assert); it plans nothing
                if video in rooms:
                    prompts, longest = rooms[video]
                    prompts.append(prompt)
                    rooms[video] = (prompts, max(longest, max_new_tokens(gen_kwargs)))
        return rooms

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        with exit_on_error("scoring log-likelihoods"):
            raise InputError("the statekv model generates answers; it does not score log-likelihoods "
                             "(use generate_until tasks)")

    # -- internals --------------------------------------------------------------------------------------
    def _prepare(self, request: Any) -> tuple[str, str, dict[str, Any]]:
        """``(video path, prompt text, generation kwargs)`` of one chat request."""
        doc_to_messages, gen_kwargs, doc_id, task, split = _chat_args(request)
        where = f"{task} doc {doc_id}"
        messages = messages_of(doc_to_messages, self._doc(task, split, doc_id), where=where)
        return (*video_and_prompt(messages, where=where), gen_kwargs)

    def _doc(self, task: Any, split: Any, doc_id: Any) -> Any:
        """The document a request names; a one-line `InputError` when the task's data holds none."""
        try:
            return self.task_dict[task][split][doc_id]
        except (KeyError, IndexError, TypeError):
            raise InputError(f"the request names doc {doc_id!r} of task {task!r} (split {split!r}), which the tasks' "
                             "data does not hold") from None

    def _answer(self, encoded, prompt: str, gen_kwargs: dict[str, Any]) -> str:
        until = stop_strings(gen_kwargs)
        sampled = sampling(gen_kwargs)
        options: dict[str, Any] = {"max_new_tokens": max_new_tokens(gen_kwargs), **sampled,
                                   **passed_on(gen_kwargs, bool(sampled))}
        self._say_unread(gen_kwargs)
        if until:
            options.update(stop_strings=until, tokenizer=self.qa.adapter.tokenizer)
        return before_stops(encoded.ask(prompt, **options), until)

    def _say_unread(self, gen_kwargs: dict[str, Any]) -> None:
        """Say the request's generation kwargs statekv does not apply: once a run for each set of them."""
        ignored = tuple(unread(gen_kwargs))
        if ignored and ignored not in self.unread_said:
            self.unread_said.add(ignored)
            print(f"statekv (lmms-eval model): the request's generation kwargs {', '.join(ignored)} are not "
                  "generation settings statekv applies (another model's, lmms-eval's own, or misspelt); ignored",
                  file=sys.stderr, flush=True)


def video_and_prompt(messages: Any, *, where: str = "request") -> tuple[str, str]:
    """The one video path and the prompt text of lmms-eval chat ``messages`` (dicts or ``ChatMessages``).

    System turns are not part of the benchmarks' prompts and are ignored; the user turn's text items are
    joined in order.
    """
    if hasattr(messages, "model_dump"):
        messages = messages.model_dump()["messages"]
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, (list, tuple)) or not all(isinstance(message, dict) for message in messages):
        raise InputError(f"{where}: expected chat messages (a list of role and content dicts), got {shown(messages)}")
    videos, texts = [], []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content", [])
        if not isinstance(content, (list, tuple)) or not all(isinstance(item, dict) for item in content):
            raise InputError(f"{where}: a user turn's content must be a list of typed items, got {shown(content)}")
        for item in content:
            kind = item.get("type")
            if kind == "video":
                videos.append(item.get("url"))
            elif kind == "text" and not isinstance(item.get("text", ""), str):
                raise InputError(f"{where}: a text item's text must be a string, got {shown(item['text'])}")
            elif kind == "text":
                texts.append(item.get("text", ""))
            else:
                raise InputError(f"{where}: the statekv model takes one video and text, not {kind!r} content")
    if len(videos) != 1 or not isinstance(videos[0], (str, os.PathLike)):
        raise InputError(f"{where}: expected exactly one video given as a file path, got {videos!r}")
    prompt = "".join(texts)
    if not prompt.strip():
        raise InputError(f"{where}: the request has no question text")
    return os.fspath(videos[0]), check_question(prompt, f"{where}: the question text")


@dataclass(frozen=True)
class _Ask:
    """One question (or round) to ask on its source's stream: ``key`` says where its answer goes."""

    key: Any
    source: str
    seconds: float
    video: str
    prompt: str
    gen_kwargs: dict[str, Any]


def query_time(doc: Any, *, where: str = "document") -> float | None:
    """A streaming document's query time (its ``realtime``, seconds), when it also names its source ``video``.

    An OVO-Bench document (one with a ``task``) is read by `statekv eval`'s own loader
    (`statekv.eval.ovobench.row_questions`): the plugin takes the rows it takes (a repeated option, five options)
    and refuses, in one line, those it refuses; a document of a task OVO-Bench does not define has no time."""
    if not isinstance(doc, dict) or not isinstance(doc.get("video"), str):
        return None
    if "task" in doc:
        questions = ovobench.row_questions(doc, Path(), where)
        return questions[0].realtime if len(questions) == 1 and not questions[0].item else None
    seconds = doc.get("realtime")
    return None if seconds is None else ovobench.seconds(seconds, f"{where}: field 'realtime'")


def round_times(doc: Any, rounds: int, *, where: str = "document") -> list[float] | None:
    """A multi-round document's query time for each of its ``rounds`` (``test_info[i].realtime``), or None; an
    OVO-Bench document is read by `statekv eval`'s loader, as in `query_time`."""
    if not isinstance(doc, dict) or not isinstance(doc.get("video"), str):
        return None
    polls = doc.get("test_info")
    if not isinstance(polls, list) or len(polls) != rounds:
        return None
    if "task" in doc:
        questions = ovobench.row_questions(doc, Path(), where)
        return [question.realtime for question in questions] if len(questions) == rounds else None
    times = [query_time({"video": doc["video"], "realtime": poll.get("realtime")}, where=f"{where} round {number}")
             if isinstance(poll, dict) else None for number, poll in enumerate(polls)]
    return None if None in times else times  # type: ignore[return-value]


def task_rounds(doc_to_messages: Any, doc: Any, *, where: str = "request") -> list[tuple[str, str]]:
    """``[(video, prompt)]`` of every round of a multi-round document, asking the task round by round (lmms-eval
    0.7's protocol: round 0 is ``doc_to_messages(doc)``, round ``i`` ``doc_to_messages(doc, round_idx=i,
    previous_output=..., previous_round_info=...)``, which returns ``(messages, terminal, output, info)``)."""
    first = f"{where} round 0"
    rounds = [video_and_prompt(messages_of(doc_to_messages, doc, where=first), where=first)]
    info = None
    while len(rounds) <= MAX_ROUNDS:
        payload = messages_of(doc_to_messages, doc, where=f"{where} round {len(rounds)}", round_idx=len(rounds),
                              previous_output=[], previous_round_info=info)
        if not (isinstance(payload, tuple) and len(payload) == 4):
            raise InputError(f"{where}: round {len(rounds)} of a multi-round task must give (messages, terminal, "
                             f"output, info), got {type(payload).__name__}")
        messages, terminal, _, info = payload
        if terminal:
            return rounds
        rounds.append(video_and_prompt(messages, where=f"{where} round {len(rounds)}"))
    raise InputError(f"{where}: a multi-round task gave more than {MAX_ROUNDS} rounds without ending")


def _chat_args(request: Any) -> tuple[Any, dict[str, Any], int, str, str]:
    """``(doc_to_messages, gen_kwargs, doc_id, task, split)`` of an lmms-eval 0.7 chat request."""
    try:
        _, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
    except (TypeError, ValueError):
        raise InputError("expected a chat request: args = (context, doc_to_messages, gen_kwargs, doc_id, task, "
                         "split); is the model registered as a chat model?") from None
    if not callable(doc_to_messages) or not isinstance(gen_kwargs or {}, Mapping):
        raise InputError(f"a chat request's doc_to_messages must be callable and its gen_kwargs a mapping, got "
                         f"{type(doc_to_messages).__name__} and {type(gen_kwargs).__name__}")
    return doc_to_messages, dict(gen_kwargs or {}), doc_id, task, split


def _is_padding(request: Any) -> bool:
    metadata = getattr(request, "metadata", None)
    return isinstance(metadata, dict) and bool(metadata.get(PADDING_KEY))


def _leave_process_group() -> None:
    """At exit, tear down the process group lmms-eval joined for a multi-process run and never leaves: left to the
    interpreter's end, its gloo group's teardown sometimes aborts a rank (exit status -6, "terminate called without
    an active exception") after every answer was written."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the exit goes on: nothing is left to lose
            pass


def _device(device: str | None, context: RankContext) -> str | None:
    """The model's device: this process's GPU under a multi-process launch, else the requested one."""
    import torch

    if context.distributed and torch.cuda.is_available() and (device is None or device == "cuda"):
        return f"cuda:{context.local_rank}"
    return device
