"""Evaluate one model under one method on one benchmark: resumable, data-parallel, with a rank-0 merge.

    from statekv.eval.runner import EvalConfig, run_evaluation

    summary = run_evaluation(EvalConfig.for_model("videomme", "OpenGVLab/InternVL3-1B-hf", data_root="data",
                                                  out="runs/videomme-internvl3-1b-statekv", budget=4096))

The run directory ``out`` holds one (benchmark, model, method, budget) run::

    run.json                  the settings, the fingerprints of the data, the answer key and the weights (a rerun
                              that differs in any is refused, or redone with ``overwrite``), the limit, the ids
    run.lock                  held by the run going on (a second run on the folder is refused; `lock`)
    answers.rank000.jsonl     one line per answered question, flushed and fsynced (see `records`)
    errors.rank000.jsonl      videos that could not be read (their questions stay unanswered)
    answers.jsonl             rank 0's merge of the rank files, sorted by question id
    results.json, table.md    the scores (`report.write_summary`), the run's settings, the paper's table: removed
                              while a resumed run has questions left (``eval table`` scores what is there)

Rerunning the same command skips every answered question, so a killed run loses at most the question in flight.
Under ``torchrun`` or ``accelerate launch`` each rank takes whole videos (deterministic sharding of the full question
list, so a resumed run keeps its assignment), uses ``cuda:<LOCAL_RANK>``, and rank 0 merges and scores after all
ranks have finished.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from statekv.errors import ConfigurationError, DataError
from statekv.flushing import write_whole
from statekv.eval.answering import Answer, Asker, answer_afresh, answer_clips, answer_encoded, answer_streamed
from statekv.eval.distributed import RankContext
from statekv.core.storage.quantized import check_kv_cache_dtype
from statekv.eval.identity import answer_key_fingerprint, data_fingerprint, model_fingerprint, video_fingerprints
from statekv.eval.lock import RunLock
from statekv.eval.loaders import load_benchmark, load_benchmark_from_hub
from statekv.eval.parsing import check_parser
from statekv.eval.prompts import check_protocol, generation_settings
from statekv.eval.questions import BENCHMARKS, Question, counted, first_questions, questions_asked
from statekv.eval.records import (MERGED_FILE, RANK_FILE_GLOB, AnswerRecord, ResultsWriter, completed_qids,
                                  drop_answers, drop_unterminated_tails, merge_rank_files, rank_file, written_in)
from statekv.eval.report import SUMMARY_FILE, paper_table, write_summary
from statekv.eval.run_settings import RUN_IDENTITY, conditions_used, device_named, unrecorded, with_defaults
from statekv.eval.sharding import VideoQuestions, group_by_video, shard_by_video
from statekv.eval.video_errors import ERRORS_GLOB, log_video_error, replaced_answers, unresolved_errors
from statekv.errors import OutputError, StateKVError, VideoError
from statekv.builtin import resolve_model
from statekv.settings.options import ModelOptions, is_builtin
from statekv.settings.values import check_int, check_output_dir
from statekv.synthetic.benchmark import reading_lock
from statekv.stopping import note_kept, stop_point

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
TABLE_FILE = "table.md"
OVOBENCH_VIDEO_MODES = ("stream", "clips")
MODES = ("streaming", "offline")
PAPER_MAX_FRAMES = 512
STREAMING_BENCHMARKS = ("ovobench", "streamingbench")  # streamed by default; the others are encoded offline
GROUPED_BENCHMARKS = ("ovobench", "streamingbench")  # --groups applies
# What was answered: compared before anything is reused ("weights" once the model is loaded).
CONTENT_IDENTITY = {"data": "questions or videos", "answer_key": "answer key", "weights": "weights"}


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run.

    options: the model and method (`statekv.ModelOptions`; its ``device`` defaults to this rank's). name: the
    model's name in tables (default: derived from the checkpoint, e.g. "OpenGVLab/InternVL3-1B-hf" ->
    "InternVL3-1B"). limit: only the first ``limit`` questions (annotation order). mode: ``streaming`` (one live
    stream per video, each question asked at its time) or ``offline`` (each question from an encoding made for
    it; VideoMME and MLVU: one encoding of the whole video) (default: streaming for OVO-Bench and
    StreamingBench, offline for the others; see `statekv.eval.answering`). ovobench_videos: ``stream`` (one
    stream per source video) or ``clips`` (the released per-question clips, lmms-eval's protocol: OVO-Bench's
    offline mode). groups: only these groups of OVO-Bench or StreamingBench (default: all it takes). max_frames: at
    most this many frames of an offline encoding (default: `default_max_frames`: the paper's 512, every frame of a
    synthetic set).
    max_new_tokens: override the protocol's (for quick smoke runs only). encode_once: False re-encodes the video
    for every question (a reference for the encode-once claim). progress: a bar on a terminal, else a log line
    with the ETA about once a minute.
    """

    benchmark: str
    options: ModelOptions
    data_root: Path
    out: Path
    name: str | None = None
    parser: str = "lmms-eval-0.7"
    protocol: str = "lmms-eval-0.7"
    limit: int | None = None
    max_fps: float = 1.0
    max_frames: int | None = None
    ovobench_videos: str | None = None
    mode: str | None = None
    groups: tuple[str, ...] | None = None
    from_hub: bool = False
    max_new_tokens: int | None = None
    encode_once: bool = True
    progress: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_root", Path(self.data_root))
        object.__setattr__(self, "out", check_output_dir(self.out, "out (the run folder)"))
        if self.out.resolve() == self.data_root.resolve():  # its answers and table would lie among the set's files
            raise ConfigurationError(f"out (the run folder) {self.out} is the data root: give a folder of its own")
        if self.benchmark not in BENCHMARKS:
            raise ConfigurationError(f"unknown benchmark {self.benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
        if not isinstance(self.options, ModelOptions) or self.options.model is None:
            raise ConfigurationError("an evaluation needs ModelOptions naming a model")
        check_parser(self.parser)
        check_protocol(self.protocol)
        mode = resolve_mode(self.benchmark, self.mode, self.ovobench_videos)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "ovobench_videos", "clips" if mode == "offline" else "stream")
        if self.groups is not None:
            if self.benchmark not in GROUPED_BENCHMARKS:
                raise ConfigurationError(f"{self.benchmark} has no groups to choose (--groups applies to "
                                         f"{' and '.join(GROUPED_BENCHMARKS)})")
            object.__setattr__(self, "groups", tuple(sorted(set(self.groups))))  # one run whatever their order
        if self.max_frames is None:
            object.__setattr__(self, "max_frames", default_max_frames(self.benchmark))
        for name in ("limit", "max_new_tokens", *(("max_frames",) if self.max_frames is not None else ())):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        if self.from_hub and self.benchmark in ("ovobench", "streamingbench", "synthetic"):
            raise ConfigurationError(f"{self.benchmark} annotations are read from --data-root only (no hub loading)")

    @classmethod
    def for_model(cls, benchmark: str, model: str | Path, data_root: Path | str, out: Path | str,
                  **settings: Any) -> "EvalConfig":
        """A config from a checkpoint and flat settings: `ModelOptions` fields go to the options, the rest to the
        config (``EvalConfig.for_model("mlvu", "ckpt", "data", "runs/x", method="recency", limit=10)``)."""
        known = {field.name for field in fields(ModelOptions)}
        options = ModelOptions.given(model=str(model), **{k: v for k, v in settings.items() if k in known})
        return cls(benchmark, options, Path(data_root), Path(out),
                   **{k: v for k, v in settings.items() if k not in known})

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def method(self) -> str:
        return self.options.method

    @property
    def model_name(self) -> str:
        return self.name or display_name(self.model)

    @property
    def recorded_budget(self) -> int | None:
        """The method's size as the tables show it: B (tokens) or R (frames), none for full attention."""
        return self.options.spec.size_value(self.options.settings)

    def identity(self) -> dict[str, Any]:
        """The settings that decide the answers (what `run.json` pins)."""
        options = self.options
        values = {**asdict(self), **asdict(options), "model": str(self.model), "name": self.model_name,
                  "budget": self.recorded_budget, "retrieve": options.retrieve_frames,
                  "retrieval": options.retrieval_rule if options.retrieve_frames is not None else None,
                  "sinks": options.sinks if "sinks" in options.spec.uses else None,
                  "kv_cache_dtype": check_kv_cache_dtype(options.kv_cache_dtype)}
        values["ovobench_videos"] = self.ovobench_videos if self.benchmark == "ovobench" else None
        values["groups"] = list(self.groups) if self.groups is not None else None
        if not is_builtin(self.model):  # a trained folder's layout pinned: it was once read with the family's default
            values["layout"] = resolve_model(self.model, options.layout)[1]
        return {key: values[key] for key in RUN_IDENTITY}


