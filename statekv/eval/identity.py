"""What a run answered: fingerprints of its questions, its answer key, its videos and its model's weights.

A run folder is resumed only when these match what it holds (`statekv.eval.runner.check_run_file`), so answers
made for other data, another answer key or other weights are never scored as this run's.

    data_fingerprint(questions)     the questions (text, options, videos and their bytes' fingerprints)
    answer_key_fingerprint(...)     every question's answer letter
    model_fingerprint(qa)           the weights (`statekv.stream_file.weights_fingerprint`)
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
    """SHA-256 over every question's text, options, task and video, and each video file's size and first and
    last bytes (so a folder whose videos were regenerated under the same names differs)."""
    digest = hashlib.sha256()
    files: dict[str, str] = {}
    for question in questions:
        paths = [path for path in (question.video_path, question.clip_path) if path is not None]
        for path in paths:
            files.setdefault(str(path), _file_fingerprint(Path(path)))
        digest.update(_canonical([question.qid, question.video_id, question.question, list(question.options),
                                  question.task_type, question.realtime,
                                  [Path(path).name for path in paths], [files[str(path)] for path in paths]]))
    return digest.hexdigest()


def answer_key_fingerprint(questions: Sequence[Question]) -> str:
    """SHA-256 over every question's id and answer letter."""
    return hashlib.sha256(_canonical([[question.qid, question.answer] for question in questions])).hexdigest()


def model_fingerprint(qa: Any) -> str:
    """The loaded model's weights fingerprint (the one saved streams record)."""
    from statekv.stream_file import weights_fingerprint

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
