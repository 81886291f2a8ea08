"""Resuming a disk-tier stream costs what it holds, not every step it ever streamed: a stream evicting under a cap
for weeks has millions of steps behind one ``compacted`` journal record, and reading its folder back never makes a
record per step of them."""

from __future__ import annotations

import json
import tracemalloc

import pytest

import statekv
from statekv.core.disk.compaction import COMPACTED
from statekv.core.disk.files import journal_line, read_file_set
from statekv.core.disk.resume import check_checkpoint
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

EVICTED = 1_000_000  # steps a fortnight's stream at about one a second evicted: ~400 MB as a dict each


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _shifted(record: dict, by: int) -> dict:
    """A journal record with the steps it names (past the prompt prefix, step 0) ``by`` later."""
    record = dict(record)
    if isinstance(record.get("step"), int) and record["step"]:
        record["step"] += by
    if "carry" in record:
        record["carry"] += by
    if "evict" in record:
        record["evict"] = [step + by for step in record["evict"]]
    if COMPACTED in record:
        record[COMPACTED] = [[first + by, difference, count] for first, difference, count in record[COMPACTED]]
        if "last_frame" in record:
            record["last_frame"] = [record["last_frame"][0] + by, record["last_frame"][1]]
    return record


def test_a_folder_with_a_million_compacted_steps_reads_back_in_what_it_holds(adapter, tmp_path, monkeypatch):
    """Before: every compacted step was unfolded into a dict of its own (~400 bytes a step) as the folder was read
    back, so a stream that had evicted for two weeks needed gigabytes to resume."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    stream = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path, max_cache_bytes=200_000,
                     cache_limit="evict-oldest").stream()
    for frame in random_frames(60):
        stream.push(frame)
    stream.close()
    folder = stream.prefill.disk.folder
    before = read_file_set(folder)
    lines = (folder / "journal").read_text().splitlines()
    records = [json.loads(line.split(" ", 1)[1]) for line in lines]
    assert any(COMPACTED in record for record in records)
    tokens = before.steps[1]["tokens"]
    standing = {COMPACTED: [[1, 1, EVICTED]], "tokens": [[tokens, 0, EVICTED]], "frames": [[1, 0, EVICTED]]}
    (folder / "journal").write_bytes(b"".join(
        [journal_line(records[0]), journal_line(standing), *(journal_line(_shifted(r, EVICTED)) for r in records[1:])]))
    tracemalloc.start()
    try:
        journal = read_file_set(folder)
        check_checkpoint(folder, journal)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # unfolded: ~290 MB
    assert len(journal.steps) == len(before.steps) + EVICTED
    assert len(journal.evicted) == len(before.evicted) + EVICTED
    assert journal.steps.tokens.total() == before.steps.tokens.total() + tokens * EVICTED
    assert journal.steps[EVICTED // 2]["tokens"] == tokens and journal.steps[EVICTED // 2]["frames"] == 1
    assert journal.steps[-1] == _shifted(before.steps[-1], EVICTED)
    assert journal.carry["carry"] == before.carry["carry"] + EVICTED
