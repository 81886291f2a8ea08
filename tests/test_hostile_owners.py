"""One owner per stream: a live stream holds its files, and a file says whose stream it is.

A disk-tier file set is locked by the stream living in it (a second `Stream.load`, in this process or another,
is refused with one line naming the holder, and the set stays loadable); a stream file being written is locked
too; a saved file records its stream's id and its owner's digest, checked on load, so a file moved under
another stream's name or owner is refused; every descriptive file of a file set carries a checksum.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import statekv
from statekv import Stream
from statekv.errors import ConfigurationError, InputError, OutputError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint

from hostile import noise_frames, small_qa

CHILD_TIMEOUT = 120


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint)


def _pushed(stream, count: int, seed: int = 0):
    start = 0.0 if stream.last_timestamp is None else stream.last_timestamp + 1.0
    for index, frame in enumerate(noise_frames(count, seed)):
        stream.push(frame, start + index)
    return stream


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------------------------
# A live file set has one owner
# ---------------------------------------------------------------------------------------------------------------
def test_a_second_opener_of_a_live_file_set_is_refused_naming_the_holder(adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = _pushed(qa.stream(horizon_frames=8, name="desk camera"), 3)
    folder = stream.prefill.disk.folder
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    message = _one_line(error)
    assert f"{folder} is in use by stream 'desk camera' (process {os.getpid()}" in message
    _pushed(stream, 2, seed=1)  # the owner goes on, untouched by the refused opener
    stream.close()
    resumed = Stream.load(folder, qa)  # the owner is gone: the next one may take it, and finds every frame
    assert (resumed.frames, resumed.frames_lost) == (5, 0)
    with pytest.raises(InputError, match="is in use by stream 'desk camera'"):
        Stream.load(folder, qa)
    resumed.close()


SECOND_OPENER = """
import sys, statekv
from statekv.models import load_adapter
qa = statekv.VideoQA(load_adapter(sys.argv[1]), statekv.StateKV(budget=12), attention="eager", reserve_tokens=40,
                     offload="disk", offload_dir=sys.argv[3])
try:
    stream = statekv.Stream.load(sys.argv[2], qa)
    stream.push(__import__("numpy").zeros((24, 32, 3), dtype="uint8"))
    print("opened", stream.frames)
except statekv.errors.StateKVError as error:
    print("refused", error)
