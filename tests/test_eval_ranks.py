"""The ranks of a data-parallel evaluation (`statekv.eval.distributed.RankContext`): what a rank says when the
launch is broken or another rank goes away while it waits; the answer files the ranks write and read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from statekv.errors import ConfigurationError
from statekv.eval.distributed import RankContext
from statekv.eval.questions import Question
from statekv.eval.records import AnswerRecord, ResultsWriter, completed_qids, rank_file, read_records

# rank 1 joins and goes away at once; rank 0 then waits for it
RANK = """
import os, sys
from statekv.errors import StateKVError
from statekv.eval.distributed import RankContext
from statekv.eval.questions import Question
from statekv.eval.records import AnswerRecord, ResultsWriter, completed_qids, rank_file, read_records
context = RankContext.from_env()
context.connect()
if context.rank == 1:
    os._exit(0)
try:
    context.barrier()
except StateKVError as error:
    print(type(error).__name__, error, flush=True)
    os._exit(3)
"""


def _free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def test_a_rank_waiting_for_one_that_went_away_stops_with_one_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode == 3, err[-2000:]
    assert out.startswith("RankLostError rank 0 of 2: another rank of this run stopped while this one waited")
    assert "rerun the same command to resume" in out and len(out.strip().splitlines()) == 1



def test_a_launch_without_its_rendezvous_address_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigurationError, match=r"rank 0 of 2 cannot join .*MASTER_ADDR expected, but not set\)"):
        RankContext(rank=0, world_size=2).connect()


def test_an_answer_cut_inside_a_character_by_a_kill_is_ignored_not_called_corrupt(tmp_path):
    """Before: a rerun was refused ("corrupt answer record (not UTF-8 text)") where a kill cut the last line inside
    a character of a prediction, although an unterminated last line is ignored, then cut."""
    asked = [Question("synthetic", f"q{index}", "v0", tmp_path / "v0.mp4", "Which?", ("A. x", "B. y"), "A", "needle")
             for index in range(2)]
    path = rank_file(tmp_path, 1)
    with ResultsWriter(path) as out:
        for question in asked:
            out.write(AnswerRecord.for_answer(question, "A. caf\u00e9", model="m", method="full"))
    whole = path.read_bytes()
    path.write_bytes(whole[: whole.rindex("\u00e9".encode()) + 1])  # the second line cut after é's first byte
    assert [record.qid for record in read_records(path)] == ["q0"]
    assert completed_qids(tmp_path) == {"q0"}
    with ResultsWriter(path) as out:  # a rerun's writer cuts the half line, then appends
        out.write(AnswerRecord.for_answer(asked[1], "A", model="m", method="full"))
    assert [record.qid for record in read_records(path)] == ["q0", "q1"]
