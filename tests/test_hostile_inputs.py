"""What a hostile or careless user can throw at statekv: every bad input is one line (a `StateKVError`; the command
line exits 2), nothing is silently wrong, and no encoded video is lost.

Sections: the command line (refused before any model loads, then after), work kept when a stream stops or
cannot be saved, the Python API and the engine's inputs, saved streams (damaged, hand-edited, foreign), and
evaluation runs (failed records, a second run on the same folder). Everything shares one tiny InternVL
checkpoint and runs in this process unless a real second process matters.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import statekv
from bad_videos import cut_after_header
from statekv import Stream
from statekv.cli import main
from statekv.errors import ConfigurationError, OtherSetupError, OutputError
from statekv.eval.fabricate import write_mini_videomme
from statekv.eval.lock import RunLock
from statekv.eval.runner import EvalConfig, lock_for_every_rank, run_evaluation
from statekv.api.stream_file import write_verified
from statekv.testing import make_tiny_checkpoint, write_test_video

from hostile import noise_frames

UNWRITABLE = "/sys/statekv-hostile/x.safetensors"  # not even root can create files in sysfs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "folder").mkdir()
    (root / "notes.txt").write_text("not a video, not a checkpoint")
    data = root / "data"
    write_mini_videomme(data, videos=2, seconds=3)
    return {
        "root": root, "folder": root / "folder", "file": root / "notes.txt", "data": data,
        "model": make_tiny_checkpoint("internvl", root / "internvl"),
        "video": write_test_video(root / "clip.mp4", frames=40, fps=8),  # 5 s
    }


@pytest.fixture(scope="module")
def qa(files):
    return statekv.VideoQA.from_pretrained(files["model"], budget=20, attention="eager", reserve_tokens=64)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _cli(capsys, argv) -> tuple[int, str, str]:
    """``statekv ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------------------------
# The command line: refused before any model is loaded or any frame decoded
# ---------------------------------------------------------------------------------------------------------------
ANSWER = ["answer", "{video}", "What is shown?", "--model", "{model}"]
STREAM = ["stream", "{video}", "--ask", "1:Why?", "--model", "{model}"]
EVAL = ["eval", "videomme", "--model", "{model}", "--data-root", "{data}", "--no-progress"]
BEFORE_LOADING = {
    "max-fps inf": (ANSWER + ["--max-fps", "inf"], "expected a positive number, got 'inf'"),
    "max-fps nan": (ANSWER + ["--max-fps", "nan"], "expected a positive number, got 'nan'"),
    "max-fps negative": (ANSWER + ["--max-fps=-1"], "expected a positive number"),
    "max-frames 0": (ANSWER + ["--max-frames", "0"], "expected a positive integer, got '0'"),
    "budget 0": (ANSWER + ["--budget", "0"], "expected a positive integer"),
    "budget fraction": (ANSWER + ["--budget", "1.5"], "expected a positive integer, got '1.5'"),
    "frames negative": (ANSWER + ["--frames=-2"], "expected a positive integer"),
    "sinks negative": (ANSWER + ["--sinks=-1"], "expected a non-negative integer"),
    "retrieve 0": (ANSWER + ["--retrieve", "0"], "expected a positive integer"),
    "vision-batch 0": (ANSWER + ["--vision-batch", "0"], "expected a positive integer"),
    "reserve-tokens 0": (ANSWER + ["--reserve-tokens", "0"], "expected a positive integer"),
    "max-new-tokens 0": (ANSWER + ["--max-new-tokens", "0"], "expected a positive integer"),
    "unknown method": (ANSWER + ["--method", "sliding"], "invalid choice: 'sliding'"),
    "unknown attention": (ANSWER + ["--attention", "flash"], "invalid choice: 'flash'"),
    "device that does not exist": (ANSWER + ["--device", "cuda:3"], "'cuda:3'"),
    "device that is not one": (ANSWER + ["--device", "gpu"], "'gpu' is not a device name"),
    "meta device": (ANSWER + ["--device", "meta"], "not meta"),
    "integer dtype": (ANSWER + ["--dtype", "int8"], "must be a floating-point type"),
    "unknown dtype": (ANSWER + ["--dtype", "float17"], "unknown dtype 'float17'"),
    "empty question": (["answer", "{video}", "  ", "--model", "{model}"], "a question is empty"),
    # before: the second video's name was asked as a question
    "two videos": (["answer", "{video}", "{video}", "Why?", "--model", "{model}"], "names a file or folder, not a "
                   "question: statekv answer takes one VIDEO"),
    # (a name too long for a file is a question, not an OSError)
    "a long question, then a video": (["answer", "{video}", "\u4e00" * 300, "{video}", "--model", "{model}"],
                                      "names a file or folder, not a question"),
    "missing video": (["answer", "{root}/missing.mp4", "Why?", "--model", "{model}"], "no such file"),
    # before: "http:/example.com/clip.mp4: no such file or folder", the address mangled
    "video URL": (["answer", "https://example.com/clip.mp4", "Why?", "--model", "{model}"],
                  "https://example.com/clip.mp4: URLs are not read; download the file"),
    "text file as video": (["answer", "{file}", "Why?", "--model", "{model}"], "not a readable video file"),
    "stream save to a folder": (STREAM + ["--save", "{folder}"], "names a folder"),
    "stream save unwritable": (STREAM + ["--save", UNWRITABLE], "cannot write in /sys"),
    "stream save under a file": (STREAM + ["--save", "{file}/x.safetensors"], "is a file, so no folder"),
    "stream ask without time": (["stream", "{video}", "--ask", "soon:Why?", "--model", "{model}"], "SECONDS:QUESTION"),
    "stream ask at infinity": (["stream", "{video}", "--ask", "inf:Why?", "--model", "{model}"], "SECONDS:QUESTION"),
    "stream ask nothing": (["stream", "{video}", "--ask", "3:", "--model", "{model}"], "SECONDS:QUESTION"),
    "stream max-frames 0": (STREAM + ["--max-frames", "0"], "expected a positive integer"),
    "stream save over the video": (STREAM + ["--save", "{video}"], "is the video itself"),
    # before: any file was replaced by the save, notes or another video
    "stream save over a file": (STREAM + ["--save", "{file}"], "exists and is not a stream this statekv saved "
                                "(not a saved statekv stream"),
    "stream resume of nothing": (STREAM + ["--resume", "{root}/missing.safetensors"], "no such file or folder"),
    "stream save of simplestream": (STREAM + ["--method", "simplestream", "--save", "{root}/s.safetensors"],
                                    "--save: a simplestream stream keeps only its last frames"),
    "analyze out is a file": (["analyze", "{video}", "--model", "{model}", "--out", "{file}"], "is not a folder"),
    "analyze out unwritable": (["analyze", "{video}", "--model", "{model}", "--out", UNWRITABLE],
                               "cannot write in /sys"),
    "analyze device": (["analyze", "{video}", "--model", "{model}", "--out", "{root}/a", "--device", "cuda:3"],
                       "'cuda:3'"),
    "eval out is a file": (EVAL + ["--out", "{file}"], "is not a folder"),
    "eval device": (EVAL + ["--out", "{root}/e", "--device", "cuda:3"], "'cuda:3'"),
    "eval limit 0": (EVAL + ["--out", "{root}/e", "--limit", "0"], "expected a positive integer"),
    "eval table output folder": (["eval", "table", "{root}", "--output", "{folder}"], "names a folder"),
    "eval table missing run": (["eval", "table", "{root}/no-run"], "no run directory"),
    "demo device": (["demo", "--device", "cuda:3"], "'cuda:3'"),
    # before: taken, and nothing done with them
    "demo max-fps without a video": (["demo", "--max-fps", "2", "--max-frames", "9"],
                                     "--max-fps and --max-frames sample --video"),
    "demo videos with a video": (["demo", "--video", "{video}", "--videos", "3"], "--videos counts the held-out"),
    "demo dtype": (["demo", "--dtype", "nope"], "unknown dtype 'nope'"),
    "demo plot of no image kind": (["demo", "--plot", "{root}/plot.txt"], "statekv writes no .txt plots"),
    "demo plot through LaTeX": (["demo", "--plot", "{root}/plot.pgf"], "statekv writes no .pgf plots"),
    "demo plot into a folder": (["demo", "--plot", "{folder}"], "names a folder"),
    "bench serve plot of no image kind": (["bench", "serve", "--model", "{model}", "--plot", "{video}"],
                                          "statekv writes no .mp4 plots"),
    "flops frames 0": (["flops", "--frames", "0"], "expected a positive integer"),
    "flops budget 0": (["flops", "--budgets", "0"], "expected a positive integer"),
    "flops plot into a file": (["flops", "--plot", "{file}"], "is not a folder"),
    "reown an empty owner": (["reown", "{file}", "--owner", ""], "--owner is empty"),
    "missing checkpoint": (["answer", "{video}", "Why?", "--model", "{root}/no-model"], "no such checkpoint folder"),
    "checkpoint is a file": (["answer", "{video}", "Why?", "--model", "{file}"], "must be a folder"),
    "checkpoint without config": (["answer", "{video}", "Why?", "--model", "{folder}"], "no config.json"),
    # before: half a minute of the hub's retries and its error, no word of the built-in model
    "builtin misspelt": (["answer", "{video}", "Why?", "--model", "buildin"], "did you mean builtin"),
    "builtin capitalised": (["stream", "{video}", "--model", "Builtin"], "no model 'Builtin' here; did you mean"),
}


