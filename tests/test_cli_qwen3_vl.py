"""The CLI with a tiny Qwen3-VL checkpoint, whose steps are pairs of frames."""

from __future__ import annotations

import re

from statekv.cli import main
from statekv.testing import make_tiny_checkpoint, write_test_video


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
