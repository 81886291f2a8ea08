"""The CLI with a tiny Qwen3-VL checkpoint, whose steps are pairs of frames."""

from __future__ import annotations

import re

import torch
from PIL import Image
from safetensors.torch import load_file

from statekv.cli import main
from statekv.testing import make_tiny_checkpoint, write_test_video

from conftest import random_frames


def test_stream_at_the_cache_cap_names_the_time_of_the_first_frame_refused(tmp_path, capsys):
    """A step of two frames refused at the cap: the warning's time is that of the frame it numbers (the step's
    first, still waiting), not of its partner whose push made the step."""
    model = make_tiny_checkpoint("qwen3_vl", tmp_path / "ckpt")
    video = write_test_video(tmp_path / "clip.mp4", frames=8, fps=2.0, size=(96, 64))
    capsys.readouterr()
    assert main(["stream", str(video), "--model", str(model), "--max-fps", "2", "--ask", "30:End?",
                 "--max-new-tokens", "1", "--device", "cpu", "--max-cache-bytes", "60KB", "--json"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "detailed cache is full" in line]
    assert len(warning) == 1, warning
    found = re.search(r"full at frame (\d+) .*stopped at ([\d.]+) s; .* from the (\d+) frames before it", warning[0])
    frame, seconds, before = int(found[1]), float(found[2]), int(found[3])
    assert frame == before + 1 and before % 2 == 0  # a whole pair was refused
    assert seconds == (frame - 1) / 2.0  # frame N (from 1) of a 2 fps video is at (N - 1) / 2 s


def test_a_resume_of_a_grown_video_pairs_the_lone_last_frame_as_a_run_over_the_whole_video(tmp_path):
    """Before: a run ending on an odd frame flushed it alone (repeated) and saved it so, and a --resume of the video
    grown since went on from it: (f4, f4), (f5, f6), (f7, f7) where a run over the whole video takes (f4, f5),
    (f6, f7). The file now keeps that frame waiting, and the resumed stream is the whole run's, bit for bit."""
    model = make_tiny_checkpoint("qwen3_vl", tmp_path / "ckpt")
    images = random_frames(8, seed=3)
    clip = tmp_path / "clip"
    clip.mkdir()
    base = ["--model", str(model), "--device", "cpu", "--max-new-tokens", "1", "--budget", "10"]
    for count in (5, 8):  # a recording that grew between the runs
        for index in range(count):
            Image.fromarray(images[index]).save(clip / f"{index:03d}.png")
        if count == 5:
            assert main(["stream", str(clip), *base, "--save", str(tmp_path / "first.safetensors")]) == 0
    assert main(["stream", str(clip), *base, "--resume", str(tmp_path / "first.safetensors"),
                 "--save", str(tmp_path / "resumed.safetensors")]) == 0
    assert main(["stream", str(clip), *base, "--save", str(tmp_path / "whole.safetensors")]) == 0
    resumed, whole = (load_file(tmp_path / f"{name}.safetensors") for name in ("resumed", "whole"))
    assert resumed.keys() == whole.keys()
    assert all(resumed[name].shape == whole[name].shape and torch.equal(resumed[name], whole[name]) for name in whole)
