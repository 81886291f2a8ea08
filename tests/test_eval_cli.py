"""``statekv eval``: the benchmark subcommands, ``statekv eval table``, and their one-line errors."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

import statekv.eval as ev
from statekv import cli
from statekv.eval import command
from statekv.eval.annotations import find_annotation_files, read_rows
from statekv.eval.fabricate import write_mini_mlvu, write_mini_videomme
from statekv.eval.runner import EvalConfig, check_run_file
from statekv.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("benchmarks")
    write_mini_videomme(root, videos=1)
    write_mini_mlvu(root, tasks=("count", "ego"))
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("models") / "InternVL3-1B-hf")


def arguments(benchmark, checkpoint, data_root, out, *extra) -> list[str]:
    return [benchmark, "--model", str(checkpoint), "--data-root", str(data_root), "--out", str(out),
            "--max-new-tokens", "2", "--no-progress", *extra]


@pytest.fixture
def statekv_with_eval(monkeypatch):
    """``statekv.cli.main`` with the eval command registered (as the package's COMMANDS list does)."""
    if "statekv.eval.command" not in cli.COMMANDS:
        monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "statekv.eval.command"))
    return cli.main


def test_benchmark_subcommand_runs_and_reports(checkpoint, data_root, tmp_path, capsys, statekv_with_eval):
    out = tmp_path / "run"
    argv = ["eval", *arguments("mlvu", checkpoint, data_root, out, "--method", "recency", "--frames", "2",
                               "--name", "Tiny-1B")]
    assert statekv_with_eval(argv) == 0
    printed = capsys.readouterr().out
    assert "Tiny-1B Recency R=2 on mlvu:" in printed and "3 questions answered" in printed and "unparsable" in printed
    assert f"wrote {out / 'results.json'} and {out / 'table.md'}" in printed
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["method"] == "recency" and run["settings"]["budget"] == 2
    assert sorted(run["expected_qids"]) == ["count_0", "count_1", "ego_0"]
    assert "| Tiny-1B | Recency R=2 |" in (out / "table.md").read_text()


