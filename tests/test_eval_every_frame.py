"""`statekv eval synthetic` streams every frame of a synthetic set unless --max-frames caps it: past 512 frames
(the published benchmarks' cap) nothing is silently left out, so a long set's needle is always seen."""

from __future__ import annotations

import json

from statekv.cli import main
from statekv.synthetic.benchmark import make_benchmark


def frames_encoded(tmp_path, name: str, *extra: str) -> set[int]:
    assert main(["eval", "synthetic", "--model", "builtin", "--method", "recency", "--frames", "4", "--data-root",
                 str(tmp_path / "set"), "--out", str(tmp_path / name), "--limit", "1", "--no-progress", *extra]) == 0
    rows = (tmp_path / name / "answers.rank000.jsonl").read_text().splitlines()
    return {json.loads(row)["extra"]["frames"] for row in rows}


def test_a_synthetic_set_is_streamed_whole_by_default(tmp_path, capsys):
    make_benchmark(tmp_path / "set", videos=1, seed=43, num_frames=530, families=("needle",))
    assert frames_encoded(tmp_path, "every") == {530}
    assert frames_encoded(tmp_path, "capped", "--max-frames", "100") == {100}
    try:
        main(["eval", "synthetic", "--help"])
    except SystemExit:
        pass
    assert "(default: every frame:" in " ".join(capsys.readouterr().out.split())
