"""Mini benchmarks in the published layouts, with synthetic videos: for tests and for checking a setup.

``write_mini_benchmarks(root)`` writes small VideoMME, MLVU and OVOBench real-time copies under ``root``
exactly where `statekv.eval.loaders` looks for the real ones (parquet annotations when ``pyarrow`` is
installed, else JSON Lines), so ``statekv eval ... --data-root root`` runs end to end in seconds.

Videos show one still picture per second (`statekv.video.patterns.draw_test_frame` of the second's index) and are
coded losslessly, so any frame of a second decodes to the same pixels: sampling one frame per second by
the paper's uniform rule, by a stream's fixed rate or from a cut clip shows the model the same images.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from statekv.eval.questions import MLVU_TASKS, OVOBENCH_REALTIME_TASKS

SIZE = (64, 64)
FPS = 4


def write_still_seconds_video(path: Path | str, seconds: int, *, fps: int = FPS, size: tuple[int, int] = SIZE,
                              offset: int = 0) -> Path:
    """A lossless H.264 (RGB) video of ``seconds`` seconds at ``fps``; second ``k`` shows picture ``offset + k``."""
    import av

    from statekv.video.patterns import draw_test_frame

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "rgb24"
        stream.options = {"qp": "0", "preset": "ultrafast"}
        for index in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(draw_test_frame(offset + index // fps, size), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def write_mini_videomme(root: Path | str, *, videos: int = 2, seconds: int = 5, fmt: str | None = None) -> Path:
    """``videos`` videos with VideoMME's three questions each; returns the benchmark folder."""
    folder = Path(root) / "videomme"
    rows = []
    for v in range(videos):
        video_id = f"fab{v:03d}"
        write_still_seconds_video(folder / "data" / f"{video_id}.mp4", seconds + v, offset=10 * v)
        for q in range(3):
            rows.append({
                "video_id": f"{v + 1:03d}", "duration": ("short", "medium", "long")[v % 3],
                "domain": ("Knowledge", "Sports")[v % 2], "sub_category": "Humanity & History",
                "url": f"https://example.invalid/{video_id}", "videoID": video_id,
                "question_id": f"{v + 1:03d}-{q + 1}", "task_type": ("Counting Problem", "OCR Problems",
                                                                    "Action Recognition")[q],
                "question": f"What happens in part {q + 1} of the video?",
                "options": ["A. It rains.", "B. A car passes.", "C. Nothing.", "D. A bird sings."],
                "answer": "ABCD"[(v + q) % 4],
            })
    _write_table(folder / "videomme", "test-00000-of-00001", rows, fmt)
    return folder


def write_mini_mlvu(root: Path | str, *, tasks: Sequence[str] = MLVU_TASKS, seconds: int = 4,
                    fmt: str | None = None) -> Path:
    """One video per task (the first task's video gets a second question); returns the benchmark folder."""
    folder = Path(root) / "mlvu"
    rows = []
    for index, task in enumerate(tasks):
        name = f"video/{index + 1}_{task}/clip{index}.mp4"
        write_still_seconds_video(folder / name, seconds + index % 2, offset=7 * index)
        for q in range(2 if index == 0 else 1):
            candidates = ["red", "green", "blue", "white"]
            options = "\n".join(f"({letter}) {text}" for letter, text in zip("ABCD", candidates, strict=True))
            rows.append({
                "video_name": name, "duration": float(seconds), "question_id": f"{task}_{q}",
                "task_type": task, "question": f"Which colour dominates ({q})?\n{options}",
                "candidates": candidates, "answer": "ABCD"[(index + q) % 4],
            })
    _write_table(folder / "mlvu", "test-00000-of-00001", rows, fmt)
    return folder