def test_table_merges_finished_and_unfinished_runs(checkpoint, data_root, tmp_path, capsys):
    finished = tmp_path / "videomme-statekv"
    assert command.main(arguments("videomme", checkpoint, data_root, finished, "--budget", "32")) == 0
    # a run killed after one answer: no results.json yet, but run.json says what it was asked
    killed = tmp_path / "mlvu-statekv"
    config = EvalConfig.for_model("mlvu", str(checkpoint), data_root, killed, budget=32, max_new_tokens=2)
    questions = ev.load_benchmark("mlvu", data_root)
    check_run_file(config, [q.qid for q in questions], write=True)
    with ev.ResultsWriter(ev.rank_file(killed, 0)) as out:
        out.write(ev.AnswerRecord.for_answer(questions[0], "C", model="InternVL3-1B", method="statekv", budget=32))
    capsys.readouterr()
    table_file = tmp_path / "table.md"
    before = sorted(path.name for path in killed.iterdir())
    assert command.main(["table", str(killed), str(finished), "--output", str(table_file)]) == 0
    # scored where the table is made: nothing written in a run's folder (before: answers.jsonl and results.json,
    # a traceback where the folder was read-only, a race with a run still writing there)
    assert sorted(path.name for path in killed.iterdir()) == before
    printed = capsys.readouterr().out
    cell = "100.00" if questions[0].answer == "C" else "0.00"
    assert printed == table_file.read_text() == (
        "| Model | Method | VideoMME | MLVU | OVOBench RT |\n"
        "|---|---|---|---|---|\n"
        f"| InternVL3-1B | StateKV B=32 | {_cell(finished)} | {cell} (partial 1/3) | – |\n"
    )
    assert command.main(["table", str(finished), "--parser", "paper"]) == 0
    assert "| InternVL3-1B | StateKV B=32 |" in capsys.readouterr().out

    # the killed run answers one more (resumed, killed again): the table scores what is there now, not what an
    # earlier table wrote, into a folder it makes
    with ev.ResultsWriter(ev.rank_file(killed, 0)) as out:
        out.write(ev.AnswerRecord.for_answer(questions[1], "C", model="InternVL3-1B", method="statekv", budget=32))
    table_file = tmp_path / "tables" / "now" / "table.md"
    assert command.main(["table", str(killed), "--output", str(table_file)]) == 0
    assert "(partial 2/3)" in capsys.readouterr().out and "(partial 2/3)" in table_file.read_text()
    assert command.main(["table", str(finished)]) == 0  # a finished run's own summary is read as it is
    assert json.loads((finished / "results.json").read_text())["run"]

    # runs of other weights under the same name (every `statekv train-builtin` folder's model is "model"), and runs
    # of other question sets in one column: before, merged into one row and one column without a word
    def copy(name: str, **content) -> Path:
        folder = tmp_path / name
        shutil.copytree(finished, folder)
        recorded = json.loads((folder / "run.json").read_text())
        recorded["content"].update(content)
        (folder / "run.json").write_text(json.dumps(recorded))
        return folder
    retrained = copy("retrained", weights="0" * 64)
    capsys.readouterr()
    assert command.main(["table", str(finished), str(retrained)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| InternVL3-1B")]
    weights = json.loads((finished / "run.json").read_text())["content"]["weights"]
    assert [row.split(" | ")[0] for row in rows] == [f"| InternVL3-1B [weights {weights[:12]}]",
                                                     "| InternVL3-1B [weights 000000000000]"]
    other_set = copy("other-set", data="1" * 64)
    assert command.main(["table", str(finished), str(retrained), str(other_set)]) == 2  # one row given twice
    assert command.main(["table", str(retrained), str(other_set)]) == 0
    assert "note: the videomme runs read 2 different question sets" in capsys.readouterr().out


def test_a_finished_run_resumed_for_more_questions_and_killed_is_partial_in_the_table(checkpoint, data_root,
                                                                                      tmp_path, capsys, monkeypatch):
    """Before: its earlier summary (of fewer questions) stayed, and the table showed that run as finished."""
    import statekv.eval.runner as runner

    out = tmp_path / "mlvu"
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1")) == 0
    assert (out / "results.json").is_file() and (out / "table.md").is_file()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "answer_questions", killed)
    with pytest.raises(KeyboardInterrupt):
        runner.run_evaluation(EvalConfig.for_model("mlvu", str(checkpoint), data_root, out, max_new_tokens=2))
    assert not (out / "results.json").exists() and not (out / "table.md").exists()
    capsys.readouterr()
    assert command.main(["table", str(out)]) == 0
    assert "(partial 1/3)" in capsys.readouterr().out


def _cell(run_dir: Path) -> str:
    score = json.loads((run_dir / "results.json").read_text())["score"]
    text = f"{score['headline']:.2f}"
    return text + (f" ({score['overall']['unparsable']} unparsed)" if score["overall"]["unparsable"] else "")


def test_annotations_from_the_hub(checkpoint, data_root, tmp_path, monkeypatch, capsys):
    folder = data_root / "videomme" / "videomme"
    rows = read_rows(find_annotation_files([folder], "test"))
    calls = []
    fake = types.SimpleNamespace(load_dataset=lambda *args, **kw: calls.append((args, kw)) or rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out = tmp_path / "hub"
    assert command.main(arguments("videomme", checkpoint, data_root, out, "--from-hub", "--limit", "1")) == 0
    assert calls == [(("lmms-lab/Video-MME", "videomme"), {"split": "test"})]
    assert [r.qid for r in ev.run_records(out)] == ["001-1"]


def test_errors_are_one_line(checkpoint, data_root, tmp_path, capsys):
    assert command.main(arguments("videomme", checkpoint, tmp_path / "nowhere", tmp_path / "o")) == 2
    error = capsys.readouterr().err
    assert error.startswith("statekv eval: error: no annotation file found") and error.count("\n") == 1
    (tmp_path / "no set").mkdir()
    for where, made in (("nowhere", "no folder"), ("no set", "a folder with no questions.jsonl")):
        assert command.main(arguments("synthetic", checkpoint, tmp_path / where, tmp_path / "o")) == 2
        assert capsys.readouterr().err == (  # before: "annotation file not found", with no word of how to make one
            f"statekv eval: error: {tmp_path / where} is {made}: a synthetic set is a folder `statekv synthetic make "
            f"--out {tmp_path / where}` writes\n")

    out = tmp_path / "run"
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1")) == 0
    capsys.readouterr()
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1", "--method", "full")) == 2
    error = capsys.readouterr().err
    assert ("holds a run with method='statekv', not 'full'; to resume it, give --method statekv; or use another "
            "--out" in error and error.count("\n") == 1)  # before: it offered only --overwrite, answering it all again
    # the engine's positions and layouts change answers past the model's range: a resume takes the run's own
    for flags, held in ((["--positions", "bounded"], "positions=None, not 'bounded'; to resume it, leave out "
                                                     "--positions"),
                        (["--bounded-layout", "own-then-cache"], "bounded_layout=None, not 'own-then-cache'; to "
                                                                 "resume it, leave out --bounded-layout"),
                        (["--question-span", "0"], "question_span=384, not 0; to resume it, give --question-span 384"),
                        (["--max-cache-bytes", "1G"], "max_cache_bytes=None, not 1073741824; to resume it, leave out "
                                                      "--max-cache-bytes"),
                        (["--parser", "paper"], "parser='lmms-eval-0.7', not 'paper'; to resume it, give --parser "
                                                "lmms-eval-0.7 (`statekv eval table --parser paper` reads its "
                                                "answers the other way)")):
        assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1", *flags)) == 2
        assert f"holds a run with {held}; or use another --out" in capsys.readouterr().err
    both = ["--positions", "bounded", "--max-fps", "2"]  # every flag to change named; none when a setting no flag
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1", *both)) == 2  # gives differs
    assert "to resume it, give --max-fps 1.0 and leave out --positions; or" in capsys.readouterr().err
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1", "--name", "other",
                                  "--positions", "bounded")) == 2
    assert "holds a run with name=" in capsys.readouterr().err
    run_file = out / "run.json"  # as a statekv that did not record them wrote it: compared with their defaults
    run = json.loads(run_file.read_text())
    for name in ("positions", "bounded_layout", "question_span", "max_cache_bytes", "cache_limit"):
        del run["settings"][name]
    run_file.write_text(json.dumps(run))
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1", "--question-span", "0")) == 2
    assert ("holds a run with no question_span recorded (its run.json predates it: taken as question_span=384), "
            "not 0" in capsys.readouterr().err)
    assert command.main(arguments("mlvu", checkpoint, data_root, out, "--limit", "1")) == 0

    assert command.main(["table", str(tmp_path / "missing")]) == 2
    assert "no run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert command.main(["table", str(tmp_path / "empty")]) == 2
    assert "holds no answers yet" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        command.main(arguments("mlvu", checkpoint, data_root, out, "--budget", "0"))
    assert exit_info.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_help_lists_the_benchmarks_and_the_table(capsys):
    with pytest.raises(SystemExit):
        command.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in ("videomme", "mlvu", "ovobench", "table"))
    with pytest.raises(SystemExit):
        command.main(["ovobench", "--help"])
    assert "--videos {stream,clips}" in capsys.readouterr().out
