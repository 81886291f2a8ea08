"""Mini benchmarks in the published layouts, with synthetic videos: for tests and for checking a setup.

``write_mini_benchmarks(root)`` writes small VideoMME, MLVU, OVO-Bench and StreamingBench copies under ``root``
exactly where `statekv.eval.loaders` looks for the real ones (parquet annotations when ``pyarrow`` is
installed, else JSON Lines), so ``statekv eval ... --data-root root`` runs end to end in seconds.
``write_lmms_ovobench_tasks(root)`` writes a local copy of lmms-eval's ``ovo_realtime`` and ``ovo_forward`` tasks
(lmms-eval's own task code, local documents and clips).

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
from statekv.eval.streamingbench import REALTIME_TASKS as STREAMINGBENCH_REALTIME_TASKS

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
    """Source videos of ``seconds`` seconds with real-time questions at ``realtimes`` (per video), a backward
    question (EPM, at 2 s) and a forward one (REC, polled at 3 and 5.5 s) on the first video, and, with ``clips``,
    the released-style clip of each question (``<id>.mp4``) and poll (``<id>_<j>.mp4``): the source's first
    ``ceil(realtime)`` seconds (capped at its duration). Returns the benchmark folder."""
    folder = Path(root) / "ovobench"
    rows: list[dict[str, Any]] = []
    cuts: list[tuple[str, int, float]] = []  # (clip name, video index, time)
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
            cuts.append((f"{qid}.mp4", v, realtime))
    # the other groups: a backward question and a forward one polled twice, on the first video
    rows.append({"id": 1, "task": "EPM", "video": "Fabricated/source0.mp4", "realtime": 2.0,
                 "question": "What was shown first?", "answer": "y", "options": ["x", "y"], "gt": 1})
    cuts.append(("1.mp4", 0, 2.0))
    rows.append({"id": 2, "task": "REC", "video": "Fabricated/source0.mp4", "activity": "show a picture",
                 "start_times": [0], "end_times": [5],
                 "test_info": [{"realtime": 5.5, "count": 2}, {"realtime": 3, "count": 1}]})
    cuts += [("2_0.mp4", 0, 5.5), ("2_1.mp4", 0, 3)]
    if clips:
        for name, v, realtime in cuts:
            length = min(math.ceil(realtime), seconds[v])
            write_still_seconds_video(folder / "chunked_videos" / name, length, offset=20 * v)
    (folder / "ovo_bench_new.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return folder


def write_mini_streamingbench(root: Path | str, *, seconds: int = 8) -> Path:
    """Two videos of ``seconds`` seconds: real-time questions at 2, 5 and 5 s on the first, two sequential
    questions and a proactive output (due at 6 s) on the second, an omni-source question (left out by the
    loader), in the release's question files. Returns the benchmark folder."""
    folder = Path(root) / "streamingbench"
    write_still_seconds_video(folder / "videos" / "sample_1_real.mp4", seconds, offset=0)
    write_still_seconds_video(folder / "videos" / "sample_2_sqa.mp4", seconds, offset=30)

    def choice(task: str, clock: str, answer: str, prefixed: bool = True) -> dict[str, Any]:
        options = [f"picture {i}" for i in range(4)]
        return {"task_type": task, "question": f"What is shown at {clock}?", "time_stamp": clock, "answer": answer,
                "options": [f"{chr(65 + i)}. {text}" for i, text in enumerate(options)] if prefixed else options,
                "required_ability": "perception"}

    real = [{"time": "[0:00:00 - 0:00:03]", "questions": [choice(STREAMINGBENCH_REALTIME_TASKS[0], "00:00:02", "C")],
             "video_categories": "fabricated", "video_path": "./videos/sample_1_real.mp4"},
            {"time": "[0:00:03 - 0:00:06]", "questions": [choice(STREAMINGBENCH_REALTIME_TASKS[1], "00:00:05", "B"),
                                                         choice(STREAMINGBENCH_REALTIME_TASKS[2], "00:00:05", "A")],
             "video_categories": "fabricated", "video_path": "./videos/sample_1_real.mp4"}]
    sqa = [[{"time": "[0:00:00 - 0:00:04]", "questions": [choice("Sequential Question Answering", "00:00:03", "D",
                                                                 prefixed=False)],
             "video_categories": "fabricated", "video_path": "./videos/sample_2_sqa.mp4"},
            {"time": "[0:00:04 - 0:00:08]", "questions": [choice("Sequential Question Answering", "00:00:07", "A",
                                                                 prefixed=False)],
             "video_categories": "fabricated", "video_path": "./videos/sample_2_sqa.mp4"}]]
    proactive = [{"time": "[0:00:00 - 0:00:08]", "questions": [
        {"task_type": "Proactive Output", "question": 'When picture 36 is shown, output "36".',
         "time_stamp": "00:00:02", "ground_truth_time_stamp": "00:00:06", "ground_truth_output": "36",
         "required_ability": "working memory"}],
        "video_categories": "fabricated", "video_path": "./videos/sample_2_sqa.mp4"}]
    omni = [{"time": "[0:00:00 - 0:00:03]", "questions": [choice("Emotion Recognition", "00:00:02", "A")],
             "video_categories": "fabricated", "video_path": "./videos/sample_1_real.mp4"}]
    for name, data in (("questions_real.json", real), ("questions_sqa.json", sqa),
                       ("questions_proactive.json", proactive), ("questions_omni.json", omni)):
        (folder / name).write_text(json.dumps(data, indent=1), encoding="utf-8")
    return folder


