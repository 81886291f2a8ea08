"""README.md's Python blocks, run in order in one namespace on the built-in model: the quick start, live streams
and watches. Only what needs a download or a device differs: the checkpoint is the built-in model on CPU, the
video is a short test video, and ``camera`` is a stand-in that yields frames at 100 s apart (its timestamps go on
from one loop to the next, as a camera's do). The last block (a bare decoder from the hub) is only compiled."""

from __future__ import annotations

import re

import numpy as np
import pytest
from statekv.eval.fabricate import write_still_seconds_video
from test_docs import README, blocks

pytestmark = pytest.mark.slow


class Camera:
    """Eight RGB frames a loop, 100 s apart, the clock going on between loops."""

    def __init__(self):
        self.seconds, self.random = 0.0, np.random.default_rng(0)

    def __iter__(self):
        for _ in range(8):
            yield self.random.integers(0, 256, (64, 64, 3), dtype=np.uint8), self.seconds
            self.seconds += 100.0


def test_the_readmes_python_blocks_run_on_the_built_in_model(tmp_path, monkeypatch, capsys):
    python = [text for language, text in blocks(README) if language == "python"]
    quick_start, *streaming, decoder = python
    assert "from_pretrained(" in quick_start and "camera" in streaming[0] and "StreamingPrefill" in decoder
    loaded = re.sub(r"from_pretrained\((.|\n)*?\)\n", 'from_pretrained("builtin")\n', quick_start, count=1)
    assert loaded.count('"builtin"') == 1 and "cuda" not in loaded and '"lecture.mp4"' in loaded
    write_still_seconds_video(tmp_path / "lecture.mp4", 8)
    monkeypatch.chdir(tmp_path)  # where the video is and the live block saves its stream
    namespace = {"camera": Camera()}
    for text in [loaded, *streaming]:
        exec(compile(text, "README.md", "exec"), namespace)
    compile(decoder, "README.md", "exec")
    printed = capsys.readouterr().out.splitlines()
    assert namespace["video"].stats.frames == 8
    assert namespace["asked"] is True  # asked once, at 600 s
    assert (tmp_path / "desk.safetensors").is_file() and namespace["stream"].stats.frames == 16
    # a watch is evaluated when it is made, then after every 4 frames
    assert namespace["watch"].evaluations == 3 and printed[-1] == repr(namespace["watch"].events)
