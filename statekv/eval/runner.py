"""Evaluate one model under one method on one benchmark: resumable, data-parallel, with a rank-0 merge.

    from statekv.eval.runner import EvalConfig, run_evaluation

    summary = run_evaluation(EvalConfig.for_model("videomme", "OpenGVLab/InternVL3-1B-hf", data_root="data",
                                                  out="runs/videomme-internvl3-1b-statekv", budget=4096))

The run directory ``out`` holds one (benchmark, model, method, budget) run::

    run.json                  the settings (a rerun with different ones is refused) and the question ids
    run.lock                  held by the run going on (a second run on the folder is refused; `lock`)
    answers.rank000.jsonl     one line per answered question, flushed and fsynced (see `records`)
    errors.rank000.jsonl      videos that could not be read (their questions stay unanswered)
    answers.jsonl             rank 0's merge of the rank files, sorted by question id
    results.json              the scores (`report.write_summary`) and the run's settings
    table.md                  the paper's table for this run

Rerunning the same command skips every answered question, so a killed run loses at most the question
in flight. Under ``torchrun`` or ``accelerate launch`` each rank takes whole videos (deterministic
sharding of the full question list, so a resumed run keeps its assignment), uses ``cuda:<LOCAL_RANK>``,
and rank 0 merges and scores after all ranks have finished.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from statekv.errors import ConfigurationError
from statekv.eval.answering import Answer, Asker, answer_clips, answer_encoded, answer_streamed
from statekv.eval.distributed import RankContext
from statekv.eval.lock import RunLock
from statekv.eval.loaders import load_benchmark, load_benchmark_from_hub
from statekv.eval.parsing import check_parser
from statekv.eval.prompts import check_protocol, generation_settings
from statekv.eval.questions import BENCHMARKS, Question
from statekv.eval.records import AnswerRecord, ResultsWriter, completed_qids, rank_file
from statekv.eval.report import paper_table, write_summary
from statekv.eval.sharding import VideoQuestions, group_by_video, shard_by_video
from statekv.errors import OutputError, VideoError
from statekv.options import ModelOptions
from statekv.values import check_int, check_output_dir

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
TABLE_FILE = "table.md"
OVOBENCH_VIDEO_MODES = ("stream", "clips")
# Settings that change the answers: a run directory must not mix them (settings a run.json written before
# one of them existed does not name are compared with their default).
RUN_IDENTITY = ("benchmark", "model", "name", "method", "budget", "parser", "protocol", "max_fps", "max_frames",
                "layout", "attention", "dtype", "ovobench_videos", "max_new_tokens", "retrieve", "sinks",
                "retrieval")
IDENTITY_DEFAULTS = {"retrieve": None, "sinks": None, "retrieval": None}


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run.

    options: the model and method (`statekv.ModelOptions`; its ``device`` defaults to this rank's). name: the
    model's name in tables (default: derived from the checkpoint, e.g. "OpenGVLab/InternVL3-1B-hf" ->
    "InternVL3-1B"). limit: only the first ``limit`` questions (annotation order). ovobench_videos: ``stream``
    (one stream per source video) or ``clips`` (the released per-question clips, lmms-eval's protocol).
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
    max_frames: int = 512
    ovobench_videos: str = "stream"
    from_hub: bool = False
    max_new_tokens: int | None = None
    encode_once: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_root", Path(self.data_root))
        object.__setattr__(self, "out", check_output_dir(self.out, "out (the run folder)"))
        if self.benchmark not in BENCHMARKS:
            raise ConfigurationError(f"unknown benchmark {self.benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
        if not isinstance(self.options, ModelOptions) or self.options.model is None:
            raise ConfigurationError("an evaluation needs ModelOptions naming a model")
        check_parser(self.parser)
        check_protocol(self.protocol)
        if self.ovobench_videos not in OVOBENCH_VIDEO_MODES:
            raise ConfigurationError(f"ovobench_videos must be one of {', '.join(OVOBENCH_VIDEO_MODES)}, "
                                     f"got {self.ovobench_videos!r}")
        for name in ("limit", "max_new_tokens"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        if self.from_hub and self.benchmark in ("ovobench", "synthetic"):
            raise ConfigurationError(f"{self.benchmark} annotations are read from --data-root only (no hub loading)")

    @classmethod
    def for_model(cls, benchmark: str, model: str | Path, data_root: Path | str, out: Path | str,
                  **settings: Any) -> "EvalConfig":
        """A config from a checkpoint and flat settings: `ModelOptions` fields go to the options, the rest to the
        config (``EvalConfig.for_model("mlvu", "ckpt", "data", "runs/x", method="recency", limit=10)``)."""
        known = set(ModelOptions.__dataclass_fields__)
        options = ModelOptions(model=str(model), **{k: v for k, v in settings.items() if k in known})
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
                  "sinks": options.sinks if "sinks" in options.spec.uses else None}
        values["ovobench_videos"] = self.ovobench_videos if self.benchmark == "ovobench" else None
        return {key: values[key] for key in RUN_IDENTITY}


def display_name(model: str | Path) -> str:
    """A checkpoint's table name: the last path component without "-hf"/"-Instruct" suffixes."""
    name = Path(str(model).rstrip("/")).name
    while (shorter := re.sub(r"-(hf|instruct)$", "", name, flags=re.IGNORECASE)) != name:
        name = shorter
    return name


