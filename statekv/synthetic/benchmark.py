"""A synthetic long-video QA set on disk: video files and a question file.

    make_benchmark("data/synthetic", videos=24, seed=0)

writes::

    data/synthetic/videos/v0000.mp4 ...   one still per second, lossless H.264 (RGB), 4 fps
    data/synthetic/questions.jsonl         one question per line (see `QUESTION_FIELDS`)
    data/synthetic/benchmark.json          how the set was made (seed, videos, frames, families, version)

Sampled at 1 frame per second (``statekv``'s default), a video gives exactly its ``num_frames`` stills. The
question file is written last, so an interrupted ``make`` leaves no file that looks complete; it leaves
``making.json`` (what it was asked to make) and whole videos (each written beside its name, then renamed), so the
same command run again makes only the videos missing. A make holds the folder's lock while it writes: a second
make into it meanwhile is refused, and so is an evaluation of it, which holds the lock shared while it reads
(`reading_lock`), so a make into a set being evaluated is refused too.

``make_benchmark(..., streaming=True)`` writes ``streaming.json`` instead of ``questions.jsonl``: timestamped
questions asked while the video plays, in OVO-Bench's format (`statekv.synthetic.streaming`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, InputError, OutputError, StateKVError
from ..flushing import flush_file, flush_folder, write_whole
from ..locks import FileLock
from ..settings.values import check_output_dir
from ..stopping import note_kept, stop_point
from .plans import MIN_FRAMES, VideoPlan, plan_video
from .scenes import render
from .seeds import EVALUATION_SEEDS, TRAINING_SEEDS, video_rng
from .streaming import GROUPS as STREAMING_TASKS
from .streaming import streaming_rows
from .tasks import FAMILIES, QuestionSpec, ask_all
from .videos import write_stills_video

QUESTIONS_FILE = "questions.jsonl"
STREAMING_FILE = "streaming.json"
MANIFEST_FILE = "benchmark.json"
MAKING_FILE = "making.json"  # what a make under way was asked for, until its question file is written
VIDEO_DIR = "videos"
OWN_VIDEO = re.compile(r"v[0-9]{4,}(\.partial)?\.mp4")  # a set's video in VIDEO_DIR (or one being written)
FORMAT_VERSION = 1
DEFAULT_FRAMES = 96
MAX_VIDEOS = 100_000   # ids are v0000..v99999; more is a typo, not a benchmark
MAX_FRAMES = 36_000    # ten hours of stills per video
BYTES_PER_FRAME = 2048  # lossless stills take about a quarter of this: room to spare for the disk check
BYTES_PER_VIDEO = 4096  # its questions, the container's header
QUESTION_FIELDS = ("qid", "video_id", "video", "task_type", "question", "options", "answer", "evidence_frames",
                   "num_frames")


def make_benchmark(out: Path | str, *, videos: int, seed: int, num_frames: int = DEFAULT_FRAMES,
                   families: Sequence[str] = tuple(FAMILIES), overwrite: bool = False,
                   progress: Callable[[int, int], None] | None = None, streaming: bool = False) -> Path:
    """Write ``videos`` videos of ``num_frames`` frames with one question per family each to ``out``.

    seed: in `EVALUATION_SEEDS` (the training range is refused). overwrite: replace the set a folder already
    holds (its ``videos/``, question file and ``benchmark.json``); without it a non-empty folder is refused, but for
    one that holds this very set whole (a finished make run again: nothing is written).
    progress: called as ``progress(videos done, videos)``. streaming: timestamped questions of the streaming
    tasks instead (`statekv.synthetic.streaming`; ``families`` is then unused), in ``streaming.json``. Returns the
    path of the question file.
    """
    _check_arguments(videos, seed, num_frames, families)
    out = check_output_dir(out, "the synthetic set's folder")
    making = _making(videos, seed, num_frames, families, streaming)
    made = None if overwrite else _finished(out, making)
    if made is not None:  # a finished make run again: nothing to write
        return made
    resumed = _resumes(out, making, overwrite)
    _check_room(out, sum(not (out / _video_path(index)).is_file() for index in range(videos)) if resumed else videos,
                num_frames)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = FileLock.acquire(out, what=f"the synthetic set's folder {out}", error=OutputError,
                                advice="another make is writing it or an evaluation reading it: wait for it to end, or "
                                "give this one another --out")
        try:
            # read again under the lock: a make that held the folder until now may have finished or replaced its set
            return _write_set(out, making, _resumes(out, making, overwrite), overwrite, progress)
        except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: every video renamed whole is kept
            written = sum((out / _video_path(index)).is_file() for index in range(videos))
            note_kept(stop, f"{written} of {videos} videos written in {out}; rerun the same command to go on")
            raise
        finally:
            lock.release()
    except OSError as error:
        if isinstance(error, StateKVError):
            raise
        raise OutputError(f"cannot write {error.filename or out} ({error.strerror or error}); the videos written so "
                          "far are kept: run the same command again to go on once it can be written") from None


def holds_set(out: Path | str, *, videos: int, seed: int, num_frames: int = DEFAULT_FRAMES,
              families: Sequence[str] = tuple(FAMILIES), streaming: bool = False) -> bool:
    """Whether ``out`` holds, whole, the set `make_benchmark` makes of these settings (a make of it finished)."""
    return _finished(Path(out), _making(videos, seed, num_frames, families, streaming)) is not None


def _finished(out: Path, making: dict[str, Any]) -> Path | None:
    """`_made_already`, read again under the folder's shared lock (a make writing it meanwhile: a one-line error
    naming it, never a set being replaced taken for a finished one)."""
    if _made_already(out, making) is None:
        return None
    lock = FileLock.acquire(out, what=f"the synthetic set's folder {out}", error=OutputError, shared=True,
                            advice="another make is writing it: wait for it to end, or give this one another --out")
    try:
        return _made_already(out, making)
    finally:
        lock.release()


def _making(videos: int, seed: int, num_frames: int, families: Sequence[str], streaming: bool) -> dict[str, Any]:
    return {"generator": "statekv.synthetic", "version": FORMAT_VERSION, "seed": seed, "videos": videos,
            "num_frames": num_frames, "streaming": streaming, "families": list(families)}


def _made_already(out: Path, making: dict[str, Any]) -> Path | None:
    """The question file of the set ``making`` describes when ``out`` holds it whole (its make finished), else
    None."""
    try:
        manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or (out / MAKING_FILE).exists():
        return None
    keys = ("generator", "version", "seed", "videos", "num_frames", "streaming", *(() if making["streaming"] else
                                                                                 ("families",)))
    questions = out / (STREAMING_FILE if making["streaming"] else QUESTIONS_FILE)
    whole = questions.is_file() and all((out / _video_path(index)).is_file() for index in range(making["videos"]))
    return questions if whole and all(manifest.get(key) == making[key] for key in keys) else None


def reading_lock(folder: str | os.PathLike) -> FileLock | None:
    """The lock of a synthetic set's ``folder``, held shared while an evaluation reads it (None when there is no
    such folder): a one-line `InputError` while a make writes it."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return FileLock.acquire(folder, what=f"the synthetic set's folder {folder}", error=InputError, shared=True,
                            advice="a `statekv synthetic make` is writing it: wait for it to end")


