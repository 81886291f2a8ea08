"""Hostile uses of the long-running data and evaluation commands: a synthetic make that the disk stops or that a
second make joins, an evaluation's error log cut short by a stop, a table of a run resumed with a smaller limit,
a table written into a run's own folder."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

import statekv.eval as ev
import statekv.eval.runner as runner
import statekv.synthetic.benchmark as benchmark
from statekv.cli import main
from statekv.errors import OutputError
from statekv.eval.records import ResultsWriter
from statekv.eval.video_errors import unresolved_errors
from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark
from hostile import run_child

FAMILIES = ("needle", "position")  # the built-in model answers the first right and the second wrong on this set


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-eval-runs") / "set"
    make_benchmark(root, videos=2, seed=52, num_frames=12, families=FAMILIES)
    return root


def _eval(data, out, *extra: str) -> int:
    return main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out),
                 "--budget", "16", "--no-progress", *extra])


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _make(out, *extra: str) -> int:
    return main(["synthetic", "make", "--out", str(out), "--videos", "3", "--seed", "53", "--frames", "12", *extra])


def test_a_make_the_disk_stops_is_one_line_and_the_same_command_finishes_it(tmp_path, monkeypatch, capsys):
    write_video, written = benchmark.write_video, []

    def full_on_the_second(plan, path):
        written.append(path)
        if len(written) == 2:
            path.write_bytes(b"cut short")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_video(plan, path)

    monkeypatch.setattr(benchmark, "write_video", full_on_the_second)
    out = tmp_path / "set"
    assert _make(out) == 2
    line = _one_line(capsys.readouterr().err)
    assert "No space left on device" in line and "v0001.partial.mp4" in line and "run the same command" in line
    monkeypatch.setattr(benchmark, "write_video", write_video)
    assert _make(out) == 0
    assert sorted(path.name for path in (out / "videos").iterdir()) == ["v0000.mp4", "v0001.mp4", "v0002.mp4"]
    assert len(ev.load_benchmark("synthetic", out)) == 3 * 6


def test_a_second_make_into_a_folder_being_made_is_refused_and_the_first_finishes(tmp_path):
    out, refusals = tmp_path / "set", []

    def second_make_midway(done, total):
        if done == 1:
            with pytest.raises(OutputError) as refused:
                make_benchmark(out, videos=3, seed=53, num_frames=12)
            refusals.append(str(refused.value))

    make_benchmark(out, videos=3, seed=53, num_frames=12, progress=second_make_midway)
    (refusal,) = refusals
    assert f"{out} is in use by process {os.getpid()}" in refusal and "another make is writing it" in refusal
    clean = make_benchmark(tmp_path / "clean", videos=3, seed=53, num_frames=12)
    assert (out / QUESTIONS_FILE).read_bytes() == clean.read_bytes()
    assert sorted(path.name for path in out.iterdir()) == ["benchmark.json", QUESTIONS_FILE, "videos"]


def test_an_error_note_cut_short_by_a_stop_is_dropped_before_the_next_is_written(data, tmp_path, capsys):
    """Before: the next run glued its note to the half line, and every later run ended on "damaged error log line"
    without scoring."""
    broken = tmp_path / "set"
    shutil.copytree(data, broken)
    (broken / "videos" / "v0001.mp4").write_bytes(b"not a video")
    out = tmp_path / "run"
    out.mkdir()
    (out / "errors.rank000.jsonl").write_text('{"video_id": "v0001", "qids": ["v0001-nee')  # a stop mid-write
    assert _eval(broken, out) == 1  # scored, with the unreadable video's questions named as unanswered
    assert "2 question(s) unanswered: 1 video(s) could not be read" in capsys.readouterr().err
    assert [entry["video_id"] for entry in unresolved_errors(out)] == ["v0001"]
    assert json.loads((out / "results.json").read_text())["score"]["missing"] == 2


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-eval-streaming") / "set"
    make_benchmark(root, videos=2, seed=53, num_frames=24, streaming=True)
    return root


def _cut_in_the_middle(video, keep: float = 0.6) -> bytes:
    """Rewrite ``video`` with its index up front, cut after ``keep`` of its bytes (it opens, and decoding stops part
    way); returns its bytes as they were."""
    import av

    whole = video.read_bytes()
    fast = video.with_name("fast.mp4")
    with av.open(str(video)) as source, av.open(str(fast), "w", options={"movflags": "faststart"}) as target:
        taken = source.streams.video[0]
        written = target.add_stream_from_template(taken)
        for packet in source.demux(taken):
            if packet.dts is not None:
                packet.stream = written
                target.mux(packet)
    data = fast.read_bytes()
    fast.unlink()
    video.write_bytes(data[: int(len(data) * keep)])
    return whole


def test_a_video_replaced_after_it_failed_part_way_is_answered_again_and_the_others_kept(streaming, tmp_path,
                                                                                         caplog):
    """Before: a video that could not be read part way (some of its questions answered before) and was then replaced
    by a whole file refused the rerun ("holds answers made from other videos"): only --overwrite went on, throwing
    away every other video's answers."""
    damaged = tmp_path / "set"
    shutil.copytree(streaming, damaged)
    whole = _cut_in_the_middle(damaged / "videos" / "v0000.mp4")
    out = tmp_path / "run"
    assert _eval(damaged, out) == 1
    before = {record.qid: record for record in ev.run_records(out)}
    partly = sorted(qid for qid, record in before.items() if "v0000" in record.video_id)
    assert partly and unresolved_errors(out), "v0000 did not fail part way"
    (damaged / "videos" / "v0000.mp4").write_bytes(whole)
    assert _eval(damaged, out) == 0
    after = {record.qid: record for record in ev.run_records(out)}
    expected = json.loads((out / "run.json").read_text())["expected_qids"]
    assert sorted(after) == sorted(expected) and not unresolved_errors(out)
    assert all(after[qid] == record for qid, record in before.items() if "v0000" not in record.video_id)
    assert f"its {len(partly)} earlier answer(s) are dropped" in caplog.text
    (damaged / "videos" / "v0000.mp4").write_bytes(b"not the video")  # a whole run's video changed: refused still
    assert _eval(damaged, out) == 2