"""


def test_another_process_cannot_open_a_live_file_set_and_both_pushing_cannot_happen(adapter, checkpoint, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = _pushed(qa.stream(horizon_frames=8), 3)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(SECOND_OPENER), str(checkpoint),
                            str(stream.prefill.disk.folder), str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=CHILD_TIMEOUT)
    assert child.stdout.startswith("refused") and "is in use by stream 'stream'" in child.stdout, child.stderr
    _pushed(stream, 2, seed=1)
    stream.close()
    resumed = Stream.load(stream.prefill.disk.folder, qa)  # never two writers: the set still loads, whole
    assert (resumed.frames, resumed.frames_lost) == (5, 0)


def test_a_closed_or_collected_stream_gives_its_files_back(adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    folder = _pushed(qa.stream(horizon_frames=4), 2).prefill.disk.folder  # never closed: collected
    import gc

    gc.collect()
    resumed = Stream.load(folder, qa)  # as after a kill: at its last checkpoint of the carried state
    assert resumed.frames + resumed.frames_lost == 2


# ---------------------------------------------------------------------------------------------------------------
# A saved file says whose stream it is
# ---------------------------------------------------------------------------------------------------------------
def test_a_saved_stream_keeps_its_id_and_owner_and_refuses_others(adapter, tmp_path):
    qa = small_qa(adapter)
    alice = _pushed(qa.stream(horizon_frames=8, stream_id="st_alice", owner="key-1"), 3)
    bob = _pushed(qa.stream(horizon_frames=8, stream_id="st_bob", owner="key-2"), 2, seed=1)
    alice_file, bob_file = alice.save(tmp_path / "st_alice.safetensors"), bob.save(tmp_path / "st_bob.safetensors")
    metadata = json.loads(_header(alice_file)["statekv"])
    assert metadata["stream_id"] == "st_alice" and "key-1" not in json.dumps(metadata)  # a digest, not the owner
    loaded = Stream.load(alice_file, qa, stream_id="st_alice", owner="key-1")
    assert (loaded.id, loaded.owner_digest, loaded.frames) == ("st_alice", alice.owner_digest, 3)
    os.replace(bob_file, alice_file)  # the other key's stream moved under this one's name
    for kwargs, phrase in [({"stream_id": "st_alice", "owner": "key-1"}, "holds stream 'st_bob', not 'st_alice'"),
                           ({"owner": "key-1"}, "belongs to another owner"),
                           ({}, "belongs to an owner; give its owner"),
                           ({"stream_id": "st_bob", "owner": "key-1"}, "belongs to another owner")]:
        with pytest.raises(InputError) as error:
            Stream.load(alice_file, qa, **kwargs)
        assert phrase in _one_line(error)
    assert Stream.load(alice_file, qa, stream_id="st_bob", owner="key-2").frames == 2


def test_a_file_set_keeps_its_id_and_owner_and_refuses_others(adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = _pushed(qa.stream(horizon_frames=8, stream_id="st_cam", owner="key-1"), 2)
    stream.close()
    folder = stream.prefill.disk.folder
    with pytest.raises(InputError, match="not 'st_other'"):
        Stream.load(folder, qa, stream_id="st_other", owner="key-1")
    with pytest.raises(InputError, match="belongs to another owner"):
        Stream.load(folder, qa, owner="key-2")
    resumed = Stream.load(folder, qa, stream_id="st_cam", owner="key-1")
    assert resumed.id == "st_cam" and resumed.owner_digest == stream.owner_digest
    saved = Stream.load(resumed.save(tmp_path / "s.safetensors"), small_qa(adapter), owner="key-1")
    assert saved.id == "st_cam"  # the same stream, saved from its file set


@pytest.mark.parametrize("kwargs", [{"stream_id": ""}, {"stream_id": "x" * 201}, {"stream_id": 7}, {"owner": ""},
                                    {"owner": 3}])
def test_bad_ids_and_owners_are_one_line(kwargs, adapter, tmp_path):
    with pytest.raises(ConfigurationError) as error:
        small_qa(adapter).stream(horizon_frames=2, **kwargs)
    _one_line(error)
    with pytest.raises(ConfigurationError):
        Stream.load(tmp_path / "missing.safetensors", small_qa(adapter), **kwargs)


def _header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()


# ---------------------------------------------------------------------------------------------------------------
# A stream file being written has one writer
# ---------------------------------------------------------------------------------------------------------------
def test_a_second_save_to_a_file_being_written_is_refused_and_the_first_completes(adapter, tmp_path, monkeypatch):
    import statekv.api.stream_file as stream_file

    first, second = _pushed(small_qa(adapter).stream(horizon_frames=8), 3), _pushed(small_qa(adapter).stream(horizon_frames=8),
                                                                               2, seed=1)
    target, real, refused = tmp_path / "shared.safetensors", stream_file.save_file, []

    def save_file(tensors, filename, metadata=None):  # while the first is writing, the second tries
        if not refused:
            with pytest.raises(OutputError) as error:
                second.save(target)
            refused.append(str(error.value))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(stream_file, "save_file", save_file)
    first.save(target)
    monkeypatch.undo()
    assert refused and "\n" not in refused[0] and f"{target} (being saved) is in use by process {os.getpid()}" \
        in refused[0] and ": this process, from another of its threads;" in refused[0]
    assert Stream.load(target, first.qa).frames == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.safetensors"]  # no lock or partial file left


# ---------------------------------------------------------------------------------------------------------------
# Every descriptive file of a file set is checksummed
# ---------------------------------------------------------------------------------------------------------------
def _edit_json(path: Path, change) -> None:
    fields = json.loads(path.read_text())
    change(fields)
    path.write_text(json.dumps(fields))


DESCRIPTION_EDITS = {
    "stream.json: another max_fps": ("stream.json", lambda f: f.update(max_fps=30.0)),
    "stream.json: another name": ("stream.json", lambda f: f.update(name="other")),
    "stream.json: another owner": ("stream.json", lambda f: f.update(owner_digest="0" * 64)),
    "stream.json: its checksum removed": ("stream.json", lambda f: f.pop("checksum")),
    "manifest.json: another horizon": ("manifest.json", lambda f: f.update(horizon=10**6)),
    "a layer file's shape": ("layer0.detailed.0.bin.json", lambda f: f.update(row=[1, 1, 1])),
}


@pytest.fixture(scope="module")
def file_set(adapter, tmp_path_factory):
    """A closed disk-tier stream's folder (each test edits a copy)."""
    stream = _pushed(small_qa(adapter, offload="disk", offload_dir=tmp_path_factory.mktemp("sets")).stream(
        horizon_frames=8, max_fps=1), 3)
    stream.close()
    return stream.prefill.disk.folder


@pytest.mark.parametrize("case", DESCRIPTION_EDITS)
def test_an_edited_description_of_a_file_set_is_refused(case, adapter, file_set, tmp_path):
    name, change = DESCRIPTION_EDITS[case]
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    folder = Path(shutil.copytree(file_set, tmp_path / file_set.name))
    Stream.load(folder, qa).close()  # the copy loads as it is
    _edit_json(folder / name, change)
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    message = _one_line(error)
    assert name in message and ("checksum" in message), message


