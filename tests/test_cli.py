"""The ``statekv`` command: answer, stream and demo end to end on tiny checkpoints; one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

import statekv
import bad_videos
from bad_videos import BAD_VIDEOS
from conftest import random_frames
from statekv.cli import main
from statekv.errors import CacheLimitError
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.settings.values import format_bytes


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "root": root,
        "model": make_tiny_checkpoint("internvl", root / "internvl"),
        "video": write_test_video(root / "clip.mp4", frames=40, fps=8),  # 5 s
    }


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "statekv.cli", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "error:" in lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# End to end, in a fresh process
# ---------------------------------------------------------------------------------------------------


def test_answer_encodes_once_and_answers_every_question(files):
    result = _run("answer", files["video"], "What is shown?", "Why?", "--model", files["model"], "--budget", "20",
                  "--max-new-tokens", "3", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert [a["question"] for a in document["answers"]] == ["What is shown?", "Why?"]
    assert all(isinstance(a["answer"], str) for a in document["answers"])
    stats = document["stats"]
    assert stats["frames"] == 5 and stats["tokens"] == 5 * 19 and stats["carried_tokens"] == 20
    assert len(stats["frame_seconds"]) == 5 and "Traceback" not in result.stderr


def test_stream_asks_each_question_when_the_stream_reaches_its_time(files):
    saved = files["root"] / "stream.safetensors"
    result = _run("stream", files["video"], "--model", files["model"], "--method", "recency", "--frames", "2",
                  "--ask", "1.5:What now?", "--ask", "0:First?", "--ask", "99:At the end?", "--max-new-tokens", "2",
                  "--save", saved, "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]  # each answer as made, then a summary
    assert [line["event"] for line in lines] == ["answer"] * 3 + ["summary"]
    answers = lines[-1]["answers"]
    assert [(a["time"], a["frames"]) for a in answers] == [(0.0, 1), (1.5, 2), (99.0, 5)]
    assert [{k: v for k, v in line.items() if k != "event"} for line in lines[:3]] == answers
    assert lines[-1]["saved"] == str(saved) and lines[-1]["save_error"] is None
    qa = statekv.VideoQA.from_pretrained(files["model"], method="recency", frames=2)
    assert statekv.Stream.load(saved, qa).frames == 5


def test_stream_without_questions_watches_with_no_horizon_and_shows_progress(files):
    """A new user's first run: no --ask, a --watch, no horizon (as qa.stream()), a progress bar on a terminal."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()  # stderr a terminal, as a person's (80 columns: tqdm draws to its width)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    # a budget the tiny model's 128 positions leave a watch room beside (the default 4,096 would carry the range's
    # cap, leaving 16 positions: the watch would be refused as it opens)
    process = subprocess.Popen([sys.executable, "-m", "statekv.cli", "stream", str(files["video"]), "--model",
                                str(files["model"]), "--watch", "2:What is shown?", "--max-new-tokens", "2", "--json",
                                "--budget", "64"], stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    out, _ = process.communicate(timeout=300)
    os.close(leader)
    assert process.returncode == 0, shown.decode(errors="replace")
    lines = [json.loads(line) for line in out.splitlines()]
    summary = lines[-1]
    assert summary["event"] == "summary" and summary["answers"] == []
    assert summary["horizon_frames"] is None and summary["positions"] == "bounded"
    events = [line for line in lines if line["event"] == "watch"]
    assert events and [{k: v for k, v in line.items() if k != "event"} for line in events] == summary["watches"]
    assert all(event["frame"] % 2 == 0 and event["question"] == "What is shown?" for event in events)
    assert b"clip.mp4:" in shown and b"/5 [" in shown  # a bar over the video's five frames, named after it


def test_demo_runs_offline_on_its_built_in_model(files):
    env = {"STATEKV_CACHE": str(files["root"] / "cache")}
    result = _run("demo", "--videos", "1", "--json", env=env)  # tests/test_docs.py runs it as the README shows
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    rows = {row["method"]: row for row in document["rows"]}
    assert document["builtin"] and set(rows) == {"full", "recency", "statekv"} and len(document["videos"]) == 1
    questions = document["questions"]
    assert len(questions) == 6 and all(row["questions"] == 6 for row in rows.values())
    for row in rows.values():  # every answer is checked against its question's truth
        truth = {q["qid"]: q["answer"] for q in questions}
        from statekv.eval.parsing import ranked_letter

        assert row["correct"] == sum(ranked_letter(a["answer"]) == truth[a["qid"]] for a in row["answers"])
        assert sum(family["correct"] for family in row["families"].values()) == row["correct"]
        low, high = row["interval"]
        assert low <= row["correct"] / 6 <= high
    per_frame = 4  # Frame{i}: <img> visual token </img>
    stream = {run["method"]: run for run in document["stream"]}
    assert all(len(run["tokens"]) == 96 for run in stream.values())
    assert stream["full"]["carried"] == stream["full"]["tokens"]  # every earlier token
    assert max(stream["recency"]["carried"]) == 16 * per_frame and max(stream["statekv"]["carried"]) == 64
    assert stream["statekv"]["carried"][-1] == 64 and stream["statekv"]["token_bytes"] > 0
    assert Path(document["plot"]).stat().st_size > 10_000


def _cap_after(files, frames: int) -> int:
    """A max_cache_bytes that holds the video's first ``frames`` frames (at 1 fps) and half of the next."""
    from statekv.video import open_video

    stream = statekv.VideoQA.from_pretrained(files["model"], max_cache_bytes="1G").stream(horizon_frames=5)
    held = [stream.prefill.stats.held_bytes]
    for frame in open_video(files["video"]).sample_at_rate(1.0):
        stream.push(frame)
        held.append(stream.prefill.stats.held_bytes)
    stream.close()
    return (held[frames] + held[frames + 1]) // 2


def test_answer_at_the_cache_cap_answers_from_the_frames_that_fit(files, capsys):
    cap = _cap_after(files, 2)
    capsys.readouterr()
    argv = ["answer", str(files["video"]), "Why?", "What is shown?", "--model", str(files["model"]),
            "--max-new-tokens", "3", "--max-cache-bytes", str(cap)]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    warning = (f"statekv answer: warning: {files['video']}: the detailed cache is full at frame 3 of 5 "
               f"(max_cache_bytes={format_bytes(cap)}): encoding stopped; the first 2 frames are "
               "encoded and can be asked about; answering from what was encoded")
    assert captured.err.strip() == warning
    document = json.loads(captured.out)
    assert document["stats"]["frames"] == 2
    assert document["stopped"] == warning.split("warning: ", 1)[1].removesuffix("; answering from what was encoded")
    with pytest.raises(CacheLimitError) as error:  # the same as the Python API's partial encoding
        statekv.VideoQA.from_pretrained(files["model"], max_cache_bytes=cap).encode(files["video"])
    assert [a["answer"] for a in document["answers"]] == [error.value.encoded.ask(q, max_new_tokens=3)
                                                          for q in ("Why?", "What is shown?")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == warning and "2 frames (stopped: see the warning)" in captured.out
    assert main([*argv[:-1], str(_cap_after(files, 0) - 1)]) == 2  # no frame fits: nothing to answer from
    assert "no frame fit under it" in _one_line_error(capsys.readouterr().err)


def test_stream_at_the_cache_cap_answers_every_question_left(files, capsys, tmp_path):
    cap = _cap_after(files, 2)
    capsys.readouterr()
    saved = tmp_path / "capped.safetensors"
    assert main(["stream", str(files["video"]), "--model", str(files["model"]), "--ask", "0:First?",
                 "--ask", "2.5:Later?", "--ask", "4.5:At the end?", "--max-new-tokens", "2",
                 "--max-cache-bytes", str(cap), "--save", str(saved), "--json"]) == 0
    captured = capsys.readouterr()
    warning = (f"statekv stream: warning: {files['video']}: the detailed cache is full at frame 3 "
               f"(max_cache_bytes={format_bytes(cap)}): the stream stopped at 2.00 s; the 2 questions "
               "left are answered from the 2 frames before it")
    assert captured.err.strip() == warning
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["event"] for line in lines] == ["answer"] * 3 + ["summary"]
    answers = lines[-1]["answers"]
    assert [(a["time"], a["frames"], a["after_cap"]) for a in answers] == [(0.0, 1, False), (2.5, 2, True),
                                                                            (4.5, 2, True)]
    assert lines[-1]["stopped"] == warning.split("warning: ", 1)[1] and lines[-1]["error"] is None
    qa = statekv.VideoQA.from_pretrained(files["model"], max_cache_bytes=cap)
    assert statekv.Stream.load(saved, qa).frames == 2


# ---------------------------------------------------------------------------------------------------
# Bad input: exit code 2 and one line on stderr
# ---------------------------------------------------------------------------------------------------


def test_bad_video_in_a_fresh_process(files):
    result = _run("answer", files["root"] / "missing.mp4", "Why?", "--model", files["model"])
    assert result.returncode == 2 and "no such file" in _one_line_error(result.stderr)


@pytest.mark.parametrize("name", BAD_VIDEOS)
def test_bad_videos(files, tmp_path, capsys, name):
    make, phrase = BAD_VIDEOS[name]
    for command, extra in (("answer", ["Why?"]), ("stream", ["--ask", "1:Why?"])):
        folder = tmp_path / command
        folder.mkdir()
        assert main([command, str(make(folder)), *extra, "--model", str(files["model"])]) == 2
        assert phrase in _one_line_error(capsys.readouterr().err)


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main([*map(str, argv)])
    assert info.value.code == 2
    return _one_line_error(capsys.readouterr().err)


def test_ask_takes_seconds_or_a_clock_time():
    from statekv.commands.stream import timed_question

    assert timed_question("12.5:What is on the table?") == (12.5, "What is on the table?")
    assert timed_question("1:30:Who came in?") == (90.0, "Who came in?")
    assert timed_question("1:02:03.5:Is it dark?") == (3723.5, "Is it dark?")
    assert timed_question("30:Is the ratio 2:1?") == (30.0, "Is the ratio 2:1?")  # a colon in the question
    assert timed_question("5:10 people or more?") == (5.0, "10 people or more?")
    for bad in ("1:30:", "soon:Why?", "9" * 400 + ":00:00:Why?"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\[H:\]M:SS:QUESTION"):
            timed_question(bad)
    for bad, clock in (("1:75:Why?", "1:75"), ("1:60:00:Why?", "1:60:00")):  # asked at 135 s, with a warning
        with pytest.raises(argparse.ArgumentTypeError, match=f"{clock} is not a clock time"):
            timed_question(bad)


def test_bad_options(files, capsys):
    base = ["answer", files["video"], "Why?", "--model", files["model"]]
    assert "positive integer" in _usage_error(capsys, [*base, "--budget", "0"])
    assert "positive integer" in _usage_error(capsys, [*base, "--frames", "-2"])
    assert "positive number" in _usage_error(capsys, [*base, "--max-fps", "0"])
    assert "argument --max-fps: expected frames per second above 0 and at most 4e+07, got '1e9'" in _usage_error(
        capsys, ["stream", files["video"], "--model", files["model"], "--max-fps", "1e9"])  # before the model loads
    assert "invalid choice" in _usage_error(capsys, [*base, "--method", "sliding"])
    assert "SECONDS:QUESTION" in _usage_error(capsys, ["stream", files["video"], "--model", files["model"],
                                                        "--ask", "soon:Why?"])
    assert "(a value that starts with '-' is given as --ask=VALUE)" in _usage_error(
        capsys, ["stream", files["video"], "--model", files["model"], "--ask", "-5:Why?"])
    assert "SECONDS:QUESTION" in _usage_error(capsys, ["stream", files["video"], "--model", files["model"],
                                                        "--ask=-5:Why?"])
    assert "required" in _usage_error(capsys, ["answer", files["video"], "Why?"])
    assert "positive integer" in _usage_error(capsys, [*base, "--vision-batch", "0"])
    assert "positive integer" in _usage_error(capsys, [*base, "--vision-batch", "1.5"])


def test_cache_option_errors_name_the_flags_on_the_command_line_and_the_arguments_in_python(files, capsys, tmp_path):
    base = ["answer", str(files["video"]), "Why?", "--model", str(files["model"])]
    cases = [(["--offload", "disk"], "--offload disk needs --offload-dir (the folder for each stream's files)",
              dict(offload="disk"), "offload='disk' needs offload_dir (the folder for each stream's files)"),
             (["--cache-limit", "evict-oldest"], "--cache-limit evict-oldest needs --max-cache-bytes (the cap it acts at)",
              dict(cache_limit="evict-oldest"), "cache_limit=evict-oldest needs max_cache_bytes (the cap it acts at)"),
             (["--offload-dir", str(tmp_path)], f"--offload-dir {tmp_path} is only used with --offload disk",
              dict(offload_dir=str(tmp_path)), f"offload_dir='{tmp_path}' is only used with offload='disk'"),
             (["--max-cache-bytes", "1M", "--cache-limit", "evict-oldest"],
              "--cache-limit evict-oldest needs the detailed cache offloaded (--offload or --offload disk)", None, None)]
    for flags, on_command_line, arguments, in_python in cases:
        assert main([*base, *flags]) == 2
        message = _one_line_error(capsys.readouterr().err)
        assert message.startswith(f"statekv answer: error: {on_command_line}"), message
        if arguments is not None:
            with pytest.raises(statekv.ConfigurationError) as refused:
                statekv.ModelOptions(**arguments)
            assert str(refused.value) == in_python
    assert main([*base, "--max-cache-bytes", "1M", "--cache-limit", "evict-oldest", "--method", "rekv",
                 "--max-new-tokens", "1"]) == 0  # rekv offloads its detailed cache: it can evict
    capsys.readouterr()


def test_an_unknown_flag_names_its_subcommand_its_help_and_the_closest_flag(files, capsys):
    base = ["answer", str(files["video"]), "Why?", "--model", str(files["model"])]
    assert _usage_error(capsys, [*base, "--bugdet", "64"]) == (
        "statekv answer: error: unrecognized arguments: --bugdet 64; did you mean --budget? (see statekv answer --help)")
    assert _usage_error(capsys, [*base, "--zzzz"]) == (
        "statekv answer: error: unrecognized arguments: --zzzz (see statekv answer --help)")
    assert _usage_error(capsys, ["stream", str(files["video"]), "What now?", "--model", "builtin"]) == (
        "statekv stream: error: unrecognized arguments: What now?; give questions as --ask SECONDS:QUESTION (or "
        "--watch FRAMES:QUESTION) (see statekv stream --help)")  # before: no word of --ask
    assert _usage_error(capsys, ["eval", "synthetic", "--model", "builtin", "--data-root", "d", "--out", "o",
                                 "--bugdet=3"]).startswith("statekv eval synthetic: error: unrecognized arguments: "
                                                           "--bugdet=3; did you mean --budget? (see statekv eval "
                                                           "synthetic --help)")


def test_a_question_timed_past_the_end_of_the_video_is_warned_of_in_one_line(files, capsys):
    base = ["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "1"]
    assert main([*base, "--ask", "500:Why?", "--ask", "2:Why?"]) == 0  # the video is 5 s
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [
        "statekv stream: warning: --ask at 500 s is past the end of the video (5 s); asked after its last frame"]
    assert captured.out.count("Q: Why?") == 2
    assert main([*base, "--ask", "4:Why?"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_question_after_the_frames_of_a_file_cut_short_is_warned_of_in_one_line(files, tmp_path, capsys):
    """Before: a file whose frames end before the duration its header gives (cut short, or still being written)
    answered a question timed after its last frame from what it held, without a word."""
    whole = write_test_video(tmp_path / "whole.mkv", frames=120, fps=4)  # 30 s
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # its frames end at 14 s
    assert main(["stream", str(cut), "--model", str(files["model"]), "--max-new-tokens", "1", "--ask", "25:Why?",
                 "--ask", "5:Why?"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [
        "statekv stream: warning: the video's frames end at 14 s, before the 30 s its header gives (a file cut short, "
        "or still being written): --ask at 25 s asked after its last frame"]
    assert captured.out.count("Q: Why?") == 2


def test_answer_refuses_an_answer_that_cannot_fit_before_encoding_and_warns_of_a_file_cut_short(files, tmp_path,
                                                                                                 capsys, monkeypatch):
    """Before: ``statekv answer`` encoded the whole video, then refused a --max-new-tokens the room after it could
    never hold; and it answered from a file cut short without a word. Refused up front is only what the room the
    video leaves at most cannot hold (more than the reserve where the horizon's bound on the video is loose): what
    fits in the room it leaves is answered."""
    import statekv

    encoded = []
    encode = statekv.VideoQA.encode
    monkeypatch.setattr(statekv.VideoQA, "encode", lambda *args, **kwargs: encoded.append(1) or encode(*args, **kwargs))
    base = ["answer", str(files["video"]), "Why?", "--model", str(files["model"]), "--reserve-tokens", "40"]
    assert main([*base, "--max-new-tokens", "1000"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.fullmatch(r"statekv answer: error: the question \((\d+) tokens\) and answer \(1000\) do not fit in the "
                         r"(\d+) tokens at most left after the video: raise --reserve-tokens or lower --max-new-tokens",
                         error)
    assert found and not encoded, error
    prompt, most = int(found.group(1)), int(found.group(2))
    assert most >= 40
    assert main([*base, "--max-new-tokens", str(most - prompt + 1)]) == 2 and not encoded  # a token too many
    capsys.readouterr()
    room = statekv.VideoQA.from_pretrained(files["model"], reserve_tokens=40).encode(str(files["video"]))
    left = room.prefill.horizon - room.prefill.seen_tokens  # what the engine's own check allows
    room.close()
    encoded.clear()
    assert left >= 40 and main([*base, "--max-new-tokens", str(left - prompt)]) == 0 and encoded  # the largest
    encoded.clear()
    assert main([*base, "--max-new-tokens", str(left - prompt + 1)]) == 2 and encoded  # checked once encoded
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"do not fit in the {left} tokens kept after the video: raise --reserve-tokens or lower --max-new-tokens")
    assert "warning" not in capsys.readouterr().err
    encoded.clear()
    assert main([*base, "--max-new-tokens", "100000", "--positions", "bounded"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "and answer (100000) do not fit in the model's 128 positions: lower --max-new-tokens")
    assert not encoded
    whole = write_test_video(tmp_path / "whole.mkv", frames=120, fps=4)  # 30 s
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main(["answer", str(cut), "Why?", "--model", str(files["model"]), "--max-new-tokens", "1"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [
        "statekv answer: warning: the video's frames end at 14.5 s, before the 30 s its header gives (a file cut "
        "short, or still being written); answering from them"]
    assert "Q: Why?" in captured.out


def test_answer_names_where_a_file_cut_short_ends_by_what_it_compared(files, monkeypatch, capsys):
    """Before: the warning named where the header's frame count put the end (549 s for a file of repeated
    timestamps), while the check compared where the content ends: "frames end at 549 s, before the 301 s"."""
    import statekv.video as video_module
    from statekv.video.sources import cut_short

    opened = video_module.open_video(files["video"])

    class Header:  # the file as its header tells it; everything else as it is
        duration, content_end, num_frames, fps = 301.0, 200.0, 549, 1.0

        def __getattr__(self, name):
            return getattr(opened, name)

    header = Header()
    assert cut_short(header, 549.0, 1.0) == 200.0 and cut_short(header, 549.0, 1.0) < header.duration
    monkeypatch.setattr(video_module, "open_video", lambda source: header)
    assert main(["answer", str(files["video"]), "Why?", "--model", str(files["model"]), "--max-new-tokens", "1"]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "header gives" in line]
    assert warning.startswith("statekv answer: warning: the video's frames end at 200 s, before the 301 s its header")


def test_answer_does_not_call_a_file_whose_audio_outlasts_its_video_cut_short(files, tmp_path, capsys):
    """Before: the header's duration of a Matroska file counts its audio too, and a complete file whose audio
    runs past its video was warned of as cut short."""
    import av
    import numpy as np

    from statekv.video import open_video

    path = tmp_path / "audio_longer.mkv"
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=8)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        for index in range(40):  # 5 s of video
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), index * 5, np.uint8), format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode())
        for start in range(0, 16000 * 12, 1024):  # 12 s of audio
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 16000, start
            container.mux(audio.encode(samples))
        container.mux(audio.encode())
    source = open_video(str(path))
    assert source.duration > 11 and source.num_frames / source.fps == 5 and source.content_end > 11
    assert main(["answer", str(path), "Why?", "--model", str(files["model"]), "--max-new-tokens", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_hub_id_without_the_hub_says_what_to_use_instead(files, capsys, monkeypatch):
    """Before: with no network a hub id ended in the hub's own words alone, after its retries."""
    from transformers import PretrainedConfig

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.\nCheck your internet connection.")

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", unreachable)
    assert main(["answer", str(files["video"]), "Why?", "--model", "OpenGVLab/InternVL3-1B-hf"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("statekv answer: error: cannot read the config of "
                                                       "OpenGVLab/InternVL3-1B-hf: We couldn't connect"), error
    assert error.rstrip().endswith("without the hub, give a checkpoint folder or --model builtin (HF_HUB_OFFLINE=1 "
                                   "reads the hub's local cache at once, without retrying)"), error


def test_a_stop_while_the_model_loads_says_nothing_was_saved(files, tmp_path, capsys, monkeypatch):
    """Before: `statekv stream --save FILE` stopped while its model loaded said "stopped by SIGTERM" and no more, so
    whether FILE held anything was left to guess (once streaming, the stop says what it saved)."""
    def stopped_while_loading(options, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(statekv.VideoQA, "from_options", stopped_while_loading)
    saved = tmp_path / "kept.safetensors"
    assert main(["stream", str(files["video"]), "--model", str(files["model"]), "--save", str(saved)]) == 130
    assert capsys.readouterr().err.strip() == (f"statekv stream: interrupted; nothing was streamed yet, so nothing was "
                                               f"saved to {saved}")
    assert not saved.exists()


def test_a_stream_that_never_began_still_sums_up_in_json(files, tmp_path, capsys, monkeypatch):
    """Before: `--json` printed no summary when the stream stopped before it began (a cap it cannot start under,
    a stop while the model loads), though the summary is promised also when the stream stops early."""
    argv = ["stream", str(files["video"]), "--model", "builtin", "--json"]
    assert main([*argv, "--max-cache-bytes", "10K"]) == 2  # under it the stream cannot even begin
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["event"] == "summary" and summary["stats"] is None and summary["answers"] == []
    assert {"horizon_frames", "positions", "stopped", "saved", "save_error", "folder", "watches"} <= set(summary)
    assert summary["error"] in captured.err and "max_cache_bytes" in summary["error"], (summary, captured.err)

    def stopped_while_loading(options, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(statekv.VideoQA, "from_options", stopped_while_loading)
    assert main(argv) == 130
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"] == "KeyboardInterrupt"


def test_the_engines_own_warnings_are_said_in_the_commands_voice(files):
    """Before: a warning the engine logged (a handover given up under a small cap) came out bare, the only line of
    stderr not prefixed with the command's name."""
    result = _run("stream", files["video"], "--model", "builtin", "--max-cache-bytes", "10K")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert lines[0].startswith("statekv stream: warning: ") and "without its successor engine" in lines[0], lines
    assert lines[1].startswith("statekv stream: error: "), lines


def test_a_run_resumed_without_save_says_what_it_streamed_was_not_kept(files, tmp_path, capsys, monkeypatch):
    """Before: a run resumed from a file without --save and stopped said "interrupted" and no more: what it streamed
    since was lost unsaid."""
    saved, pushes, push = tmp_path / "kept.safetensors", [], statekv.Stream.push

    def pushing(stream, *args, **kwargs):
        pushes.append(1)
        if len(pushes) in (3, 5):
            raise KeyboardInterrupt
        return push(stream, *args, **kwargs)

    monkeypatch.setattr(statekv.Stream, "push", pushing)
    argv = ["stream", str(files["video"]), "--model", str(files["model"])]
    assert main([*argv, "--save", str(saved)]) == 130
    capsys.readouterr()
    assert main([*argv, "--resume", str(saved)]) == 130
    assert capsys.readouterr().err.strip() == (
        f"statekv stream: interrupted; the frames streamed since --resume {saved} were not saved (it holds the stream "
        "as it was; give --save to keep what a run streams)")


def test_a_second_ctrl_c_as_the_stream_is_saved_still_says_where_and_sums_up(files, tmp_path, capsys, monkeypatch):
    """Before: a second Ctrl-C held back during the save was raised as it ended, before the command said where the
    stream was saved and printed its summary: "interrupted", and nothing more, for a stream that was saved."""
    import signal

    import statekv.commands.stream as stream_command
    from statekv.stopping import request_stop

    saved, pushes, save = tmp_path / "kept.safetensors", [], stream_command.save_or_rescue
    push = statekv.Stream.push

    def pushing(stream, *args, **kwargs):
        pushes.append(1)
        if len(pushes) == 3:
            raise KeyboardInterrupt  # the first Ctrl-C
        return push(stream, *args, **kwargs)

    def saving(stream, target):
        kept = save(stream, target)
        request_stop(signal.SIGINT, None)  # the second, as the save ends
        return kept

    monkeypatch.setattr(statekv.Stream, "push", pushing)
    monkeypatch.setattr(stream_command, "save_or_rescue", saving)
    code = main(["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "1", "--json",
                 "--save", str(saved)])
    captured = capsys.readouterr()
    assert code == 130 and captured.err.strip() == (
        f"statekv stream: interrupted; the 2 frames streamed before it were saved to {saved}")
    assert json.loads(captured.out.strip().splitlines()[-1])["saved"] == str(saved)


def test_a_question_that_fits_the_stream_at_no_point_is_refused_before_the_first_frame(files, capsys):
    """Before: it was refused when asked, hours into the stream, and the run ended there."""
    code = main(["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "100000",
                 "--ask", "2:Why?"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.strip().startswith("statekv stream: error: --ask at 2 s: the question") and \
        len(captured.err.strip().splitlines()) == 1, captured.err


def test_a_question_the_stream_will_not_reach_or_has_passed_is_warned_of_in_one_line(files, capsys, tmp_path):
    """Before: a question after where --max-frames stops the stream, or before where a resumed one goes on, was
    answered from fewer frames than its time, or not asked, without a word."""
    base = ["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "1"]
    saved = tmp_path / "first.safetensors"
    assert main([*base, "--max-frames", "2", "--ask", "3:Why?", "--ask", "500:Why?"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        "statekv stream: warning: --ask at 500 s is past the end of the video (5 s); asked after its last frame",
        "statekv stream: warning: --ask at 3 s is past where the stream's horizon of 2 frames (--max-frames) stops it "
        "(its last frame at 1 s); asked after it"]
    assert main([*base, "--save", str(saved)]) == 0
    capsys.readouterr()
    assert main([*base, "--resume", str(saved), "--ask", "0.5:Why?", "--ask", "4.5:Why?"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "warning" in line] == [
        "statekv stream: warning: --ask at 0.5 s is before where the resumed stream goes on (4 s): not asked (a run "
        "asks what it streams)"]
    assert captured.out.count("Q: Why?") == 1


def test_stream_replays_a_video_into_simplestream_too(files, capsys):
    """Before: its summary read a horizon, positions and a folder that `RecentFrames` does not have."""
    assert main(["stream", str(files["video"]), "--model", str(files["model"]), "--method", "simplestream",
                 "--max-new-tokens", "1", "--ask", "2:Why?", "--json"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["event"] for line in printed] == ["answer", "summary"]
    assert printed[-1]["method"] == "simplestream" and printed[-1]["folder"] is None and printed[-1]["error"] is None


def test_a_question_of_several_lines_is_printed_with_its_options_under_it(files, capsys):
    base = ["stream", str(files["video"]), "--model", str(files["model"]), "--max-new-tokens", "1"]
    assert main([*base, "--max-fps", "4", "--ask", "4:Which?\nA. red\nB. blue\nAnswer with the letter."]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(index for index, line in enumerate(lines) if line.endswith("Q: Which?"))
    column = lines[first].index("Which?")  # the options line up under the question, after "17 frames"
    assert lines[first].startswith("[   4.00 s, 17 frames] Q: ")
    assert lines[first + 1:first + 4] == [" " * column + text for text in ("A. red", "B. blue",
                                                                          "Answer with the letter.")]
    assert lines[first + 4].startswith(" " * 21 + "A: ")


def test_answer_stats_print_each_stage(files, capsys):
    assert main(["answer", str(files["video"]), "Why?", "--model", str(files["model"]), "--max-new-tokens", "2",
                 "--vision-batch", "2", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "5 frames" in out and "frames/s" in out and "vision in batches of 2 frames" in out
    assert all(f"{stage} " in out for stage in ("decode", "vision", "language"))


def test_answer_refuses_an_answer_longer_than_its_room_naming_the_flags(files, capsys):
    base = ["answer", str(files["video"]), "Why is the sky shown here?", "--model", str(files["model"])]
    for answer, reserve in (("99999999999", "1024"), ("38", "40")):
        assert main([*base, "--max-new-tokens", answer, "--reserve-tokens", reserve]) == 2
        message = _one_line_error(capsys.readouterr().err)
        assert re.search(rf"answer \({answer}\) do not fit in the \d+ tokens at most left after the video", message)
        assert "raise --reserve-tokens or lower --max-new-tokens" in message and "VideoQA" not in message


def test_triton_attention_off_cuda_is_refused_before_the_first_step(files, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["answer", str(files["video"]), "Why?", "--model", str(files["model"]), "--attention", "triton"]) == 2
    assert "attention 'triton' runs on CUDA, and the model is on cpu" in _one_line_error(capsys.readouterr().err)


def test_stream_saves_what_it_streamed_before_a_broken_frame(files, tmp_path, capsys):
    broken = bad_videos.cut_after_header(tmp_path, frames=40, fps=4, keep=0.6)
    saved = tmp_path / "kept.safetensors"
    assert main(["stream", str(broken), "--ask", "9:Why?", "--model", str(files["model"]), "--max-fps", "4",
                 "--max-new-tokens", "1", "--save", str(saved)]) == 2
    message = _one_line_error(capsys.readouterr().err)
    assert "cannot be decoded" in message and "saved to" in message
    qa = statekv.VideoQA.from_pretrained(files["model"])
    assert statekv.Stream.load(saved, qa).frames > 0


def test_bad_questions_and_models(files, tmp_path, capsys):
    assert main(["answer", str(files["video"]), "  ", "--model", str(files["model"])]) == 2
    assert "question is empty" in _one_line_error(capsys.readouterr().err)

    plain = tmp_path / "plain"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(plain)
    capsys.readouterr()  # drop the progress bars of writing the checkpoint
    assert main(["answer", str(files["video"]), "Why?", "--model", str(plain)]) == 2
    message = _one_line_error(capsys.readouterr().err)
    assert "not supported" in message and "internvl" in message and "qwen3_vl" in message

    assert main(["answer", str(files["video"]), "Why?", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no such checkpoint" in _one_line_error(capsys.readouterr().err)

    static_rope = {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    short = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=static_rope)
    capsys.readouterr()
    # a video past the model's 64 positions streams at bounded positions; the question itself cannot fit
    assert main(["answer", str(files["video"]), "Why?", "--model", str(short), "--reserve-tokens", "16"]) == 2
    assert "do not fit in the model's 64 positions" in _one_line_error(capsys.readouterr().err)
    assert main(["answer", str(files["video"]), "Why?", "--model", str(short), "--reserve-tokens", "16",
                 "--positions", "stream"]) == 2
    assert "beyond the model's RoPE" in _one_line_error(capsys.readouterr().err)


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in ("answer", "stream", "demo", "flops"))
    with pytest.raises(SystemExit):
        main(["stream", "--help"])
    assert "SECONDS:QUESTION" in capsys.readouterr().out


def test_a_torchvision_built_for_another_torch_is_named(tmp_path):
    """PyPI's torchvision beside a CPU torch fails to load its operators; transformers would then report an
    unrelated import error. statekv names torchvision and the fix."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", "import statekv; statekv.VideoQA"], capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torchvision is installed but does not load with torch ")
    assert "operator torchvision::nms does not exist" in last and "pip uninstall torchvision" in last


def test_the_command_loads_no_torch_before_it_can_take_a_ctrl_c():
    """The console script imports `statekv.cli` before `main` runs; that import loads neither torch nor
    transformers (the package's names load on first use), so a Ctrl-C finds `main`'s handler in place. Nor does
    building the parser and showing ``statekv --help`` (before: 3 to 6 s, every method's help made up front)."""
    program = ("import sys, statekv, statekv.cli\n"
               "assert statekv.__version__\n"
               "assert 'train-builtin' in statekv.cli.build_parser().format_help()\n"
               "print(sorted(name for name in ('torch', 'torchvision', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # torchvision, where installed, is checked as transformers is imported


def test_a_ctrl_c_that_falls_in_a_destructor_while_the_command_starts_is_one_line_and_runs_nothing(monkeypatch,
                                                                                                   capsys):
    """A Ctrl-C whose handler ran inside an object's ``__del__`` (a module being imported drops one) was swallowed
    there: Python printed it as an exception ignored, and the command went on and ran. Now it is the same one line,
    and nothing runs."""
    import gc
    import signal

    import statekv.cli as cli

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between these, inside the destructor
                pass

    built = cli.build_parser

    def building():
        Dropped()
        gc.collect()
        return built()

    monkeypatch.setattr(cli, "build_parser", building)
    ran = []
    monkeypatch.setattr("statekv.console.run_command", lambda *args: ran.append(args) or 0)
    assert cli.main(["flops", "--model", "internvl3-1b", "--frames", "4"]) == 130
    assert capsys.readouterr().err == "statekv: interrupted while starting; nothing was done\n" and ran == []


def test_a_ctrl_c_while_the_command_starts_is_one_line():
    """torch and transformers load for seconds while the parser is built; a Ctrl-C then (a mistyped command) ends
    with one line and status 130, not a traceback (nor transformers' report of the import it cut short). The
    moments are fractions of the whole start, measured first, so a faster or a loaded machine is hit inside it; a
    start that ends first (the load eased) is measured again and hit earlier in it."""
    import signal
    import time

    command = [sys.executable, "-m", "statekv.cli", "eval", "synthetic", "--help"]
    began = time.monotonic()
    subprocess.run(command, capture_output=True, timeout=300, check=True)
    whole = time.monotonic() - began
    for share in (0.3, 0.6):
        for attempt in range(8):
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(share * 0.8 ** attempt * whole)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                stdout, stderr = process.communicate(timeout=300)
                if (process.returncode, stderr) != (0, "") and "usage:" not in stdout:
                    break  # stopped by the signal while it started (or wrongly: checked below)
            else:
                process.communicate()
            # done already, or done as the signal came (its help printed, the process ending): the load that
            # slowed the first start eased; measured again
            began = time.monotonic()
            subprocess.run(command, capture_output=True, timeout=300, check=True)
            whole = time.monotonic() - began
        else:
            pytest.fail(f"the command finished before {share} of its start, or earlier, eight times")
        assert process.returncode == 130, (share, whole, stderr)
        assert stderr == "statekv: interrupted while starting; nothing was done\n"


def test_the_packages_names_load_on_first_use():
    """Every name in ``statekv.__all__`` is there, as its home module defines it; others are refused as Python
    refuses them; the built-in methods and retrieval rules are found from the settings alone."""
    from statekv.api.stream import Stream
    from statekv.core import StateKV

    assert statekv.Stream is Stream and statekv.StateKV is StateKV
    assert all(getattr(statekv, name) is not None for name in statekv.__all__)
    assert set(statekv.__all__) <= set(dir(statekv))
    with pytest.raises(AttributeError, match="has no attribute 'Steam'"):
        statekv.Steam
    program = ("from statekv.settings.methods import MethodSpec, method, register_method, retrieval_rule\n"
               "mine = register_method(MethodSpec('statekv', 'mine', 'budget', lambda s, f: None, None, 'Mine'))\n"
               "print(method('statekv') is mine, method('full').name, retrieval_rule('rekv').name)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "full", "rekv"]  # a built-in replaced stays replaced


def test_a_reader_that_leaves_early_stops_the_command_quietly():
    """`statekv ... | head`: the closed pipe ends the command with 128 + SIGPIPE and no traceback."""
    import signal

    program = ("import sys\nfrom statekv.console import run_command\n"
               "sys.exit(run_command('flops', lambda: [print('x' * 1000) for _ in range(10_000)] and 0))")
    reader = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    reader.stdout.read(10)
    reader.stdout.close()  # the reader leaves
    assert reader.wait(timeout=120) == 128 + signal.SIGPIPE
    assert reader.stderr.read() == b""


def test_answer_answers_from_the_frames_before_one_that_cannot_be_read(files, capsys, tmp_path):
    """Before: a frames folder with an unreadable image in its middle was an error naming the Python API's
    ``.encoded``; the frames before it, encoded already, were thrown away."""
    from PIL import Image

    folder = tmp_path / "frames"
    folder.mkdir()
    for index, frame in enumerate(random_frames(4)):
        Image.fromarray(frame).save(folder / f"{index:03d}.png")
    (folder / "002.png").write_bytes(b"not a png")
    argv = ["answer", str(folder), "Why?", "--model", str(files["model"]), "--max-new-tokens", "2"]
    assert main([*argv, "--json"]) == 2  # a broken video is a failure, as `statekv stream` says, its answers given
    captured = capsys.readouterr()
    [error] = [line for line in captured.err.splitlines() if line.strip()]
    assert error.startswith("statekv answer: error: ") and "frame 2" in error, error
    assert error.endswith("; the answers are from the 2 frames before it"), error
    assert ".encoded" not in error
    document = json.loads(captured.out)
    assert document["stats"]["frames"] == 2 and document["stopped"] in error and document["answers"][0]["answer"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "(stopped: see the error line)" in captured.out and "A: " in captured.out
    assert captured.err.strip() == error
    (folder / "000.png").write_bytes(b"not a png")  # nothing before it: nothing to answer from
    assert main(["answer", str(folder), "Why?", "--model", str(files["model"])]) == 2


def test_the_built_in_model_asked_a_free_form_question_says_what_it_answers(files, capsys):
    """Before: it answered any question with words it repeated, and said nothing; ``statekv demo --video`` asked it
    such a question by default."""
    video = str(files["video"])
    warning = ("warning: the built-in model answers multiple-choice questions only (a question, its options on lines "
               "'A. ...' to 'D. ...', then 'Answer with the letter.'); it was trained on no other")
    choice = "Which colour was shown first?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."
    assert main(["answer", video, "What happens?", "--model", "builtin", "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().err.strip() == f"statekv answer: {warning}"
    assert main(["stream", video, "--model", "builtin", "--max-new-tokens", "1", "--ask", f"1:{choice}",
                 "--watch", "2:What now?"]) == 0
    assert f"statekv stream: {warning}" in capsys.readouterr().err
    assert main(["answer", video, choice, "--model", "builtin", "--max-new-tokens", "1"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["answer", video, "What happens?", "--model", str(files["model"]), "--max-new-tokens", "1"]) == 0
    assert "warning" not in capsys.readouterr().err  # another model is asked what it is asked
    assert main(["demo", "--video", video, "--no-plot", "--max-new-tokens", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["question"] == choice and "warning" not in captured.err


def test_json_output_names_the_sizes_the_method_reads(files, capsys):
    """Before: every method's document said budget 64 and frames_window 16, sizes full attention never reads, and
    simplestream's window (4) not at all."""
    base = ["answer", str(files["video"]), "Why?", "--model", str(files["model"]), "--max-new-tokens", "1", "--json"]
    expected = {"full": (None, None, {}), "statekv": (12, None, {"budget": 12}),
                "recency": (None, 3, {"frames": 3}), "simplestream": (None, None, {"window": 4})}
    for name, (budget, frames, sizes) in expected.items():
        given = {"statekv": ["--budget", "12"], "recency": ["--frames", "3"]}.get(name, [])
        assert main([*base, "--method", name, *given]) == 0
        document = json.loads(capsys.readouterr().out)
        assert (document["budget"], document["frames_window"], document["sizes"]) == (budget, frames, sizes), name
    assert main(["stream", str(files["video"]), "--model", str(files["model"]), "--method", "full", "--json",
                 "--max-new-tokens", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["budget"], summary["frames_window"], summary["sizes"]) == (None, None, {})


def test_python_dash_m_statekv_is_the_command():
    result = subprocess.run([sys.executable, "-m", "statekv", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"statekv {statekv.__version__}", result.stderr


def test_version_and_a_missing_data_folder(capsys, tmp_path):
    """Before: ``statekv --version`` asked for a command; a --data-root that does not exist was named as a missing
    annotation file only."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"statekv {statekv.__version__}"
    assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(tmp_path / "nosuch"), "--out",
                 str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'nosuch'} is no folder: a synthetic set is" in _one_line_error(capsys.readouterr().err)
    (tmp_path / "a-file").write_text("not a folder")
    assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(tmp_path / "a-file"), "--out",
                 str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'a-file'} is a file, not a folder: a synthetic" in _one_line_error(capsys.readouterr().err)
    (tmp_path / "set").mkdir()
    assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(tmp_path / "set"), "--out",
                 f"{tmp_path}/set/../set"]) == 2
    assert _one_line_error(capsys.readouterr().err).endswith(
        f"out (the run folder) {tmp_path}/set/../set is the data root: give a folder of its own")
    assert not list((tmp_path / "set").iterdir())  # nothing written into the set


def test_demo_on_a_video_with_a_frame_that_cannot_be_read_says_so_in_the_commands_voice(tmp_path, capsys):
    """Before: the one-line error ended with the Python API's way on ("the error's .encoded answers from them"),
    which means nothing on the command line."""
    from PIL import Image

    frames = tmp_path / "frames"
    frames.mkdir()
    for index in range(6):
        Image.new("RGB", (64, 48), (40 * index, 90, 200)).save(frames / f"f{index:02d}.png")
    (frames / "f03.png").write_bytes(b"not a picture")
    assert main(["demo", "--video", str(frames), "--no-plot", "--max-new-tokens", "1", "--json"]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("statekv demo: error: ") and "f03.png" in said and ".encoded" not in said, said
    assert said.endswith("give one that reads to its end, or ask from the frames before it with statekv answer")


def test_a_ctrl_c_pressed_again_as_a_stopped_command_ends_cuts_no_teardown(tmp_path):
    """Before: the stop's line was followed by "Exception ignored in atexit callback ... KeyboardInterrupt" and the
    process ended by SIGINT, not with its status."""
    child = ("import atexit, os, signal, sys, threading, time\n"
             "from statekv.cli import main\n"
             "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.3)))\n"
             f"def stop():  # once the make has begun writing\n"
             f"    while not os.path.isdir({str(tmp_path / 'set')!r}):\n"
             f"        time.sleep(0.01)\n"
             f"    os.kill(os.getpid(), signal.SIGINT)\n"
             "threading.Thread(target=stop, daemon=True).start()\n"
             f"sys.argv = ['statekv', 'synthetic', 'make', '--out', {str(tmp_path / 'set')!r}, '--videos', '400',"
             " '--seed', '1', '--frames', '3600']\n"
             "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 130, done.stderr
    assert "statekv synthetic: interrupted" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_ctrl_c_numpy_swallows_while_a_make_plans_a_video_still_stops_it(tmp_path, monkeypatch, capsys):
    """Before: numpy's ``Generator.choice`` of a list clears a KeyboardInterrupt raised while it runs; a Ctrl-C
    landing there while a video was planned was lost, and the make went on (about half the Ctrl-Cs sent)."""
    import contextlib
    import signal

    import statekv.synthetic.benchmark as benchmark

    planned = benchmark.plan_video
    sent = []

    def plan_video(rng, frames):
        if not sent:  # the first video's planning takes the Ctrl-C and swallows it, as numpy does
            sent.append(True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        return planned(rng, frames)

    monkeypatch.setattr(benchmark, "plan_video", plan_video)
    out = tmp_path / "set"
    assert main(["synthetic", "make", "--out", str(out), "--videos", "3", "--seed", "1", "--frames", "40"]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("statekv synthetic: interrupted; 0 of 3 videos written"), said
    assert sent and not list((out / "videos").glob("*.mp4"))