def write_mini_benchmarks(root: Path | str) -> Path:
    """All four mini benchmarks under ``root``; returns ``root``."""
    write_mini_videomme(root)
    write_mini_mlvu(root)
    write_mini_ovobench(root)
    write_mini_streamingbench(root)
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


LMMS_OVO_TASKS = ("statekv_ovo_realtime", "statekv_ovo_forward")
# lmms-eval's own ovobench task functions, imported into the local task folder (`!function utils.<name>`)
LMMS_OVO_UTILS = """from lmms_eval.tasks.ovobench.utils import (  # noqa: F401  lmms-eval's own OVO-Bench task code
    ovo_back_real_acc, ovo_back_real_doc_to_text, ovo_back_real_process_results, ovo_doc_to_visual, ovo_forward_acc,
    ovo_forward_doc_to_text, ovo_forward_process_results)
"""
LMMS_OVO_TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: {output_type}
doc_to_text: !function utils.{doc_to_text}
doc_to_visual: !function utils.ovo_doc_to_visual
doc_to_target: "answer"
process_results: !function utils.{process_results}
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  temperature: 0
  do_sample: false
metric_list:
  - metric: {metric}
    aggregation: !function utils.{aggregation}
    higher_is_better: true
lmms_eval_specific_kwargs:
  default:
    data_dir: {clips}
metadata:
  version: 0.0
"""


def write_lmms_ovobench_tasks(root: Path | str, *, max_new_tokens: int = 4) -> Path:
    """lmms-eval's ``ovo_realtime`` and ``ovo_forward`` tasks on `write_mini_ovobench`'s data, fully local.

    Writes the mini OVO-Bench under ``root``, its real-time questions and its forward question as documents in the
    layout of lmms-eval's dataset (``realtime.jsonl``, ``forward.jsonl``), and the tasks ``statekv_ovo_realtime``
    (``generate_until``) and ``statekv_ovo_forward`` (``generate_until_multi_round``) whose task functions are
    lmms-eval's own (``utils.py`` imports them) and whose clips are the mini benchmark's. Run with
    ``--include_path root``. Returns ``root``.
    """
    root = Path(root).resolve()
    folder = write_mini_ovobench(root)
    rows = json.loads((folder / "ovo_bench_new.json").read_text(encoding="utf-8"))
    documents = {"realtime": [row for row in rows if row["task"] in OVOBENCH_REALTIME_TASKS],
                 "forward": [row for row in rows if "test_info" in row]}
    for name, docs in documents.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    (root / "utils.py").write_text(LMMS_OVO_UTILS, encoding="utf-8")
    for task, name, output_type, doc_to_text, process, metric, aggregation in (
            ("statekv_ovo_realtime", "realtime", "generate_until", "ovo_back_real_doc_to_text",
             "ovo_back_real_process_results", "back_real_acc", "ovo_back_real_acc"),
            ("statekv_ovo_forward", "forward", "generate_until_multi_round", "ovo_forward_doc_to_text",
             "ovo_forward_process_results", "forward_acc", "ovo_forward_acc")):
        (root / f"{task}.yaml").write_text(LMMS_OVO_TASK.format(
            task=task, docs=json.dumps(str(root / f"{name}.jsonl")), output_type=output_type,
            doc_to_text=doc_to_text, process_results=process, max_new_tokens=max_new_tokens, metric=metric,
            aggregation=aggregation, clips=json.dumps(str(folder / "chunked_videos"))), encoding="utf-8")
    return root
