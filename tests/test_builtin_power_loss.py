"""What a power loss (not a kill) leaves of a built-in training run: its checkpoint, once written, stays (the
rename that makes it the run's forced to the device), and so do the log lines of the steps it holds (forced
before it), so a resume neither goes back past a checkpoint it said it saved nor has a curve with steps missing."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from statekv.builtin.long_range import LongRange
from statekv.builtin.training import LOG_FILE, STATE_FILE, Recipe, train
from statekv.errors import OutputError


def _watched(monkeypatch) -> list[tuple[str, str, int]]:
    """What is forced to the device and renamed from now on, in order: ``("fsync", path, size)`` for a file,
    ``("fsync", folder, -1)`` for a folder, ``("replace", target, -1)``."""
    seen, fsync, replace = [], os.fsync, os.replace

    def forced(fd):
        status = os.fstat(fd)
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), -1 if stat.S_ISDIR(status.st_mode)
                     else status.st_size))
        fsync(fd)

    def renamed(source, target):
        replace(source, target)
        seen.append(("replace", str(Path(target).resolve()), -1))
    monkeypatch.setattr(os, "fsync", forced)
    monkeypatch.setattr(os, "replace", renamed)
    return seen


def test_each_checkpoint_is_forced_with_its_log_lines_before_and_its_name_after(tmp_path, monkeypatch):
    """Before: the log was never forced and the checkpoint's folder neither, so a power loss right after a
    checkpoint could bring back the one before it, or a log without the lines of the steps it holds."""
    out = tmp_path.resolve()
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (3, 1)), warmup_steps=1, log_every=1,
                    checkpoint_every=1, long_range=LongRange(steps=0))
    seen = _watched(monkeypatch)
    threads = torch.get_num_threads()
    try:
        train(recipe, out, stop_after=2)
    finally:
        torch.set_num_threads(threads)
    commits = [index for index, event in enumerate(seen) if event[:2] == ("replace", str(out / STATE_FILE))]
    assert len(commits) == 2
    log_sizes, start = [], 0
    for commit in commits:
        forced_log = [size for kind, path, size in seen[start:commit] if path == str(out / LOG_FILE)]
        log_sizes.append(forced_log[-1] if forced_log else None)
        assert ("fsync", str(out), -1) in seen[commit + 1:commit + 3], seen[commit:]
        start = commit
    lines = (out / LOG_FILE).read_bytes().splitlines(keepends=True)
    assert log_sizes == [len(lines[0]), len(lines[0]) + len(lines[1])]


def test_a_log_whose_fsync_failed_stops_the_run_naming_the_log_and_a_rerun_goes_on_from_the_last_checkpoint(
        tmp_path, monkeypatch):
    """Before: the error named the checkpoint (which was written and forced), not the log whose fsync failed, and
    said the run goes on. Its lines since the last checkpoint may be lost (Linux may drop the pages a failed fsync
    could not write): no checkpoint is written past them, the run stops saying so, and a rerun goes on from the
    last checkpoint with the log cut back to it."""
    recipe = Recipe(videos_per_batch=1, curriculum=((0, 1), (3, 1)), warmup_steps=1, log_every=1,
                    checkpoint_every=1, long_range=LongRange(steps=0))
    fsync, flushes = os.fsync, []

    def failing_once(fd):  # the log's second flush, that of step 2's checkpoint
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == LOG_FILE:
            flushes.append(fd)
            if len(flushes) == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync(fd)
    monkeypatch.setattr(os, "fsync", failing_once)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(OutputError) as error:
            train(recipe, tmp_path, stop_after=2)
        assert torch.load(tmp_path / STATE_FILE, weights_only=True)["step"] == 1
        train(recipe, tmp_path, stop_after=2)
    finally:
        torch.set_num_threads(threads)
    message = str(error.value)
    assert "\n" not in message and f"cannot force the training log {tmp_path / LOG_FILE} to the device" in message
    assert "rerun to go on from the last one written, 1 steps" in message
    assert [line.split(b",")[0] for line in (tmp_path / LOG_FILE).read_bytes().splitlines()] == [b'{"step": 1',
                                                                                                b'{"step": 2']