def _write_set(out: Path, making: dict[str, Any], resumed: bool, overwrite: bool,
               progress: Callable[[int, int], None] | None) -> Path:
    """The set ``making`` describes, written in ``out`` (``resumed``: going on with a make that was stopped)."""
    seed, videos, num_frames = making["seed"], making["videos"], making["num_frames"]
    streaming, families = making["streaming"], making["families"]
    if not resumed:
        _prepare_folder(out, overwrite)
        write_whole(out / MAKING_FILE, (json.dumps(making, indent=1) + "\n").encode())
    rows: list[dict[str, Any]] = []
    for index in range(videos):
        video_id = f"v{index:04d}"
        rng = video_rng(seed, index)
        plan = plan_video(rng, num_frames)
        relative = _video_path(index)
        if streaming:
            rows += streaming_rows(plan, rng, relative, first_id=len(rows))
        else:
            rows += [question_row(spec, video_id, relative, num_frames) for spec in ask_all(plan, rng, families)]
        stop_point()  # planning draws with numpy, which can swallow a Ctrl-C
        if not (out / relative).is_file():  # one there was renamed whole by a make that was stopped
            partial = out / VIDEO_DIR / f"{video_id}.partial.mp4"
            flush_file(write_video(plan, partial))
            os.replace(partial, out / relative)
        if progress is not None:
            progress(index + 1, videos)
    stop_point()  # one a library swallowed as the last video was written: the set is finished by the next make
    flush_folder(out / VIDEO_DIR)  # the videos' names, before a question file names them
    manifest = {"generator": "statekv.synthetic", "version": FORMAT_VERSION, "seed": seed, "videos": videos,
                "num_frames": num_frames, "questions": len(rows), "streaming": streaming,
                **({"tasks": STREAMING_TASKS} if streaming else {"families": list(families)})}
    write_whole(out / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode())
    if streaming:
        write_whole(out / STREAMING_FILE, (json.dumps(rows, indent=1) + "\n").encode())
    else:
        write_whole(out / QUESTIONS_FILE, ("".join(json.dumps(row) + "\n" for row in rows)).encode())
    (out / MAKING_FILE).unlink()
    return out / (STREAMING_FILE if streaming else QUESTIONS_FILE)