# ---------------------------------------------------------------------------------------------------------------
# A saved stream's push clock is checked against max_fps: checksums recomputed after an edit vouch for nothing
# ---------------------------------------------------------------------------------------------------------------
def _resigned(path: Path, edit) -> Path:
    """The stream file at ``path`` with ``edit`` applied to its metadata and every checksum recomputed."""
    import hashlib

    from safetensors.torch import load_file, save_file

    header = _header(path)
    metadata = json.loads(header["statekv"])
    edit(metadata)
    text = json.dumps(metadata)
    save_file(load_file(str(path)), str(path), metadata={"statekv": text,
                                                         "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})
    return path


CLOCK_FORGERIES = {
    "max_fps raised": lambda m: m.update(max_fps=4.0),
    "max_fps lowered": lambda m: m.update(max_fps=0.25),
    "max_fps removed (keep every frame)": lambda m: m.update(max_fps=None),
    "next_tick moved back": lambda m: m.update(next_tick=m["next_tick"] - 1),
    "last_timestamp moved on": lambda m: m.update(last_timestamp=m["last_timestamp"] + 5),
}


@pytest.fixture(scope="module")
def clocked(adapter, tmp_path_factory):
    """A saved stream at max_fps 1 whose frames came every 0.75 s (some dropped between ticks)."""
    stream = small_qa(adapter).stream(horizon_frames=8, max_fps=1)
    for index, frame in enumerate(noise_frames(6)):
        stream.push(frame, index * 0.75)
    return stream.save(tmp_path_factory.mktemp("clocked") / "s.safetensors")


@pytest.mark.parametrize("case", CLOCK_FORGERIES)
def test_a_forged_push_clock_with_fresh_checksums_is_refused(case, adapter, clocked, tmp_path):
    qa = small_qa(adapter)
    path = _resigned(Path(shutil.copy(clocked, tmp_path / "s.safetensors")), lambda metadata: None)
    assert Stream.load(path, qa).frames == 4  # re-signed as it was, it loads: 4 of the 6 frames kept
    path = _resigned(path, CLOCK_FORGERIES[case])
    with pytest.raises(InputError) as error:
        Stream.load(path, qa)
    assert "push clock does not hold" in _one_line(error)


def test_a_stream_saved_before_the_tick_rule_changed_still_loads(adapter, tmp_path):
    """A camera's time where the tick rule before 2026-12-02 (a fixed slack) put the last frame a tick earlier: the
    file it wrote says so in next_tick, and is not refused as forged."""
    stream = small_qa(adapter).stream(horizon_frames=8, max_fps=25)
    last = 1250393848.36  # 25 fps: on a tick by `tick`, a tick earlier by the fixed slack
    for index, frame in enumerate(noise_frames(2)):
        stream.push(frame, last - 0.04 * (1 - index))
    path = _resigned(stream.save(tmp_path / "s.safetensors"), lambda m: m.update(next_tick=m["next_tick"] - 1))
    assert Stream.load(path, small_qa(adapter)).frames == 2
    _resigned(path, lambda m: m.update(next_tick=m["next_tick"] - 1))
    with pytest.raises(InputError, match="push clock does not hold"):
        Stream.load(path, small_qa(adapter))


def test_an_eagle_stream_whose_stated_rate_was_forged_is_refused(tmp_path):
    qa = statekv.VideoQA.from_pretrained(make_tiny_checkpoint("eagle", tmp_path / "eagle"), budget=12,
                                         attention="eager", reserve_tokens=40, trust_remote_code=True, layout="eagle")
    stream = qa.stream(horizon_frames=4, max_fps=2)
    for index, frame in enumerate(noise_frames(2)):
        stream.push(frame, index / 2)
    path = _resigned(stream.save(tmp_path / "s.safetensors"), lambda m: m["state"]["extra"].update(fps=8.0))
    with pytest.raises(InputError) as error:
        Stream.load(path, qa)
    assert "state.extra.fps is 8.0" in _one_line(error)
    assert torch.equal(Stream.load(stream.save(tmp_path / "t.safetensors"), qa).prefill.state_dict()[0][
        "layers.0.keys"], stream.prefill.state_dict()[0]["layers.0.keys"])


@pytest.mark.parametrize("number", [errno.ENOLCK, errno.EIO], ids=["no locks", "i/o error"])
def test_a_file_system_without_locks_locks_nothing_and_any_other_lock_failure_is_one_line(tmp_path, monkeypatch,
                                                                                        number):
    """Before: every failure of flock was taken for a file system without locks, so a stream ran without its
    one-owner lock and nothing said so."""
    import fcntl

    from statekv.locks import FileLock

    def failing(fd, operation):
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(fcntl, "flock", failing)
    if number == errno.ENOLCK:
        lock = FileLock.acquire(tmp_path / "lock", what="the test's file set")
        lock.release()
        return
    with pytest.raises(InputError, match=r"^cannot lock the test's file set: Input/output error$"):
        FileLock.acquire(tmp_path / "lock", what="the test's file set", error=InputError)