@pytest.mark.parametrize("case", BEFORE_LOADING)
def test_bad_command_lines_are_refused_before_any_model_loads(case, files, capsys, no_model_loads):
    argv, phrase = BEFORE_LOADING[case]
    if "cuda:3" in argv and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    code, out, err = _cli(capsys, [arg.format(**files) for arg in argv])
    assert code == 2 and not out
    assert phrase in _one_line(err)
    assert not list(files["root"].glob("*.partial")) and not list(files["folder"].iterdir())


def _broken_checkpoint(files, name: str, damage) -> Path:
    folder = files["root"] / name
    if not folder.exists():
        folder.mkdir()
        for item in files["model"].iterdir():
            (folder / item.name).write_bytes(item.read_bytes())
        damage(folder)
    return folder


def _half_the_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


AFTER_LOADING = {
    "horizon too large for memory": (STREAM + ["--max-frames", "100000000"], "GiB of detailed cache"),
    "no room for the question": (ANSWER + ["--reserve-tokens", "1"], "do not fit"),
    "answer longer than the room": (ANSWER + ["--max-new-tokens", "100000"], "do not fit"),
    "unknown layout": (ANSWER + ["--layout", "weird"], "no prompt layout 'weird'"),
    "checkpoint without weights": (["answer", "{video}", "Why?", "--model", "@no-weights"], "cannot load"),
    "checkpoint with cut weights": (["answer", "{video}", "Why?", "--model", "@cut-weights"], "cannot load"),
    "checkpoint with broken json": (["answer", "{video}", "Why?", "--model", "@bad-json"], "cannot load"),
}
DAMAGES = {"@no-weights": lambda folder: (folder / "model.safetensors").unlink(),
           "@cut-weights": _half_the_weights,
           "@bad-json": lambda folder: (folder / "tokenizer_config.json").write_text("{oops")}


@pytest.mark.parametrize("case", AFTER_LOADING)
def test_bad_command_lines_found_at_loading_or_planning_are_one_line(case, files, capsys):
    argv, phrase = AFTER_LOADING[case]
    argv = [str(_broken_checkpoint(files, arg[1:], DAMAGES[arg])) if arg in DAMAGES else arg.format(**files)
            for arg in argv]
    code, out, err = _cli(capsys, argv)
    assert code == 2 and phrase in _one_line(err)


# ---------------------------------------------------------------------------------------------------------------
# No encode is ever lost
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, signature", [("plot", b"\x89PNG"), ("plot.svg", b"<?xml"), ("plot.PDF", b"%PDF")])
def test_a_plot_is_written_where_it_is_named(name, signature, tmp_path):
    """Before: matplotlib wrote ``plot.png`` for ``--plot plot`` while the command said it wrote ``plot``."""
    from statekv.plotting import check_plot_file, pyplot, save_figure

    figure = pyplot().figure()
    path = check_plot_file(tmp_path / "plots" / name, "--plot")
    assert save_figure(figure, path, dpi=50) == path
    assert [item.name for item in path.parent.iterdir()] == [name]
    assert path.read_bytes().startswith(signature)


def test_a_plot_without_matplotlib_is_one_line_before_the_work(monkeypatch, tmp_path):
    import sys

    from statekv.plotting import check_plot_file

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for name in ("plot.png", "plot"):
        with pytest.raises(ConfigurationError, match=r"^plotting needs matplotlib: pip install 'statekv\[plot\]'$"):
            check_plot_file(tmp_path / name, "--plot")


def test_the_demo_without_matplotlib_stops_at_once_naming_no_plot(monkeypatch, capsys, no_model_loads):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _cli(capsys, ["demo"])
    assert code == 2 and not out
    assert _one_line(err) == ("statekv demo: error: plotting needs matplotlib: pip install 'statekv[plot]', or run "
                              "the demo with --no-plot")


