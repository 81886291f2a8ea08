"""`Stream.sync` (and `Stream.save`, which syncs first) on the disk tier keeps the open watches as they stand, also
those opened or closed since the last step (on Qwen3-VL a watch opened while a frame waits for its partner): a kill
after it reopens them so.

Before: the watches were kept only with a checkpoint of a new step, so a watch opened after the last step and
synced was gone after a kill, and one closed since came back."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import statekv
from statekv import Stream

QUESTION = "What happens?"


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


@pytest.mark.parametrize("how", ["sync", "save"])
@pytest.mark.parametrize("family", ["builtin", "qwen3_vl"])
def test_a_sync_keeps_the_watches_opened_and_closed_since_the_last_step(family, how, tiny_checkpoint, tmp_path):
    model = "builtin" if family == "builtin" else str(tiny_checkpoint(family))
    qa = statekv.VideoQA.from_pretrained(model, method="statekv", budget=64, offload="disk",
                                         offload_dir=str(tmp_path / "tier"))
    stream = qa.stream(max_fps=1.0)
    closed = stream.watch(QUESTION, every=2, max_new_tokens=2)
    for index, t in enumerate([0.0, 1.0, 2.0, 3.0, 4.0]):  # on Qwen3-VL the frame at 4 s waits for its partner
        stream.push(_image(index), t)
    stream.sync()
    kept = stream.watch(QUESTION, every=2, max_new_tokens=2)  # after the last step: answered at once
    closed.close()
    stream.push(_image(9), 4.5)  # dropped by max_fps: no step
    stream.sync() if how == "sync" else stream.save(tmp_path / "saved.safetensors")  # (a save syncs first)
    resumed = Stream.load(shutil.copytree(stream.folder, tmp_path / "killed"), qa)  # the files a kill leaves
    try:
        assert [watch.id for watch in resumed.watches] == [kept.id]
        again = resumed.watches[0]
        assert (again.answer, again.evaluations, again.events) == (kept.answer, kept.evaluations, kept.events)
        assert again.events[-1].seconds == stream.encoded_timestamp
    finally:
        resumed.close()
        stream.close()


def test_a_sync_writes_no_watches_into_a_folder_that_replaced_the_streams(tmp_path):
    """A sync whose watches changed since the last one, after the stream's folder was moved away and another put
    at its path (what the path names may be another stream's file set), leaves that folder as it is: an error.
    Before: it wrote its watches file into it over the one there, and removed the older one there, then failed."""
    qa = statekv.VideoQA.from_pretrained("builtin", method="statekv", budget=64, offload="disk",
                                         offload_dir=str(tmp_path / "tier"))
    stream = qa.stream(max_fps=1.0)
    try:
        for index, t in enumerate([0.0, 1.0, 2.0]):
            stream.push(_image(index), t)
        stream.watch(QUESTION, every=2, max_new_tokens=2)
        stream.sync()  # its watches in one file; the next sync writes them into the other
        folder = stream.folder
        folder.rename(tmp_path / "moved")
        folder.mkdir()  # another's, as far as this stream can tell
        theirs = {"watches.0.safetensors": b"another stream's", "watches.1.safetensors": b"another stream's",
                  "watches.safetensors": b"an older statekv's"}
        for name, data in theirs.items():
            (folder / name).write_bytes(data)
        stream.watch(QUESTION, every=2, max_new_tokens=2)
        with pytest.raises(statekv.errors.OutputError):
            stream.sync()
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == theirs
    finally:
        stream.close()
