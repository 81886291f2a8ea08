"""The files a disk-tier stream holds open: a few a layer while it streams (the files of the block each of its
buffers writes), as many more while a checksum pass reads (a resume, a saved stream loaded onto the disk tier). A
library user keeps the usual soft limit of 1,024, which one stream of an 80-layer model passes: the disk tier raises
it to the hard limit as it opens, as `statekv serve` does at start. Each check whose limit would leak runs in a
process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

import statekv
from statekv import Stream
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames

LAYERS = 8  # files enough that a soft limit a few files above what a process holds refuses the stream

CHILD = """
import os, resource, sys
import statekv
from statekv import Stream

checkpoint, saved, folder, offload_dir = sys.argv[1:5]
qa = statekv.VideoQA.from_pretrained(checkpoint, method="statekv", offload="disk", offload_dir=offload_dir,
                                     attention="eager")

def lowered():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))

lowered()
with Stream.load(saved, qa) as loaded:  # onto the disk tier: its files written, then every step checksummed
    print("loaded", loaded.frames)
lowered()
with Stream.load(folder, qa) as resumed:
    print("resumed", resumed.frames)
"""


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("deep") / "ckpt",
                                text_config={"num_hidden_layers": LAYERS})


def run_child(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_a_library_stream_on_the_disk_tier_raises_the_soft_limit_on_open_files(deep_checkpoint, tmp_path):
    """Before: a soft limit below what the stream's layers hold open refused the load and the resume with a
    traceback (``OSError: [Errno 24] Too many open files``), where `statekv serve` would have raised it."""
    frames = random_frames(6)
    with statekv.VideoQA.from_pretrained(deep_checkpoint, method="statekv", offload=True,
                                         attention="eager").stream() as stream:
        for frame in frames:
            stream.push(frame)
        saved = stream.save(tmp_path / "s.safetensors")
    qa = statekv.VideoQA.from_pretrained(deep_checkpoint, method="statekv", offload="disk",
                                         offload_dir=tmp_path / "disk", attention="eager")
    with qa.stream() as stream:
        for frame in frames:
            stream.push(frame)
        folder = stream.folder
    child = run_child(CHILD, deep_checkpoint, saved, folder, tmp_path / "child")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["loaded", "6", "resumed", "6"]
