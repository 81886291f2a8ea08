"""The disk tier of the detailed cache (offload="disk"): answers identical to the in-memory cache, nothing of the
detailed cache or its step summaries in RAM, durability (its contract: a kill loses at most the steps since the
last checkpoint of the carried state; a real kill -9, then Stream.load), damaged and foreign file sets refused."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import statekv
from statekv import Stream
from statekv.core.disk.buffers import MappedTokenBuffer
from statekv.core.disk.mirrored import MirroredTokenBuffer
from statekv.errors import CacheLimitError, ConfigurationError, InputError, OutputError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
CHILD_TIMEOUT = 120


@pytest.fixture
def every_step(monkeypatch):
    """The carried state checkpointed at every step: a stream resumes exactly where it stopped."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 1)


@pytest.fixture(scope="module")
def adapters(checkpoint):
    return {layout: load_adapter(checkpoint, layout=layout) for layout in ("paper", "chat")}


def _carried(stream) -> list[torch.Tensor]:
    out = []
    for layer in stream.prefill.cache.layers:
        out += [t.cpu() for t in layer.carried()] + [layer.positions().cpu()]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["paper", "chat"])
@pytest.mark.parametrize("method", ["statekv", "recency"])
def test_disk_tier_answers_as_the_in_memory_cache(adapters, layout, method, tmp_path):
    memory = tiny_qa(adapters[layout], method).stream(horizon_frames=6)
    disk = tiny_qa(adapters[layout], method, offload="disk", offload_dir=tmp_path).stream(horizon_frames=6)
    for frame in random_frames(6):
        memory.push(frame)
        disk.push(frame)
    assert _same(_carried(disk), _carried(memory))
    for layer_disk, layer_memory in zip(disk.prefill.cache.layers, memory.prefill.cache.layers):
        length = layer_memory.detailed.length
        assert _same(layer_disk.detailed.view(0, length), layer_memory.detailed.view(0, length))
    for retrieve in (None, 2):  # the whole cache, and 2 retrieved frames per layer
        assert torch.equal(disk.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve),
                           memory.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve))


def test_nothing_of_the_detailed_cache_is_held_in_ram(adapters, tmp_path):
    stream = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path).stream(horizon_frames=4)
    for frame in random_frames(4):
        stream.push(frame)
    folder = stream.prefill.disk.folder
    assert folder.parent == tmp_path and (folder / "journal").is_file() and (folder / "stream.json").is_file()
    steps = len(stream.prefill.cache.chunk_lengths)
    for index, layer in enumerate(stream.prefill.cache.layers):
        detailed = layer.storage.detailed
        assert isinstance(detailed, MappedTokenBuffer) and detailed.length == stream.tokens
        # every token's keys and values are in the layer's files, appended in token order
        files = sorted(folder.glob(f"layer{index}.detailed.*.bin"))  # one block of each part, so far
        assert [p.name for p in files] == [f"layer{index}.detailed.0.0.bin", f"layer{index}.detailed.1.0.bin"]
        on_disk = sum(os.path.getsize(path) for path in files)
        assert on_disk >= detailed.nbytes == 2 * stream.tokens * detailed.row_bytes
        # the step summaries are in files too; in RAM only the segment index, one row per 16 steps
        for summary in (layer.storage.block_keys, layer.storage.step_samples):
            assert isinstance(summary, MappedTokenBuffer) and summary.length == steps
        assert isinstance(layer.storage.segment_index, MirroredTokenBuffer)
        assert layer.storage.segment_index.length == steps // 16


def test_a_stream_never_killed_resumes_from_its_folder_and_continues_bit_identically(adapters, tmp_path, every_step):
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    frames = random_frames(7)
    stream = qa.stream(horizon_frames=7, vision_batch=3)
    for frame in frames[:5]:
        stream.push(frame)  # 3 encoded in one batch, 2 pending
    folder = stream.prefill.disk.folder
    stream.close()  # one owner at a time: its lock goes; the frames waiting for their batch are kept beside it
    resumed = Stream.load(folder, qa)
    assert (resumed.frames, resumed.frames_lost, resumed.pushed, len(resumed.pending)) == (3, 0, 5, 2)
    reference = tiny_qa(adapters["chat"]).stream(horizon_frames=7)
    for frame in frames[:3]:
        reference.push(frame)
    assert _same(_carried(resumed), _carried(reference))
    for frame in frames[5:]:
        resumed.push(frame)
    for frame in frames[3:]:
        reference.push(frame)
    resumed.flush()
    assert _same(_carried(resumed), _carried(reference))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6), reference.ask_tokens(QUESTION, max_new_tokens=6))
    resumed.close()
    again = Stream.load(folder, qa)  # the resumed stream journals into the same file set
    assert (again.frames, again.frames_lost) == (7, 0)


