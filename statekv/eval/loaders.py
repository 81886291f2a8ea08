"""Load VideoMME, MLVU (dev, multiple choice), OVO-Bench, StreamingBench and the synthetic sets from local copies.

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
                                 <id>_<j>.mp4                   (forward tasks: one per poll)
    <data_root>/streamingbench/questions_real.json              StreamingBench's question files (and, when
                  questions_omni.json, questions_sqa.json,      present, the contextual ones)
                  questions_proactive.json
    <data_root>/streamingbench/<video_path>                     e.g. ./videos/sample_1_real.mp4
    <data_root>/questions.jsonl, <data_root>/videos/*.mp4       a synthetic set (``statekv synthetic make``)
    <data_root>/streaming.json, <data_root>/videos/*.mp4        a streaming synthetic set (``--streaming``)

For VideoMME and MLVU, any ``test*.parquet`` / ``test*.jsonl`` / ``test*.json`` in the inner
folder (or directly in the benchmark folder) is accepted; pass ``annotation=`` to name files
explicitly. Question ids are the published ``question_id`` (VideoMME, MLVU) or ``id``
(OVOBench) when every row has a distinct one, else the row's position in the file (in one warning line when some
rows have one).

``load_benchmark_from_hub`` reads the annotations with the ``datasets`` library instead (for
VideoMME and MLVU; needs network and ``pip install datasets``); videos still come from
``data_root``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from dataclasses import replace
from typing import Any, Literal

from statekv.errors import ConfigurationError, DataError, MissingFileError
from statekv.eval.annotations import (LoadNotes, find_annotation_files, parse_options, read_rows, require_fields,
                                      video_in)
from statekv.eval.questions import BENCHMARKS, MLVU_TASKS, AnnotationError, Question
from statekv.eval.ovobench import ovobench_questions, seconds
from statekv.eval.streamingbench import check_video_files, streamingbench_questions
from statekv.synthetic.benchmark import MAKING_FILE, QUESTIONS_FILE, STREAMING_FILE
from statekv.synthetic.streaming import GROUPS as STREAMING_GROUPS

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
    """Questions of ``benchmark`` ("videomme", "mlvu", "ovobench", "streamingbench" or "synthetic"), in annotation
    order. ``groups=`` (OVO-Bench, StreamingBench) keeps those groups only."""
    loaders = {"videomme": load_videomme, "mlvu": load_mlvu, "ovobench": load_ovobench,
               "streamingbench": load_streamingbench, "synthetic": load_synthetic}
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


def load_ovobench(
    data_root: Path | str,
    *,
    annotation: AnnotationArg = None,
    check_videos: bool = True,
    videos: Literal["source", "clips"] = "source",
    groups: Sequence[str] | None = None,
) -> list[Question]:
    """OVO-Bench's questions in ``groups`` (default: backward, realtime and forward; see `statekv.eval.ovobench`).
    ``videos`` says which files must exist when checking: the source videos (a streaming run asks each question
    when the stream reaches its time) or the released per-question clips."""
    folder = Path(data_root) / "ovobench"
    if annotation is None:
        candidates = [folder / name for name in OVOBENCH_ANNOTATIONS]
        found = next((path for path in candidates if path.is_file()), None)
        if found is None:
            raise MissingFileError(f"no OVOBench annotation found; looked for {', '.join(map(str, candidates))}")
        paths = [found]
    else:
        paths = _annotation_paths(annotation, [], stem="")
    return ovobench_questions(read_rows(paths), folder, check_videos=check_videos, videos=videos,
                              source=_describe(paths), groups=groups)


def load_ovobench_realtime(data_root: Path | str, *, annotation: AnnotationArg = None, check_videos: bool = True,
                           videos: Literal["source", "clips"] = "source") -> list[Question]:
    """OVO-Bench's six real-time subtasks (the paper's Table 1 column)."""
    return load_ovobench(data_root, annotation=annotation, check_videos=check_videos, videos=videos,
                         groups=("realtime",))


def load_streamingbench(data_root: Path | str, *, annotation: AnnotationArg = None, check_videos: bool = True,
                        groups: Sequence[str] | None = None) -> list[Question]:
    """StreamingBench's real-time and contextual groups from ``<data_root>/streamingbench`` (see
    `statekv.eval.streamingbench`); ``annotation``: another folder holding the question files."""
    folder = Path(data_root) / "streamingbench"
    files = folder if annotation is None else Path(annotation)
    if not files.is_dir():
        raise MissingFileError(f"no StreamingBench folder {files}")
    questions = streamingbench_questions(files, check_videos=False, groups=groups)
    if files != folder:  # videos stay under the data root
        questions = [replace(q, video_path=folder / q.video_id) for q in questions]
    if check_videos:
        check_video_files(questions)
    return questions


def load_synthetic(data_root: Path | str, *, annotation: AnnotationArg = None,
                   check_videos: bool = True) -> list[Question]:
    """A set written by ``statekv synthetic make``: ``<data_root>/questions.jsonl``, videos relative to it; made
    with ``--streaming``: ``<data_root>/streaming.json`` (OVO-Bench's format, see `statekv.synthetic.streaming`)."""
    folder = Path(data_root)
    if annotation is None and not (folder / QUESTIONS_FILE).exists() and not (folder / STREAMING_FILE).exists() \
            and (folder / MAKING_FILE).is_file():  # its question file is written last
        raise MissingFileError(f"{folder} holds a synthetic make that was stopped before its question file was "
                               "written: run the same `statekv synthetic make` command again to finish it")
    if annotation is None and not (folder / QUESTIONS_FILE).exists() and not (folder / STREAMING_FILE).exists():
        made = "no folder" if not folder.exists() else "a file, not a folder" if not folder.is_dir() else \
            f"a folder with no {QUESTIONS_FILE}"
        raise MissingFileError(f"{folder} is {made}: a synthetic set is a folder `statekv synthetic make --out "
                               f"{folder}` writes")
    if annotation is None and not (folder / QUESTIONS_FILE).exists() and (folder / STREAMING_FILE).is_file():
        path = folder / STREAMING_FILE
        return synthetic_streaming_questions(read_rows([path]), folder, check_videos=check_videos, source=str(path))
    paths = _annotation_paths(annotation, [], stem="") if annotation is not None else [folder / QUESTIONS_FILE]
    if len(paths) == 1 and paths[0].name == STREAMING_FILE:
        return synthetic_streaming_questions(read_rows(paths), folder, check_videos=check_videos,
                                             source=str(paths[0]))
    return synthetic_questions(read_rows(paths), folder, check_videos=check_videos, source=_describe(paths))


def load_benchmark_from_hub(benchmark: str, data_root: Path | str, *, check_videos: bool = True) -> list[Question]:
    """Like ``load_benchmark`` but the annotations come from the Hugging Face hub."""
    if benchmark not in HUB_DATASETS:
        raise ValueError(f"no hub dataset for {benchmark!r}; hub loading supports {', '.join(HUB_DATASETS)}")
    try:
        import datasets
    except ImportError as error:
        raise ConfigurationError("loading annotations from the hub needs the datasets library (pip install "
                                 "datasets)") from error
    repo, config, split = HUB_DATASETS[benchmark]
    try:
        rows = [dict(row) for row in datasets.load_dataset(repo, config, split=split)]
    except Exception as error:  # the network, the hub or a gated dataset: each library raises its own kinds
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise DataError(f"cannot load {repo} from the Hugging Face Hub ({reason}); or fetch its files "
                        "(docs/evaluation.md) and run without --from-hub") from None
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
    qids = _question_ids(rows, "question_id", source)
    questions = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        video_id = str(row["videoID"])
        video_in(folder / "data", video_id, where, "videoID")  # a name inside the folder, refused otherwise
        questions.append(
            _checked(
                Question(
                    benchmark="videomme",
                    qid=qids[index],
                    video_id=video_id,
                    video_path=_videomme_video(folder / "data", video_id, check_videos),
                    question=str(row["question"]),
                    options=parse_options(row["options"], where, distinct=False),
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
    qids = _question_ids(rows, "question_id", source)
    questions = []
    notes = LoadNotes("MLVU")
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        if row["task_type"] not in MLVU_TASKS:
            notes.add(f"row(s) of task {str(row['task_type'])[:40]!r} not used (not one of the seven "
                      "multiple-choice tasks)", where)
            continue
        video_path = video_in(folder, row["video_name"], where, "video_name")
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
                    options=parse_options(row["candidates"], where, distinct=False),
                    answer=str(row["answer"]).strip(),
                    task_type=str(row["task_type"]),
                ),
                where,
            )
        )
    notes.warn()
    return questions


def synthetic_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool,
                        source: str) -> list[Question]:
    fields = ("qid", "video_id", "video", "task_type", "question", "options", "answer")
    questions = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, fields, where)
        check_evidence(row, where)
        video_path = video_in(folder, row["video"], where)
        if check_videos and not video_path.is_file():
            raise MissingFileError(f"{where}: video not found: {video_path}")
        questions.append(_checked(Question(
            benchmark="synthetic", qid=str(row["qid"]), video_id=str(row["video_id"]), video_path=video_path,
            question=str(row["question"]), options=parse_options(row["options"], where), answer=str(row["answer"]).strip(),
            task_type=str(row["task_type"])), where))
    if len({question.qid for question in questions}) != len(questions):
        raise AnnotationError(f"{source}: question ids repeat")
    return questions