def resolve_mode(benchmark: str, mode: str | None, ovobench_videos: str | None) -> str:
    """The mode a run takes: ``mode`` when given (checked against ``ovobench_videos``), else `default_mode`."""
    if mode is not None and mode not in MODES:
        raise ConfigurationError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if ovobench_videos is not None and ovobench_videos not in OVOBENCH_VIDEO_MODES:
        raise ConfigurationError(f"ovobench_videos must be one of {', '.join(OVOBENCH_VIDEO_MODES)}, "
                                 f"got {ovobench_videos!r}")
    if mode is not None and ovobench_videos is not None and (ovobench_videos == "clips") != (mode == "offline"):
        raise ConfigurationError(f"ovobench_videos={ovobench_videos} contradicts mode={mode} (the released clips "
                                 "are OVO-Bench's offline mode)")
    return mode or default_mode(benchmark, ovobench_videos)


def default_mode(benchmark: str, ovobench_videos: str | None = None) -> str:
    """A benchmark's mode when none is asked for: the streaming benchmarks stream (OVO-Bench's released clips
    are its offline mode), the others are encoded offline."""
    if benchmark == "ovobench" and ovobench_videos == "clips":
        return "offline"
    return "streaming" if benchmark in STREAMING_BENCHMARKS else "offline"


