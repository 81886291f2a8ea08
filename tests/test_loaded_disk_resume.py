"""A capped stream saved to its file, loaded onto the disk tier, closed and resumed from that folder: the block
files the load wrote end at the last row it kept (it writes none of the rows the stream had given back), which is
no damage; a file cut short under rows still held is."""

from __future__ import annotations

import pytest
import torch

from statekv import Stream
from statekv.errors import InputError
from statekv.models import load_adapter

from conftest import random_frames, tiny_qa

QUESTION = "Why?"
SETTINGS = dict(max_cache_bytes=60_000, cache_limit="evict-oldest", positions="bounded")


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint, layout="chat")


def _loaded_on_disk(adapter, tmp_path):
    """A stream of 40 frames that evicted whole blocks of rows, saved, loaded onto the disk tier; and its qa."""
    stream = tiny_qa(adapter, "statekv", offload=True, **SETTINGS).stream()
    for frame in random_frames(40):
        stream.push(frame)
    path = stream.save(tmp_path / "s.safetensors")
    stream.close()
    qa = tiny_qa(adapter, "statekv", offload="disk", offload_dir=tmp_path / "disk", **SETTINGS)
    return Stream.load(path, qa), qa


def test_a_saved_evicting_stream_loaded_onto_the_disk_tier_resumes_from_its_folder(adapter, tmp_path, small_blocks):
    """Before: refused, "the disk cache is damaged: layer0.detailed.0.0.bin is shorter than the rows its journal
    lists": the resume asked every block file to reach the end of its block's rows, given back or not."""
    loaded, qa = _loaded_on_disk(adapter, tmp_path)
    assert len(loaded.prefill.cache.evicted_steps) > 10
    answer = loaded.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2)
    folder = loaded.prefill.disk.folder
    loaded.close()
    resumed = Stream.load(folder, qa)
    assert resumed.frames == 40 and torch.equal(resumed.ask_tokens(QUESTION, max_new_tokens=4, retrieve=2), answer)
    for frame in random_frames(5, seed=1):  # it streams on, and resumes again
        resumed.push(frame)
    resumed.close()
    Stream.load(folder, qa).close()


def test_a_loaded_block_file_cut_short_under_rows_still_held_is_refused(adapter, tmp_path, small_blocks):
    loaded, qa = _loaded_on_disk(adapter, tmp_path)
    folder, values = loaded.prefill.disk.folder, loaded.prefill.disk.buffers[1]["detailed"]
    block, rows = divmod(values.length - 1, values.block_rows)  # the last row, of the last step (held)
    loaded.close()
    cut = folder / f"layer1.detailed.1.{block}.bin"
    cut.write_bytes(cut.read_bytes()[:rows * values.row_bytes])
    with pytest.raises(InputError) as error:
        Stream.load(folder, qa)
    assert f"damaged: {cut.name} is shorter than the rows its journal lists" in str(error.value)
    assert "\n" not in str(error.value)
