"""What a run answered: fingerprints of its questions, its answer key, its videos and its model's weights.

A run folder is resumed only when these match what it holds (`statekv.eval.runner.check_run_file`), so answers
made for other data, another answer key or other weights are never scored as this run's.

    data_fingerprint(questions)     the questions (text, options, task, which video)
    answer_key_fingerprint(...)     every question's answer letter
    video_fingerprints(questions)   each video's size and first and last bytes, by video id (a video may change
                                    while none of its questions is answered: a damaged file repaired)
    model_fingerprint(qa)           the weights (`statekv.api.stream_file.weights_fingerprint`)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statekv.eval.questions import Question

VIDEO_BYTES_READ = 1 << 16  # from each end of a video: enough to tell two encodings apart, cheap on 900 videos


def data_fingerprint(questions: Sequence[Question]) -> str:
    """SHA-256 over every question's id, text, options, task, time and video names."""
    digest = hashlib.sha256()
    for question in questions:
        paths = [path for path in (question.video_path, question.clip_path) if path is not None]
        digest.update(_canonical([question.qid, question.video_id, question.question, list(question.options),
                                  question.task_type, question.realtime, [Path(path).name for path in paths]]))
    return digest.hexdigest()


def video_fingerprints(questions: Sequence[Question], *, clips: bool = False, both: bool = False) -> dict[str, str]:
    """Each question's video file by question id: size and first and last bytes, so a video regenerated under the
    same name differs. clips: the file is the question's released clip (OVO-Bench's offline mode reads those);
    both: its video and clip together (what runs recorded before 2026-12-01, accepted when they resume)."""
    files: dict[str, str] = {}
    fingerprints = {}
    for question in questions:
        chosen = (question.video_path, question.clip_path) if both else (
            question.clip_path if clips and question.clip_path is not None else question.video_path,)
        paths = [str(path) for path in chosen if path is not None]
        for path in paths:
            if path not in files:
                files[path] = _file_fingerprint(Path(path))
        fingerprints[question.qid] = hashlib.sha256(_canonical([files[path] for path in paths])).hexdigest()
    return fingerprints


def answer_key_fingerprint(questions: Sequence[Question]) -> str:
    """SHA-256 over every question's id and answer letter."""
    return hashlib.sha256(_canonical([[question.qid, question.answer] for question in questions])).hexdigest()


def model_fingerprint(qa: Any) -> str:
    """The loaded model's weights fingerprint (the one saved streams record)."""
    from statekv.api.stream_file import weights_fingerprint

    return weights_fingerprint(qa.adapter.model)


def _file_fingerprint(path: Path) -> str:
    try:
        size = os.stat(path).st_size
        with path.open("rb") as file:
            head = file.read(VIDEO_BYTES_READ)
            file.seek(max(0, size - VIDEO_BYTES_READ))
            tail = file.read(VIDEO_BYTES_READ)
    except OSError:
        return "unreadable"  # reading the video will say why; the questions still identify the data
    return hashlib.sha256(str(size).encode() + b":" + head + b":" + tail).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