def check_evidence(row: dict[str, Any], where: str, field: str = "evidence_frames") -> None:
    """A synthetic question's ``num_frames`` (the video's frames: a positive integer) and its evidence (``field``:
    the frames that decide its answer, a non-empty list of distinct frame indices in ``[0, num_frames)``), when the
    row has them (what `benchmarks/retrieval.py` and ``statekv demo`` read; a streaming set's rows name them
    ``evidence``)."""
    frames = row.get("num_frames")
    if "num_frames" in row and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise AnnotationError(f"{where}: field 'num_frames' must be a positive integer, got {str(frames)[:40]!r}")
    if field not in row:
        return
    evidence = row[field]
    if not isinstance(evidence, list) or not evidence:
        raise AnnotationError(f"{where}: field {field!r} must be a non-empty list of frame indices, got "
                              f"{str(evidence)[:40]!r}")
    limit = frames if isinstance(frames, int) and not isinstance(frames, bool) else None
    for frame in evidence:
        if isinstance(frame, bool) or not isinstance(frame, int) or frame < 0 or (limit is not None and frame >= limit):
            within = f" of the video's {limit}" if limit is not None else ""
            raise AnnotationError(f"{where}: {field} holds {str(frame)[:40]}, not a frame{within} (0-based)")
    if len(set(evidence)) != len(evidence):
        raise AnnotationError(f"{where}: {field} names a frame twice")