def test_stream_json_prints_each_answer_as_it_is_made_then_a_summary(files, capsys, tmp_path):
    saved = tmp_path / "deep" / "er" / "s.safetensors"
    code, out, err = _cli(capsys, ["stream", files["video"], "--model", files["model"], "--budget", "20",
                                   "--ask", "1:First?", "--ask", "3:Then?", "--max-new-tokens", "2",
                                   "--save", saved, "--json"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["event"] for line in lines] == ["answer", "answer", "summary"]
    assert [(line["time"], line["frames"]) for line in lines[:2]] == [(1.0, 2), (3.0, 4)]
    assert lines[-1]["saved"] == str(saved) and lines[-1]["stats"]["frames"] == 5
    assert sorted(p.name for p in saved.parent.iterdir()) == ["s.safetensors"]  # no .partial left


def test_a_save_is_durable_by_its_name_too(qa, stream, tmp_path, monkeypatch):
    """Before: the saved file was flushed, not the folder its rename wrote: a power loss could bring back the save
    before, after the new one was reported."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(source, target):
        events.append(("replace", str(target)))
        return real_replace(source, target)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    stream.save(tmp_path / "s.safetensors")
    renamed = events.index(("replace", str(tmp_path / "s.safetensors")))
    assert ("fsync", str(tmp_path)) in events[renamed:]


def test_a_save_that_fails_at_the_end_is_rescued_and_said(files, capsys, tmp_path, monkeypatch, qa):
    from hostile import fill_disk_beside

    target = tmp_path / "out" / "talk.safetensors"
    target.parent.mkdir()
    fill_disk_beside(monkeypatch, target)
    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path / "cache"))
    code, out, err = _cli(capsys, ["stream", files["video"], "--model", files["model"], "--budget", "20",
                                   "--ask", "2:Why?", "--max-new-tokens", "2", "--save", target, "--json"])
    line = _one_line(err)
    assert code == 2 and f"could not save the stream to {target} (No space left on device)" in line
    rescued = Path(line.rsplit("saved to ", 1)[1].removesuffix(" instead"))
    assert rescued.parent == tmp_path / "cache" / "rescued" and not list(target.parent.iterdir())
    lines = [json.loads(text) for text in out.splitlines()]
    assert lines[0]["event"] == "answer" and lines[-1]["save_error"] == "No space left on device"
    resumed = Stream.load(rescued, qa)
    assert resumed.frames == 5 and resumed.tokens == lines[-1]["stats"]["tokens"]
    resumed.close()


def test_a_frame_that_cannot_be_decoded_keeps_the_frames_before_it(files, capsys, tmp_path, qa):
    video = cut_after_header(tmp_path)
    saved = tmp_path / "kept.safetensors"
    code, out, err = _cli(capsys, ["stream", video, "--model", files["model"], "--budget", "20", "--max-fps", "10",
                                   "--ask", "0.2:Why?", "--ask", "1.9:And then?", "--max-new-tokens", "2",
                                   "--save", saved, "--json"])
    line = _one_line(err)
    assert code == 2 and "cannot be decoded" in line and f"frames streamed before it were saved to {saved}" in line
    answer, after, summary = [json.loads(text) for text in out.splitlines()]  # before: the second was never asked
    assert answer["event"] == after["event"] == "answer" and summary["event"] == "summary"
    assert (answer["after_error"], after["after_error"], after["question"]) == (False, True, "And then?")
    assert after["frames"] == summary["stats"]["frames"] and len(summary["answers"]) == 2
    assert summary["saved"] == str(saved)
    assert summary["error"] == line.removeprefix("statekv stream: error: ")
    resumed = Stream.load(saved, qa)
    assert resumed.frames == summary["stats"]["frames"] > answer["frames"]
    resumed.close()


def test_ctrl_c_while_streaming_saves_what_was_streamed(files, capsys, tmp_path, monkeypatch, qa):
    real_push, pushes = Stream.push, []

    def push_then_interrupt(self, *args, **kwargs):
        pushes.append(1)
        if len(pushes) == 3:
            raise KeyboardInterrupt
        return real_push(self, *args, **kwargs)

    monkeypatch.setattr(Stream, "push", push_then_interrupt)
    saved = tmp_path / "interrupted.safetensors"
    code, _, err = _cli(capsys, ["stream", files["video"], "--model", files["model"], "--budget", "20",
                                 "--max-new-tokens", "1", "--ask", "4:Why?", "--save", saved])
    kept = f"the 2 frames streamed before it were saved to {saved}"
    assert code == 130 and err.strip().splitlines() == [f"statekv stream: interrupted; {kept}"]  # one line
    monkeypatch.undo()
    resumed = Stream.load(saved, qa)
    assert resumed.frames == 2
    resumed.close()


# ---------------------------------------------------------------------------------------------------------------
# The Python API and the engine's inputs
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stream(qa):
    live = qa.stream(horizon_frames=4)
    live.push(noise_frames(1)[0], 0.0)
    return live


def _api_cases():
    frames = noise_frames(2)
    ids = torch.tensor([[1, 2]])
    return {
        "encode max_fps inf": (lambda qa, s: qa.encode(frames, max_fps=math.inf), statekv.InputError, "max_fps"),
        "encode max_fps nan": (lambda qa, s: qa.encode(frames, max_fps=math.nan), statekv.InputError, "max_fps"),
        "encode max_frames True": (lambda qa, s: qa.encode(frames, max_frames=True), statekv.InputError, "max_frames"),
        "encode float frames": (lambda qa, s: qa.encode(frames.astype(np.float32)), statekv.StateKVError, "uint8"),
        "encode no frames": (lambda qa, s: qa.encode(frames[:0]), statekv.StateKVError, "no frames"),
        "encode None": (lambda qa, s: qa.encode(None), statekv.StateKVError, "unsupported video source"),
        "answer without question": (lambda qa, s: qa.answer(frames, []), statekv.InputError, "no question"),
        "encode frames of no pixels": (lambda qa, s: qa.encode(np.zeros((2, 0, 0, 3), np.uint8)), statekv.StateKVError,
                                       "with frames of at least one pixel, got uint8 [2, 0, 0, 3]"),
        "encode a list of an empty frame": (lambda qa, s: qa.encode([np.zeros((0, 5, 3), np.uint8)]),
                                            statekv.StateKVError, "uint8 [H, W, 3] arrays, got ndarray (0, 5, 3)"),
        "encode a path with a NUL": (lambda qa, s: qa.encode("a\x00b.mp4"), statekv.StateKVError,
                                     "a path holds no NUL character"),
        "load no model": (lambda qa, s: statekv.VideoQA.from_pretrained(None), statekv.ConfigurationError,
                          "model must be a checkpoint folder or hub id, got None"),
        "load an empty model name": (lambda qa, s: statekv.VideoQA.from_pretrained(""), statekv.ConfigurationError,
                                     "model must be a checkpoint folder or hub id, got ''"),
        "answer a number": (lambda qa, s: qa.answer(frames, ["Why?", 3]), statekv.InputError,
                            "the question must be text, got int"),
        "stream horizon True": (lambda qa, s: qa.stream(horizon_frames=True), statekv.InputError, "horizon_frames"),
        "stream horizon beyond memory": (lambda qa, s: qa.stream(horizon_frames=10**9), statekv.HorizonError,
                                         "GiB of detailed cache"),
        "stream vision_batch 0": (lambda qa, s: qa.stream(2, vision_batch=0), statekv.ConfigurationError,
                                  "vision_batch"),
        "push a float image": (lambda qa, s: s.push(frames.astype(float)[0], 5.0), statekv.InputError,
                               "RGB uint8 array [H, W, 3] or a PIL image, got float64 values of shape ["),
        "push a file name": (lambda qa, s: s.push("frame.png", 5.0), statekv.InputError, "PIL image, got a str"),
        "push None": (lambda qa, s: s.push(None, 5.0), statekv.InputError, "PIL image, got a NoneType"),
        "push a ragged list": (lambda qa, s: s.push([[1, 2], [3]], 5.0), statekv.InputError,
                               "PIL image, got a list that is no array on the CPU"),
        "push at nan seconds": (lambda qa, s: s.push(frames[0], math.nan), statekv.InputError, "timestamp"),
        "push before the stream began": (lambda qa, s: s.push(frames[0], -1.0), statekv.InputError,
                                         "timestamp must be a finite number of seconds >= 0, got -1.0"),
        "push back in time": (lambda qa, s: [(stream.push(frames[0], 3.0), stream.push(frames[1], 2.0))
                                             for stream in [qa.stream()]], statekv.InputError,
                              "timestamps must be non-decreasing; got 2.0 after 3.0"),
        "push in milliseconds since the epoch": (lambda qa, s: s.push(frames[0], 1.7e12), statekv.InputError,
                                                 "not milliseconds"),
        "push past what a saved clock holds": (lambda qa, s: qa.stream(max_fps=1).push(frames[0], 1e19),
                                               statekv.InputError, "past the latest time a stream takes"),
        "a clock too fast to tick the latest time": (lambda qa, s: qa.stream(max_fps=1e9), statekv.InputError,
                                                     "max_fps must be a number above 0 and at most 4e+07"),
        "ask nothing": (lambda qa, s: s.ask("  "), statekv.InputError, "empty"),
        "ask None": (lambda qa, s: s.ask(None), statekv.InputError, "the question must be text, got NoneType"),
        "ask a number": (lambda qa, s: s.ask(5), statekv.InputError, "the question must be text, got int"),
        "ask a lone surrogate": (lambda qa, s: s.ask("Why\ud800?"), statekv.InputError,
                                 "the question holds a lone surrogate (U+D800) at character 3, which is no text"),
        "watch a lone surrogate": (lambda qa, s: s.watch("Is it \udcff?"), statekv.InputError,
                                   "the watch's question holds a lone surrogate (U+DCFF) at character 6"),
        "answer bytes": (lambda qa, s: qa.answer(frames, [b"Why?"]), statekv.InputError,
                         "the question must be text, got bytes"),
        "answer bare bytes": (lambda qa, s: qa.answer(frames, b"Why?"), statekv.InputError,
                              "the question must be text, got bytes"),
        "answer None": (lambda qa, s: qa.answer(frames, None), statekv.InputError,
                        "the question must be text, got NoneType"),
        "ask too long an answer": (lambda qa, s: s.ask("Why?", max_new_tokens=10**6), statekv.HorizonError,
                                   "do not fit"),
        "ask retrieve 0": (lambda qa, s: s.ask("Why?", retrieve=0), statekv.ConfigurationError, "retrieve"),
        "ask max_new_tokens 0": (lambda qa, s: s.ask("Why?", max_new_tokens=0), statekv.ConfigurationError,
                                 "max_new_tokens"),
        "save into a folder": (lambda qa, s: s.save(Path(".")), OutputError, "names a folder"),
        "save unwritable": (lambda qa, s: s.save(UNWRITABLE), OutputError, "cannot write"),
        "load a string flag": (lambda qa, s: Stream.load("x", qa, allow_other_weights="yes"),
                               statekv.ConfigurationError, "allow_other_weights"),
        "load a number": (lambda qa, s: Stream.load(123, qa), statekv.InputError, "must be a path"),
        "push at a time past the sampling clock": (lambda qa, s: qa.stream(max_fps=2).push(frames[0], 1e308),
                                                   statekv.InputError, "past the latest time"),
        "a clock past a float's range": (lambda qa, s: qa.stream(max_fps=1e308), statekv.InputError,
                                         "at most 4e+07 (or None to keep every frame), got 1e+308"),
        # normal doubles: a process that flushes subnormals to zero reads a max_fps of 1e-310 as 0
        "a frame after the last time a tiny max_fps's clock holds": (lambda qa, s: [
            (stream.push(frames[0], 0.0), stream.push(frames[1])) for stream in [qa.stream(max_fps=1e-307)]],
            statekv.InputError, "push it with its timestamp"),
        "simplestream past a tiny max_fps's clock": (lambda qa, s: [
            (stream.push(frames[0], 0.0), stream.push(frames[1])) for stream in [qa.with_options(
                method="simplestream").stream(max_fps=1e-307)]], statekv.InputError, "push it with its timestamp"),
        "simplestream on a clock too fast": (lambda qa, s: qa.with_options(method="simplestream").stream(
            max_fps=2e9), statekv.InputError, "max_fps must be a number above 0 and at most 4e+07"),
        "misspelt option": (lambda qa, s: qa.with_options(bugdet=3), statekv.ConfigurationError, "'bugdet'"),
        "options budget text": (lambda qa, s: statekv.ModelOptions(budget="12"), statekv.ConfigurationError,
                                "budget"),
        "options offload maybe": (lambda qa, s: statekv.ModelOptions.from_strings({"offload": "maybe"}),
                                  statekv.ConfigurationError, "offload"),
        "options device": (lambda qa, s: statekv.ModelOptions(device="cuda:7"), statekv.ConfigurationError,
                           "'cuda:7'"),
        "step float64 embeddings": (lambda qa, s: s.prefill.step(torch.zeros(1, 2, 64, dtype=torch.float64)),
                                    statekv.InputError, "float64"),
        "step embeddings on another device": (lambda qa, s: s.prefill.step(torch.zeros(1, 2, 64, device="meta")),
                                              statekv.InputError, "is on meta"),
        "step ids outside the vocabulary": (lambda qa, s: s.prefill.step(input_ids=torch.tensor([[10**6]])),
                                            statekv.InputError, "outside the vocabulary"),
        "step float ids": (lambda qa, s: s.prefill.step(input_ids=ids.float()), statekv.InputError, "integer"),
        "step positions of another length": (lambda qa, s: s.prefill.step(
            input_ids=ids, position_ids=torch.tensor([[0, 1, 2]])), statekv.InputError, "position_ids"),
        "step float positions": (lambda qa, s: s.prefill.step(input_ids=ids, position_ids=ids.float()),
                                 statekv.InputError, "position_ids"),
        "step a padding mask": (lambda qa, s: s.prefill.step(input_ids=ids, attention_mask=torch.tensor([[0, 1]])),
                                statekv.InputError, "attention mask"),
        "step a numpy array": (lambda qa, s: s.prefill.step(np.zeros((1, 2, 64), np.float32)), statekv.InputError,
                               "tensor"),
        "generate ids outside the vocabulary": (lambda qa, s: s.prefill.generate(torch.tensor([[10**6]])),
                                                statekv.InputError, "outside the vocabulary"),
        "generate float ids": (lambda qa, s: s.prefill.generate(ids.float()), statekv.InputError, "integer"),
        "prefill horizon beyond memory": (lambda qa, s: statekv.StreamingPrefill(
            qa.adapter.model, statekv.StateKV(budget=4), horizon=10**12), statekv.HorizonError, "GiB"),
    }


API_CASES = _api_cases()


@pytest.mark.parametrize("case", API_CASES)
def test_bad_python_calls_raise_one_line_errors_and_change_nothing(case, qa, stream):
    call, error, phrase = API_CASES[case]
    before = (stream.frames, stream.tokens, stream.pushed, [t.clone() for t in stream.prefill.carried(0)])
    with pytest.raises(error, match=None) as info:
        call(qa, stream)
    assert isinstance(info.value, statekv.StateKVError) and phrase in str(info.value)
    assert "\n" not in str(info.value)
    after = (stream.frames, stream.tokens, stream.pushed, stream.prefill.carried(0))
    assert before[:3] == after[:3] and all(torch.equal(a, b) for a, b in zip(before[3], after[3]))


def test_a_misspelt_option_is_named_before_it_reaches_the_model(files):
    with pytest.raises(statekv.ConfigurationError, match="unknown option 'bugdet'"):
        statekv.VideoQA.from_pretrained(files["model"], bugdet=3)


def test_a_closed_stream_refuses_to_answer_or_continue(qa):
    closed = qa.stream(horizon_frames=3)
    closed.push(noise_frames(1)[0], 0.0)
    closed.close()
    for attempt in (lambda: closed.ask("Why?"), lambda: closed.push(noise_frames(1)[0], 1.0)):
        with pytest.raises(statekv.InputError, match="closed"):
            attempt()


def test_the_internvl_adapter_passes_trust_remote_code_on(files, monkeypatch):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    seen = []
    for cls in (AutoModelForImageTextToText, AutoTokenizer):
        real = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, _real=real, **k: seen.append(k.get("trust_remote_code")) or _real(c, *a, **k)))
    statekv.VideoQA.from_pretrained(files["model"], trust_remote_code=True)
    assert seen == [True, True]


def test_push_many_takes_bare_images_as_push_does(qa):
    """Before: images without timestamps (an array of frames, say) were unpacked as arguments of `push`: a
    TypeError naming 33 arguments."""
    images = noise_frames(3)
    with qa.stream() as pairs, qa.stream() as bare:
        assert pairs.push_many([(image, None) for image in images]) == 3
        assert bare.push_many(np.stack(images)) == 3
        assert bare.frames + len(bare.pending) == 3
        assert torch.equal(bare.ask_tokens("Why?", max_new_tokens=2), pairs.ask_tokens("Why?", max_new_tokens=2))


# ---------------------------------------------------------------------------------------------------------------
# Saved streams
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(qa, tmp_path_factory):
    """A stream of 3 frames saved to a file, and its answer to a question (to compare after loading)."""
    live = qa.stream(horizon_frames=6, max_fps=1)
    live.push_many((image, float(t)) for t, image in enumerate(noise_frames(3)))
    path = live.save(tmp_path_factory.mktemp("saved") / "stream.safetensors")
    answer = live.ask_tokens("Why?", max_new_tokens=4)
    live.close()
    return path, answer


def _contents(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as handle:
        return json.loads(handle.metadata()["statekv"]), {name: handle.get_tensor(name) for name in handle.keys()}


def _edited(saved_path: Path, out: Path, metadata=None, tensors=None) -> Path:
    """A copy of a saved stream with ``metadata(m)`` / ``tensors(t)`` applied to its parts, written with fresh
    checksums (as a careful forger would)."""
    meta, tens = _contents(saved_path)
    meta.pop("checksums")
    if metadata:
        metadata(meta)
    if tensors:
        tensors(tens)
    return write_verified(out, tens, meta)


def test_a_saved_watch_no_watch_opens_with_is_refused_naming_the_file(qa, tmp_path):
    """Before: a watch record edited to ``every`` 0 was refused without naming the file it was in."""
    live = qa.stream(horizon_frames=6, max_fps=1)
    live.push_many((image, float(t)) for t, image in enumerate(noise_frames(2)))
    live.watch("Why?", every=2, max_new_tokens=2)
    path = live.save(tmp_path / "watched.safetensors")
    live.close()

    def never(metadata):
        metadata["watches"][0]["every"] = 0
    edited = _edited(path, tmp_path / "edited.safetensors", metadata=never)
    with pytest.raises(statekv.InputError) as info:
        Stream.load(edited, qa)
    assert str(info.value) == (f"{edited}: watches[0]: every (frames between evaluations) must be a positive "
                               "integer, got 0")


def test_a_saved_stream_resumes_exactly(saved, qa):
    path, answer = saved
    resumed = Stream.load(path, qa)
    assert resumed.frames == 3 and torch.equal(resumed.ask_tokens("Why?", max_new_tokens=4), answer)
    resumed.close()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _flip_a_tensor_byte(path: Path, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor's data
    out.write_bytes(bytes(data))
    return out


def _flip_a_header_byte(path: Path, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    at = data.index(b'"pushed\\":') + len(b'"pushed\\":')  # the JSON inside the header is escaped there
    data[at] = ord("7") if data[at] != ord("7") else ord("8")
    out.write_bytes(bytes(data))
    return out


def _drop_tensor(name):
    return lambda tensors: tensors.pop(name)


def _set(path, value):
    def edit(metadata):
        *parents, key = path.split(".")
        target = metadata
        for parent in parents:
            target = target[parent]
        if value is KeyError:
            del target[key]
        else:
            target[key] = value
    return edit


FILE_DAMAGE = {
    "a flipped byte in a tensor": (_flip_a_tensor_byte, "checksum does not match"),
    "a flipped digit in the metadata": (_flip_a_header_byte, "metadata is corrupt"),
    "cut in half": (lambda p, o: _write(o, p.read_bytes()[: p.stat().st_size // 2]), "not a saved statekv stream"),
    "not safetensors": (lambda p, o: _write(o, b"hello"), "not a saved statekv stream"),
    "empty": (lambda p, o: _write(o, b""), "not a saved statekv stream"),
}


@pytest.mark.parametrize("case", FILE_DAMAGE)
def test_damaged_stream_files_are_refused(case, saved, qa, tmp_path):
    damage, phrase = FILE_DAMAGE[case]
    with pytest.raises(statekv.InputError, match=phrase) as info:
        Stream.load(damage(saved[0], tmp_path / "damaged.safetensors"), qa)
    assert "\n" not in str(info.value)


METADATA_EDITS = {
    "format 1 (earlier statekv)": (_set("version", 1), "stream format 1 by an earlier statekv"),
    "a future format": (_set("version", 99), "stream format 99"),
    "no version": (_set("version", KeyError), "no format version"),
    "not a statekv stream": (_set("format", "other"), "not a saved statekv stream"),
    "no model": (_set("model", KeyError), "lacks 'model'"),
    "pushed as text": (_set("pushed", "3"), "metadata.pushed must be a non-negative integer"),
    "negative pushed": (_set("pushed", -1), "metadata.pushed must be a non-negative integer"),
    "fewer pushed than kept": (_set("pushed", 1), "fewer than the 3 frames kept"),
    "absurd horizon_frames": (_set("horizon_frames", 10**15), "plus its reserve"),
    "horizon_frames past int64": (_set("horizon_frames", 2**63), "metadata.horizon_frames must be at most"),
    "horizon_frames below the frames kept": (_set("horizon_frames", 2), "fewer than the 3 frames kept"),
    "a float horizon": (_set("horizon", 1e3), "metadata.horizon must be a positive integer"),
    "max_fps of zero": (_set("max_fps", 0), "metadata.max_fps must be a finite number > 0"),
    "max_fps past HIGHEST_FPS": (_set("max_fps", 1e9), "metadata.max_fps must be at most 4e+07, got 1000000000.0"),
    "a timestamp as text": (_set("last_timestamp", "2"), "metadata.last_timestamp"),
    "the clock set back": (_set("last_timestamp", 1.0), "kept_timestamp 2.0 is after the last timestamp 1.0"),
    "a time past any stream's": (_set("last_timestamp", 1e200), "metadata.last_timestamp must be at most 1e+11"),
    "an unknown field": (_set("state.colour", "red"), "has unknown field 'colour'"),
    "steps that do not add up": (_set("cache.seen_tokens", 5), "inconsistent"),
    "window starts for other layers": (_set("cache.window_starts", [None]), "layers"),
    "seconds as text": (_set("stats.frame_seconds", ["fast"]), "metadata.stats.frame_seconds[0]"),
    "pending frame in the future": (_set("pending", [[0, -1]]), "metadata.pending[0][1]"),
    "another policy": (_set("engine.policy", "Recency(steps=2)"),
                       "saved with method 'statekv' (Recency(steps=2)), but this VideoQA uses method"),
    "another layout": (_set("model.layout", "chat"), "saved with layout 'chat'"),
    "another dtype": (_set("model.dtype", "bfloat16"), "saved with dtype 'bfloat16'"),
    "another checkpoint": (_set("model.weights", "0" * 64), "saved with other weights"),
}


@pytest.mark.parametrize("case", METADATA_EDITS)
def test_hand_edited_metadata_is_refused_in_one_line_before_anything_changes(case, saved, qa, tmp_path):
    edit, phrase = METADATA_EDITS[case]
    path = _edited(saved[0], tmp_path / "edited.safetensors", metadata=edit)
    buffers = {name: buffer.clone() for name, buffer in qa.adapter.model.named_buffers() if name.endswith("inv_freq")}
    with pytest.raises(statekv.InputError) as info:
        Stream.load(path, qa)
    assert phrase in str(info.value) and "\n" not in str(info.value)
    for name, buffer in qa.adapter.model.named_buffers():  # the model's RoPE is as it was
        if name in buffers:
            assert torch.equal(buffer, buffers[name])


def _absurd_but_consistent_horizon(metadata):
    metadata["horizon_frames"] = 10**9
    metadata["horizon"] = 10**9 * 19 + 64


TENSOR_EDITS = {
    "a missing detailed cache tensor": (None, _drop_tensor("cache.layers.0.values"), "lacks layers.0.values"),
    "keys of the wrong length": (None, lambda t: t.update({"cache.layers.1.keys": t["cache.layers.1.keys"][:, :, 1:]}),
                                 "layers.1.keys is float32"),
    "values of the wrong dtype": (None, lambda t: t.update({"cache.layers.2.values": t["cache.layers.2.values"].half()}),
                                  "layers.2.values is float16"),
    "an unexpected tensor": (None, lambda t: t.update({"cache.layers.9.keys": torch.zeros(1)}), "unexpected"),
    "a stray tensor": (None, lambda t: t.update({"payload": torch.zeros(3)}), "unexpected tensor payload"),
    "carried positions out of range": (None, lambda t: t.update({
        "cache.layers.0.carried_positions": t["cache.layers.0.carried_positions"] + 10**6}), "outside the"),
    "a pending frame without its image": (lambda m: (_set("pending", [[3, 3.0]])(m), _set("pushed", 4)(m)), None,
                                          "lacks pending.0"),
    "a horizon too large for memory": (_absurd_but_consistent_horizon, None, "GiB of detailed cache"),
}


@pytest.mark.parametrize("case", TENSOR_EDITS)
def test_missing_malformed_or_unexpected_tensors_are_refused(case, saved, qa, tmp_path):
    edit_metadata, edit_tensors, phrase = TENSOR_EDITS[case]
    path = _edited(saved[0], tmp_path / "edited.safetensors", metadata=edit_metadata, tensors=edit_tensors)
    with pytest.raises(statekv.InputError) as info:
        Stream.load(path, qa)
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_a_checksum_without_its_tensor_is_refused(saved, qa, tmp_path):
    meta, tensors = _contents(saved[0])
    tensors.pop("cache.layers.0.block_keys")
    from safetensors.torch import save_file
    import hashlib

    text = json.dumps(meta)
    path = tmp_path / "short.safetensors"
    save_file(tensors, str(path), metadata={"statekv": text, "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})
    with pytest.raises(statekv.InputError, match="lacks tensor cache.layers.0.block_keys"):
        Stream.load(path, qa)


def test_another_checkpoint_is_refused_unless_allowed(saved, files, tmp_path):
    other = statekv.VideoQA.from_pretrained(make_tiny_checkpoint("internvl", tmp_path / "other", seed=1),
                                            budget=20, attention="eager", reserve_tokens=64)
    with pytest.raises(OtherSetupError, match="saved with other weights"):  # an InputError: sound files
        Stream.load(saved[0], other)
    resumed = Stream.load(saved[0], other, allow_other_weights=True)  # the user vouches for it
    assert resumed.frames == 3
    resumed.close()


def test_a_stream_saved_in_another_dtype_is_refused(saved, files):
    half = statekv.VideoQA.from_pretrained(files["model"], budget=20, attention="eager", reserve_tokens=64,
                                           dtype="bfloat16")
    with pytest.raises(OtherSetupError, match="saved with dtype 'float32', but this VideoQA has 'bfloat16'"):
        Stream.load(saved[0], half)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation runs
# ---------------------------------------------------------------------------------------------------------------
def _eval_argv(files, out, *extra) -> list:
    return ["eval", "videomme", "--model", files["model"], "--data-root", files["data"], "--out", out,
            "--budget", "20", "--max-new-tokens", "2", "--no-progress", *extra]


def test_a_run_with_an_unreadable_video_ends_non_zero_with_a_summary(files, capsys, tmp_path):
    data = tmp_path / "data"
    folder = write_mini_videomme(data, videos=2, seconds=3)
    (folder / "data" / "fab001.mp4").write_bytes(b"not a video")
    out = tmp_path / "run"
    code, stdout, err = _cli(capsys, _eval_argv(files, out, "--data-root", data))
    assert code == 1 and "3 questions answered, 3 of 6 missing" in stdout
    last = err.strip().splitlines()[-1]
    assert last == (f"statekv eval: 3 question(s) unanswered: 1 video(s) could not be read (errors logged in "
                    f"{out}/errors.rank*.jsonl); rerun the same command to retry them")
    assert json.loads((out / "errors.rank000.jsonl").read_text())["video_id"] == "fab001"


def test_a_second_run_on_a_busy_folder_is_refused(files, tmp_path):
    out = tmp_path / "run"
    config = EvalConfig.for_model("videomme", files["model"], files["data"], out, budget=20, max_new_tokens=2,
                                  progress=False, limit=1)
    with RunLock(out):
        with pytest.raises(OutputError, match=f"{out} is in use by another evaluation \\(pid {os.getpid()} on"):
            run_evaluation(config)
    assert not list(out.glob("answers*"))
    run_evaluation(config)  # the lock went with the run holding it
    RunLock(out).acquire()  # and this run gave it back


def test_a_run_held_by_another_process_is_refused(files, capsys, tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 1 on elsewhere'); f.flush(); "
                               "print('held', flush=True); time.sleep(120)", str(out / "run.lock")],
        stdout=subprocess.PIPE, text=True) if out.mkdir() is None else None
    try:
        assert holder.stdout.readline().strip() == "held"
        code, _, err = _cli(capsys, _eval_argv(files, out, "--limit", "1"))
        assert code == 2 and "is in use by another evaluation (pid 1 on elsewhere)" in err.strip().splitlines()[-1]
    finally:
        holder.kill()
        holder.wait()


class _Rank:
    """A rank of a launch whose rank 0 said ``refusal`` (what `RankContext.share_from_main` returns)."""

    def __init__(self, is_main: bool, refusal: str | None):
        self.is_main, self.refusal = is_main, refusal

    def share_from_main(self, value):
        return value if self.is_main else self.refusal


def test_the_ranks_of_one_launch_share_the_folder_and_stop_together(tmp_path):
    lock = RunLock(tmp_path)
    lock_for_every_rank(lock, _Rank(is_main=False, refusal=None))  # rank 0 holds it for the launch
    assert not lock.held  # other ranks never lock
    with pytest.raises(OutputError, match="in use"):
        lock_for_every_rank(RunLock(tmp_path), _Rank(is_main=False, refusal="x is in use by another evaluation"))
    lock_for_every_rank(lock, _Rank(is_main=True, refusal=None))
    with pytest.raises(OutputError, match="in use"):  # a second launch's rank 0
        lock_for_every_rank(RunLock(tmp_path), _Rank(is_main=True, refusal=None))
    lock.release()


# ---------------------------------------------------------------------------------------------------------------
# Saved streams: values checked against each other and the model, whatever the checksums say
# ---------------------------------------------------------------------------------------------------------------
def _tensor_edit(name, change):
    def edit(tensors):
        tensor = tensors[name].clone()
        change(tensor)
        tensors[name] = tensor
    return edit


def _nan(tensor):
    tensor[0, 0, 0, 0] = float("nan")


VALUE_EDITS = {
    "a horizon that is not the frames' tokens plus the reserve": (
        lambda m: m.update(horizon=m["horizon"] + 5), None, "is not the"),
    "a prompt prefix this model does not have": (_set("prefix_tokens", 5), None, "prompt prefix is 0 tokens"),
    "a step longer than a frame's tokens": (_set("cache.chunk_lengths", [18, 20, 19]), None, "step 1 holds 20"),
    "three steps for two frames": (
        lambda m: (_set("state.frames", 2)(m), _set("stats.frames", 2)(m)), None, "3 frame steps for 2 frames"),
    "NaN keys": (None, _tensor_edit("cache.layers.1.keys", _nan), "holds NaN"),
    "infinite values": (None, _tensor_edit("cache.layers.0.values", lambda t: t.fill_(float("inf"))), "infinite"),
    "all-zero carried positions": (None, _tensor_edit("cache.layers.0.carried_positions", lambda t: t.zero_()),
                                   "each carried token once"),
    "carried keys that are not the cache's": (None, _tensor_edit("cache.layers.2.carried_keys", lambda t: t.add_(1)),
                                              "carried_keys are not the detailed cache's keys"),
    "a last timestamp with nothing pushed": (
        lambda m: m.update(last_timestamp=None), None, "last_timestamp None after 3 pushed"),
}


@pytest.mark.parametrize("case", VALUE_EDITS)
def test_values_edited_with_fresh_checksums_are_refused(case, saved, qa, tmp_path):
    edit_metadata, edit_tensors, phrase = VALUE_EDITS[case]
    path = _edited(saved[0], tmp_path / "edited.safetensors", metadata=edit_metadata, tensors=edit_tensors)
    buffers = {name: buffer.clone() for name, buffer in qa.adapter.model.named_buffers() if name.endswith("inv_freq")}
    with pytest.raises(statekv.InputError) as info:
        Stream.load(path, qa)
    assert phrase in str(info.value) and "\n" not in str(info.value) and str(path) in str(info.value)
    for name, buffer in qa.adapter.model.named_buffers():  # the model's RoPE is as it was
        if name in buffers:
            assert torch.equal(buffer, buffers[name])


def test_deeply_nested_metadata_is_one_line_not_a_recursion_error(saved, qa, tmp_path):
    import hashlib

    from safetensors.torch import save_file

    text = '{"format": "statekv-stream", "version": 2, "name": ' + "[" * 200_000 + "]" * 200_000 + "}"
    path = tmp_path / "nested.safetensors"
    save_file({"x": torch.zeros(1)}, str(path),
              metadata={"statekv": text, "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})
    with pytest.raises(statekv.InputError, match="nested too deeply"):
        Stream.load(path, qa)


# ---------------------------------------------------------------------------------------------------------------
# Frames as pushed, one thread at a time, arguments of ask, a save with nothing encoded
# ---------------------------------------------------------------------------------------------------------------
def test_a_reused_buffer_does_not_change_frames_waiting_for_their_batch(qa):
    frames = noise_frames(4, seed=3)
    reused, copied = qa.stream(4, vision_batch=2), qa.stream(4, vision_batch=2)
    buffer = np.empty_like(frames[0])
    for frame in frames:
        buffer[...] = frame  # a camera loop refilling one buffer
        reused.push(buffer)
        copied.push(frame.copy())
        if reused.pending:
            np.testing.assert_array_equal(reused.pending[-1].image, frame)
    reused.flush(), copied.flush()
    assert torch.equal(reused.ask_tokens("Why?", max_new_tokens=3), copied.ask_tokens("Why?", max_new_tokens=3))
    reused.close(), copied.close()


def test_calls_from_two_threads_take_turns(qa):
    import threading

    live = qa.stream(4)
    live.push(noise_frames(1)[0])
    done = threading.Event()
    with live.lock:  # as if another thread were in the middle of ask()
        worker = threading.Thread(target=lambda: (live.push(noise_frames(1, seed=1)[0]), done.set()))
        worker.start()
        assert not done.wait(0.5) and live.frames == 1  # the push waits for its turn
    worker.join(timeout=60)
    assert done.is_set() and live.frames == 2
    live.close()


def test_many_threads_asking_and_pushing_leave_the_stream_as_one_thread_would(qa):
    import threading

    live = qa.stream(24)
    live.push(noise_frames(1)[0])
    errors = []

    def push():
        try:
            for image in noise_frames(12, seed=4):
                live.push(image)
        except Exception as error:  # noqa: BLE001 - recorded for the assertion below
            errors.append(error)

    def ask():
        try:
            for _ in range(4):
                live.ask_tokens("Why?", max_new_tokens=2)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=push), threading.Thread(target=ask), threading.Thread(target=ask)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and live.frames == 13 and live.stats.chunks == 13
    live.close()


def test_saving_while_every_frame_waits_is_one_line(qa, tmp_path):
    live = qa.stream(4, vision_batch=4)
    live.push(noise_frames(1)[0])
    with pytest.raises(statekv.InputError, match="nothing is encoded yet") as info:
        live.save(tmp_path / "early.safetensors")
    assert "\n" not in str(info.value) and not (tmp_path / "early.safetensors").exists()
    live.close()


GENERATION_ARGUMENTS = {
    "an unknown name": ({"temprature": 0.5}, "unknown generation argument 'temprature'"),
    "a negative temperature": ({"temperature": -1.0, "do_sample": True}, "temperature must be"),
    "top_p above 1": ({"top_p": 1.5}, "top_p must be"),
    "num_beams as text": ({"num_beams": "2"}, "num_beams must be"),
    "several answers": ({"num_return_sequences": 2}, "num_return_sequences must be 1"),
    "an argument statekv sets": ({"past_key_values": None}, "sets past_key_values itself"),
    "do_sample as text": ({"do_sample": "yes"}, "do_sample must be True or False"),
}


@pytest.mark.parametrize("case", GENERATION_ARGUMENTS)
def test_unknown_or_invalid_generation_arguments_are_one_line(case, stream):
    arguments, phrase = GENERATION_ARGUMENTS[case]
    with pytest.raises(statekv.InputError, match=phrase) as info:
        stream.ask("Why?", max_new_tokens=2, **arguments)
    assert "\n" not in str(info.value)


def test_valid_generation_arguments_still_reach_generate(stream):
    assert stream.ask_tokens("Why?", max_new_tokens=2, do_sample=False, num_beams=1).shape[0] == 1


# ---------------------------------------------------------------------------------------------------------------
# Every frame of a user's source, the last one included
# ---------------------------------------------------------------------------------------------------------------
def test_encode_at_the_sources_rate_sees_every_frame_once(qa, tmp_path):
    from PIL import Image

    folder = tmp_path / "three"
    folder.mkdir()
    for index, image in enumerate(noise_frames(3, seed=5)):
        Image.fromarray(image).save(folder / f"{index}.png")
    with qa.encode(folder) as encoded:
        assert encoded.frames == 3
    seen = []
    real = qa.adapter.prepare_frames

    def record(frames, state):
        seen.extend(frame.index for frame in frames)
        return real(frames, state)

    qa.adapter.prepare_frames = record
    try:
        with qa.encode(noise_frames(10, seed=6), max_fps=1.0) as encoded:
            assert encoded.frames == 10
        with qa.encode(noise_frames(10, seed=6), max_fps=1.0, protocol=True):
            pass
    finally:
        del qa.adapter.prepare_frames
    assert seen == list(range(10)) + [0, 1, 2, 3, 4, 4, 5, 6, 7, 8]  # the benchmarks' rule, kept as published
