"""Benchmarks for long and streaming video QA: VideoMME, MLVU (dev), OVO-Bench, StreamingBench and the synthetic
sets, each streaming (one live stream per video, questions asked at their times) or offline.

The runner (`statekv.eval.runner`, ``statekv eval`` on the command line) evaluates one model and
method on one benchmark, resumably and data-parallel::

    from statekv.eval.runner import EvalConfig, run_evaluation

    summary = run_evaluation(EvalConfig("videomme", "OpenGVLab/InternVL3-1B-hf", data_root="data",
                                        out="runs/videomme/internvl3-1b-statekv", method="statekv"))

This package holds everything it uses below the model: datasets, prompts, generation settings,
answer parsing, scoring, crash-safe per-question records, sharding and reports. On rank ``rank``
of ``world`` the runner does::

    import statekv.eval as ev

    questions = ev.load_benchmark("videomme", data_root)            # list[Question]
    settings = ev.generation_settings("videomme")                   # max_new_tokens, stop strings
    done = ev.completed_qids(run_dir)
    mine = [q for q in ev.shard_by_video(questions, rank, world) if q.qid not in done]
    with ev.ResultsWriter(ev.rank_file(run_dir, rank)) as out:
        for video in ev.group_by_video(mine):                       # each video once
            ...encode video.video_path once (OVOBench: stream, see video.checkpoints())...
            for q in video.questions:
                text = ...generate from ev.build_prompt(q) with settings...
                out.write(ev.AnswerRecord.for_answer(
                    q, text, model=name, method="statekv", budget=4096, timings={"answer": s}))
    # rank 0, after all ranks finished:
    ev.write_summary(run_dir, expected_qids=[q.qid for q in questions])
    print(ev.paper_table([run_dir, ...]))

Parsing defaults to lmms-eval 0.7's extractor; ``parser="paper"`` selects the paper-era one,
and ``results.json`` holds the score under both. `statekv.eval.lmms_plugin` makes the same
models available inside lmms-eval (``lmms-eval --model statekv``); `statekv.eval.fabricate`
writes mini benchmarks in the published layouts for tests and smoke runs.
"""

from statekv.eval.loaders import (
    load_benchmark,
    load_benchmark_from_hub,
    load_mlvu,
    load_ovobench,
    load_ovobench_realtime,
    load_streamingbench,
    load_videomme,
)
from statekv.eval.parsing import (
    DEFAULT_PARSER,
    PARSERS,
    judge,
    ovobench_letter,
    paper_mlvu_letter,
    paper_videomme_letter,
    parse_answer,
    ranked_letter,
)
from statekv.eval.prompts import (
    DEFAULT_PROTOCOL,
    PROTOCOLS,
    GenerationSettings,
    build_prompt,
    generation_settings,
)
from statekv.eval.questions import (
    BENCHMARKS,
    MLVU_TASKS,
    OVOBENCH_REALTIME_TASKS,
    AnnotationError,
    Question,
)
from statekv.errors import MissingFileError
from statekv.eval.records import (
    AnswerRecord,
    ResultsFileError,
    ResultsWriter,
    completed_qids,
    latest_per_question,
    merge_rank_files,
    rank_file,
    read_records,
    run_records,
)
from statekv.eval.report import build_summary, method_label, paper_table, read_summary, write_summary
from statekv.eval.scoring import BenchmarkScore, Tally, score
from statekv.eval.sharding import VideoQuestions, assign_videos, group_by_video, shard_by_video

__all__ = [
    "BENCHMARKS",
    "DEFAULT_PARSER",
    "DEFAULT_PROTOCOL",
    "MLVU_TASKS",
    "OVOBENCH_REALTIME_TASKS",
    "PARSERS",
    "PROTOCOLS",
    "AnnotationError",
    "AnswerRecord",
    "BenchmarkScore",
    "GenerationSettings",
    "MissingFileError",
    "Question",
    "ResultsFileError",
    "ResultsWriter",
    "Tally",
    "VideoQuestions",
    "assign_videos",
    "build_prompt",
    "build_summary",
    "completed_qids",
    "generation_settings",
    "group_by_video",
    "judge",
    "latest_per_question",
    "load_benchmark",
    "load_benchmark_from_hub",
    "load_mlvu",
    "load_ovobench",
    "load_ovobench_realtime",
    "load_streamingbench",
    "load_videomme",
    "merge_rank_files",
    "method_label",
    "ovobench_letter",
    "paper_mlvu_letter",
    "paper_table",
    "paper_videomme_letter",
    "parse_answer",
    "rank_file",
    "ranked_letter",
    "read_records",
    "read_summary",
    "run_records",
    "score",
    "shard_by_video",
    "write_summary",
]