def default_max_frames(benchmark: str) -> int | None:
    """The paper's cap of 512 frames per video for the published benchmarks; none (every frame at ``max_fps``) for
    a synthetic set, whose videos are the model's own test videos: a cap would drop the frames its answers
    depend on."""
    return None if benchmark == "synthetic" else PAPER_MAX_FRAMES


def frames_read(config: EvalConfig, questions: Sequence[Question]) -> str:
    """What a run reads of its videos for ``questions``, in words (its log says it before the first question):
    the rate, and how far (`_answers`: a question with a time reads up to it; an OVO-Bench clip or a video
    otherwise up to ``max_frames``)."""
    rate = f"frames read at up to {config.max_fps:g} a second"
    if config.mode == "streaming" or (config.benchmark != "ovobench"
                                      and any(question.realtime is not None for question in questions)):
        return f"{rate}, each question's up to its time"
    if config.max_frames is None:
        return f"{rate}, every one of each video"
    return f"{rate}, at most {config.max_frames} a {'clip' if config.benchmark == 'ovobench' else 'video'}"


def display_name(model: str | Path) -> str:
    """A checkpoint's table name: the last path component without "-hf"/"-Instruct" suffixes."""
    name = Path(str(model).rstrip("/")).name
    while (shorter := re.sub(r"-(hf|instruct)$", "", name, flags=re.IGNORECASE)) != name:
        name = shorter
    return name


def run_evaluation(config: EvalConfig, *, context: RankContext | None = None, qa=None) -> dict[str, Any] | None:
    """Run (or resume) ``config`` on this rank; rank 0 returns the summary written to ``results.json``. A synthetic
    set is read under its folder's shared lock (`statekv.synthetic.benchmark.reading_lock`): no make replaces it
    meanwhile.

    qa: an already loaded `statekv.VideoQA` with the config's method (default: load ``config.model``)."""
    data = reading_lock(config.data_root) if config.benchmark == "synthetic" and not config.from_hub else None
    try:
        return _run_evaluation(config, context or RankContext.from_env(), qa)
    finally:
        if data is not None:
            data.release()


