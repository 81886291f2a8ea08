"""The service's pieces on their own, without a model or a server: keys kept for a state folder, the refusal
over streams no key owns, the state folder's records and its quarantine, messages without server paths, and the
worker that brings together the pushes of streams fed frame after frame."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from statekv.errors import ConfigurationError  # noqa: E402
from statekv import ModelOptions  # noqa: E402
from statekv.serve.app import check_owners  # noqa: E402
from statekv.serve.auth import KeyFile, KeyRing, owner_of  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402
from statekv.serve.errors import public_message  # noqa: E402
from statekv.serve.store import StreamFiles, hold_state_folder  # noqa: E402
from statekv.serve.worker import ModelWorker  # noqa: E402


def test_a_key_is_made_once_per_folder_and_only_its_digest_is_kept(tmp_path):
    made: list[str | None] = []
    threads = [threading.Thread(target=lambda: made.append(KeyFile(tmp_path).make())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    keys = [key for key in made if key is not None]
    assert len(keys) == 1  # servers starting together on one folder: one of them makes it
    text = (tmp_path / "keys.json").read_text()
    assert keys[0] not in text and json.loads(text)["keys"][0]["owner"] == owner_of(keys[0])
    assert not list(tmp_path.glob("*.partial"))
    ring = KeyRing.for_folder(tmp_path, ["given-key"])
    assert ring.owner(keys[0]) == owner_of(keys[0]) and ring.owner("given-key") == owner_of("given-key")
    assert ring.owner("another") is None and ring.owner("") is None


def test_no_key_at_all_and_an_unreadable_key_file_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="no API key: pass --api-key"):
        KeyRing.for_folder(tmp_path, [])
    (tmp_path / "keys.json").write_text("{broken")
    with pytest.raises(ConfigurationError, match="keys.json in the state folder is unreadable"):
        KeyRing.for_folder(tmp_path, ["k"])


def _record(files: StreamFiles, stream_id: str, owner: str) -> None:
    files.write_record({"id": stream_id, "owner": owner, "settings": {}, "horizon_frames": 4, "max_fps": 1.0,
                        "name": "s", "created": 0.0})
    files.state_path(stream_id).write_bytes(b"state")


def test_streams_no_accepted_key_owns_stop_a_start_or_are_dropped(tmp_path):
    files = StreamFiles(tmp_path)
    _record(files, "st_" + "a" * 24, owner_of("alice"))
    _record(files, "st_" + "b" * 24, owner_of("bob"))
    (files.folder / "st_broken.json").write_text("{")
    records = files.records()
    assert sum(isinstance(record, Exception) for _, record in records) == 1
    assert files.owners() == {owner_of("alice"): 1, owner_of("bob"): 1}
    config = ServeConfig(options=ModelOptions(model="builtin"), state_dir=tmp_path, api_keys=("alice",))
    check_owners(ServeConfig(options=config.options, state_dir=tmp_path, api_keys=("alice", "bob")),
                 KeyRing.for_folder(tmp_path, ["alice", "bob"]))  # every stream owned: nothing to say
    with pytest.raises(ConfigurationError, match="holds 1 stream of a key this server was not given; pass it "
                                                 "with --api-key"):
        check_owners(config, KeyRing.for_folder(tmp_path, ["alice"]))
    config.drop_unowned_streams = True
    check_owners(config, KeyRing.for_folder(tmp_path, ["alice"]))
    assert files.owners() == {owner_of("alice"): 1} and not files.state_path("st_" + "b" * 24).exists()


def test_a_state_folder_has_one_server_at_a_time(tmp_path):
    state = tmp_path / "state"
    held = hold_state_folder(state, "statekv serve on http://127.0.0.1:1")  # a folder never served: made
    try:
        with pytest.raises(ConfigurationError, match=rf"^the state folder {re.escape(str(state))} is in use by statekv serve on "
                                                     rf"http://127\.0\.0\.1:1 \(process {os.getpid()} on .*; one "
                                                     "state folder has one server"):
            hold_state_folder(state, "statekv serve on http://127.0.0.1:2")
    finally:
        held.release()
    hold_state_folder(state, "statekv serve on http://127.0.0.1:2").release()  # free once its holder let go
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigurationError, match="^--state-dir .*a-file/sub: cannot use it as the state folder"):
        hold_state_folder(tmp_path / "a-file" / "sub", "statekv serve")


@pytest.mark.parametrize("same_file_system", [True, False])
def test_a_file_set_moved_to_quarantine_arrives_whole_and_goes_only_with_its_stream(tmp_path, monkeypatch,
                                                                                   same_file_system):
    import errno
    import os

    files, stream_id = StreamFiles(tmp_path / "state"), "st_" + "c" * 24
    _record(files, stream_id, owner_of("alice"))
    folder = tmp_path / "tier" / "s-1234abcd"
    (folder / "steps").mkdir(parents=True)
    for name, data in (("stream.json", b"{}"), ("lock", b""), ("steps/0.bin", bytes(range(256)) * 64)):
        (folder / name).write_bytes(data)
    before = {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    if not same_file_system:  # as when --offload-dir is another disk: a rename is refused
        rename = os.rename

        def across(source, target):
            if Path(source) == folder:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return rename(source, target)

        monkeypatch.setattr(os, "rename", across)
    where = files.move_to_quarantine(stream_id, folder)
    moved = tmp_path / "state" / where
    assert where.startswith(f"quarantine/{stream_id}-") and not folder.exists()
    assert {path.relative_to(moved): path.read_bytes() for path in moved.rglob("*") if path.is_file()} == before
    assert files.quarantined(stream_id) == [moved.name] and files.quarantined("st_" + "d" * 24) == []
    files.write_note({"id": stream_id, "owner": owner_of("alice"), "reason": f"moved to {where}"})
    assert files.notes() == {stream_id: files.read_note(stream_id)}
    assert f"{where}" in files.files_of(stream_id) and f"quarantine/{stream_id}.json" in files.files_of(stream_id)
    files.remove(stream_id)
    assert not list((tmp_path / "state").rglob(f"{stream_id}*"))


def test_messages_name_files_as_the_client_gave_them():
    message = "/srv/videos/synth/a.mp4: not a readable video file; /srv/videos/ is the root"
    assert public_message(message, {"/srv/videos/": "", "/srv/videos/synth/a.mp4": "a.mp4"}) == (
        "a.mp4: not a readable video file;  is the root")


class _Stream:
    def __init__(self, qa):
        self.qa = qa


class _QA:
    def __init__(self):
        self.groups: list[int] = []

    def push_many(self, items, return_exceptions=False):
        self.groups.append(len(items))
        return [True] * len(items)


def test_streams_pushing_frame_after_frame_meet_in_one_drain():
    """Two clients each push one frame at a time (the next only once the last is answered): without waiting
    they would take turns forever; the worker waits a few milliseconds for a stream that just pushed."""
    qa, worker = _QA(), ModelWorker(gather_seconds=0.05)
    streams = [_Stream(qa), _Stream(qa)]

    async def client(stream, decode_seconds: float) -> None:
        for _ in range(20):
            await asyncio.to_thread(time.sleep, decode_seconds)  # its next frame is decoded, at its own pace
            await worker.push(stream, None, None, before=lambda: 0, after=lambda context, kept: kept)

    async def both() -> None:
        await asyncio.gather(client(streams[0], 0.001), client(streams[1], 0.006))

    try:
        asyncio.run(both())
    finally:
        worker.close()
    assert sum(qa.groups) == 40 and qa.groups.count(2) >= 15  # nearly every drain steps both streams
