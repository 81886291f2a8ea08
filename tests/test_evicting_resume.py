"""An evicting stream saved and resumed (to a file, from its disk-tier folder, after a kill or a step the disk refused)
goes on as the stream that never stopped, its tally of attention too; a damaged tally is refused in one line."""

from __future__ import annotations

import shutil

import pytest
import torch

from statekv import Stream
from statekv.core.stream.prefill import cache_geometry
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


@pytest.mark.parametrize("where", ["file", "folder"])
@pytest.mark.parametrize("policy", ["evict-oldest", "evict-least-attended"])
def test_an_evicting_stream_resumed_goes_on_as_the_stream_that_never_stopped(adapter, where, policy, tmp_path,
                                                                            monkeypatch):
    """Saved to a file and loaded, or closed and resumed from its disk-tier folder, an evicting stream evicts what
    the stream that never stopped evicts and answers alike. Before: evict-least-attended's tally of attention per
    step was neither saved nor checkpointed, so a resumed stream ranked every earlier step zero."""
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)  # the stream stops at a checkpoint: its folder resumes whole
    settings = dict(offload=True, max_cache_bytes=200_000) if where == "file" else dict(
        offload="disk", offload_dir=tmp_path / "tier", max_cache_bytes=200_000)
    qa = tiny_qa(adapter, "statekv", cache_limit=policy, **settings)
    frames = random_frames(70)
    whole, stopped = qa.stream(), qa.stream()
    for frame in frames:
        whole.push(frame)
    for frame in frames[:39]:  # steps 0 (the prompt prefix) to 39, evicting already
        stopped.push(frame)
    assert stopped.prefill.cache.evicted_steps
    if where == "file":
        resumed = Stream.load(stopped.save(tmp_path / "s.safetensors"), qa)
    else:
        stopped.close()
        resumed = Stream.load(stopped.prefill.disk.folder, qa)
    for frame in frames[39:]:
        resumed.push(frame)
    assert len(whole.prefill.cache.evicted_steps) > 30
    assert resumed.prefill.cache.evicted_steps == whole.prefill.cache.evicted_steps
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       whole.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))


def test_an_evict_least_attended_folder_resumes_after_a_kill_or_a_step_the_disk_refused(adapter, tmp_path,
                                                                                        monkeypatch):
    """Before: a checkpoint of an empty tally could not be read back (a kill before the first scored checkpoint
    left a folder nothing resumed), and a step the disk refused left its attention in the tally (naming a step
    the stream did not hold: its next save or folder could not be loaded)."""
    from statekv.core.disk.tier import DiskTier
    from statekv.errors import OutputError

    qa = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path / "tier", max_cache_bytes=200_000,
                 cache_limit="evict-least-attended")
    frames = random_frames(40)
    stream = qa.stream()
    stream.push(frames[0])
    killed = Stream.load(shutil.copytree(stream.prefill.disk.folder, tmp_path / "killed",
                                         ignore=shutil.ignore_patterns("lock")), qa)
    assert killed.frames == 0 and killed.frames_lost == 1
    killed.close()
    reference = qa.stream()
    for frame in frames:
        reference.push(frame)
    for frame in frames[1:20]:
        stream.push(frame)
    commit = DiskTier.commit_step

    def full(self, *args, **kwargs):
        raise OutputError(f"cannot write the disk cache in {self.folder}: No space left on device")
    monkeypatch.setattr(DiskTier, "commit_step", full)
    with pytest.raises(OutputError, match="the step was not taken"):
        stream.push(frames[20])
    monkeypatch.setattr(DiskTier, "commit_step", commit)
    for frame in frames[20:]:
        stream.push(frame)
    assert stream.prefill.cache.evicted_steps == reference.prefill.cache.evicted_steps
    mine, theirs = (s.prefill.cache.tally.export(s.prefill.cache.evicted_steps) for s in (stream, reference))
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    loaded = Stream.load(stream.save(tmp_path / "s.safetensors"), tiny_qa(
        adapter, "statekv", offload=True, max_cache_bytes=200_000, cache_limit="evict-least-attended"))
    assert loaded.frames == 40
    stream.close()
    assert Stream.load(stream.prefill.disk.folder, qa).frames == 40


