"""What a power loss (not a kill) leaves of an evaluation's run folder: an answer, or a note of a video that could
not be read, appended but not yet forced to the device comes back with its pages in any order: the file's end
zero-filled, with or without the line's last bytes and newline after the zeros. The same command resumes the run,
asks that question again and says so in one line; a line that does not read before a whole one is still refused."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from statekv.cli import main
from statekv.synthetic.benchmark import make_benchmark

RANK_FILE = "answers.rank000.jsonl"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A synthetic set and a run on it answered to the end: (set, run folder)."""
    root = tmp_path_factory.mktemp("eval-power-loss")
    make_benchmark(root / "set", videos=2, seed=52, num_frames=12, families=("needle", "position"))
    assert _eval(root / "set", root / "run") == 0
    return root / "set", root / "run"


def _eval(data, out) -> int:
    return main(["eval", "synthetic", "--model", "builtin", "--data-root", str(data), "--out", str(out),
                 "--budget", "16", "--no-progress"])


def _after_a_power_loss(finished, tmp_path, answers: bytes, errors: bytes | None = None):
    """A copy of the finished run as a power loss while it wrote left it: its rank file ``answers``, its error
    log ``errors`` (None: none), nothing merged or scored yet."""
    out = tmp_path / "run"
    shutil.copytree(finished[1], out)
    for name in ("answers.jsonl", "results.json", "table.md"):
        (out / name).unlink()
    (out / RANK_FILE).write_bytes(answers)
    if errors is not None:
        (out / "errors.rank000.jsonl").write_bytes(errors)
    return out


def _lines(finished) -> list[bytes]:
    return (finished[1] / RANK_FILE).read_bytes().splitlines(keepends=True)


def _scores(out) -> dict:
    return json.loads((out / "results.json").read_text())["score"]


@pytest.mark.parametrize("end", ["zeros", "zeros_then_newline", "zeros_then_the_lines_end"])
def test_an_answer_a_power_loss_zero_filled_is_asked_again_and_said_once(finished, tmp_path, caplog, end):
    """Before: a zero-filled last line with its newline kept was refused as 'corrupt answer record', and the run
    could not be resumed."""
    lines = _lines(finished)
    last = lines[-1]
    lost = {"zeros": b"\0" * 4096, "zeros_then_newline": b"\0" * (len(last) - 1) + b"\n",
            "zeros_then_the_lines_end": b"\0" * 100 + last[100:]}[end]
    out = _after_a_power_loss(finished, tmp_path, b"".join(lines[:-1]) + lost)
    with caplog.at_level(logging.INFO, logger="statekv.eval"):
        assert _eval(finished[0], out) == 0
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert said == [f"{out / RANK_FILE}: dropping an end a power loss zero-filled ({len(lost)} bytes), an answer "
                    "not yet on the disk; its question is asked again"]
    assert any(f"1 questions to answer ({len(lines) - 1} of its {len(lines)} already done)" in record.getMessage()
               for record in caplog.records)
    assert b"\0" not in (out / RANK_FILE).read_bytes() and len(_lines((None, out))) == len(lines)
    assert _scores(out) == _scores(finished[1])


def test_a_zero_filled_line_before_a_whole_one_is_still_refused(finished, tmp_path, capsys):
    lines = _lines(finished)
    damaged = [*lines[:1], b"\0" * (len(lines[1]) - 1) + b"\n", *lines[2:]]
    out = _after_a_power_loss(finished, tmp_path, b"".join(damaged))
    capsys.readouterr()
    assert _eval(finished[0], out) == 2
    err = capsys.readouterr().err
    assert f"{out / RANK_FILE}:2: corrupt answer record" in err and "Traceback" not in err
    assert (out / RANK_FILE).read_bytes() == b"".join(damaged)


def test_a_note_of_an_unreadable_video_a_power_loss_zero_filled_is_ignored(finished, tmp_path, capsys):
    """Before: the run ended on 'damaged error log line', without scoring."""
    note = json.dumps({"video_id": "v0001", "qids": ["v0001-needle"], "error": "cannot read"}).encode() + b"\n"
    out = _after_a_power_loss(finished, tmp_path, b"".join(_lines(finished)), b"\0" * 20 + note[20:])
    assert _eval(finished[0], out) == 0
    assert _scores(out) == _scores(finished[1])


def test_a_new_answers_file_has_its_name_forced_to_the_device_before_its_first_answer(tmp_path, forced_folders):
    """Before: each answer was forced, the file's name in the run folder never, so a power loss could take the
    whole file back with answers the run had counted durable."""
    from statekv.eval.records import ResultsWriter

    (tmp_path / "run").mkdir()
    with ResultsWriter(tmp_path / "run" / RANK_FILE):
        pass
    assert forced_folders == [str(tmp_path / "run")]
    with ResultsWriter(tmp_path / "run" / RANK_FILE):  # there already: nothing new to name
        pass
    assert forced_folders == [str(tmp_path / "run")]


def test_a_new_note_of_an_unreadable_video_has_its_name_forced_to_the_device(tmp_path, forced_folders):
    """Before: each note was forced, its file's name in the run folder never, so a power loss could take the whole
    file back: the merge then counted none of its unreadable videos, and a rerun kept the answers given before a
    video failed part way even once its file was replaced."""
    from types import SimpleNamespace

    from statekv.eval.video_errors import log_video_error, unresolved_errors

    video = SimpleNamespace(video_id="v0001", questions=[SimpleNamespace(qid="v0001-needle")])
    for _ in range(2):  # the second note appends to a file already named
        log_video_error(tmp_path, 0, video, OSError("cannot read"), 0)
    assert forced_folders == [str(tmp_path)]
    assert [entry["qids"] for entry in unresolved_errors(tmp_path)] == [["v0001-needle"]]


def test_a_note_file_whose_name_could_not_be_forced_is_made_again_by_the_next_note(tmp_path, monkeypatch):
    """Before: the new file stayed, empty, when its folder's flush failed (EIO), so the next note appended to it
    and never forced its name."""
    import errno
    from types import SimpleNamespace

    from statekv.eval.video_errors import log_video_error, unresolved_errors

    from conftest import failing_folders

    video = SimpleNamespace(video_id="v0001", questions=[SimpleNamespace(qid="v0001-needle")])
    folders = failing_folders(monkeypatch, errno.EIO, times=1)
    with pytest.raises(OSError):
        log_video_error(tmp_path, 0, video, OSError("cannot read"), 0)
    assert list(tmp_path.iterdir()) == []
    log_video_error(tmp_path, 0, video, OSError("cannot read"), 0)
    assert len(folders) == 2  # the next note made the file again and forced its name
    assert [entry["qids"] for entry in unresolved_errors(tmp_path)] == [["v0001-needle"]]
