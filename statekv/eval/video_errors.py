"""The videos an evaluation could not read: logged to ``errors.rankNNN.jsonl`` in its run folder as they fail, and
read back for those whose questions are still unanswered (a rerun retries them)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from statekv.errors import DataError
from statekv.eval.records import completed_qids, drop_unterminated_tail, durable_end
from statekv.eval.questions import Question
from statekv.eval.sharding import VideoQuestions
from statekv.flushing import flush_folder

logger = logging.getLogger(__name__)
ERRORS_GLOB = "errors.rank*.jsonl"


def log_video_error(out: Path, rank: int, video: VideoQuestions, error: Exception, answered: int) -> None:
    """Log that ``video`` could not be read after ``answered`` of its questions, and note it in rank ``rank``'s
    error file in ``out`` (a rerun retries its questions still unanswered)."""
    left = len(video.questions) - answered
    logger.error("%s: %s (%s stay unanswered; rerun to retry)", video.video_id, error,
                 "its questions" if not answered else f"{left} of its {len(video.questions)} questions")
    entry = {"video_id": video.video_id, "qids": [q.qid for q in video.questions], "error": str(error)}
    path = out / f"errors.rank{rank:03d}.jsonl"
    drop_unterminated_tail(path, "the note of a video that could not be read, cut short by a stop",
                           "the note of a video that could not be read, not yet on the disk")
    made = not path.exists()
    with path.open("a", encoding="utf-8") as file:
        if made:  # its name on the device too: a rerun and the merge read the notes only through it
            try:
                flush_folder(out)
            except OSError:  # made again by the next note, whose flush then forces its name
                path.unlink(missing_ok=True)
                raise
        file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        file.flush()
        os.fsync(file.fileno())


def unresolved_errors(run_dir: Path, asked: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Logged video errors whose questions are still unanswered (one entry per video, the latest error, with the
    ids of its questions still unanswered), of the questions ``asked`` only (None: any; a rerun with a smaller
    --limit asks fewer than the folder's log names)."""
    answered, asked = completed_qids(run_dir), None if asked is None else set(asked)
    latest: dict[str, dict[str, Any]] = {}
    for path in sorted(run_dir.glob(ERRORS_GLOB)):
        for entry in _error_entries(path):
            latest[entry["video_id"]] = entry
    left = ({**entry, "qids": [qid for qid in entry["qids"] if qid not in answered and (asked is None or qid in asked)]}
            for entry in latest.values())
    return [entry for entry in left if entry["qids"]]  # a video that failed part way: its answers before count


def _error_entries(path: Path) -> list[dict[str, Any]]:
    """The entries of an error log; an unterminated last line (a killed writer) or a zero-filled end (a power
    loss: `durable_end`) is ignored, any other damaged line is a one-line `DataError` naming the file and the line."""
    data = path.read_bytes()
    text = data[:durable_end(data)].decode("utf-8", errors="replace")
    lines = text.split("\n")
    entries = []
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            entry = None
        if not (isinstance(entry, dict) and isinstance(entry.get("video_id"), str)
                and isinstance(entry.get("qids"), list) and all(isinstance(q, str) for q in entry["qids"])
                and isinstance(entry.get("error", ""), str)):
            raise DataError(f"{path}:{number}: damaged error log line (expected an object with video_id, qids and "
                            "error); delete the line to retry that video")
        entries.append(entry)
    return entries


def replaced_answers(out: Path, questions: Sequence[Question], videos: dict[str, str], recorded: Any,
                     before: Callable[[], dict[str, str]] | None = None) -> dict[str, list[str]]:
    """The answered questions (by video) of each video that could not be read part way (its error logged, some of its
    questions answered) and whose file has changed since, replaced by one that reads (``videos``: the questions'
    fingerprints now; ``recorded``: as the run's ``run.json`` records them; ``before``: as an earlier statekv
    recorded them, also unchanged). The run drops them once its checks pass, and answers all that video's
    questions from the new file, as those of a video that failed at once are; every other answer is kept."""
    failed = unresolved_errors(out) if isinstance(recorded, dict) else []
    if not failed:
        return {}
    failed_ids = {entry["video_id"] for entry in failed}
    answered = completed_qids(out)
    by_video: dict[str, list[str]] = {}
    missing: set[str] = set()  # a video not there now (its drive not mounted, say) is no replaced one
    for question in questions:
        if question.video_id not in failed_ids:
            continue
        by_video.setdefault(question.video_id, []).append(question.qid)
        if not all(Path(path).is_file() for path in (question.video_path, question.clip_path) if path is not None):
            missing.add(question.video_id)
    earlier: dict[str, str] | None = None
    replaced: dict[str, list[str]] = {}
    for entry in failed:
        if entry["video_id"] in missing:
            continue
        qids = [qid for qid in by_video.get(entry["video_id"], []) if qid in answered]
        changed = [qid for qid in qids if recorded.get(qid) != videos.get(qid)]
        if changed and before is not None:
            earlier = before() if earlier is None else earlier
            changed = [qid for qid in changed if recorded.get(qid) != earlier.get(qid)]
        if changed:
            replaced[entry["video_id"]] = qids
    return replaced