def _run_evaluation(config: EvalConfig, context: RankContext, qa) -> dict[str, Any] | None:
    every_question = load_questions(config)
    questions = first_questions(every_question, config.limit)
    expected = [question.qid for question in questions]
    content = {"data": data_fingerprint(every_question), "answer_key": answer_key_fingerprint(every_question),
               "videos": video_fingerprints(every_question, clips=config.benchmark == "ovobench"
                                            and config.mode != "streaming")}
    before = {"videos_before": lambda: video_fingerprints(every_question, both=True)}
    lock = RunLock(config.out)
    try:
        context.connect()
        lock_for_every_rank(lock, context)
        if config.overwrite and context.is_main:
            clear_run(config.out)
        context.barrier()
        run = read_run_file(config.out)
        replaced = replaced_answers(config.out, every_question, content["videos"],
                                    None if run is None else run["content"].get("videos"), before["videos_before"])
        dropped = {qid for qids in replaced.values() for qid in qids}
        check_run_file(config, expected, content, write=False, replaced=dropped, **before)  # settings, data
        if context.is_main:  # this run's: a killed writer's half line is cut here, and said, once
            drop_unterminated_tails(config.out)
            for video_id, qids in replaced.items():
                logger.warning("%s: its file changed since it could not be read part way: its %d earlier answer(s) "
                               "are dropped and all its questions answered from the new file", video_id, len(qids))
            drop_answers(config.out, dropped)
        context.barrier()
        qa = qa if qa is not None else load_model(config, context)
        if qa.method != config.method:
            raise ConfigurationError(f"the model was set up for {qa.method!r}, the run asks for {config.method!r}")
        content["weights"] = model_fingerprint(qa)
        check_run_file(config, expected, content, write=context.is_main, device=device_named(qa.adapter.device),
                       **before)
        done = completed_qids(config.out)
        assigned = shard_by_video(questions, context.rank, context.world_size)
        todo = [question for question in assigned if question.qid not in done]
        rank = f"rank {context.rank}/{context.world_size}: " if context.distributed else ""
        logger.info("%s%d %s (%d of its %d already done); %s", rank, len(todo), counted(todo),
                    len(assigned) - len(todo), len(assigned), frames_read(config, todo))
        if todo:
            try:
                answer_questions(config, qa, todo, all_questions=every_question, context=context,
                                 answered_before=[question for question in assigned if question.qid in done])
            except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: every answer so far is on disk already
                answered = len(completed_qids(config.out) & set(expected))
                given = "questions answered" if questions_asked(questions) == len(questions) else "answers given"
                note_kept(stop, f"{answered} of {len(expected)} {given} in {config.out}; rerun the same command to "
                                "resume")
                raise
        context.barrier()
        if not context.is_main:
            return None
        return finish(config, expected)
    except OSError as error:
        if isinstance(error, StateKVError) or not written_in(error, config.out):
            raise
        answered = len(completed_qids(config.out) & set(expected))
        where = f"{error.filename} in the run folder" if error.filename else f"the run folder {config.out}"
        raise OutputError(f"cannot write {where} ({error.strerror or error}); the {answered} of "
                          f"{len(expected)} answers written before are kept there: rerun the same command to resume "
                          "once it can be written") from None
    finally:
        lock.release()
        context.close()


def lock_for_every_rank(lock: RunLock, context: RankContext) -> None:
    """Rank 0 takes the run folder's lock; every rank stops if it could not (another run holds it, its work)."""
    refusal = None
    if context.is_main:
        try:
            lock.acquire()
        except OutputError as error:
            refusal = str(error)
    refusal = context.share_from_main(refusal)
    if refusal is not None:
        raise OutputError(refusal)


def load_questions(config: EvalConfig) -> list[Question]:
    """All the benchmark's questions (``limit`` is not applied), videos checked for the chosen mode."""
    if config.from_hub:
        questions = load_benchmark_from_hub(config.benchmark, config.data_root)
    elif config.benchmark == "ovobench":
        videos = "source" if config.ovobench_videos == "stream" else "clips"
        questions = load_benchmark("ovobench", config.data_root, videos=videos, groups=config.groups)
    elif config.benchmark == "streamingbench":
        questions = load_benchmark("streamingbench", config.data_root, groups=config.groups)
    else:
        questions = load_benchmark(config.benchmark, config.data_root)
    if not questions:
        raise ConfigurationError(f"no {config.benchmark} questions found under {config.data_root}")
    return questions


def load_model(config: EvalConfig, context: RankContext):
    """The `VideoQA` of the config, on ``config.device`` or this rank's default device."""
    import torch

    from statekv.api.videoqa import VideoQA

    device = config.options.device or context.default_device()
    if str(device).startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))  # kernels launch on the current device
    return VideoQA.from_options(config.options.with_changes(device=device))