def test_a_stream_named_in_any_script_gets_a_folder_a_service_record_accepts(adapters, tmp_path):
    from statekv.serve.store import TIER_NAME

    stream = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path).stream(horizon_frames=2, name="Küche café")
    stream.push(random_frames(1)[0])
    name = stream.prefill.disk.folder.name
    assert name.startswith("K-che-caf--") and name.isascii() and TIER_NAME.fullmatch(name)
    assert TIER_NAME.fullmatch("café-b10ac339") and not TIER_NAME.fullmatch("a/b") and not TIER_NAME.fullmatch("..")
    stream.close()


def test_a_saved_disk_tier_stream_loads_with_nothing_lost(adapters, tmp_path):
    qa = tiny_qa(adapters["paper"], offload="disk", offload_dir=tmp_path / "cache")
    stream = qa.stream(horizon_frames=4)
    for frame in random_frames(3):
        stream.push(frame)
    saved = stream.save(tmp_path / "s.safetensors")
    expected = stream.ask_tokens(QUESTION, max_new_tokens=6)
    stream.close()
    for loaded in (Stream.load(saved, qa), Stream.load(stream.prefill.disk.folder, qa)):
        assert (loaded.frames, loaded.frames_lost) == (3, 0)
        assert torch.equal(loaded.ask_tokens(QUESTION, max_new_tokens=6), expected)
    # the file loaded into the disk tier got a file set of its own, which resumes too
    from_file = Stream.load(saved, qa)
    from_file.close()
    assert (Stream.load(from_file.prefill.disk.folder, qa).frames, from_file.prefill.disk.folder.exists()) == (3, True)


def _disk_stream(adapter, folder, frames=3):
    stream = tiny_qa(adapter, offload="disk", offload_dir=folder).stream(horizon_frames=4)
    for frame in random_frames(frames):
        stream.push(frame)
    stream.close()
    return stream.prefill.disk.folder


def _refused(folder, qa, needle):
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    message = str(error.value)
    assert "\n" not in message and needle in message, message


def test_damaged_file_sets_are_refused_with_one_line(adapters, tmp_path):
    adapter = adapters["paper"]
    qa = tiny_qa(adapter, offload="disk", offload_dir=tmp_path)
    folder = _disk_stream(adapter, tmp_path / "a")
    data = bytearray((folder / "layer1.detailed.0.0.bin").read_bytes())
    data[5] ^= 0xFF
    (folder / "layer1.detailed.0.0.bin").write_bytes(bytes(data))
    _refused(folder, qa, "damaged: step 0's data")

    folder = _disk_stream(adapter, tmp_path / "b")
    (folder / "carry.0.bin").write_bytes(b"\0" * 8)
    (folder / "carry.1.bin").write_bytes(b"\0" * 8)
    _refused(folder, qa, "carried state")

    folder = _disk_stream(adapter, tmp_path / "c")
    lines = (folder / "journal").read_bytes().split(b"\n")
    stepped = next(number for number, line in enumerate(lines) if b'"tokens":' in line)  # the first step's
    lines[stepped] = lines[stepped].replace(b'"tokens":', b'"tokens": ')  # its CRC no longer matches
    (folder / "journal").write_bytes(b"\n".join(lines))
    _refused(folder, qa, f"journal is damaged at line {stepped + 1}")

    folder = _disk_stream(adapter, tmp_path / "d")
    with open(folder / "journal", "ab") as journal:  # what a kill mid-write leaves: a torn last line
        journal.write(b'1234abcd {"step": 3, "tok')
    assert Stream.load(folder, qa).frames == 3

    folder = _disk_stream(adapter, tmp_path / "e")
    (folder / "manifest.json").write_text("{}")
    _refused(folder, qa, "not a statekv disk cache")
    _refused(tmp_path, qa, "not a statekv disk cache")

    for damage in ("missing", "short"):  # before: either named the layer's other file, ``.0.bin``
        folder = _disk_stream(adapter, tmp_path / f"values {damage}")
        values = folder / "layer1.detailed.1.0.bin"  # the values' first block
        if damage == "missing":
            values.unlink()
        else:
            values.write_bytes(b"")
        _refused(folder, qa, "the disk cache is damaged: " + (  # a block gone was given back, unless a step held it
            "step 0's data does not match" if damage == "missing" else
            "layer1.detailed.1.0.bin is shorter than the rows its journal lists"))
        assert values.exists() == (damage == "short")  # not made again by the refused load

    folder = _disk_stream(adapter, tmp_path / "f")  # before: reading a pipe waited for a writer, for ever
    (folder / "stream.json").unlink()
    os.mkfifo(folder / "stream.json")
    _refused(folder, qa, "stream.json is not a regular file; a disk-tier file set holds only files and folders")
    os.mkfifo(tmp_path / "pipe.safetensors")
    _refused(tmp_path / "pipe.safetensors", qa, "pipe.safetensors: not a regular file; a saved stream is one")