def test_a_limit_keeps_whole_questions_with_all_their_polls(streaming, tmp_path, capsys):
    """Before: --limit N kept the first N polls, so it could keep part of a forward question's polls, and scored
    that question as if it were whole (nothing said missing)."""
    assert _eval(streaming, tmp_path / "all", "--limit", "100") == 0
    every = json.loads((tmp_path / "all" / "run.json").read_text())["expected_qids"]
    item = [qid.split("_")[0] for qid in every]
    cut = next(n for n in range(1, len(every)) if item[n] == item[n - 1])  # N polls end inside a question
    wanted = list(dict.fromkeys(item))[:cut]
    assert _eval(streaming, tmp_path / "limited", "--limit", str(cut)) == 0
    kept = json.loads((tmp_path / "limited" / "run.json").read_text())["expected_qids"]
    assert kept == [qid for qid in every if qid.split("_")[0] in wanted] and len(kept) > cut
    printed = capsys.readouterr().out
    assert f"{cut} questions answered ({len(kept)} answers" in printed and "missing" not in printed


def test_the_table_of_a_run_resumed_with_a_smaller_limit_and_stopped_scores_only_its_questions(
        data, tmp_path, monkeypatch, capsys):
    """Answers the run asked before its --limit shrank stay in its folder: an unfinished run's cell scored them too,
    under the smaller run's count."""
    damaged = tmp_path / "set"
    shutil.copytree(data, damaged)
    video = damaged / "videos" / "v0000.mp4"
    whole = video.read_bytes()
    video.write_bytes(b"not a video")
    out = tmp_path / "run"
    assert _eval(damaged, out) == 1  # v0001's questions answered, v0000's left by its error
    video.write_bytes(whole)  # the damaged file replaced
    write, writes = ResultsWriter.write, []

    def stop_after_one(self, record):
        if writes:
            raise KeyboardInterrupt
        writes.append(record.qid)
        write(self, record)

    monkeypatch.setattr(ResultsWriter, "write", stop_after_one)
    assert _eval(damaged, out, "--limit", "2") == 130
    assert writes == ["v0000-needle"]
    monkeypatch.setattr(ResultsWriter, "write", write)
    records = ev.run_records(out)
    own = [record for record in records if record.qid in writes]
    assert len(records) == 3 and sum(r.correct for r in records) / 3 != sum(r.correct for r in own) / len(own)
    capsys.readouterr()
    assert main(["eval", "table", str(out)]) == 0
    cell = capsys.readouterr().out.splitlines()[2].split(" | ")[-1]
    assert cell == f"{100 * sum(r.correct for r in own) / len(own):.2f} (partial 1/2) |"