def run_evaluation(config: EvalConfig, *, context: RankContext | None = None, qa=None) -> dict[str, Any] | None:
    """Run (or resume) ``config`` on this rank; rank 0 returns the summary written to ``results.json``.

    qa: an already loaded `statekv.VideoQA` with the config's method (default: load ``config.model``).
    """
    context = context or RankContext.from_env()
    every_question = load_questions(config)
    questions = every_question[: config.limit] if config.limit else every_question
    expected = [question.qid for question in questions]
    lock = RunLock(config.out)
    try:
        context.connect()
        _lock_for_every_rank(lock, context)
        check_run_file(config, expected, write=context.is_main)
        done = completed_qids(config.out)
        assigned = shard_by_video(questions, context.rank, context.world_size)
        todo = [question for question in assigned if question.qid not in done]
        logger.info("rank %d/%d: %d questions to answer (%d of its %d already done)", context.rank,
                    context.world_size, len(todo), len(assigned) - len(todo), len(assigned))
        if todo:
            qa = qa if qa is not None else load_model(config, context)
            if qa.method != config.method:
                raise ConfigurationError(f"the model was set up for {qa.method!r}, the run asks for {config.method!r}")
            answer_questions(config, qa, todo, all_questions=every_question, context=context)
        context.barrier()
        if not context.is_main:
            return None
        return finish(config, expected)
    finally:
        lock.release()
        context.close()


def _lock_for_every_rank(lock: RunLock, context: RankContext) -> None:
    """Rank 0 takes the run folder's lock; every rank of the launch stops if it could not (another run holds
    it), so none of them repeats that run's work."""
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
        questions = load_benchmark("ovobench", config.data_root, videos=videos)
    else:
        questions = load_benchmark(config.benchmark, config.data_root)
    if not questions:
        raise ConfigurationError(f"no {config.benchmark} questions found under {config.data_root}")
    return questions


def load_model(config: EvalConfig, context: RankContext):
    """The `VideoQA` of the config, on ``config.device`` or this rank's default device."""
    import torch

    from statekv.pipeline import VideoQA

    device = config.options.device or context.default_device()
    if str(device).startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))  # kernels launch on the current device
    return VideoQA.from_options(config.options.with_changes(device=device))


def answer_questions(config: EvalConfig, qa, questions: Sequence[Question], *, all_questions: Sequence[Question],
                     context: RankContext) -> None:
    """Answer ``questions`` video by video, appending one durable record per answer to this rank's file.

    ``all_questions`` (the whole benchmark) size each encoding's room for questions, so an answer does not
    depend on which of its video's questions are left to answer (``limit``, resuming)."""
    asker = Asker(qa, generation_settings(config.benchmark, config.protocol), config.protocol,
                  max_new_tokens=config.max_new_tokens)
    every_question = {group.video_id: group.questions for group in group_by_video(all_questions)}
    label = config.options.label
    with ResultsWriter(rank_file(config.out, context.rank)) as out, \
            _progress(config, len(questions), f"{config.benchmark} {label}", context) as bar:
        for video in group_by_video(questions):
            answered = 0
            try:
                for answer in _answers(config, asker, video, every_question[video.video_id]):
                    out.write(_record(config, answer))
                    answered += 1
                    bar.update(1)
            except VideoError as error:  # the data's fault, not the model's: note it and go on
                _log_video_error(config, context, video, error)
                bar.update(len(video.questions) - answered)


