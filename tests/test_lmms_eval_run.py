"""lmms-eval itself, offline, on a tiny local video task: one process, two processes (torchrun, gloo), failures.

Each run is a real ``python -m lmms_eval --model statekv ...`` (the plugin found through its entry point) on
`write_lmms_task`'s synthetic videos and a tiny InternVL checkpoint. lmms-eval is an optional extra: these tests
skip without it, except under CI (``CI`` set), where the Makefile installs it and a missing lmms-eval fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from statekv.eval.answering import room_for_prompts
from statekv.eval.fabricate import LMMS_TASK, write_lmms_task, write_still_seconds_video
from statekv.api.videoqa import VideoQA
from statekv.testing import make_tiny_checkpoint
from frames import read_frame_index

if os.environ.get("CI"):
    import lmms_eval  # noqa: F401  (CI must run these tests, not skip them)
else:
    pytest.importorskip("lmms_eval", reason="lmms-eval is an optional extra (make lmms)")

MODEL_ARGS = "budget=32,max_fps=1,offload=off,trust_remote_code=no"
DOCS = 6  # write_lmms_task's default: 3 videos x 2 questions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    return write_lmms_task(tmp_path_factory.mktemp("task"))


def lmms_eval(task: Path, out: Path, model_args: str, *, processes: int = 1) -> subprocess.CompletedProcess:
    """Run lmms-eval offline on the smoke task; ``processes > 1`` launches it with torchrun."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                     "--log-dir", str(out.parent / "torchrun")]  # else a folder left in the system's temporary one
    command = [*launcher, "-m", "lmms_eval", "--model", "statekv", "--model_args", model_args,
               "--include_path", str(task.parent), "--tasks", LMMS_TASK, "--batch_size", "1",
               "--output_path", str(out), "--log_samples", "--verbosity", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out.parent / "hf-home"), "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)


def logged_run(out: Path) -> tuple[dict, dict[int, dict]]:
    """``(results.json, {doc_id: sample line})`` of the one run under ``out``."""
    results = list(out.glob("*/*_results.json"))
    samples = list(out.glob(f"*/*_samples_{LMMS_TASK}.jsonl"))
    assert len(results) == 1 and len(samples) == 1, sorted(out.rglob("*"))
    lines = [json.loads(line) for line in samples[0].read_text(encoding="utf-8").splitlines()]
    by_doc = {line["doc_id"]: line for line in lines}
    assert len(by_doc) == len(lines), "a document was logged twice"
    return json.loads(results[0].read_text(encoding="utf-8")), by_doc


def test_one_and_two_processes_give_the_answers_statekv_gives(checkpoint, task, tmp_path):
    model_args = f"pretrained={checkpoint},{MODEL_ARGS}"
    single = lmms_eval(task, tmp_path / "one", model_args)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    double = lmms_eval(task, tmp_path / "two", model_args, processes=2)
    assert double.returncode == 0, double.stdout[-3000:] + double.stderr[-3000:]

    docs = [json.loads(line) for line in (task.parent / "docs.jsonl").read_text().splitlines()]
    assert len(docs) == DOCS
    runs = [logged_run(tmp_path / "one"), logged_run(tmp_path / "two")]
    for results, samples in runs:  # the log is complete: every document once, scored, under this model
        assert sorted(samples) == list(range(DOCS))
        assert results["n-samples"][LMMS_TASK] == {"original": DOCS, "effective": DOCS}
        assert set(results["results"][LMMS_TASK]) >= {"exact_match,none", "exact_match_stderr,none"}
        assert results["config"]["model"] == "statekv" and "budget=32" in results["config"]["model_args"]
        assert [samples[i]["target"] for i in range(DOCS)] == [doc["answer"] for doc in docs]
        assert [samples[i]["input"] for i in range(DOCS)] == [doc["question"] for doc in docs]
    predictions = [[samples[i]["filtered_resps"] for i in range(DOCS)] for _, samples in runs]
    assert predictions[0] == predictions[1]
    assert runs[0][0]["results"] == runs[1][0]["results"]

    # the same answers straight from statekv: one encoding per video planned for all of its questions, the
    # task's 4 new tokens, cut at "\n\n"
    qa = VideoQA.from_pretrained(checkpoint, method="statekv", budget=32)
    expected = []
    for video in dict.fromkeys(doc["video"] for doc in docs):
        questions = [doc["question"] for doc in docs if doc["video"] == video]
        with qa.encode(video, max_fps=1, max_frames=512,
                       reserve_tokens=room_for_prompts(qa, questions, 4)) as encoded:
            expected += [encoded.ask(question, max_new_tokens=4).split("\n\n")[0] for question in questions]
    assert predictions[0] == expected