def test_foreign_file_sets_are_refused_with_one_line(adapters, checkpoint, tmp_path):
    folder = _disk_stream(adapters["paper"], tmp_path / "a")
    _refused(folder, tiny_qa(adapters["paper"], "recency"),
             "but this VideoQA uses method 'Recency' (Recency(frames=2))")
    _refused(folder, tiny_qa(adapters["chat"]), "layout")
    other = load_adapter(make_tiny_checkpoint("internvl", tmp_path / "other", seed=1))
    _refused(folder, tiny_qa(other), "other weights")


def test_bad_disk_options_are_refused_with_one_line(adapters, tmp_path):
    adapter = adapters["paper"]
    (tmp_path / "file").write_text("x")
    cases = [(dict(offload="disk"), ConfigurationError, "offload_dir"),
             (dict(offload_dir=tmp_path), ConfigurationError, "only used with offload='disk'"),
             (dict(offload="tape"), ConfigurationError, "offload"),
             (dict(offload="disk", offload_dir=tmp_path / "file"), OutputError, "not a folder")]
    for kwargs, kind, needle in cases:
        with pytest.raises(kind) as error:
            tiny_qa(adapter, **kwargs)
        assert "\n" not in str(error.value) and needle in str(error.value), str(error.value)
    with pytest.raises(ConfigurationError, match="offload_dir"):
        statekv.StreamingPrefill(adapter.model, statekv.StateKV(budget=4), offload="disk")


def test_cli_offload_takes_disk_and_stays_a_plain_flag(tmp_path):
    from statekv.settings.options import ModelOptions, normalize_argv
    import argparse

    parser = argparse.ArgumentParser()
    ModelOptions.add_arguments(parser)
    parser.add_argument("video")
    parse = lambda *argv: ModelOptions.from_args(parser.parse_args(normalize_argv(["--model", "m", *argv])))
    assert parse("--offload", "v.mp4").offload is True  # the flag never takes the video as its value
    assert parse("v.mp4", "--offload").offload is True
    tier = str(tmp_path / "tier")  # not a shared path: another program may hold a file there
    options = parse("--offload", "disk", "--offload-dir", tier, "--max-cache-bytes", "20G", "v.mp4")
    assert (options.offload, options.offload_dir, options.max_cache_bytes) == ("disk", tier, 20 << 30)
    with pytest.raises(SystemExit):
        parse("--max-cache-bytes", "twenty", "v.mp4")


KILLED_CHILD = """
import sys, numpy as np, statekv
from statekv.models import load_adapter
statekv.core.disk.tier.CHECKPOINT_STEPS = 4  # the carried state checkpointed every 4 steps: a kill loses at most 3
adapter = load_adapter(sys.argv[1])
qa = statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40, offload="disk",
                     offload_dir=sys.argv[2])
frames = np.random.default_rng(0).integers(0, 256, (60, 24, 32, 3), dtype=np.uint8)
stream = qa.stream(horizon_frames=60)
print("folder", stream.prefill.disk.folder, flush=True)
for index, frame in enumerate(frames):
    stream.push(frame)
    print("pushed", index, flush=True)
"""


def test_kill_9_mid_stream_then_load_resumes_from_the_last_durable_frame(adapters, checkpoint, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_CHILD), str(checkpoint), str(tmp_path)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder, last, deadline = None, -1, time.monotonic() + CHILD_TIMEOUT
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        if line.startswith("folder "):
            folder = Path(line.split(" ", 1)[1].strip())
        if line.startswith("pushed "):
            last = int(line.split()[1])
            if last == 6:
                child.send_signal(signal.SIGKILL)  # lands wherever the child is: between or inside steps
                break
    child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == -signal.SIGKILL and folder is not None, child.stderr
    qa = tiny_qa(adapters["paper"], offload="disk", offload_dir=tmp_path)
    resumed = Stream.load(folder, qa)
    # the last checkpoint was at step 3 or 7 (each step a frame: the paper layout has no prompt prefix); the frames
    # pushed after it (at most the 3 steps since, and one more in flight) are counted lost
    assert resumed.frames in (4, 8) and resumed.pushed == resumed.frames and 0 <= resumed.frames_lost <= 4
    assert resumed.frames + resumed.frames_lost >= 7
    frames = random_frames(60)
    reference = tiny_qa(adapters["paper"]).stream(horizon_frames=60)
    for frame in frames[: resumed.frames]:
        reference.push(frame)
    assert _same(_carried(resumed), _carried(reference))
    for frame in frames[resumed.frames: resumed.frames + 2]:  # and it goes on as if it had never stopped
        resumed.push(frame)
        reference.push(frame)
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=3),
                       reference.ask_tokens(QUESTION, max_new_tokens=6, retrieve=3))