def write_mini_ovobench(root: Path | str, *, realtimes: Sequence[Sequence[float]] = ((1.5, 3.2, 3.7, 6.0), (2.0,)),
                        seconds: Sequence[int] = (6, 3), clips: bool = True) -> Path:
    """Source videos of ``seconds`` seconds with questions at ``realtimes`` (per video), and, with ``clips``,
    the released-style clip ``<id>.mp4`` of each question: the source's first ``ceil(realtime)`` seconds
    (capped at its duration). Returns the benchmark folder."""
    folder = Path(root) / "ovobench"
    rows: list[dict[str, Any]] = []
    for v, (length, times) in enumerate(zip(seconds, realtimes, strict=True)):
        video = f"Fabricated/source{v}.mp4"
        write_still_seconds_video(folder / "src_videos" / video, length, offset=20 * v)
        for realtime in times:
            qid = 100 + len(rows)
            gt = qid % 4
            rows.append({
                "id": qid, "task": OVOBENCH_REALTIME_TASKS[len(rows) % len(OVOBENCH_REALTIME_TASKS)],
                "video": video, "realtime": realtime, "question": f"What is shown now ({qid})?",
                "answer": f"picture {gt}", "options": [f"picture {i}" for i in range(4)], "gt": gt,
            })
            if clips:
                clip_seconds = min(math.ceil(realtime), length)
                write_still_seconds_video(folder / "chunked_videos" / f"{qid}.mp4", clip_seconds, offset=20 * v)
    # the full release also holds backward and forward tasks, which the real-time loader skips
    rows.append({"id": 1, "task": "EPM", "video": "Fabricated/source0.mp4", "realtime": 2.0, "question": "?",
                 "answer": "x", "options": ["x", "y"], "gt": 0})
    (folder / "ovo_bench_new.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return folder


def write_mini_benchmarks(root: Path | str) -> Path:
    """All three mini benchmarks under ``root``; returns ``root``."""
    write_mini_videomme(root)
    write_mini_mlvu(root)
    write_mini_ovobench(root)
    return Path(root)


LMMS_TASK = "statekv_smoke"
# of different lengths, so that a video's planned room depends on which of its questions are counted
LMMS_QUESTIONS = ("Which picture comes first ({})? A or B?",
                  "Watching the whole clip from its first second to its last, which picture comes last ({})? "
                  "Answer with A or B only.")


def write_lmms_task(root: Path | str, *, videos: int = 3, questions: int = 2, seconds: int = 3,
                    max_new_tokens: int = 4) -> Path:
    """A tiny lmms-eval video task, fully local: ``videos`` synthetic videos with ``questions`` questions each.

    Writes ``root/videos/*.mp4``, ``root/docs.jsonl`` (``video``: absolute path, ``question``, ``answer``) and
    ``root/statekv_smoke.yaml``, an lmms-eval task (``--include_path root --tasks statekv_smoke``) that reads the docs with the ``json`` dataset builder, gives the model the
    video and the question (lmms-eval's automatic chat messages) and scores exact match. Needs no network.
    Returns the task file.
    """
    root = Path(root).resolve()
    docs = []
    for v in range(videos):
        video = write_still_seconds_video(root / "videos" / f"clip{v}.mp4", seconds + v % 2, offset=9 * v)
        for q in range(questions):
            docs.append({"video": str(video), "question": LMMS_QUESTIONS[q % 2].format(f"{v}.{q}"),
                         "answer": "AB"[(v + q) % 2]})
    (root / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    task = {
        "task": LMMS_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(root / "docs.jsonl")}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_visual": "video",
        "doc_to_text": "{{question}}",
        "doc_to_target": "answer",
        "generation_kwargs": {"max_new_tokens": max_new_tokens, "until": ["\n\n"], "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    path = root / f"{LMMS_TASK}.yaml"
    path.write_text(json.dumps(task, indent=2) + "\n", encoding="utf-8")  # JSON is YAML
    return path


def _write_table(directory: Path, stem: str, rows: list[dict[str, Any]], fmt: str | None) -> Path:
    """Parquet (the published format) when pyarrow is installed or ``fmt="parquet"``, else JSON Lines."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt is None:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            fmt = "jsonl"
        else:
            fmt = "parquet"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / f"{stem}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    if fmt != "jsonl":
        raise ValueError(f"fmt must be 'parquet' or 'jsonl', got {fmt!r}")
    path = directory / f"{stem}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
