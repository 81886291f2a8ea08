"""A disk-tier stream evicting under a cap keeps its journal bounded: the records of its evicted steps are folded
into one ``compacted`` record of runs (`statekv.core.disk.compaction`), what resumes it reads back the same, and it
streams on far past where its journal used to fill the cap."""

from __future__ import annotations

import json
import random
import shutil
import tracemalloc
import zlib

import pytest
import torch

import statekv
from statekv import Stream
from statekv.core.disk.compaction import (COMPACTED, compacted_record, folded_steps, joined, merged_record, runs,
                                          unfolded)
from statekv.core.disk.files import (FORMAT_VERSION, MANIFEST, MERGED_RECORDS, compacted_journal, journal_line,
                                     read_checked, read_file_set, write_checked)
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


@pytest.fixture
def often(monkeypatch):
    """The carried state checkpointed every 4 steps (a compaction can follow any checkpoint)."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)


def _records(folder) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in (folder / "journal").read_text().splitlines()]


def _evicting(adapter, folder, policy: str = "evict-oldest", cap: int = 200_000) -> statekv.VideoQA:
    """A VideoQA of disk-tier streams in ``folder`` evicting under ``cap`` bytes."""
    return tiny_qa(adapter, "statekv", offload="disk", offload_dir=folder, max_cache_bytes=cap, cache_limit=policy)


def _closed(qa, frames: int):
    """The folder of a stream of ``qa`` closed after ``frames`` random frames."""
    stream = qa.stream()
    for frame in random_frames(frames):
        stream.push(frame)
    stream.close()
    return stream.prefill.disk.folder


def _carried(stream) -> list[torch.Tensor]:
    return [t.cpu() for layer in stream.prefill.cache.layers for t in (*layer.carried(), layer.positions())]


def test_runs_fold_and_unfold_any_sequence():
    generator = random.Random(5)
    for _ in range(300):
        values = [generator.choice([generator.randrange(-50, 50), 7]) for _ in range(generator.randrange(0, 40))]
        start, step = generator.randrange(100), generator.randrange(-3, 4)
        values += [start + step * n for n in range(generator.randrange(0, 30))]
        assert unfolded(runs(values)) == values
    for _ in range(2000):  # runs joined without unfolding them read as the values one after the other
        left, right = ([generator.randrange(-4, 4) * (n % 3) + n * generator.choice([0, 1, 2]) for n in
                        range(generator.randrange(0, 12))] for _ in range(2))
        assert unfolded(joined(runs(left), runs(right))) == left + right
    assert runs([4] * 1000 + [5] * 3) == [[4, 0, 1000], [5, 0, 3]]
    assert runs(list(range(3, 4003, 4))) == [[3, 4, 1000]]
    for bad in ([[1, 0]], [[1, 0, 0]], [[1, 0, True]], "1,0,3", [[1.5, 0, 2]]):
        with pytest.raises(ValueError):
            unfolded(bad)


def test_a_compacted_record_reads_back_as_the_steps_it_stands_for():
    steps = [{"step": s, "tokens": 4 + (s > 20), "frames": 1, "crc": s, "placed": [4 * s, 4, 4 * s % 64],
              **({"last_frame": [s - 1, s / 2]} if s % 2 else {})} for s in [1, 2, 3, 5, 8, *range(9, 40)]]
    back = folded_steps(compacted_record(steps))
    assert [step["step"] for step in back] == [step["step"] for step in steps]
    assert all(b["tokens"] == s["tokens"] and b["frames"] == s["frames"] and b["placed"] == s["placed"]
               for b, s in zip(back, steps))
    assert back[-1]["last_frame"] == [38, 19.5] and all("last_frame" not in step for step in back[:-1])
    for broken in ({COMPACTED: [[1, 1, 3]], "tokens": [[4, 0, 2]], "frames": [[1, 0, 3]]},
                   {COMPACTED: [[3, -1, 3]], "tokens": [[4, 0, 3]], "frames": [[1, 0, 3]]},
                   {COMPACTED: [[1, 1, 2]], "tokens": [[4, 0, 2]], "frames": [[1, 0, 2]], "placed": [[[0, 0, 2]]]},
                   {COMPACTED: [[1, 1, 2]], "tokens": [[4, 0, 2]], "frames": [[1, 0, 2]], "last_frame": [9, [0, 0]]}):
        with pytest.raises(ValueError):
            folded_steps(broken)


@pytest.mark.parametrize("policy", ["evict-oldest", "evict-least-attended"])
def test_an_evicting_disk_tier_stream_keeps_its_journal_bounded_and_resumes_the_same(adapter, policy, often,
                                                                                     tmp_path):
    qa = _evicting(adapter, tmp_path, policy)
    stream = qa.stream()
    folder = stream.prefill.disk.folder
    sizes = []
    for frame in random_frames(120):
        stream.push(frame)
        sizes.append((folder / "journal").stat().st_size)
    evicted = set(stream.prefill.cache.evicted_steps)
    assert len(evicted) > 100
    # a journal line per step used to stay (about 40 KB here by the last frame, twice as much as at frame 60):
    # only its numbers' digits grow now
    assert max(sizes[60:]) <= 1.2 * max(sizes[20:60]) < 8_000, sizes
    records = _records(folder)
    assert sum(COMPACTED in record for record in records) == 1 and len(records) < 60
    assert read_checked(folder / MANIFEST)["version"] == FORMAT_VERSION
    answer = stream.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)
    frames, step_frames = stream.frames, list(stream.step_frames)
    lengths, carried = list(stream.prefill.cache.chunk_lengths), _carried(stream)
    stream.close()
    resumed = Stream.load(folder, qa)
    assert (resumed.frames, resumed.frames_lost, resumed.step_frames) == (frames, 0, step_frames)
    assert resumed.prefill.cache.chunk_lengths == lengths and resumed.prefill.cache.evicted_steps == evicted
    assert resumed.stats.evicted_frames == sum(step_frames[s] for s in evicted)
    assert all(torch.equal(a, b) for a, b in zip(_carried(resumed), carried))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer)
    for frame in random_frames(12, seed=1):  # and it goes on compacting
        resumed.push(frame)
    assert sum(COMPACTED in record for record in _records(folder)) == 1
    resumed.close()


def test_a_journal_compacted_reads_as_it_did(adapter, often, tmp_path, monkeypatch):
    """The same journal, whole and compacted: the same steps (what a resume reads of them), evictions, checkpoint
    and records after it; both resume to the same stream."""
    monkeypatch.setattr(statekv.core.disk.tier.DiskTier, "compact", lambda tier: None)  # the whole journal kept
    qa = _evicting(adapter, tmp_path / "live")
    stream = qa.stream()
    frames = random_frames(40)
    for frame in frames[:37]:  # not at a checkpoint: the frames after it are the lost ones
        stream.push(frame)
    folder = stream.prefill.disk.folder
    whole = shutil.copytree(folder, tmp_path / "whole")
    stream.close()
    data = (whole / "journal").read_bytes()
    compacted = compacted_journal(data)
    assert compacted is not None and len(compacted) < len(data) / 2
    folded = shutil.copytree(whole, tmp_path / "folded")
    (folded / "journal").write_bytes(compacted)
    assert compacted_journal(compacted) is None  # nothing left to fold
    before, after = read_file_set(whole), read_file_set(folded)
    assert sorted(before.evicted) == sorted(after.evicted) and after.carry == before.carry
    assert after.after == before.after and after.later_evictions == before.later_evictions
    read = ("step", "tokens", "frames", "placed")
    for old, new in zip(before.steps, after.steps, strict=True):
        assert new == old if old["step"] not in before.evicted else all(new.get(k) == old.get(k) for k in read)
    assert read_file_set(whole, latest=True).steps[-1] == read_file_set(folded, latest=True).steps[-1]
    (folded / "journal.partial").write_bytes(b"what a kill mid-compaction leaves")
    one, other = (Stream.load(path, qa) for path in (whole, folded))
    assert (one.frames, one.frames_lost) == (other.frames, other.frames_lost) and one.frames_lost > 0
    assert one.prefill.cache.evicted_steps == other.prefill.cache.evicted_steps
    assert all(torch.equal(a, b) for a, b in zip(_carried(one), _carried(other)))
    assert torch.equal(one.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       other.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
    one.close()
    other.close()


def test_an_evicting_disk_tier_stream_streams_past_where_its_journal_filled_the_cap(adapter, often, tmp_path):
    # the journal, counted under the cap and never evicted, used to fill this cap by frame 152
    stream = _evicting(adapter, tmp_path, cap=120_000).stream()
    frames = random_frames(50)
    for index in range(320):
        stream.push(frames[index % 50])
    assert stream.frames == 320 and stream.prefill.stats.held_bytes <= 120_000
    stream.close()


def test_steps_a_successor_replays_are_kept_whole():
    def step(number, **fields):
        return journal_line({"step": number, "tokens": 4, "crc": 1, "frames": 1, **fields})

    journal = (journal_line({"file_set": "f"}) + step(0, backlog=[0, 8, 1]) + step(1, backlog=[8, 8, 2])
               + step(2) + step(3) + journal_line({"evict": [1, 2]}) + step(4)
               + journal_line({"carry": 4, "slot": 0}) + journal_line({"push": 5, "t": 2.0}))
    lines = compacted_journal(journal).decode().splitlines()
    records = [json.loads(line.split(" ", 1)[1]) for line in lines]
    assert records[1][COMPACTED] == [[2, 0, 1]]
    assert [r.get("step") for r in records[2:6]] == [0, 1, 3, 4] and records[6] == {"evict": [1]}
    assert records[7:] == [{"carry": 4, "slot": 0}, {"push": 5, "t": 2.0}]


def test_later_evictions_join_the_compacted_record_or_sit_beside_it_until_merged(tmp_path):
    """A steady stream's evictions join its one compacted record at constant cost; steps evicted out of order
    (evict-least-attended) get records of their own, merged into one past MERGED_RECORDS."""
    def step(number):
        return journal_line({"step": number, "tokens": 4, "crc": 1, "frames": 1, "placed": [4 * number, 4, 0]})

    def journal(steps, evicted, folded=b""):
        return (journal_line({"file_set": "f"}) + folded + b"".join(step(n) for n in steps)
                + journal_line({"evict": evicted}) + journal_line({"carry": max(steps), "slot": 0}))

    def compacted(data):
        return [json.loads(line.split(b" ", 1)[1]) for line in data.split(b"\n") if b'"compacted"' in line]

    first = compacted_journal(journal(range(0, 200), list(range(1, 100))))
    later = compacted_journal(journal(range(100, 300), list(range(100, 250)), b"".join(
        journal_line(record) for record in compacted(first))))
    (record,) = compacted(later)
    assert record[COMPACTED] == [[1, 1, 249]] and record["tokens"] == [[4, 0, 249]]
    folded, held = list(range(1, 100)), list(range(100, 200))  # steps evicted newest first: beside, then merged
    records = compacted(first)
    for round_ in range(MERGED_RECORDS + 1):
        evicted = [held.pop(-2) for _ in range(3)][::-1]  # below the last record's steps from the second round on
        data = compacted_journal(journal(sorted(held + evicted), evicted, b"".join(map(journal_line, records))))
        records, folded = compacted(data), sorted(folded + evicted)
        assert len(records) == (round_ + 1 if round_ + 1 <= MERGED_RECORDS else 1), round_
        assert sorted(s["step"] for r in records for s in folded_steps(r)) == folded


def test_a_damaged_compacted_record_is_refused_with_one_line(adapter, often, tmp_path):
    qa = _evicting(adapter, tmp_path)
    folder = _closed(qa, 90)
    lines = (folder / "journal").read_bytes().split(b"\n")
    index = next(i for i, line in enumerate(lines) if b'"compacted"' in line)
    record = json.loads(lines[index].split(b" ", 1)[1])
    for damaged, needle in (({**record, COMPACTED: [[2, 1, len(unfolded(record[COMPACTED]))]]}, "journal is damaged"),
                            ({**record, "tokens": [[4, 0, 1]]}, "compacted steps do not read")):
        text = json.dumps(damaged, separators=(",", ":")).encode()
        (folder / "journal").write_bytes(b"\n".join([*lines[:index], b"%08x %s" % (zlib.crc32(text), text),
                                                     *lines[index + 1:]]))
        with pytest.raises(InputError) as error:
            Stream.load(folder, qa)
        assert needle in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_format_3_file_set_resumes_and_says_the_current_format_once_written_to(adapter, often, tmp_path):
    """Before an earlier statekv could read it as damaged (a checkpoint it cannot read, a compacted journal)."""
    qa = _evicting(adapter, tmp_path)
    folder = _closed(qa, 10)
    write_checked(folder / MANIFEST, {**read_checked(folder / MANIFEST), "version": 3})  # as statekv wrote before
    resumed = Stream.load(folder, qa)
    assert read_checked(folder / MANIFEST)["version"] == FORMAT_VERSION
    for frame in random_frames(80, seed=2):
        resumed.push(frame)
    assert sum(COMPACTED in record for record in _records(folder)) == 1
    resumed.close()
    write_checked(folder / MANIFEST, {**read_checked(folder / MANIFEST), "version": 6})
    with pytest.raises(InputError, match="format 6; this statekv reads 3 and 4 and 5"):
        Stream.load(folder, qa)


def test_merging_compacted_records_gives_what_unfolding_them_gave():
    """Records whose steps interleave (evict-least-attended) merge into the record their steps unfolded make."""
    generator = random.Random(3)
    for _ in range(400):
        count, kinds = generator.randrange(1, 120), generator.randrange(1, 6)
        owner, placed = [generator.randrange(kinds) for _ in range(count)], generator.random() < 0.7
        groups = []
        for kind in range(kinds):
            steps = [{"step": s, "tokens": generator.choice([64, 65, s % 3 + 1]), "frames": generator.choice([1, 0])}
                     for s in range(count) if owner[s] == kind and generator.random() < 0.9]
            for step in steps if placed or generator.random() < 0.5 else ():
                step["placed"] = [64 * step["step"] if generator.random() < 0.9 else 3, 64, generator.choice([0, 7])]
            if steps and generator.random() < 0.5:
                generator.choice(steps)["last_frame"] = [generator.randrange(9), 2]
            if steps:
                groups.append(compacted_record(steps))
        every = sorted((step for record in groups for step in folded_steps(record)), key=lambda step: step["step"])
        assert journal_line(merged_record(groups)) == journal_line(compacted_record(every))
    with pytest.raises(ValueError):  # the same step in two records
        merged_record([compacted_record([{"step": 3, "tokens": 4}])] * 2)


def test_merging_compacted_records_does_not_unfold_the_steps_they_stand_for():
    """A stream evicting its least-attended steps for weeks: merging its compacted records (past MERGED_RECORDS)
    costs what their runs hold, not a record per step it ever evicted."""
    kinds, block, total = MERGED_RECORDS + 1, 1000, 200_000
    lines = [journal_line({"file_set": "x"})]
    for kind in range(kinds):  # every kinds-th block of steps: a steady camera's, evicted in turn
        steps = [[first, 1, block] for first in range(kind * block, total, kinds * block)]
        held = sum(run[2] for run in steps)
        lines.append(journal_line({COMPACTED: steps, "tokens": [[64, 0, held]], "frames": [[1, 0, held]]}))
    lines += [journal_line({"step": total, "tokens": 64, "frames": 1, "crc": 0}), journal_line({"evict": [total]}),
              journal_line({"step": total + 1, "tokens": 64, "frames": 1, "crc": 0}),
              journal_line({"carry": total + 1, "slot": 0})]
    tracemalloc.start()
    try:
        compacted = compacted_journal(b"".join(lines))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    records = [json.loads(line.split(b" ", 1)[1]) for line in compacted.splitlines()]
    assert [record for record in records if COMPACTED in record] == [
        {COMPACTED: [[0, 1, total + 1]], "tokens": [[64, 0, total + 1]], "frames": [[1, 0, total + 1]]}]
    assert peak < 2 << 20, peak  # unfolding them took ~400 bytes a step