def test_a_kill_loses_at_most_the_steps_since_the_last_checkpoint(adapters, tmp_path, monkeypatch):
    """The durability contract: the carried state is checkpointed at the first step and every CHECKPOINT_STEPS
    steps, so a stream that stops without saving resumes at its last checkpoint (what follows counted as lost) and
    goes on exactly as a stream that streamed only up to there; saving, syncing or closing checkpoints."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    frames = random_frames(12)
    stream = qa.stream(horizon_frames=12)
    for frame in frames[:10]:  # steps: the prompt prefix, then a frame each; checkpoints after steps 0, 3 and 7
        stream.push(frame)
    folder = stream.prefill.disk.folder
    carries = [line for line in (folder / "journal").read_text().splitlines() if '"carry"' in line]
    assert len(carries) == 3
    killed = shutil.copytree(folder, tmp_path / "killed")  # the files as a kill leaves them: nothing was saved
    resumed = Stream.load(killed, qa)
    assert (resumed.frames, resumed.frames_lost, resumed.pushed) == (7, 3, 7)
    reference = tiny_qa(adapters["chat"]).stream(horizon_frames=12)
    for frame in frames[:7]:
        reference.push(frame)
    assert _same(_carried(resumed), _carried(reference))
    for frame in frames[7:]:
        resumed.push(frame)
        reference.push(frame)
    assert _same(_carried(resumed), _carried(reference))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6), reference.ask_tokens(QUESTION, max_new_tokens=6))
    resumed.prefill.sync()  # a sync checkpoints: nothing lost
    synced = Stream.load(shutil.copytree(killed, tmp_path / "synced"), qa)
    assert (synced.frames, synced.frames_lost) == (12, 0)


def test_stream_sync_makes_the_file_set_durable_up_to_now(adapters, tmp_path):
    """`Stream.sync` (what `statekv serve` saves a disk-tier stream with) checkpoints the last step and syncs the
    file set: a kill after it resumes every frame taken, though no checkpoint was due since the first step."""
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "tier")
    stream = qa.stream(horizon_frames=12)
    for frame in random_frames(10):
        stream.push(frame)
    folder = stream.prefill.disk.folder
    unsynced = Stream.load(shutil.copytree(folder, tmp_path / "unsynced"), qa)
    assert unsynced.frames_lost > 0
    stream.sync()
    resumed = Stream.load(shutil.copytree(folder, tmp_path / "killed"), qa)
    assert (resumed.frames, resumed.frames_lost) == (10, 0)
    unsynced.close()
    resumed.close()
    stream.close()


def test_int4_on_disk_answers_as_int4_in_memory_and_resumes(adapters, tmp_path, every_step):
    frames = random_frames(6)
    memory = tiny_qa(adapters["chat"], offload=True, kv_cache_dtype="int4").stream(horizon_frames=6)
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path, kv_cache_dtype="int4")
    disk = qa.stream(horizon_frames=6)
    for frame in frames[:4]:
        memory.push(frame)
        disk.push(frame)
    names = sorted(path.name for path in disk.prefill.disk.folder.glob("layer0.*.bin"))
    assert names == ["layer0.key_codes.0.0.bin", "layer0.key_scales.0.0.bin", "layer0.step_means.0.0.bin",
                     "layer0.step_samples.0.0.bin", "layer0.value_codes.0.0.bin", "layer0.value_scales.0.0.bin"]
    disk.close()
    with pytest.raises(InputError, match="kv_cache_dtype"):  # a file set is resumed as it was stored
        Stream.load(disk.prefill.disk.folder, tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path))
    resumed = Stream.load(disk.prefill.disk.folder, qa)
    for frame in frames[4:]:
        memory.push(frame)
        resumed.push(frame)
    assert _same(_carried(resumed), _carried(memory))
    for retrieve in (None, 2):
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve),
                           memory.ask_tokens(QUESTION, max_new_tokens=6, retrieve=retrieve))


def test_disk_tier_streams_stepped_together_journal_every_step_and_resume(adapters, tmp_path, every_step):
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    streams = [qa.stream(horizon_frames=10, name=f"s{i}") for i in range(3)]
    frames = [random_frames(8, seed=i) for i in range(3)]
    for t in range(8):
        qa.push_many([(stream, frames[i][t], float(t)) for i, stream in enumerate(streams)])
    assert qa.step_scheduler.batched_steps > 0  # steady steps shared forwards
    for i, stream in enumerate(streams):
        stream.close()
        resumed = Stream.load(stream.prefill.disk.folder, qa)
        assert (resumed.frames, resumed.frames_lost) == (8, 0)
        reference = tiny_qa(adapters["chat"]).stream(horizon_frames=10)
        for frame in frames[i]:
            reference.push(frame)
        assert _same(_carried(resumed), _carried(reference))
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6),
                           reference.ask_tokens(QUESTION, max_new_tokens=6))


@pytest.mark.parametrize("checkpoint_steps", [64, 3])
def test_frames_waiting_for_their_batch_at_a_checkpoint_are_counted_lost(adapters, tmp_path, monkeypatch,
                                                                          checkpoint_steps):
    """A checkpoint taken while frames wait for their batch (at a close, or inside a batch's steps) journals them
    again after it: whatever the checkpoint it resumes from, a resumed stream counts every frame pushed and not
    streamed, unless the stream was closed: then it holds them, waiting again."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", checkpoint_steps)
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "cache")
    frames = random_frames(14)
    for pushed in range(1, 15):
        stream = qa.stream(horizon_frames=16, vision_batch=4)
        for frame in frames[:pushed]:
            stream.push(frame)
        killed = shutil.copytree(stream.prefill.disk.folder, tmp_path / f"killed{pushed}",
                                 ignore=shutil.ignore_patterns("lock"))
        stream.close()
        resumed = Stream.load(killed, qa)  # as a kill leaves it
        assert resumed.frames + resumed.frames_lost == pushed, pushed
        resumed.close()
        resumed = Stream.load(stream.prefill.disk.folder, qa)
        assert (resumed.frames + len(resumed.pending), resumed.frames_lost) == (pushed, 0), pushed
        resumed.close()