def test_a_failing_rank_fails_the_launch(checkpoint, task, tmp_path):
    """One rank meets an unreadable video: the run must end non-zero (lmms-eval alone would exit 0)."""
    docs = (task.parent / "docs.jsonl").read_text().splitlines()
    broken = json.loads(docs[1])  # doc 1 goes to rank 1 of 2
    broken["video"] = str(task.parent / "videos" / "missing.mp4")
    docs[1] = json.dumps(broken)
    broken_task = tmp_path / "broken" / f"{LMMS_TASK}.yaml"
    broken_task.parent.mkdir()
    (broken_task.parent / "docs.jsonl").write_text("\n".join(docs) + "\n")
    broken_task.write_text(task.read_text().replace(str(task.parent / "docs.jsonl"),
                                                    str(broken_task.parent / "docs.jsonl")))
    run = lmms_eval(broken_task, tmp_path / "out", f"pretrained={checkpoint},{MODEL_ARGS}", processes=2)
    assert run.returncode != 0
    assert "statekv (lmms-eval model): error while answering" in run.stderr and "missing.mp4" in run.stderr


def test_lmms_evals_own_pyav_reader_works_with_this_pyav(tmp_path):
    """lmms-eval 0.7.3 declares av<16; statekv runs it beside a newer PyAV (its model never uses lmms-eval's
    readers, but lmms-eval's own models do). Its PyAV reader decodes the right frames with the installed one."""
    import av
    from lmms_eval.models.model_utils.load_video import read_video_pyav

    video = write_still_seconds_video(tmp_path / "clip.mp4", 4, offset=5)  # second k shows picture 5 + k
    frames = read_video_pyav(str(video), num_frm=4)
    assert frames.shape == (4, 64, 64, 3), av.__version__
    assert [read_frame_index(frame) for frame in frames] == [5, 6, 7, 8]


def test_ovo_tasks_run_in_lmms_eval_on_one_stream_per_video(tmp_path):
    """lmms-eval's own OVO-Bench task code (``ovo_realtime``, and ``ovo_forward`` through
    ``generate_until_multi_round``) on local clips: every document and round answered, as `statekv eval ovobench`
    answers them streaming."""
    from statekv.eval.fabricate import LMMS_OVO_TASKS, write_lmms_ovobench_tasks
    from statekv.eval.records import run_records
    from statekv.eval.runner import EvalConfig, run_evaluation

    root = write_lmms_ovobench_tasks(tmp_path / "task")
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "ckpt", text_config={"max_position_embeddings": 8192})
    command = [sys.executable, "-m", "lmms_eval", "--model", "statekv", "--model_args",
               f"pretrained={checkpoint},budget=32,max_fps=1", "--include_path", str(root), "--tasks",
               ",".join(LMMS_OVO_TASKS), "--batch_size", "1", "--output_path", str(tmp_path / "out"),
               "--log_samples", "--verbosity", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logged = {task: [json.loads(line) for path in (tmp_path / "out").glob(f"*/*_samples_{task}.jsonl")
                     for line in path.read_text(encoding="utf-8").splitlines()] for task in LMMS_OVO_TASKS}

    qa = VideoQA.from_pretrained(checkpoint, method="statekv", budget=32)
    run_evaluation(EvalConfig.for_model("ovobench", str(checkpoint), root, tmp_path / "run", budget=32,
                                        max_new_tokens=4, progress=False, groups=("realtime", "forward")), qa=qa)
    expected = {r.qid: r.prediction for r in run_records(tmp_path / "run")}
    realtime = sorted(logged["statekv_ovo_realtime"], key=lambda line: line["doc_id"])
    assert [line["back_real_acc"]["id"] for line in realtime] == [100, 101, 102, 103, 104]
    assert [line["back_real_acc"]["response"] for line in realtime] == [
        expected[str(line["back_real_acc"]["id"])].split("\n\n")[0].strip() for line in realtime]
    (forward,) = logged["statekv_ovo_forward"]
    polls = forward["forward_acc"]["test_info"]
    assert [poll["response"] for poll in polls] == [expected["2_0"].split("\n\n")[0],
                                                    expected["2_1"].split("\n\n")[0]]
