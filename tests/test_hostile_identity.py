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


def test_what_a_killed_save_left_is_removed_by_the_next_save(adapter, tmp_path, monkeypatch):
    """A save writes in a partial folder of its own, safetensors' temporary file included (a kill there left a
    stream-sized ``.tmpXXXXXX`` beside the target that nothing removed); the next save removes what a killed one
    left, and nothing else."""
    from statekv.api import stream_file

    stream = _pushed(small_qa(adapter).stream(horizon_frames=8), 2)
    target = tmp_path / "s.safetensors"
    (tmp_path / "s.safetensors.0123abcd.partial").write_bytes(b"half a file")  # left by a save of an older version
    killed = tmp_path / "s.safetensors.89abcdef.partial"
    killed.mkdir()
    (killed / ".tmpAbC123").write_bytes(b"safetensors' temporary file")
    (tmp_path / "s.safetensors.notes.partial").write_bytes(b"not a save's")
    written, save_file = [], stream_file.save_file

    def writing(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        written.append((Path(filename), sorted(p.name for p in tmp_path.iterdir())))

    monkeypatch.setattr(stream_file, "save_file", writing)
    stream.save(target)
    [(filename, beside)] = written
    assert filename.parent.parent == tmp_path and filename.parent.name.endswith(".partial")  # in its own folder
    assert beside == sorted(["s.safetensors.lock", "s.safetensors.notes.partial", filename.parent.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors", "s.safetensors.notes.partial"]
    assert Stream.load(target, small_qa(adapter)).frames == 2


# ---------------------------------------------------------------------------------------------------------------
# Every descriptive file of a file set belongs to it
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_sets(adapter, tmp_path_factory):
    """Two closed disk-tier streams of the same model and shapes, made apart (each test swaps files of copies)."""
    root = tmp_path_factory.mktemp("two")
    qa = small_qa(adapter, offload="disk", offload_dir=root)
    first = _pushed(qa.stream(horizon_frames=8, max_fps=1, name="first"), 3)
    second = _pushed(qa.stream(horizon_frames=16, max_fps=2, name="second"), 3, seed=1)
    first.close()
    second.close()
    return first.prefill.disk.folder, second.prefill.disk.folder


@pytest.mark.parametrize("name", ["stream.json", "manifest.json", "layer0.detailed.0.bin.json",
                                  "layer2.step_means.0.bin.json", "journal"])
def test_a_file_swapped_in_from_another_streams_set_is_refused(name, adapter, two_sets, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    folder = Path(shutil.copytree(two_sets[0], tmp_path / "set"))
    Stream.load(folder, qa).close()  # the copy loads as it is
    folder = Path(shutil.copytree(two_sets[0], tmp_path / "swapped"))
    shutil.copy(two_sets[1] / name, folder / name)  # as it is, its checksum its own
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    message = _one_line(error)
    assert "copied or swapped in from another stream" in message or "damaged" in message, message


def test_another_streams_description_copied_in_does_not_load_as_that_stream(adapter, two_sets, tmp_path):
    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path)
    folder = Path(shutil.copytree(two_sets[0], tmp_path / "set"))
    shutil.copy(two_sets[1] / "stream.json", folder / "stream.json")
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    assert "stream.json is another file set's" in _one_line(error)


# ---------------------------------------------------------------------------------------------------------------
# Owner digests need this installation's secret
# ---------------------------------------------------------------------------------------------------------------
def _resigned(path: Path, edit) -> Path:
    """The stream file at ``path`` with ``edit`` applied to its metadata and its checksums recomputed, as anyone can."""
    import hashlib
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["statekv"])
    edit(metadata)
    text = json.dumps(metadata)
    save_file(load_file(str(path)), str(path), metadata={"statekv": text,
                                                         "statekv_sha256": hashlib.sha256(text.encode()).hexdigest()})
    return path


@pytest.fixture
def secret(tmp_path, monkeypatch):
    """This test's installation secret, in a file of its own."""
    path = tmp_path / "installation.secret"
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(path))
    return path


def _owned(adapter, folder: Path, name: str, owner: str, seed: int = 0) -> Path:
    stream = _pushed(small_qa(adapter).stream(horizon_frames=8, stream_id=f"st_{name}", owner=owner), 2, seed)
    return stream.save(folder / f"{name}.safetensors")


def test_a_file_re_signed_to_name_another_owner_is_refused(adapter, secret, tmp_path):
    import hashlib

    bob = _owned(adapter, tmp_path, "bob", "key-bob")
    unsalted = hashlib.sha256(b"statekv-owner:key-alice").hexdigest()  # what an earlier statekv recorded
    _resigned(bob, lambda m: m.update(owner_digest=unsalted, installation=None))
    with pytest.raises(InputError) as error:
        Stream.load(bob, small_qa(adapter), owner="key-alice")
    assert "recorded by an earlier statekv" in _one_line(error) and "statekv reown" in str(error.value)
    assert secret.stat().st_mode & 0o777 == 0o600  # made on first use, for its user alone


def test_an_owner_digest_taken_from_another_streams_file_does_not_fit(adapter, secret, tmp_path):
    alice, bob = _owned(adapter, tmp_path, "alice", "key-alice"), _owned(adapter, tmp_path, "bob", "key-bob", 1)
    qa = small_qa(adapter)
    taken = Stream.load(alice, qa, owner="key-alice").identity
    _resigned(bob, lambda m: m.update(owner_digest=taken["owner_digest"], installation=taken["installation"]))
    with pytest.raises(InputError) as error:
        Stream.load(bob, qa, owner="key-alice")
    assert "belongs to another owner" in _one_line(error)


def test_a_file_from_another_installation_is_refused_until_re_owned(adapter, secret, tmp_path, monkeypatch, capsys):
    from statekv.cli import main

    saved = _owned(adapter, tmp_path, "cam", "key-1")
    qa = small_qa(adapter)
    for elsewhere, phrase in ((tmp_path / "missing.secret", "has none"), (tmp_path / "other.secret", "is another")):
        if phrase == "is another":
            elsewhere.write_text(os.urandom(32).hex() + "\n")
        monkeypatch.setenv("STATEKV_SECRET_FILE", str(elsewhere))
        with pytest.raises(InputError) as error:
            Stream.load(saved, qa, owner="key-1")
        message = _one_line(error)
        assert f"recorded by another statekv installation (this one's secret, {elsewhere}, {phrase})" in message
        assert f"statekv reown {saved} --owner NAME" in message
    with pytest.raises(InputError, match="belongs to an owner; give its owner.*re-own it to load it without one"):
        Stream.load(saved, qa)  # an owned file is never loaded without its owner
    assert main(["reown", str(saved), "--owner", "key-1"]) == 0
    capsys.readouterr()
    resumed = Stream.load(saved, qa, owner="key-1", stream_id="st_cam")  # its id and frames as they were
    assert resumed.frames == 2
    with pytest.raises(InputError, match="belongs to another owner"):
        Stream.load(saved, qa, owner="key-2")


def _as_format_2(folder: Path) -> None:
    """Rewrite a closed disk-tier file set as statekv wrote it before its files named their file set: format 2."""
    from statekv.core.disk.files import read_checked, write_checked

    for described in [folder / "manifest.json", folder / "stream.json", *folder.glob("layer*.bin.json")]:
        fields = read_checked(described)
        fields.pop("file_set", None)
        if described.name == "manifest.json":
            fields["version"] = 2
        if described.name == "stream.json":
            fields["version"] = 1
        write_checked(described, fields)
    journal = (folder / "journal").read_bytes()
    (folder / "journal").write_bytes(journal.split(b"\n", 1)[1])


def test_a_file_set_from_another_installation_or_an_earlier_format_is_re_owned(adapter, secret, tmp_path,
                                                                               monkeypatch):
    import json

    from statekv.api.reown import reown

    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = _pushed(qa.stream(horizon_frames=8, stream_id="st_cam", owner="key-1"), 3)
    stream.close()
    folder = stream.prefill.disk.folder
    _as_format_2(folder)
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa, owner="key-1")
    assert "format 2; this statekv reads 3" in _one_line(error)
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "new.secret"))  # and on another installation
    reown(folder, "key-1")
    resumed = Stream.load(folder, qa, owner="key-1", stream_id="st_cam")
    assert (resumed.frames, resumed.frames_lost) == (3, 0)
    resumed.close()
    assert json.loads((folder / "manifest.json").read_text())["version"] == 5


