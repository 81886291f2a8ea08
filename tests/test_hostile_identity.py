"""One owner that cannot be fooled, and files that cannot be swapped in from another stream.

A disk-tier folder is locked on the folder itself: removing or replacing its ``lock`` file under a live stream does
not let a second `Stream.load` in, and a stream whose folder was moved away (another may own what the path names
now) writes nothing more there. A save writes a partial file of its own and checks its lock before the rename.
Every descriptive file of a file set names the file set it belongs to, and the stream's setup names the stream;
owner digests need this installation's secret.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from statekv import Stream
from statekv.errors import InputError, OutputError
from statekv.models import load_adapter
from statekv.testing import make_tiny_checkpoint

from hostile import noise_frames, small_qa


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl") / "ckpt")


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
    assert "\n" not in message and "Traceback" not in message, message
    return message


# ---------------------------------------------------------------------------------------------------------------
# A live file set keeps its one owner, whatever becomes of its lock file
# ---------------------------------------------------------------------------------------------------------------
LOCK_FILE_FATES = {
    "removed": lambda lock, other: lock.unlink(),
    "replaced by a fresh file": lambda lock, other: (lock.unlink(), lock.write_text("nobody\n")),
    "replaced by another file set's": lambda lock, other: os.replace(shutil.copy(other / "lock", lock.with_name("x")),
                                                                     lock),
    "renamed away": lambda lock, other: lock.rename(lock.with_name("lock.old")),
}


@pytest.mark.parametrize("fate", LOCK_FILE_FATES)
def test_a_live_file_set_whose_lock_file_is_gone_still_refuses_a_second_owner(fate, adapter, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    stream = _pushed(qa.stream(horizon_frames=8, name="desk camera"), 3)
    other = _pushed(qa.stream(horizon_frames=8, name="other"), 1)
    other.close()
    folder = stream.prefill.disk.folder
    LOCK_FILE_FATES[fate](folder / "lock", other.prefill.disk.folder)
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    message = _one_line(error)
    assert f"{folder} is in use by" in message and ("desk camera" in message or f"process {os.getpid()}" in message)
    _pushed(stream, 2, seed=1)  # the owner goes on, untouched
    stream.close()
    resumed = Stream.load(folder, qa)  # its owner gone, the next one takes it and finds every frame
    assert (resumed.frames, resumed.frames_lost) == (5, 0)
    resumed.close()


def test_a_stream_whose_folder_was_moved_away_writes_nothing_more_where_its_path_points(adapter, tmp_path):
    """The folder moved while its stream lives, and a copy put at its path: the copy is another file set, which a
    second `Stream.load` may own; the first stream must then write nothing there (it would write into the
    second's files), so its next push is refused in one line and it closes without writing."""
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = _pushed(qa.stream(horizon_frames=12), 3)
    folder = stream.prefill.disk.folder
    stream.prefill.sync()
    moved = folder.with_name(folder.name + "-moved")
    os.rename(folder, moved)
    shutil.copytree(moved, folder)
    second = Stream.load(folder, qa)  # the copy: a file set of its own, with an owner of its own
    before = (folder / "journal").read_bytes()
    with pytest.raises(OutputError) as error:
        _pushed(stream, 2, seed=1)
    assert "was moved or replaced while this stream held it" in _one_line(error)
    assert (folder / "journal").read_bytes() == before  # nothing of the first stream's reached the second's files
    stream.close()
    _pushed(second, 2, seed=2)
    second.close()
    assert Stream.load(folder, qa).frames == second.frames


# ---------------------------------------------------------------------------------------------------------------
# A save: a partial file of its own, its lock checked before the rename
# ---------------------------------------------------------------------------------------------------------------
def test_a_save_whose_lock_file_was_removed_meanwhile_is_refused_and_the_other_save_lands(adapter, tmp_path,
                                                                                       monkeypatch):
    import statekv.api.stream_file as stream_file

    qa = small_qa(adapter)
    first, second = _pushed(qa.stream(horizon_frames=8), 3), _pushed(qa.stream(horizon_frames=8), 2, seed=1)
    target, real, partials = tmp_path / "shared.safetensors", stream_file.save_file, []

    def save_file(tensors, filename, metadata=None):
        partials.append(filename)
        if len(partials) == 1:  # while the first save writes, its lock file is removed and a second save runs
            (tmp_path / "shared.safetensors.lock").unlink()
            second.save(target)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(stream_file, "save_file", save_file)
    with pytest.raises(OutputError) as error:
        first.save(target)
    monkeypatch.undo()
    assert "its lock file was removed or replaced while it was written" in _one_line(error)
    assert len(set(partials)) == 2  # never one partial file for two saves
    assert Stream.load(target, qa).frames == 2  # the second save's, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.safetensors"]


def test_what_a_killed_save_left_is_removed_by_the_next_save(adapter, tmp_path):
    stream = _pushed(small_qa(adapter).stream(horizon_frames=8), 2)
    target = tmp_path / "s.safetensors"
    (tmp_path / "s.safetensors.0123abcd.partial").write_bytes(b"half a file")
    (tmp_path / "s.safetensors.notes.partial").write_bytes(b"not a save's")
    stream.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors", "s.safetensors.notes.partial"]