def answer_questions(config: EvalConfig, qa, questions: Sequence[Question], *, all_questions: Sequence[Question],
                     context: RankContext, answered_before: Sequence[Question] = ()) -> None:
    """Answer ``questions`` video by video, appending one durable record per answer to this rank's file.

    ``all_questions`` (the whole benchmark) size each encoding's room for questions, so an answer does not
    depend on which of its video's questions are left to answer (``limit``, resuming); ``answered_before``: the
    run's questions answered before it was interrupted (replayed in a video's stream, `answer_streamed`)."""
    asker = Asker(qa, generation_settings(config.benchmark, config.protocol), config.protocol,
                  max_new_tokens=config.max_new_tokens)
    every_question = {group.video_id: group.questions for group in group_by_video(all_questions)}
    before = {group.video_id: group.questions for group in group_by_video(answered_before)}
    label = config.options.label
    with ResultsWriter(rank_file(config.out, context.rank)) as out, \
            _progress(config, len(questions), f"{config.benchmark} {label}", context) as bar:
        for video in group_by_video(questions):
            answered = 0
            try:
                for answer in _answers(config, asker, video, every_question[video.video_id],
                                       before.get(video.video_id, ())):
                    out.write(_record(config, answer))
                    answered += 1
                    bar.update(1)
                    stop_point()  # a Ctrl-C a library swallowed
            except VideoError as error:  # the data's fault, not the model's: note it and go on
                log_video_error(config.out, context.rank, video, error, answered)
                bar.update(len(video.questions) - answered)


def _answers(config: EvalConfig, asker: Asker, video: VideoQuestions, room: Sequence[Question],
             answered: Sequence[Question]) -> Iterator[Answer]:
    if config.mode == "streaming":  # one stream a video: what its questions answered before did to it is replayed
        return answer_streamed(asker, video, max_fps=config.max_fps, room=room, replay=answered)
    if config.benchmark == "ovobench":
        return answer_clips(asker, video, max_fps=config.max_fps, max_frames=config.max_frames)
    if video.questions[0].realtime is not None:
        return answer_afresh(asker, video, max_fps=config.max_fps, room=room)
    return answer_encoded(asker, video, max_fps=config.max_fps, max_frames=config.max_frames,
                          once=config.encode_once, room=room)


def _record(config: EvalConfig, answer: Answer) -> AnswerRecord:
    return AnswerRecord.for_answer(
        answer.question, answer.text, model=config.model_name, method=config.method, budget=config.recorded_budget,
        protocol=config.protocol, parser=config.parser, timings=answer.timings, **answer.info)


def finish(config: EvalConfig, expected: Sequence[str]) -> dict[str, Any]:
    """Rank 0, after every rank: merge, score, write ``results.json`` and ``table.md``."""
    errors = unresolved_errors(config.out, expected)
    if not completed_qids(config.out):
        raise ConfigurationError(f"{config.out}: no question was answered ({len(errors)} unreadable video(s), see "
                                 "errors.rank*.jsonl)")
    wanted = set(expected)  # a run resumed with a smaller --limit scores only its own questions
    records = [record for record in merge_rank_files(config.out) if record.qid in wanted]
    if not records:
        raise ConfigurationError(f"{config.out}: none of the {len(expected)} questions asked was answered "
                                 f"({len(errors)} unreadable video(s), see errors.rank*.jsonl)")
    summary = write_summary(config.out, records, expected_qids=expected,
                            extra={"run": config.identity(), "errors": errors})
    write_whole(config.out / TABLE_FILE, paper_table([config.out]).encode())
    return summary


# ------------------------------------------------------------------------------------ run.json