def _damaged(folder: Path, damage: str) -> None:
    journal = folder / "journal"
    if damage == "layer description":  # the last: an upgrade would rewrite the others before reading it
        sorted(folder.glob("layer*.bin.json"))[-1].write_text("{")
    elif damage == "carry":
        for carried in folder.glob("carry.*.bin"):
            carried.unlink()
    elif damage == "journal line":
        lines = journal.read_bytes().split(b"\n")
        lines[2] = b"{not json"
        journal.write_bytes(b"\n".join(lines))
    elif damage == "journal cut after its first line":  # format 3: its header alone; format 2: its first push
        journal.write_bytes(journal.read_bytes().split(b"\n")[0] + b"\n")
    else:
        journal.write_bytes(b"")


def _contents(folder: Path) -> dict[str, bytes]:
    """Every file of a file set but its lock (which names its holder of the moment)."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file() and path.name != "lock"}


@pytest.mark.parametrize("damage", ["carry", "journal line", "journal emptied", "journal cut after its first line"])
def test_a_damaged_file_set_is_not_re_owned(damage, adapter, secret, tmp_path):
    """Before: `statekv reown` checked a folder's manifest and description only, and re-owned a folder whose
    journal or carried state `Stream.load` then refused."""
    from statekv.api.reown import reown
    from statekv.cli import main

    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = _pushed(qa.stream(horizon_frames=8, owner="key-1"), 3)
    stream.close()
    folder = stream.prefill.disk.folder
    reown(folder, "key-2")  # a whole folder is re-owned
    _damaged(folder, damage)
    with pytest.raises(InputError) as refused:
        Stream.load(folder, qa, owner="key-2")
    described = (folder / "stream.json").read_bytes()
    assert main(["reown", str(folder), "--owner", "key-3"]) == 2
    assert (folder / "stream.json").read_bytes() == described  # nothing re-owned
    with pytest.raises(InputError) as again:
        reown(folder, "key-3")
    assert _one_line(again) == _one_line(refused)  # as loading says it


@pytest.mark.parametrize("damage", ["carry", "journal line", "layer description", "journal emptied",
                                    "journal cut after its first line"])
def test_a_damaged_file_set_of_format_2_is_refused_as_it_was_found(damage, adapter, secret, tmp_path):
    """Before: `statekv reown` upgraded a damaged format-2 folder to format 3 (its manifest, journal and layer
    descriptions rewritten) and only then refused it; one whose journal was emptied or cut before its first step
    it re-owned as a stream of no step, which loading then refused."""
    from statekv.cli import main

    qa = small_qa(adapter, offload="disk", offload_dir=tmp_path / "tier")
    stream = _pushed(qa.stream(horizon_frames=8, owner="key-1"), 3)
    stream.close()
    folder = stream.prefill.disk.folder
    _as_format_2(folder)
    _damaged(folder, damage)
    before = _contents(folder)
    assert main(["reown", str(folder), "--owner", "key-2"]) == 2
    assert _contents(folder) == before  # not upgraded, not re-owned: every file as it was


def test_a_secret_that_cannot_be_made_is_one_line_naming_it(adapter, monkeypatch):
    monkeypatch.setenv("STATEKV_SECRET_FILE", "/proc/statekv/installation.secret")  # unwritable, root included
    with pytest.raises(OutputError) as error:
        small_qa(adapter).stream(horizon_frames=4, owner="key-1")
    assert "cannot make statekv's installation secret /proc/statekv/installation.secret" in _one_line(error)
    assert small_qa(adapter).stream(horizon_frames=4).owner_digest is None  # no owner: no secret needed


def test_the_secret_lives_in_the_cache_folder_unless_named(adapter, tmp_path, monkeypatch):
    monkeypatch.delenv("STATEKV_SECRET_FILE", raising=False)
    monkeypatch.setenv("STATEKV_CACHE", str(tmp_path / "cache"))
    stream = small_qa(adapter).stream(horizon_frames=4, owner="key-1")
    assert (tmp_path / "cache" / "installation.secret").stat().st_mode & 0o777 == 0o600
    assert stream.identity["installation"] and stream.identity["owner_digest"] != "key-1"


def test_a_server_on_another_installations_state_folder_lists_its_streams_damaged_until_re_owned(secret, tmp_path,
                                                                                                monkeypatch):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import io
    import json

    from PIL import Image

    import statekv
    from statekv.cli import main
    from test_hostile_service import Running

    qa = statekv.VideoQA.from_pretrained("builtin", budget=64)
    state = tmp_path / "state"
    with Running(state, qa) as server, server.client() as client:
        created = client.post("/v1/streams", json={"horizon_frames": 8})
        stream_id = created.json()["id"]
        for index, frame in enumerate(noise_frames(2)):
            buffer = io.BytesIO()
            Image.fromarray(frame).save(buffer, format="PNG")
            client.post(f"/v1/streams/{stream_id}/frames?t={index}", content=buffer.getvalue(),
                        headers={"Content-Type": "image/png"}).raise_for_status()
    monkeypatch.setenv("STATEKV_SECRET_FILE", str(tmp_path / "another.secret"))  # another machine's secret
    with Running(state, qa) as server, server.client() as client:
        listed = {stream["id"]: stream for stream in client.get("/v1/streams").json()["data"]}
        assert listed[stream_id]["state"] == "damaged"
        assert "recorded by another statekv installation" in listed[stream_id]["damaged"]
    owner = json.loads((state / "streams" / f"{stream_id}.json").read_text())["owner"]
    assert main(["reown", str(state / "streams" / f"{stream_id}.safetensors"), "--owner", owner]) == 0
    with Running(state, qa) as server, server.client() as client:
        listed = {stream["id"]: stream for stream in client.get("/v1/streams").json()["data"]}
        assert listed[stream_id]["state"] == "ready" and listed[stream_id]["frames"] == 2