def test_a_damaged_attention_tally_is_refused_with_one_line(adapter):
    from statekv.core.cache.persistence import check_state_dict

    stream = tiny_qa(adapter, "statekv", offload=True, max_cache_bytes=200_000,
                     cache_limit="evict-least-attended").stream()
    for frame in random_frames(6):
        stream.push(frame)
    tensors, metadata = stream.prefill.state_dict()
    tally = metadata["attention_tally"]
    assert tally["steps"] and len(tally["steps"]) == len(tally["totals"])
    check_state_dict(tensors, metadata, cache_geometry(adapter.model))
    for bad in ({"steps": [0, 99], "totals": [1.0, 1.0]}, {"steps": [2, 1], "totals": [1.0, 1.0]},
                {"steps": [1], "totals": [-1.0]}, {"steps": [1], "totals": [float("nan")]}, [1, 2]):
        with pytest.raises(InputError) as error:
            check_state_dict(tensors, {**metadata, "attention_tally": bad}, cache_geometry(adapter.model))
        assert "attention_tally" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("policy", ["evict-oldest", "evict-least-attended"])
def test_a_saved_evicting_stream_loaded_into_the_disk_tier_journals_what_it_holds(adapter, policy, tmp_path):
    """Before: loading a saved stream into the disk tier journaled a whole record (and the checksums of its rows)
    for every step it ever took, evicted or not, then read them all back to compact them: a stream weeks old meant
    millions of records. Its evicted steps are now one record of runs; the folder resumes as the stream goes on."""
    import json

    settings = dict(max_cache_bytes=200_000, cache_limit=policy)
    frames = random_frames(60)
    saved = tiny_qa(adapter, "statekv", offload=True, **settings).stream()
    for frame in frames[:50]:
        saved.push(frame)
    path = saved.save(tmp_path / "s.safetensors")
    qa = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path / "tier", **settings)
    loaded = Stream.load(path, qa)
    cache = loaded.prefill.cache
    assert len(cache.evicted_steps) > 20
    lines = (loaded.prefill.disk.folder / "journal").read_text().splitlines()
    steps = [record["step"] for record in (json.loads(line.split(" ", 1)[1]) for line in lines) if "step" in record]
    assert steps == [step for step in range(len(cache.chunk_lengths)) if step not in cache.evicted_steps]
    loaded.close()
    resumed = Stream.load(loaded.prefill.disk.folder, qa)
    assert resumed.prefill.cache.evicted_steps == saved.prefill.cache.evicted_steps
    for frame in frames[50:]:
        resumed.push(frame)
        saved.push(frame)
    assert resumed.prefill.cache.evicted_steps == saved.prefill.cache.evicted_steps
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2),
                       saved.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2))
    resumed.close()


def test_a_loaded_states_evicted_steps_fold_as_their_records_would():
    """`loaded_record` (from the runs of a loaded state's steps) is the record `compacted_record` makes of the
    evicted steps' records."""
    import random

    from statekv.core.cache.step_runs import StepRuns
    from statekv.core.disk.compaction import compacted_record, loaded_record
    from statekv.core.storage.step_values import StepValues

    for seed in range(100):
        rng = random.Random(seed)
        count = rng.randrange(2, 80)
        tokens = [rng.choice([5, 5, 5, rng.randrange(1, 9)]) for _ in range(count)]
        frames = [rng.choice([1, 1, 2]) for _ in range(count)]
        placed = [[10 * step + rng.choice([0, 0, 1]), rng.choice([3, 3, 4]), rng.choice([0, 7])]
                  for step in range(count)]
        evicted = StepRuns(step for step in range(count - 1) if rng.random() < 0.6)
        records = [{"step": s, "tokens": tokens[s], "frames": frames[s], "placed": placed[s]} for s in sorted(evicted)]
        if records:
            assert loaded_record(evicted.runs(), StepValues(tokens), frames, placed) == compacted_record(records)