def check_run_file(config: EvalConfig, expected: Sequence[str], content: dict[str, Any] | None = None, *,
                   write: bool, videos_before: Callable[[], dict[str, str]] | None = None,
                   device: str | None = None, replaced: set[str] = frozenset()) -> None:
    """Refuse to mix settings, data, answer keys or weights in one run directory (``content``: the fingerprints
    known so far, see `statekv.eval.identity`); rank 0 (re)writes ``run.json``. A run folder holding answers
    whose ``run.json`` records no fingerprints (an earlier statekv) cannot be checked, so it is refused too;
    ``videos_before`` gives the videos' fingerprints as an earlier statekv recorded them (also accepted);
    ``replaced``: answers the run drops (`replaced_answers`), whose videos may have changed; ``device``: what the
    run computes on (`statekv.eval.run_settings.device_named`), recorded in its conditions."""
    path = config.out / RUN_FILE
    identity = config.identity()
    content = dict(content or {})
    run = read_run_file(config.out)
    answered: set[str] = set()
    if run is not None:
        recorded = with_defaults(run["settings"])
        recorded.setdefault("mode", default_mode(str(recorded.get("benchmark")), recorded.get("ovobench_videos")))
        if recorded.get("benchmark") == "ovobench" and "groups" not in run["settings"]:
            recorded["groups"] = ["realtime"]  # written when statekv read OVO-Bench's real-time group only
        if isinstance(recorded.get("groups"), list):  # recorded as given before they were sorted
            recorded["groups"] = sorted(set(map(str, recorded["groups"])))
        changed = [key for key in RUN_IDENTITY if recorded.get(key) != identity[key]]
        redo = "use another --out for different settings, or --overwrite to answer again"
        if changed:  # a setting no flag gives back first (the model, say)
            # what follows from another setting changed: ovobench_videos from --mode, a method's own defaults
            derived = {"ovobench_videos", *(METHOD_DEFAULTS if "method" in changed else ())}
            unflagged = [key for key in changed if key not in RESUMABLE_FLAGS and key not in derived]
            flagged = [key for key in changed if key in RESUMABLE_FLAGS and key not in derived]
            first = (unflagged or flagged or changed)[0]
            held = f"{first}={recorded.get(first)!r}"
            if unrecorded(run["settings"], first):
                held = f"no {first} recorded (its {RUN_FILE} predates it: taken as {held})"
            hint = "" if unflagged or not flagged else resume_hint([(key, recorded.get(key), identity[key])
                                                                    for key in flagged])
            raise ConfigurationError(f"{config.out} holds a run with {held}, not {identity[first]!r}; {hint}{redo}")
        answered = completed_qids(config.out) - replaced
        if "videos" in content:
            _check_answered_videos(config.out, run["content"].get("videos"), content["videos"], answered, videos_before)
        for key, value in content.items():
            if key == "videos":
                continue
            if run["content"].get(key) is None and not answered:
                continue  # nothing answered yet: nothing to protect
            if run["content"].get(key) != value:
                what = CONTENT_IDENTITY[key]
                found = f"whose {RUN_FILE} records no fingerprint of the {what}" if run["content"].get(key) is None \
                    else f"made with other {what}"
                raise ConfigurationError(f"{config.out} holds answers {found} "
                                         f"({key}: recorded {str(run['content'].get(key))[:12]}, now {value[:12]}); "
                                         f"{redo}")
    if write:
        config.out.mkdir(parents=True, exist_ok=True)
        if not set(expected) <= completed_qids(config.out):  # gone before run.json names questions it lacks
            clear_run(config.out, (SUMMARY_FILE, TABLE_FILE))
        document = {"settings": identity, "content": content, "limit": config.limit, "expected_qids": list(expected),
                    "conditions": conditions_used(config.out, config.options, run if answered else None,
                                                      device)}
        write_whole(path, (json.dumps(document, indent=1) + "\n").encode())


METHOD_DEFAULTS = ("budget", "retrieve", "retrieval", "sinks")  # what a method sets unless told
RESUMABLE_FLAGS = ("method", "parser", "protocol", "mode", "max_new_tokens", "sinks", "retrieve", "retrieval", "layout",
                   "dtype", "attention", "kv_cache_dtype", "positions", "bounded_layout", "question_span",
                   "max_cache_bytes", "cache_limit", "max_fps", "max_frames", "groups")


def resume_hint(changed: list[tuple[str, Any, Any]]) -> str:
    """How to resume a run whose settings ``(key, recorded, given)`` differ, each a flag's (a flag typed at its
    default is refused too: what decides the answers is pinned as the run recorded it)."""
    steps = []
    for key, recorded, given in changed:
        flag = "--" + key.replace("_", "-")
        value = ",".join(map(str, recorded)) if isinstance(recorded, list) else recorded
        steps.append(f"leave out {flag}" if recorded is None else f"give {flag} {value}")
        if key == "parser":
            steps[-1] += f" (`statekv eval table --parser {given}` reads its answers the other way)"
    return f"to resume it, {' and '.join(steps)}; or "