def test_a_stream_killed_inside_a_vision_call_resumes_as_the_stream_that_never_stopped(adapters, tmp_path,
                                                                                     monkeypatch):
    """A checkpoint due inside a vision-tower call waits for the call's last step, so a stream killed anywhere
    resumes where a call began and encodes the frames it lost in the calls the stream that never stopped did: its
    keys, values and answers are that stream's, bit for bit. Before: a checkpoint inside a call had the resumed
    stream encode the frames after it in other calls, whose features differ by float rounding."""
    monkeypatch.setattr(statekv.core.disk.tier, "CHECKPOINT_STEPS", 4)
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "cache")
    frames = random_frames(24)
    whole = qa.stream(horizon_frames=24, vision_batch=3)
    for frame in frames:
        whole.push(frame)
    checkpoints = [json.loads(line.split(" ", 1)[1])["carry"] for line in
                   (whole.prefill.disk.folder / "journal").read_text().splitlines() if '"carry"' in line]
    assert checkpoints == [0, 3, 9, 12, 15, 21, 24]  # steps: the prompt prefix, then a frame each, 3 to a call
    for pushed in (5, 10, 17):
        stopped = qa.stream(horizon_frames=24, vision_batch=3)
        for frame in frames[:pushed]:
            stopped.push(frame)
        killed = shutil.copytree(stopped.prefill.disk.folder, tmp_path / f"killed{pushed}",
                                 ignore=shutil.ignore_patterns("lock"))
        resumed = Stream.load(killed, qa)
        assert resumed.frames % 3 == 0 and resumed.frames + resumed.frames_lost == pushed, pushed
        for frame in frames[resumed.frames:]:
            resumed.push(frame)
        whole_keys, resumed_keys = (s.prefill.state_dict()[0] for s in (whole, resumed))
        assert whole_keys.keys() == resumed_keys.keys()
        assert all(torch.equal(whole_keys[name], resumed_keys[name]) for name in whole_keys), pushed
        assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=6, retrieve=2),
                           whole.ask_tokens(QUESTION, max_new_tokens=6, retrieve=2))
        stopped.close()
        resumed.close()


def test_an_evicting_disk_tier_streams_detailed_bytes_follow_what_it_holds(adapters, tmp_path):
    """The evicted rows are holes in the files. Before: ``detailed_bytes`` (and ``cache_bytes``, and the service's
    ``statekv_cache_bytes``) counted every row ever written: 118 MB at frame 20,000 under a 2 MiB cap."""
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path, max_cache_bytes=120_000,
                 cache_limit="evict-oldest")
    stream = qa.stream()
    for frame in random_frames(200):
        stream.push(frame)
    assert len(stream.prefill.cache.evicted_steps) > 150
    assert stream.prefill.stats.detailed_bytes <= 120_000 and stream.stats.cache_bytes <= 120_000
    stream.close()


