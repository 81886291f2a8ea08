"""Load VideoMME, MLVU (dev, multiple choice) and OVOBench (real-time) from local copies.

Expected layout under ``data_root`` (each benchmark folder is a snapshot of its published
release; annotation files may also be converted to ``.jsonl``/``.json`` with the same fields,
which avoids the ``pyarrow`` dependency of parquet)::

    <data_root>/videomme/videomme/test-00000-of-00001.parquet   lmms-lab/Video-MME, config videomme
    <data_root>/videomme/data/<videoID>.mp4                     (else .MP4, else .mkv)
    <data_root>/mlvu/mlvu/test-00000-of-00001.parquet           sy1998/MLVU_dev, split test
    <data_root>/mlvu/<video_name>                               video_name is a relative path
    <data_root>/ovobench/ovo_bench_new.json                     the OVO-Bench release (all tasks),
                  or  ovobench/realtime/data.json               or lmms-eval's real-time subset
    <data_root>/ovobench/src_videos/<video>                     source videos (video is relative)
    <data_root>/ovobench/chunked_videos/<id>.mp4                released clips, cut at ceil(realtime)
    <data_root>/questions.jsonl, <data_root>/videos/*.mp4       a synthetic set (``statekv synthetic make``)

For VideoMME and MLVU, any ``test*.parquet`` / ``test*.jsonl`` / ``test*.json`` in the inner
folder (or directly in the benchmark folder) is accepted; pass ``annotation=`` to name files
explicitly. Question ids are the published ``question_id`` (VideoMME, MLVU) or ``id``
(OVOBench) when every row has a distinct one, else the row's position in the file.

``load_benchmark_from_hub`` reads the annotations with the ``datasets`` library instead (for
VideoMME and MLVU; needs network and ``pip install datasets``); videos still come from
``data_root``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from statekv.errors import MissingFileError
from statekv.eval.annotations import find_annotation_files, read_rows, require_fields
from statekv.eval.questions import (
    BENCHMARKS,
    MLVU_TASKS,
    OVOBENCH_REALTIME_TASKS,
    AnnotationError,
    Question,
)
from statekv.synthetic.benchmark import QUESTIONS_FILE

logger = logging.getLogger(__name__)

VIDEOMME_EXTENSIONS = (".mp4", ".MP4", ".mkv")
OVOBENCH_ANNOTATIONS = ("ovo_bench_new.json", "realtime/data.json", "realtime.jsonl", "realtime.json")
HUB_DATASETS = {
    "videomme": ("lmms-lab/Video-MME", "videomme", "test"),
    "mlvu": ("sy1998/MLVU_dev", None, "test"),
}

AnnotationArg = Path | str | Sequence[Path | str] | None


def load_benchmark(
    benchmark: str, data_root: Path | str, *, annotation: AnnotationArg = None, check_videos: bool = True, **options
) -> list[Question]:
    """Questions of ``benchmark`` ("videomme", "mlvu", "ovobench" or "synthetic"), in annotation order."""
    loaders = {"videomme": load_videomme, "mlvu": load_mlvu, "ovobench": load_ovobench_realtime,
               "synthetic": load_synthetic}
    if benchmark not in loaders:
        raise ValueError(f"unknown benchmark {benchmark!r}; expected one of {', '.join(BENCHMARKS)}")
    return one_path_per_video(loaders[benchmark](data_root, annotation=annotation, check_videos=check_videos,
                                                 **options))


def one_path_per_video(questions: list[Question]) -> list[Question]:
    """``questions`` if each video id names one video file; else a one-line `AnnotationError` (questions are
    grouped by video id, so two files under one id would be answered from one of them)."""
    paths: dict[str, tuple[Path, str]] = {}
    for question in questions:
        first = paths.setdefault(question.video_id, (question.video_path, question.qid))
        if first[0] != question.video_path:
            raise AnnotationError(f"video id {question.video_id!r} names two videos: {first[0]} (question "
                                  f"{first[1]}) and {question.video_path} (question {question.qid})")
    return questions


def load_videomme(
    data_root: Path | str, *, annotation: AnnotationArg = None, check_videos: bool = True
) -> list[Question]:
    folder = Path(data_root) / "videomme"
    paths = _annotation_paths(annotation, [folder / "videomme", folder], stem="test")
    return videomme_questions(read_rows(paths), folder, check_videos=check_videos, source=_describe(paths))


def load_mlvu(data_root: Path | str, *, annotation: AnnotationArg = None, check_videos: bool = True) -> list[Question]:
    folder = Path(data_root) / "mlvu"
    paths = _annotation_paths(annotation, [folder / "mlvu", folder], stem="test")
    return mlvu_questions(read_rows(paths), folder, check_videos=check_videos, source=_describe(paths))


def load_ovobench_realtime(
    data_root: Path | str,
    *,
    annotation: AnnotationArg = None,
    check_videos: bool = True,
    videos: Literal["source", "clips"] = "source",
) -> list[Question]:
    """The six real-time subtasks. ``videos`` says which files must exist when checking:
    the source videos (a streaming run asks each question when the stream reaches its time)
    or the released per-question clips."""
    folder = Path(data_root) / "ovobench"
    if annotation is None:
        candidates = [folder / name for name in OVOBENCH_ANNOTATIONS]
        found = next((path for path in candidates if path.is_file()), None)
        if found is None:
            raise MissingFileError(f"no OVOBench annotation found; looked for {', '.join(map(str, candidates))}")
        paths = [found]
    else:
        paths = _annotation_paths(annotation, [], stem="")
    return ovobench_questions(
        read_rows(paths), folder, check_videos=check_videos, videos=videos, source=_describe(paths)
    )


def load_synthetic(data_root: Path | str, *, annotation: AnnotationArg = None,
                   check_videos: bool = True) -> list[Question]:
    """A set written by ``statekv synthetic make``: ``<data_root>/questions.jsonl``, videos relative to it."""
    folder = Path(data_root)
    paths = _annotation_paths(annotation, [], stem="") if annotation is not None else [folder / QUESTIONS_FILE]
    return synthetic_questions(read_rows(paths), folder, check_videos=check_videos, source=_describe(paths))


def load_benchmark_from_hub(benchmark: str, data_root: Path | str, *, check_videos: bool = True) -> list[Question]:
    """Like ``load_benchmark`` but the annotations come from the Hugging Face hub."""
    if benchmark not in HUB_DATASETS:
        raise ValueError(f"no hub dataset for {benchmark!r}; hub loading supports {', '.join(HUB_DATASETS)}")
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "loading annotations from the hub needs the datasets library (pip install datasets)"
        ) from error
    repo, config, split = HUB_DATASETS[benchmark]
    rows = [dict(row) for row in datasets.load_dataset(repo, config, split=split)]
    folder = Path(data_root) / benchmark
    build = videomme_questions if benchmark == "videomme" else mlvu_questions
    return one_path_per_video(build(rows, folder, check_videos=check_videos, source=f"hub:{repo}"))


# ---------------------------------------------------------------------------------- row -> Question


def videomme_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool, source: str) -> list[Question]:
    fields = (
        "videoID",
        "question_id",
        "duration",
        "domain",
        "sub_category",
        "task_type",
        "question",
        "options",
        "answer",
    )
    qids = _question_ids(rows, "question_id")
    questions = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        video_id = str(row["videoID"])
        questions.append(
            _checked(
                Question(
                    benchmark="videomme",
                    qid=qids[index],
                    video_id=video_id,
                    video_path=_videomme_video(folder / "data", video_id, check_videos),
                    question=str(row["question"]),
                    options=_options(row["options"], where),
                    answer=str(row["answer"]).strip(),
                    task_type=str(row["task_type"]),
                    duration=str(row["duration"]),
                    domain=str(row["domain"]),
                    sub_category=str(row["sub_category"]),
                ),
                where,
            )
        )
    return questions


def mlvu_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool, source: str) -> list[Question]:
    fields = ("video_name", "question", "candidates", "answer", "task_type")
    qids = _question_ids(rows, "question_id")
    questions, skipped = [], 0
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        if row["task_type"] not in MLVU_TASKS:
            skipped += 1
            continue
        video_path = folder / str(row["video_name"])
        if check_videos and not video_path.is_file():
            raise MissingFileError(f"MLVU video not found: {video_path}")
        questions.append(
            _checked(
                Question(
                    benchmark="mlvu",
                    qid=qids[index],
                    video_id=str(row["video_name"]),
                    video_path=video_path,
                    question=str(row["question"]),
                    options=_options(row["candidates"], where),
                    answer=str(row["answer"]).strip(),
                    task_type=str(row["task_type"]),
                ),
                where,
            )
        )
    if skipped:
        logger.info("MLVU: skipped %d rows outside the seven multiple-choice tasks", skipped)
    return questions


def ovobench_questions(
    rows: list[dict[str, Any]],
    folder: Path,
    *,
    check_videos: bool,
    videos: Literal["source", "clips"] = "source",
    source: str,
) -> list[Question]:
    if videos not in ("source", "clips"):
        raise ValueError(f"videos must be 'source' or 'clips', got {videos!r}")
    fields = ("id", "task", "video", "realtime", "question", "options", "gt")
    qids = _question_ids(rows, "id")
    questions = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        if row.get("task") not in OVOBENCH_REALTIME_TASKS:
            continue
        require_fields(row, fields, where)
        options = _options(row["options"], where)
        gt = row["gt"]
        if not isinstance(gt, int) or not 0 <= gt < len(options):
            raise AnnotationError(f"{where}: gt={gt!r} is not an index into its {len(options)} options")
        realtime = row["realtime"]
        if isinstance(realtime, bool) or not isinstance(realtime, (int, float)) or not 0 <= realtime < float("inf"):
            raise AnnotationError(f"{where}: field 'realtime' must be a number of seconds >= 0, got {realtime!r}")
        video_path = folder / "src_videos" / str(row["video"])
        clip_path = folder / "chunked_videos" / f"{row['id']}.mp4"
        required = video_path if videos == "source" else clip_path
        if check_videos and not required.is_file():
            raise MissingFileError(f"OVOBench {'source video' if videos == 'source' else 'clip'} not found: {required}")
        questions.append(
            Question(
                benchmark="ovobench",
                qid=qids[index],
                video_id=str(row["video"]),
                video_path=video_path,
                question=str(row["question"]),
                options=options,
                answer=chr(ord("A") + gt),
                task_type=str(row["task"]),
                realtime=float(row["realtime"]),
                clip_path=clip_path,
            )
        )
    return questions


def synthetic_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool,
                        source: str) -> list[Question]:
    fields = ("qid", "video_id", "video", "task_type", "question", "options", "answer")
    questions = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        video_path = folder / str(row["video"])
        if check_videos and not video_path.is_file():
            raise MissingFileError(f"{where}: video not found: {video_path}")
        questions.append(_checked(Question(
            benchmark="synthetic", qid=str(row["qid"]), video_id=str(row["video_id"]), video_path=video_path,
            question=str(row["question"]), options=_options(row["options"], where), answer=str(row["answer"]).strip(),
            task_type=str(row["task_type"])), where))
    if len({question.qid for question in questions}) != len(questions):
        raise AnnotationError(f"{source}: question ids repeat")
    return questions


# ---------------------------------------------------------------------------------- helpers


def _annotation_paths(annotation: AnnotationArg, directories: list[Path], stem: str) -> list[Path]:
    if annotation is None:
        return find_annotation_files(directories, stem)
    paths = [Path(annotation)] if isinstance(annotation, (str, Path)) else [Path(p) for p in annotation]
    for path in paths:
        if not path.is_file():
            raise MissingFileError(f"annotation file not found: {path}")
    return paths


def _describe(paths: list[Path]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)"


def _question_ids(rows: list[dict[str, Any]], field: str) -> list[str]:
    ids = [row.get(field) for row in rows]
    as_text = [str(value) for value in ids]
    if None not in ids and len(set(as_text)) == len(as_text):
        return as_text
    return [str(index) for index in range(len(rows))]


def _options(value: Any, where: str) -> tuple[str, ...]:
    """A list of 2 to 26 distinct, non-empty option texts (numbers are taken as their text)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise AnnotationError(f"{where}: options must be a list, got {type(value).__name__}")
    value = list(value)
    for index, option in enumerate(value):
        if isinstance(option, bool) or not isinstance(option, (str, int, float)) or not str(option).strip():
            shown = "empty" if isinstance(option, str) else f"{type(option).__name__} {str(option)[:40]!r}"
            raise AnnotationError(f"{where}: option {index} must be a non-empty text, got {shown}")
    options = tuple(str(option) for option in value)
    if not 2 <= len(options) <= 26:
        raise AnnotationError(f"{where}: expected 2 to 26 options, got {len(options)}")
    repeated = next((option for index, option in enumerate(options) if option.strip() in
                     {other.strip() for other in options[:index]}), None)
    if repeated is not None:
        raise AnnotationError(f"{where}: option {repeated!r} appears twice")
    return options


def _checked(question: Question, where: str) -> Question:
    if len(question.answer) != 1 or question.answer not in question.letters:
        raise AnnotationError(f"{where}: answer {question.answer!r} is not one of {question.letters}")
    return question


def _videomme_video(directory: Path, video_id: str, check: bool) -> Path:
    candidates = [directory / f"{video_id}{extension}" for extension in VIDEOMME_EXTENSIONS]
    if not check:
        return next((path for path in candidates if path.is_file()), candidates[0])
    for path in candidates:
        if path.is_file():
            return path
    raise MissingFileError(f"VideoMME video not found: {candidates[0]} (also tried .MP4, .mkv)")


__all__ = [
    "load_benchmark",
    "load_benchmark_from_hub",
    "load_mlvu",
    "load_ovobench_realtime",
    "load_synthetic",
    "load_videomme",
]