def _check_answered_videos(out: Path, recorded: Any, current: dict[str, str], answered: set[str],
                           before: Callable[[], dict[str, str]] | None = None) -> None:
    """Refuse when a video changed after some of its questions were answered (a video whose questions are all
    unanswered may change: a damaged file replaced)."""
    if not answered:
        return
    if not isinstance(recorded, dict):
        raise ConfigurationError(f"{out} holds answers whose {RUN_FILE} records no fingerprint of the videos; use "
                                 "another --out, or --overwrite to answer again")
    changed = sorted(qid for qid in answered if qid in current and recorded.get(qid) != current[qid])
    if changed and before is not None:
        earlier = before()
        changed = [qid for qid in changed if recorded.get(qid) != earlier.get(qid)]
    if changed:
        raise ConfigurationError(f"{out} holds answers made from other videos (question {changed[0]}'s video "
                                 "changed since it was answered); use another --out, or --overwrite to answer again")


def read_run_file(run_dir: Path | str) -> dict[str, Any] | None:
    """``run.json`` checked: ``settings`` and ``content`` objects and ``expected_qids`` a list of ids (None when
    the folder has none); a one-line `DataError` naming the file and the field otherwise."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        return None
    if not path.is_file():
        raise DataError(f"{path} is not a regular file")
    try:
        run = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: damaged run file (not UTF-8 text); delete it or use --overwrite") from None
    except (ValueError, RecursionError) as error:  # ValueError: json's, and integers too long to convert
        raise DataError(f"{path}: damaged run file (not JSON: {str(error)[:80]}); delete it or use --overwrite") \
            from None
    if not isinstance(run, dict):
        raise DataError(f"{path}: damaged run file (not a JSON object)")
    run.setdefault("content", {})
    for field, kind, description in (("settings", dict, "an object"), ("content", dict, "an object"),
                                     ("expected_qids", list, "a list of question ids")):
        value = run.get(field)
        if not isinstance(value, kind) or (field == "expected_qids" and not all(isinstance(q, str) for q in value)):
            raise DataError(f"{path}: damaged run file (field {field!r} must be {description}); delete it or use "
                            "--overwrite")
    if not isinstance(run.get("conditions", []), list):
        raise DataError(f"{path}: damaged run file (field 'conditions' must be a list); delete it or use --overwrite")
    return run


def read_expected_qids(run_dir: Path | str) -> list[str] | None:
    """The question ids a run was asked to answer (``None`` when the directory has no ``run.json``)."""
    run = read_run_file(run_dir)
    return None if run is None else run["expected_qids"]


def clear_run(run_dir: Path, patterns: Sequence[str] = (RANK_FILE_GLOB, ERRORS_GLOB, MERGED_FILE,
                                                         SUMMARY_FILE, TABLE_FILE, RUN_FILE)) -> None:
    """Remove what a run wrote in ``run_dir`` (answers, errors, merge, summary, table, ``run.json``; or the files
    ``patterns`` name), nothing else: ``overwrite`` answers every question again."""
    if not run_dir.is_dir():
        return
    for pattern in patterns:
        for path in run_dir.glob(pattern):
            if path.is_file():
                path.unlink()


# ------------------------------------------------------------------------------------ progress


class _progress:
    """Progress over this rank's questions with an ETA: a tqdm bar on a terminal, else a log line at most
    every ``LOG_EVERY`` seconds (cluster logs)."""

    LOG_EVERY = 60.0

    def __init__(self, config: EvalConfig, total: int, description: str, context: RankContext):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = config.progress
        self.description = description + (f" [rank {context.rank}/{context.world_size}]" if context.distributed else "")
        self.started = self.logged = time.monotonic()
        if self.enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=self.description, unit="question", file=sys.stderr,
                            position=context.rank if context.distributed else None, dynamic_ncols=True)

    def __enter__(self) -> _progress:
        return self

    def update(self, count: int) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
            return
        now = time.monotonic()
        if self.enabled and count and (now - self.logged >= self.LOG_EVERY or self.done == self.total):
            self.logged = now
            rate = (now - self.started) / self.done
            logger.info("%s: %d/%d questions, %.1f s/question, ETA %s", self.description, self.done, self.total,
                        rate, datetime.timedelta(seconds=round(rate * (self.total - self.done))))

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
