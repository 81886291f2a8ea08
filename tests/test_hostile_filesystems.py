"""Read-only and full file systems: every save, load, disk-tier stream and evaluation run on one fails in one line
(no traceback), and nothing is left half-written.

Each case runs in a child process (`hostile.run_child`) that sees a folder read-only (a read-only bind mount in a
mount namespace of its own where the system allows it, else the folder's permissions, else a shim failing its
writes there: `hostile.read_only_way`), or whose files cannot grow past a few kilobytes (``RLIMIT_FSIZE``: a full
disk without root). The monkeypatched failures of every single write are `test_hostile_failures`'.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from statekv import Stream
from statekv.models import load_adapter
from statekv.synthetic.benchmark import make_benchmark
from statekv.testing import make_tiny_checkpoint

from hostile import noise_frames, run_child, small_qa

SETUP = """
from pathlib import Path
import numpy as np, statekv
from statekv import Stream
from statekv.models import load_adapter
checkpoint, root = Path(sys.argv[1]), Path(sys.argv[2])
adapter = load_adapter(checkpoint)
frames = np.random.default_rng(0).integers(0, 256, (4, 24, 32, 3), dtype=np.uint8)
def qa(**kwargs):
    return statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40, **kwargs)
def pushed(stream, count=3):
    for index in range(count):
        stream.push(frames[index], float(index))
    return stream
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("internvl") / "ckpt")


@pytest.fixture
def shelf(checkpoint, tmp_path):
    """A folder holding a closed disk-tier stream's file set (``tier/``) and a saved stream (``s.safetensors``)."""
    adapter = load_adapter(checkpoint)
    stream = small_qa(adapter, offload="disk", offload_dir=tmp_path / "shelf" / "tier").stream(horizon_frames=8)
    for index, frame in enumerate(noise_frames(3)):
        stream.push(frame, float(index))
    stream.save(tmp_path / "shelf" / "s.safetensors")
    stream.close()
    return tmp_path / "shelf"


def _contents(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "/"
            for path in sorted(folder.rglob("*"))}


def _one_line(result: dict, *phrases: str) -> str:
    assert not result["ok"] and "raw" not in result, result.get("raw") or result
    message = result["message"]
    assert "\n" not in message and all(phrase in message for phrase in phrases), message
    return message


# ---------------------------------------------------------------------------------------------------------------
# Read-only
# ---------------------------------------------------------------------------------------------------------------
READ_ONLY_CASES = {
    "Stream.load of a disk-tier folder": ("attempt(lambda: Stream.load(next((root / 'tier').iterdir()), "
                                          "qa(offload='disk', offload_dir=root.parent / 'writable')).frames)",
                                          ("cannot write the disk cache", "copy the folder somewhere writable")),
    "Stream.save into it": ("attempt(lambda: str(pushed(qa().stream(horizon_frames=4)).save(root / 't.safetensors')))",
                            ("t.safetensors",)),
    "Stream.save over a file there": ("attempt(lambda: str(pushed(qa().stream(horizon_frames=4)).save("
                                      "root / 's.safetensors')))", ("s.safetensors",)),
    "a new disk-tier stream there": ("attempt(lambda: qa(offload='disk', offload_dir=root / 'tier').stream("
                                     "horizon_frames=4).frames)", ("tier",)),
    "statekv eval --out there": ("from statekv.cli import main\n"
                                 "attempt(lambda: main(['eval', 'synthetic', '--model', 'builtin', '--data-root', "
                                 "sys.argv[3], '--out', str(root / 'run'), '--budget', '16', '--no-progress', "
                                 "'--max-new-tokens', '2', '--limit', '1']))", ("run",)),
}


@pytest.mark.parametrize("case", READ_ONLY_CASES)
def test_on_a_read_only_folder_every_write_is_one_line_and_nothing_changes(case, checkpoint, shelf, tmp_path,
                                                                          capfd):
    data = make_benchmark(tmp_path / "data", videos=1, seed=3, num_frames=12).parent
    before = _contents(shelf)
    call, phrases = READ_ONLY_CASES[case]
    result, child = run_child(SETUP + call, checkpoint, shelf, data, read_only=shelf)
    if case.startswith("statekv eval"):  # a command: its one line on stderr, exit status 2
        lines = [line for line in child.stderr.splitlines() if line.startswith("statekv eval:")]
        assert result == {"ok": True, "value": 2}, (result, child.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in child.stderr, child.stderr[-2000:]
        assert "Read-only file system" in lines[0] or "Permission denied" in lines[0], lines[0]
    else:
        message = _one_line(result, *phrases)
        assert "Read-only file system" in message or "Permission denied" in message, message
    assert _contents(shelf) == before


def test_a_saved_stream_on_a_read_only_folder_still_loads(checkpoint, shelf):
    result, _ = run_child(SETUP + "attempt(lambda: Stream.load(root / 's.safetensors', qa()).frames)", checkpoint,
                          shelf, read_only=shelf)
    assert result == {"ok": True, "value": 3}


# ---------------------------------------------------------------------------------------------------------------
# Full
# ---------------------------------------------------------------------------------------------------------------
FULL_CASES = {  # (what the child does, the most bytes a file may hold)
    "a new disk-tier stream whose first step does not fit": (
        "attempt(lambda: pushed(qa(offload='disk', offload_dir=root.parent / 'tier2').stream(horizon_frames=4)).frames)",
        600),
    "a saved stream loaded into a disk tier that cannot hold it": (
        "attempt(lambda: Stream.load(root / 's.safetensors', qa(offload='disk', offload_dir=root.parent / 'tier2')).frames)",
        3000),
    "a save that does not fit over the file there": (
        "attempt(lambda: str(pushed(qa().stream(horizon_frames=4), 4).save(root / 's.safetensors')))", 3000),
}


@pytest.mark.parametrize("case", FULL_CASES)
def test_on_a_full_disk_every_write_is_one_line_and_nothing_is_left_half_written(case, checkpoint, shelf):
    before = _contents(shelf)
    call, limit = FULL_CASES[case]
    result, _ = run_child(SETUP + call, checkpoint, shelf, max_file_bytes=limit)
    _one_line(result, "File too large")
    assert _contents(shelf) == before  # no partial file, and the file there as it was
    tier = shelf.parent / "tier2"  # the offload folder asked for may stay, empty: no file set is left in it
    assert not tier.exists() or not any(tier.iterdir()), sorted(tier.rglob("*"))


def test_an_evaluation_whose_run_folder_fills_up_is_one_line_and_a_rerun_finishes(tmp_path):
    data = make_benchmark(tmp_path / "data", videos=1, seed=3, num_frames=12).parent
    out = tmp_path / "run"
    run = ("from statekv.cli import main\n"
           "attempt(lambda: main(['eval', 'synthetic', '--model', 'builtin', '--data-root', sys.argv[1], '--out', "
           "sys.argv[2], '--budget', '16', '--no-progress', '--max-new-tokens', '2', '--limit', '2']))")
    result, child = run_child(run, data, out, max_file_bytes=700)
    lines = [line for line in child.stderr.splitlines() if line.startswith("statekv eval:")]
    assert result == {"ok": True, "value": 2}, (result, child.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in child.stderr and "File too large" in lines[0], child.stderr[-3000:]
    result, child = run_child(run, data, out)  # room again: the run goes on from what it kept
    assert result == {"ok": True, "value": 0}, (result, child.stderr[-2000:])