def write_video(plan: VideoPlan, path: Path) -> Path:
    """The video of ``plan``: each frame's still for one second."""
    return write_stills_video(path, (render(still) for still in plan.stills))


def question_row(spec: QuestionSpec, video_id: str, video: str, num_frames: int) -> dict[str, Any]:
    """One line of the question file."""
    return {"qid": f"{video_id}-{spec.family}", "video_id": video_id, "video": video, "task_type": spec.family,
            "question": spec.question, "options": list(spec.options), "answer": spec.answer_letter,
            "evidence_frames": list(spec.evidence), "num_frames": num_frames}


def _check_arguments(videos: int, seed: int, num_frames: int, families: Sequence[str]) -> None:
    for name, value, least in (("videos", videos, 1), ("num_frames", num_frames, MIN_FRAMES), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigurationError(f"{name} must be an integer of at least {least}, got {value!r}")
    if seed not in EVALUATION_SEEDS:
        reserved = " (reserved for training)" if seed in TRAINING_SEEDS or seed >= TRAINING_SEEDS.start else ""
        raise ConfigurationError(f"seed {seed} is outside the evaluation seeds {EVALUATION_SEEDS.start} to "
                                 f"{EVALUATION_SEEDS.stop - 1}{reserved}")
    if videos > MAX_VIDEOS:
        raise ConfigurationError(f"videos must be at most {MAX_VIDEOS}, got {videos}")
    if num_frames > MAX_FRAMES:
        raise ConfigurationError(f"num_frames must be at most {MAX_FRAMES} (ten hours of stills), got {num_frames}")
    unknown = [name for name in families if name not in FAMILIES]
    if unknown or not families:
        raise ConfigurationError(f"unknown question family {unknown[0] if unknown else ''!r}; "
                                 f"choose from {', '.join(FAMILIES)}")
    repeated = [name for number, name in enumerate(families) if name in families[:number]]
    if repeated:  # each video asks one question of each family, named by it
        raise ConfigurationError(f"question family {repeated[0]!r} is given twice")


def _check_room(out: Path, videos: int, num_frames: int) -> None:
    """Refuse, before writing anything, a set the disk under ``out`` has no room for."""
    existing = out
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return  # `_prepare_folder` says what is wrong with the path
    needed = videos * (num_frames * BYTES_PER_FRAME + BYTES_PER_VIDEO)
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise OutputError(f"{out}: {videos} videos of {num_frames} frames need about {needed / 2**20:.0f} MiB, but "
                          f"only {free / 2**20:.0f} MiB are free there")


def _resumes(out: Path, making: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``out`` holds a make of ``making`` that was stopped (and not ``overwrite``): it then goes on; a stopped
    make of another set is refused, naming what it was making."""
    try:
        begun = json.loads((out / MAKING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if overwrite:
        return False
    if begun != making:
        other = {key: value for key, value in begun.items() if making.get(key) != value} if isinstance(
            begun, dict) else begun
        raise ConfigurationError(f"{out} holds a stopped make of another set ({json.dumps(other)[:120]}): run that "
                                 "command again to finish it, or pass --overwrite to replace it")
    return True


def _prepare_folder(out: Path, overwrite: bool) -> None:
    """``out`` made, or emptied of a set's own files (``overwrite``): a folder holding anything else is refused,
    whatever a set may also be in it."""
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"{out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigurationError(f"{out} is not empty; pass --overwrite to replace the set it holds")
        videos = out / VIDEO_DIR
        written = (QUESTIONS_FILE, STREAMING_FILE, MANIFEST_FILE, MAKING_FILE)
        # the partial files of a write cut short (".tmp": an earlier version's)
        own = [out / f"{name}{suffix}" for name in written for suffix in ("", ".partial", ".tmp")]
        found = sorted(out.iterdir()) + (sorted(videos.iterdir()) if videos.is_dir() else [])
        foreign = [path for path in found if path not in own and path != videos
                   and not (path.parent == videos and OWN_VIDEO.fullmatch(path.name) and path.is_file())]
        if foreign:
            raise ConfigurationError(f"{out} holds {foreign[0].relative_to(out)}, which no synthetic set writes: "
                                     "--overwrite replaces only a set's own files; choose another folder")
        for path in found:
            if path.is_file():
                path.unlink()
        if videos.is_dir():
            videos.rmdir()
    out.mkdir(parents=True, exist_ok=True)


def _video_path(index: int) -> str:
    return f"{VIDEO_DIR}/v{index:04d}.mp4"