def test_a_question_of_a_stream_whose_folder_was_removed_is_one_line(adapters, tmp_path):
    """Before: torch's own error, several lines long (over HTTP a 500 with a traceback in the log)."""
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    stream = qa.stream(horizon_frames=4)
    for frame in random_frames(3):
        stream.push(frame)
    shutil.rmtree(stream.prefill.disk.folder)
    with pytest.raises(OutputError) as error:
        stream.ask_tokens(QUESTION, max_new_tokens=2)
    assert "\n" not in str(error.value) and "is missing or shorter" in str(error.value)


def test_a_saved_file_with_waiting_frames_loaded_into_the_tier_resumes_after_a_crash_taking_them_again(
        adapters, tmp_path, monkeypatch):
    """Before: the tier recorded the last frame encoded with the first waiting frame's time, so after a crash the
    resumed stream's clock stood at that frame: pushed again, it was dropped (under max_fps) or skipped (by
    `statekv stream --resume`), and the stream ended a frame short."""
    frames = random_frames(12)
    saved = tiny_qa(adapters["chat"]).stream(max_fps=1, vision_batch=4)
    for index in range(6):  # 4 encoded, 2 waiting for their batch
        saved.push(frames[index], float(index))
    path = saved.save(tmp_path / "s.safetensors")
    disk = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "tier")
    tiered = Stream.load(path, disk)
    folder = tiered.prefill.disk.folder
    monkeypatch.setattr(tiered.durability, "closing", lambda *args: None)  # it dies: its waiting frames not kept
    tiered.close()
    resumed = Stream.load(folder, disk)
    assert (resumed.frames, resumed.pushed, resumed.frames_lost) == (4, 4, 2)
    assert (resumed.last_timestamp, resumed.encoded_timestamp, resumed.next_tick) == (3.0, 3.0, 4)
    assert all(resumed.push(frames[index], float(index)) for index in range(4, 12))
    resumed.flush()
    assert resumed.frames == 12
    resumed.close()
    saved.close()


def test_a_resumed_folder_keeps_its_frame_rate_clock(adapters, tmp_path):
    """A stream under max_fps closed and resumed from its folder drops the frames the stream that never stopped
    drops (its clock, ``next_tick``, is the last kept frame's)."""
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    frames = random_frames(30)
    whole, stopped = qa.stream(max_fps=2), qa.stream(max_fps=2)
    kept = [whole.push(frame, 0.3 * index) for index, frame in enumerate(frames)]
    again = [stopped.push(frame, 0.3 * index) for index, frame in enumerate(frames[:17])]
    assert not again[-1]  # the last frame pushed was dropped: the clock counts it all the same
    folder, tick = stopped.prefill.disk.folder, stopped.next_tick
    stopped.close()
    resumed = Stream.load(folder, qa)
    assert (resumed.next_tick, resumed.pushed, resumed.frames_lost) == (tick, 17, 0)
    assert (resumed.last_timestamp, resumed.kept_timestamp) == (stopped.last_timestamp, stopped.kept_timestamp)
    again += [resumed.push(frame, 0.3 * index) for index, frame in enumerate(frames[17:], start=17)]
    assert again == kept and resumed.frames == whole.frames
    whole.close()
    resumed.close()


def test_frames_waiting_for_their_batch_are_kept_when_the_stream_closes(adapters, tmp_path):
    """Before: a closed disk-tier stream counted the frames waiting for their vision batch as lost."""
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path)
    frames = random_frames(14)
    whole, stopped = qa.stream(vision_batch=4), qa.stream(vision_batch=4)
    for frame in frames:
        whole.push(frame)
    for frame in frames[:10]:  # two batches streamed, two frames waiting
        stopped.push(frame)
    assert len(stopped.pending) == 2
    folder = stopped.prefill.disk.folder
    stopped.close()
    copy = shutil.copytree(folder, tmp_path / "copy")
    resumed = Stream.load(folder, qa)
    assert (resumed.frames, len(resumed.pending), resumed.pushed, resumed.frames_lost) == (8, 2, 10, 0)
    killed = Stream.load(shutil.copytree(folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock")), qa)
    assert (killed.frames, len(killed.pending), killed.frames_lost) == (8, 2, 0)  # resumed, then killed: kept still
    killed.close()
    for frame in frames[10:]:
        resumed.push(frame)
    assert resumed.frames == whole.frames == 12 and _same(_carried(resumed), _carried(whole))
    assert torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4), whole.ask_tokens(QUESTION, max_new_tokens=4))
    (copy / "waiting.safetensors").write_bytes(b"damaged")  # then they are lost, and counted
    damaged = Stream.load(copy, qa)
    assert (damaged.frames, len(damaged.pending), damaged.frames_lost) == (8, 0, 2)
    for stream in (whole, resumed, damaged):
        stream.close()


