"""The ranks of a data-parallel evaluation (`statekv.eval.distributed.RankContext`): what a rank says when the
launch is broken or another rank goes away while it waits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from statekv.errors import ConfigurationError
from statekv.eval.distributed import RankContext

# rank 1 joins and goes away at once; rank 0 then waits for it
RANK = """
import os, sys
from statekv.errors import StateKVError
from statekv.eval.distributed import RankContext
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