def synthetic_streaming_questions(rows: list[dict[str, Any]], folder: Path, *, check_videos: bool,
                                  source: str) -> list[Question]:
    """A streaming synthetic set's rows (OVO-Bench's layout; a forward question's polls carry their own ``gt``)."""
    questions: list[Question] = []
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        require_fields(row, ("id", "task", "video", "question", "options"), where)
        check_evidence(row, where, "evidence")
        task = str(row["task"])
        if task not in STREAMING_GROUPS:
            raise AnnotationError(f"{where}: unknown task {task!r}; expected one of {', '.join(STREAMING_GROUPS)}")
        options = parse_options(row["options"], where)
        video_path = video_in(folder, row["video"], where)
        if check_videos and not video_path.is_file():
            raise MissingFileError(f"{where}: video not found: {video_path}")
        common = dict(benchmark="synthetic", video_id=str(row["video"]), video_path=video_path,
                      question=str(row["question"]), options=options, task_type=task, group=STREAMING_GROUPS[task])
        if STREAMING_GROUPS[task] == "forward":
            require_fields(row, ("test_info",), where)
            polls = row["test_info"]
            if not isinstance(polls, list) or not polls or not all(isinstance(poll, dict) for poll in polls):
                raise AnnotationError(f"{where}: field 'test_info' must be a non-empty list of polls")
            for j, poll in enumerate(polls):
                at = f"{where} test_info[{j}]"
                require_fields(poll, ("realtime", "gt"), at)
                questions.append(_checked(Question(
                    **common, qid=f"{row['id']}_{j}", item=str(row["id"]), answer=_letter(poll["gt"], options, at),
                    realtime=seconds(poll["realtime"], f"{at}: field 'realtime'")), at))
        else:
            require_fields(row, ("realtime", "gt"), where)
            questions.append(_checked(Question(
                **common, qid=str(row["id"]), answer=_letter(row["gt"], options, where),
                realtime=seconds(row["realtime"], f"{where}: field 'realtime'")), where))
    if len({question.qid for question in questions}) != len(questions):
        raise AnnotationError(f"{source}: question ids repeat")
    return questions


def _letter(gt: Any, options: tuple[str, ...], where: str) -> str:
    if isinstance(gt, bool) or not isinstance(gt, int) or not 0 <= gt < len(options):
        raise AnnotationError(f"{where}: gt={gt!r} is not an index into its {len(options)} options")
    return chr(ord("A") + gt)


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


def _question_ids(rows: list[dict[str, Any]], field: str, source: str) -> list[str]:
    """Each row's ``field`` as its question id when every row has a distinct one, else its position (said in one
    warning when some rows have one: a run's answers are then kept by position, not by the published ids)."""
    ids = [row.get(field) for row in rows]
    as_text = [str(value) for value in ids]
    if None not in ids and len(set(as_text)) == len(as_text):
        return as_text
    if any(value is not None for value in ids):
        first: dict[str, int] = {}
        for number, (value, text) in enumerate(zip(ids, as_text)):
            if value is None:
                why = f"row {number} has no {field}"
                break
            if text in first:
                why = f"rows {first[text]} and {number} share {field} {text[:40]!r}"
                break
            first[text] = number
        logger.warning("%s: %s, so its questions are numbered by their rows", source, why)
    return [str(index) for index in range(len(rows))]


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
    "load_ovobench",
    "load_ovobench_realtime",
    "load_streamingbench",
    "load_synthetic",
    "load_videomme",
]