def test_a_stream_closed_before_its_first_step_says_what_it_lost_and_flush_keeps_it(adapters, tmp_path, caplog):
    """Before: a disk-tier stream closed with frames waiting for its first vision batch and a watch open removed its
    folder without a word (nothing resumes a folder without a step; under the chat layout its prefix is one)."""
    qa = tiny_qa(adapters["paper"], offload="disk", offload_dir=tmp_path)
    frames = random_frames(2)
    for flushed in (False, True):
        stream = qa.stream(vision_batch=4)
        watch = stream.watch(QUESTION, every=2, max_new_tokens=2)
        for frame in frames:
            stream.push(frame)
        if flushed:
            stream.flush()
        folder = stream.prefill.disk.folder
        caplog.clear()
        with caplog.at_level("WARNING", logger="statekv"):
            stream.close()
        said = [record.getMessage() for record in caplog.records]
        if not flushed:
            assert said == [f"{stream.name}: closed before its first step: 2 frame(s) waiting for their batch are lost; "
                            "its 1 watch(es) will not be reopened (flush() before close encodes the frames waiting, "
                            "and the folder then keeps them)"] and not folder.exists()
            continue
        assert said == []
        resumed = Stream.load(folder, qa)
        assert resumed.frames == 2 and [kept.id for kept in resumed.watches] == [watch.id]
        resumed.close()


def _memory_and_swap() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))


@pytest.mark.skipif(Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2",
                    reason="strict overcommit accounts every mapping, reserved or not")
def test_a_disk_buffer_larger_than_memory_and_swap_is_still_read(tmp_path):
    """A disk tier's file has a row for every token streamed, given back or not, so a stream that evicts for weeks
    has files larger than the machine's memory: mapping one must not reserve its size (the kernel refused it)."""
    buffer = MappedTokenBuffer(2, None, tmp_path / "layer0.detailed")
    rows = torch.arange(2 * 3 * 64, dtype=torch.float32).view(1, 2, 3, 64)
    far = 2 * _memory_and_swap() // (2 * 64 * 4)  # rows of [1, 2, 64] float32
    buffer.write(0, rows, -rows)
    buffer.write(far, rows, -rows)  # a sparse file twice the memory and swap
    buffer.length = far + 3
    assert buffer.capacity * buffer.row_bytes > _memory_and_swap()
    keys, values = buffer.gather(torch.tensor([1, far + 2]))  # row 1 of the first write, row 2 of the last
    assert torch.equal(keys, rows[:, :, [1, 2]]) and torch.equal(values, -rows[:, :, [1, 2]])
    assert torch.equal(buffer.view(far, far + 3)[0], rows) and not buffer.view(far - 5, far)[1].any()
    buffer.close()


def _streamed(adapter, folder: Path, settings: dict, frames, save_at: tuple[int, ...] = (),
              load_at: int | None = None):
    """A capped disk-tier stream of ``frames``, saved and synced after the frames of ``save_at``, saved to a file
    and loaded onto the disk tier before frame ``load_at``: ``held_bytes`` after each frame, the frames refused,
    the steps evicted and the carried state at the end."""
    stream = tiny_qa(adapter, offload_dir=folder, **settings).stream()
    held, refused = [], []
    for index, frame in enumerate(frames):
        if index == load_at:
            path = stream.save(folder.with_suffix(".safetensors"))
            stream.close()
            stream = Stream.load(path, tiny_qa(adapter, offload_dir=folder.with_name(f"{folder.name}-loaded"),
                                               **settings))
        try:
            stream.push(frame)
        except CacheLimitError:
            refused.append(index)
        if index in save_at:
            stream.save(folder.with_name(f"{folder.name}-{index}.safetensors"))
            stream.prefill.sync()
        held.append(stream.prefill.stats.held_bytes)
    kept = held, refused, sorted(stream.prefill.cache.evicted_steps), _carried(stream)
    stream.close()
    return kept