def test_a_table_written_into_a_run_folder_is_refused_and_the_runs_files_kept(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "1") == 0
    kept = {path.name: path.read_bytes() for path in out.iterdir()}
    capsys.readouterr()
    for name in ("answers.rank000.jsonl", "run.json", "new.md"):
        assert main(["eval", "table", str(out), "--output", str(out / name)]) == 2
        assert f"--output {out / name} is in the run folder {out}" in _one_line(capsys.readouterr().err)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == kept
    assert main(["eval", "table", str(out), "--output", str(tmp_path / "table.md")]) == 0


def test_evaluating_a_make_that_was_stopped_says_so_in_one_line(tmp_path, capsys):
    def stop_after_one(done, total):
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_benchmark(tmp_path / "set", videos=2, seed=53, num_frames=12, progress=stop_after_one)
    for check in ((), ("--check",)):
        assert main(["eval", "synthetic", "--model", "builtin", "--data-root", str(tmp_path / "set"), "--out",
                     str(tmp_path / "run"), "--no-progress", *check]) == 2
        line = _one_line(capsys.readouterr().err)
        assert "holds a synthetic make that was stopped before its question file was written" in line
        assert "statekv synthetic make" in line


def test_a_run_stopped_just_after_it_asks_more_questions_is_not_scored_by_its_earlier_summary(
        data, tmp_path, monkeypatch, capsys):
    """Before: a stop between writing run.json and removing the finished --limit 1 run's results.json left that
    summary, which `eval table` trusted: the run's cell read 1 of 1 answered, not 1 of the 4 it now asks."""
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "1") == 0
    whole = runner.write_whole

    def stopped_after_run_file(path, content, *args):
        whole(path, content, *args)
        if path.name == "run.json":
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "write_whole", stopped_after_run_file)
    assert _eval(data, out) == 130
    assert json.loads((out / "run.json").read_text())["limit"] is None
    capsys.readouterr()
    assert main(["eval", "table", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[2].endswith("(partial 1/4) |")


def test_a_table_the_disk_stops_is_one_line_and_the_earlier_table_is_kept(data, tmp_path):
    """Before: the table was written in place, so a full disk left the earlier file cut to what fitted."""
    out = tmp_path / "run"
    assert _eval(data, out, "--limit", "1") == 0
    table = tmp_path / "table.md"
    table.write_text("the earlier table\n")
    result, child = run_child("from statekv.cli import main\n"
                              "attempt(lambda: main(['eval', 'table', sys.argv[1], '--output', sys.argv[2]]))",
                              out, table, max_file_bytes=40)
    lines = [line for line in child.stderr.splitlines() if line.strip()]
    assert result == {"ok": True, "value": 2}, (result, child.stderr[-2000:])
    assert len(lines) == 1 and "File too large" in lines[0], child.stderr[-2000:]
    assert table.read_text() == "the earlier table\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run", "table.md"]


def test_a_make_over_a_set_being_evaluated_is_refused_and_an_evaluation_of_a_set_being_made_too(
        tmp_path, monkeypatch, capsys):
    """Before: `synthetic make --overwrite` replaced the videos and questions of a set an evaluation was reading,
    whose later answers then came from the new set, scored against the old answer key."""
    data = tmp_path / "set"
    make_benchmark(data, videos=2, seed=52, num_frames=12, families=FAMILIES)
    write, refusals = ResultsWriter.write, []

    def make_over_it(self, record):
        if not refusals:
            with pytest.raises(OutputError) as refused:
                make_benchmark(data, videos=2, seed=54, num_frames=12, families=FAMILIES, overwrite=True)
            refusals.append(str(refused.value))
        write(self, record)

    monkeypatch.setattr(ResultsWriter, "write", make_over_it)
    assert _eval(data, tmp_path / "run") == 0
    (refusal,) = refusals
    assert f"the synthetic set's folder {data} is in use by" in refusal and "an evaluation reading it" in refusal
    assert json.loads((data / "benchmark.json").read_text())["seed"] == 52
    monkeypatch.setattr(ResultsWriter, "write", write)
    capsys.readouterr()

    def evaluate_midway(done, total):
        if done == 1:
            assert _eval(tmp_path / "new", tmp_path / "run2") == 2

    make_benchmark(tmp_path / "new", videos=2, seed=54, num_frames=12, families=FAMILIES, progress=evaluate_midway)
    line = _one_line(capsys.readouterr().err)
    assert f"{tmp_path / 'new'} is in use by" in line and "a `statekv synthetic make` is writing it" in line
    assert _eval(tmp_path / "new", tmp_path / "run2") == 0
