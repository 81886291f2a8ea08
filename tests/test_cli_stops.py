"""Commands stopped where their work ends: a stop a library swallowed after the last stop point of a loop, what a
resumed stream says it lost, a first demo stopped and run again."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import pytest

import statekv
from statekv.cli import main
from statekv.testing import make_tiny_checkpoint, write_test_video


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stops")
    return {"model": make_tiny_checkpoint("internvl", root / "internvl"),
            "video": write_test_video(root / "clip.mp4", frames=40, fps=8)}  # 5 s


def swallowing(called):
    """``called``, which takes a Ctrl-C as it begins and swallows it, as numpy's ``Generator.choice`` of a list
    does with one landing in it."""
    def call(*args, **kwargs):
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        return called(*args, **kwargs)

    return call


def test_a_ctrl_c_swallowed_as_a_make_writes_its_last_video_stops_it(tmp_path, monkeypatch, capsys):
    """Before: the last video had no stop point after it: the make wrote the question file and exited 0."""
    import statekv.synthetic.benchmark as benchmark

    written = benchmark.write_video
    monkeypatch.setattr(benchmark, "write_video", lambda plan, path: (
        swallowing(written) if path.name.startswith("v0001") else written)(plan, path))
    out = tmp_path / "set"
    argv = ["synthetic", "make", "--out", str(out), "--videos", "2", "--seed", "1", "--frames", "12"]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == (f"statekv synthetic: interrupted; 2 of 2 videos written in {out}; "
                                               "rerun the same command to go on")
    assert not (out / "questions.jsonl").exists()
    monkeypatch.setattr(benchmark, "write_video", written)
    assert main(argv) == 0 and (out / "questions.jsonl").is_file()
    assert "(2 of them written by the make this one went on from)" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["ask", "flush"])
def test_a_ctrl_c_swallowed_after_the_last_frame_stops_the_stream(files, tmp_path, monkeypatch, capsys, where):
    """Before: a Ctrl-C swallowed as a question timed after the last frame was answered (or as the last frames were
    encoded) reached no stop point: the run asked every question left and exited 0. Now the answer being made is
    printed, the stream saved and the stop said, once."""
    monkeypatch.setattr(statekv.Stream, where, swallowing(getattr(statekv.Stream, where)))
    saved = tmp_path / "kept.safetensors"
    code = main(["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "1", "--json",
                 "--save", str(saved), "--ask", "9:Why?", "--ask", "10:Who?"])
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert code == 130 and captured.err.strip().splitlines()[-1] == (
        f"statekv stream: interrupted; the 5 frames streamed before it were saved to {saved}"), captured.err
    assert captured.err.count("interrupted") == 1
    asked = [line["question"] for line in lines if line["event"] == "answer"]
    assert asked == (["Why?"] if where == "ask" else [])  # the answer under way is printed, no later one is asked
    assert lines[-1]["event"] == "summary" and lines[-1]["saved"] == str(saved) and saved.is_file()


def test_a_resumed_folder_whose_last_frames_were_not_durable_says_they_are_streamed_again(files, tmp_path,
                                                                                         monkeypatch, capsys, caplog):
    """Before: `--resume FOLDER` of a run killed with frames waiting for their batch printed the library's warning
    that they "are lost", though the replay pushes them again from the video, and the stream ended whole."""
    import shutil

    pushes, push, killed = [], statekv.Stream.push, tmp_path / "killed"

    def pushing(stream, *args, **kwargs):
        pushes.append(1)
        if len(pushes) == 7:  # 4 frames streamed, 2 waiting for their batch: the folder as a kill -9 now leaves it
            shutil.copytree(stream.folder, killed, ignore=shutil.ignore_patterns("lock"))
            raise KeyboardInterrupt
        return push(stream, *args, **kwargs)

    monkeypatch.setattr(statekv.Stream, "push", pushing)
    argv = ["stream", str(files["video"]), "--model", str(files["model"]), "--max-fps", "2", "--offload", "disk",
            "--offload-dir", str(tmp_path / "tier"), "--vision-batch", "4", "--json"]
    assert main(argv) == 130
    monkeypatch.setattr(statekv.Stream, "push", push)
    capsys.readouterr()
    assert main([*argv, "--resume", str(killed)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"statekv stream: --resume {killed}: the 2 frames pushed after the 4 it holds were "
                                    f"not durable when its run ended; they are streamed again from {files['video']}")
    assert json.loads(captured.out.strip().splitlines()[-1])["stats"]["frames"] == 10
    assert "lost" not in caplog.text


@pytest.mark.parametrize("order", [("SIGTERM", "SIGINT"), ("SIGINT", "SIGTERM"), ("SIGHUP", "SIGINT", "SIGINT")])
def test_a_server_stopped_by_sigterm_then_ctrl_c_ends_as_stopped_by_sigterm(order):
    """Before: uvicorn raises the signals it caught again last first, so SIGTERM then a Ctrl-C (to cut the graceful
    wait short) exited 130, and the other order 143. A SIGTERM or SIGHUP outranks a Ctrl-C, as in every command."""
    import uvicorn

    from statekv.serve.server import AppServer
    from statekv.stopping import Stopped, signals_stop_like_ctrl_c

    server = AppServer.__new__(AppServer)  # its signal handling alone: no app
    uvicorn.Server.__init__(server, uvicorn.Config(app=None))
    numbers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {number: signal.getsignal(number) for number in numbers}  # put back after the test
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt) as raised, signals_stop_like_ctrl_c(), server.capture_signals():
            for name in order:
                signal.raise_signal(getattr(signal, name))
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert isinstance(raised.value, Stopped) and raised.value.signal_number == getattr(signal, order[0].replace(
        "SIGINT", "SIGTERM"))
    assert server.force_exit == (order[0] != "SIGINT")  # a Ctrl-C after a SIGTERM still cuts the graceful wait short


def test_a_first_demo_stopped_while_it_writes_its_videos_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """Before: the first run wrote its set in a temporary folder that the stop removed, though its line said to rerun
    the command to go on: the next run wrote every video again."""
    import statekv.synthetic.benchmark as benchmark
    from statekv.commands.demo import DEMO_SET, demo_set

    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path))
    written, write = [], benchmark.write_video

    def writing(plan, path):
        written.append(path.name)
        if len(written) == 3:
            raise KeyboardInterrupt
        return write(plan, path)

    monkeypatch.setattr(benchmark, "write_video", writing)
    with pytest.raises(KeyboardInterrupt) as stopped:
        demo_set(4)
    (note,) = stopped.value.__notes__
    folder = note.split(" videos written in ")[1].split(";")[0]
    assert note.startswith("2 of 4 videos written") and len(list((Path(folder) / "videos").glob("v*.mp4"))) == 2
    videos = demo_set(4)
    assert written[3:] == ["v0002.partial.mp4", "v0003.partial.mp4"]  # the two missing, no more
    assert len(videos) == 4 and all(video.is_file() for video, _ in videos)
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{DEMO_SET}-4"]


def test_a_first_demo_started_while_another_writes_its_set_is_refused_in_one_line(tmp_path, monkeypatch):
    """Before: the second first run was refused by the synthetic make's lock, whose advice named --out, a flag demo
    does not have."""
    from statekv.commands.demo import DEMO_SET, demo_set
    from statekv.errors import OutputError
    from statekv.locks import FileLock

    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path))
    other = FileLock.acquire(tmp_path / f"{DEMO_SET}-2.lock", what="the other demo", holder="another statekv demo")
    try:
        with pytest.raises(OutputError, match="another statekv demo is writing it: wait for it to end, then run this "
                                              "again$"):
            demo_set(2)
    finally:
        other.release()
    assert not (tmp_path / f"{DEMO_SET}-2.partial").exists()
    assert len(demo_set(2)) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{DEMO_SET}-2"]