def test_an_evicting_disk_tier_stream_evicts_the_same_whatever_befell_its_file_set(adapters, tmp_path):
    """What the cap counts of the journal and the checkpoint slots follows the stream's steps alone. Before: it was
    the files' lengths, so a stream saved or synced midway (a checkpoint sooner, its second slot written earlier)
    held other bytes and evicted one frame more, and a stream saved to a file and loaded onto the disk tier (one
    slot written, a journal of another length) held other bytes from the load on."""
    settings = dict(offload="disk", max_cache_bytes=180_000, cache_limit="evict-oldest")
    frames = random_frames(100)
    never_stopped = _streamed(adapters["chat"], tmp_path / "never-stopped", settings, frames)
    assert len(never_stopped[2]) > 50
    for other in (_streamed(adapters["chat"], tmp_path / "saved", settings, frames, save_at=(10, 30, 50)),
                  _streamed(adapters["chat"], tmp_path / "loaded", settings, frames, load_at=40)):
        assert other[:3] == never_stopped[:3]
        assert _same(other[3], never_stopped[3])


def test_a_refusing_disk_tier_stream_refuses_the_same_whatever_befell_its_file_set(adapters, tmp_path):
    """Under ``refuse`` too. Before: the stream saved and synced early was refused a frame sooner than the stream
    never saved, and the stream loaded from a file counted other bytes."""
    settings = dict(offload="disk", max_cache_bytes=330_000, cache_limit="refuse")
    frames = random_frames(16)
    never_stopped = _streamed(adapters["chat"], tmp_path / "never-stopped", settings, frames)
    assert never_stopped[1] and never_stopped[1][0] > 8
    for other in (_streamed(adapters["chat"], tmp_path / "saved", settings, frames, save_at=(3, 6)),
                  _streamed(adapters["chat"], tmp_path / "loaded", settings, frames, load_at=8)):
        assert other[:3] == never_stopped[:3]
        assert _same(other[3], never_stopped[3])


def test_an_evicting_disk_tier_stream_evicts_no_more_steps_than_it_needs(adapters, tmp_path):
    """Each step held counts its share of the journal (`DiskTier.counted_bytes`), which its eviction gives back.
    Before: the share was not credited, so a step that needed room up to three shares more than three steps'
    tokens and summaries evicted a fourth step."""
    from statekv.core.disk.tier import JOURNAL_STEP_BYTES
    from statekv.settings.engine import CacheLimit

    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path, max_cache_bytes="1G",
                 cache_limit="evict-oldest")
    with qa.stream() as stream:
        for frame in random_frames(8):
            stream.push(frame)
        keeper, lengths = stream.prefill.keeper, list(stream.prefill.cache.chunk_lengths)
        three = sum(length * keeper.bytes_per_token + keeper.bytes_per_step for length in lengths[1:4])
        step = lengths[-1]
        before = keeper.held_bytes + step * keeper.bytes_per_token + keeper.bytes_per_step + keeper.other_bytes()[1]
        for short in (1, 3 * JOURNAL_STEP_BYTES):  # room short by three steps' tokens and summaries, and a little more
            keeper.limit = CacheLimit(before - three - short, "evict-oldest")
            assert keeper.make_room(step) == [1, 2, 3]
        keeper.limit = CacheLimit(before - three - 3 * JOURNAL_STEP_BYTES - 1, "evict-oldest")
        assert keeper.make_room(step) == [1, 2, 3, 4]


UNCLOSED_CHILD = """
import sys
from pathlib import Path
from statekv.models import load_adapter
from conftest import random_frames, tiny_qa

qa = tiny_qa(load_adapter(sys.argv[1], layout="chat"), offload="disk", offload_dir=sys.argv[2])
kept = qa.encode(random_frames(3))  # alive at exit, never closed
print("files", len(list(Path(sys.argv[2]).iterdir())), flush=True)
"""


def test_an_encoding_dropped_unclosed_takes_its_files_with_it_and_a_streams_stay(adapters, checkpoint, tmp_path):
    qa = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "encodings")
    encoded = qa.encode(random_frames(3))
    folder = encoded.prefill.disk.folder
    assert folder.is_dir()
    del encoded
    gc.collect()
    assert not folder.exists() and list((tmp_path / "encodings").iterdir()) == []
    # at exit too: an encoding still alive when its process ends leaves nothing behind
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    child = subprocess.run([sys.executable, "-c", UNCLOSED_CHILD, str(checkpoint), str(tmp_path / "at_exit")],
                           env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert child.returncode == 0 and "files 1" in child.stdout, child.stderr
    assert list((tmp_path / "at_exit").iterdir()) == []
    # a stream's files outlive it, closed or not: `Stream.load` resumes them
    streams = tiny_qa(adapters["chat"], offload="disk", offload_dir=tmp_path / "streams")
    stream = streams.stream(horizon_frames=4)
    stream.push(random_frames(1)[0])
    folder = stream.prefill.disk.folder
    del stream
    gc.collect()
    resumed = Stream.load(folder, streams)  # as after a kill: the frame since its last checkpoint counted lost
    assert (resumed.frames, resumed.frames_lost) == (0, 1)
