"""``statekv eval BENCHMARK --check``: every annotation row and every video header read in seconds, no model; per
group the questions, the videos found / missing / undecodable and the frames a run would encode; status 0 when
every row parses (missing videos listed), 2 naming the first bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from statekv.api.videoqa import VideoQA
from statekv.cli import main
from statekv.eval.fabricate import write_mini_ovobench, write_mini_streamingbench, write_mini_videomme
from statekv.video import open_video


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("check")
    write_mini_videomme(root)
    write_mini_ovobench(root)
    write_mini_streamingbench(root)
    (root / "ovobench" / "src_videos" / "Fabricated" / "source1.mp4").unlink()  # missing
    (root / "streamingbench" / "videos" / "sample_2_sqa.mp4").write_bytes(b"not a video")  # undecodable
    return root


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """A check loads no model."""
    monkeypatch.setattr(VideoQA, "from_options", lambda *a, **k: pytest.fail("--check loaded a model"))


def _check(capsys, *argv) -> tuple[int, str, dict[str, list[str]]]:
    code = main(["eval", *map(str, argv), "--check"])
    captured = capsys.readouterr()
    table = {}
    for line in captured.out.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[1].replace(",", "").isdigit():
            table[cells[0]] = cells[1:]
    return code, captured.out + captured.err, table


def test_per_group_questions_videos_and_frames_of_a_stream(root, capsys):
    code, out, table = _check(capsys, "ovobench", "--data-root", root)
    assert code == 0
    # questions, videos, found, missing, undecodable, frames: a stream per source video up to its last question
    # (1 frame per second): a run of the real-time group streams source0 up to 6 s, of the backward group up to
    # 2 s, of the forward group up to its poll at 5.5 s; a run of all three streams it once, up to 6 s; source1
    # is missing, so its frames are not counted
    # (before: the forward question counted once per poll, where a run counts it once, among 8 answers to give)
    assert table == {"backward": ["1", "1", "1", "0", "0", "2"], "realtime": ["5", "2", "1", "1", "0", "6"],
                     "forward": ["1", "1", "1", "0", "0", "6"], "total": ["7", "2", "1", "1", "0", "6"]}
    assert f"missing videos (1):\n  {root}/ovobench/src_videos/Fabricated/source1.mp4\n" in out
    assert out.rstrip().endswith("every annotation row parses: 7 questions (8 answers to give: a forward question is "
                                 "asked at each of its polls); 1 of 2 videos readable")


def test_offline_frames_follow_the_sampling_a_run_uses(root, capsys):
    code, _, table = _check(capsys, "videomme", "--data-root", root)
    videos = sorted((root / "videomme" / "data").glob("*.mp4"))
    expected = sum(len(open_video(path).sample_indices(max_fps=1, max_frames=512, protocol=True)) for path in videos)
    assert code == 0 and table["all"] == ["6", "2", "2", "0", "0", str(expected)]
    _, _, table = _check(capsys, "videomme", "--data-root", root, "--max-frames", "2")
    assert table["all"][-1] == "4"
    _, _, table = _check(capsys, "ovobench", "--data-root", root, "--mode", "offline")  # the released clips
    assert table["realtime"][:5] == ["5", "5", "5", "0", "0"]


def test_undecodable_videos_are_listed_with_the_reason(root, capsys):
    code, out, table = _check(capsys, "streamingbench", "--data-root", root)
    assert code == 0 and table["contextual"][3:5] == ["0", "1"] and table["realtime"][2:5] == ["1", "0", "0"]
    assert f"undecodable videos (1):\n  {root}/streamingbench/videos/sample_2_sqa.mp4: not a readable video file" in out


def test_the_first_bad_row_is_one_line_and_status_2(root, tmp_path, capsys):
    bad = tmp_path / "bad"
    folder = write_mini_ovobench(bad, clips=False)
    rows = json.loads((folder / "ovo_bench_new.json").read_text())
    rows[2]["gt"], rows[4]["options"] = 9, None
    (folder / "ovo_bench_new.json").write_text(json.dumps(rows))
    code, out, _ = _check(capsys, "ovobench", "--data-root", bad)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out
    assert lines[0] == f"statekv eval: error: {folder}/ovo_bench_new.json row 2: gt=9 is not an index into its 4 options"


def test_a_run_still_needs_a_model_and_a_folder(root, capsys):
    code = main(["eval", "videomme", "--data-root", str(root)])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("statekv eval: error: --model and --out are required (all but "
                                               "--data-root may be left out with --check)")


@pytest.mark.parametrize("mode", ["streaming", "offline"])
def test_the_frames_are_those_a_run_encodes(mode, tmp_path, capsys, monkeypatch):
    from statekv.synthetic.benchmark import make_benchmark

    root = tmp_path / "set"
    make_benchmark(root, videos=1, seed=41, num_frames=24, streaming=True)
    _, _, table = _check(capsys, "synthetic", "--data-root", root, "--mode", mode)
    monkeypatch.undo()  # the run loads its model
    assert main(["eval", "synthetic", "--model", "builtin", "--method", "recency", "--frames", "4", "--data-root",
                 str(root), "--out", str(tmp_path / "run"), "--mode", mode, "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "answers.rank000.jsonl").read_text().splitlines()]
    if mode == "streaming":  # one stream per video, up to its last question
        encoded = sum(max(r["extra"]["frames"] for r in records if r["video_id"] == video)
                      for video in {r["video_id"] for r in records})
    else:  # one encoding per video and second asked at
        encoded = sum({(r["video_id"], r["extra"]["second"]): r["extra"]["frames"] for r in records}.values())
    assert table["total"][-1] == str(encoded)