def _answers(config: EvalConfig, asker: Asker, video: VideoQuestions, room: Sequence[Question]) -> Iterator[Answer]:
    if config.benchmark != "ovobench":
        return answer_encoded(asker, video, max_fps=config.max_fps, max_frames=config.max_frames,
                              once=config.encode_once, room=room)
    if config.ovobench_videos == "clips":
        return answer_clips(asker, video, max_fps=config.max_fps, max_frames=config.max_frames)
    return answer_streamed(asker, video, max_fps=config.max_fps, room=room)


def _record(config: EvalConfig, answer: Answer) -> AnswerRecord:
    return AnswerRecord.for_answer(
        answer.question, answer.text, model=config.model_name, method=config.method, budget=config.recorded_budget,
        protocol=config.protocol, parser=config.parser, timings=answer.timings, **answer.info,
    )


def finish(config: EvalConfig, expected: Sequence[str]) -> dict[str, Any]:
    """Rank 0, after every rank: merge, score, write ``results.json`` and ``table.md``."""
    errors = unresolved_errors(config.out)
    if not completed_qids(config.out):
        raise ConfigurationError(f"{config.out}: no question was answered ({len(errors)} unreadable video(s), see "
                                 "errors.rank*.jsonl)")
    summary = write_summary(config.out, expected_qids=expected, extra={"run": config.identity(), "errors": errors})
    (config.out / TABLE_FILE).write_text(paper_table([config.out]), encoding="utf-8")
    return summary


# ------------------------------------------------------------------------------------ run.json


def check_run_file(config: EvalConfig, expected: Sequence[str], *, write: bool) -> None:
    """Refuse to mix settings in one run directory; rank 0 (re)writes ``run.json``."""
    path = config.out / RUN_FILE
    identity = config.identity()
    if path.is_file():
        recorded = {**IDENTITY_DEFAULTS, **json.loads(path.read_text(encoding="utf-8")).get("settings", {})}
        changed = [key for key in RUN_IDENTITY if recorded.get(key) != identity[key]]
        if changed:
            first = changed[0]
            raise ConfigurationError(
                f"{config.out} holds a run with {first}={recorded.get(first)!r}, not {identity[first]!r}; "
                "use another --out for different settings")
    if write:
        config.out.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(RUN_FILE + ".tmp")
        temporary.write_text(json.dumps({"settings": identity, "expected_qids": list(expected)}, indent=1) + "\n",
                             encoding="utf-8")
        os.replace(temporary, path)


def read_expected_qids(run_dir: Path | str) -> list[str] | None:
    """The question ids a run was asked to answer (``None`` when the directory has no ``run.json``)."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))["expected_qids"]


# ------------------------------------------------------------------------------------ unreadable videos


def _log_video_error(config: EvalConfig, context: RankContext, video: VideoQuestions, error: Exception) -> None:
    logger.error("%s: %s (its questions stay unanswered; rerun to retry)", video.video_id, error)
    entry = {"video_id": video.video_id, "qids": [q.qid for q in video.questions], "error": str(error)}
    with (config.out / f"errors.rank{context.rank:03d}.jsonl").open("a", encoding="utf-8") as file:
        file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        file.flush()
        os.fsync(file.fileno())


def unresolved_errors(run_dir: Path) -> list[dict[str, Any]]:
    """Logged video errors whose questions are still unanswered (one entry per video, the latest error)."""
    answered = completed_qids(run_dir)
    latest: dict[str, dict[str, Any]] = {}
    for path in sorted(run_dir.glob("errors.rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                latest[entry["video_id"]] = entry
    return [entry for entry in latest.values() if not set(entry["qids"]) <= answered]


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
