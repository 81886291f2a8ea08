"""A handover stream's successor across faults (`statekv.api.handover`, `statekv.core.disk.successor`): a fault that
passes (the backlog file unreadable for a moment, the model out of memory) puts its replay off, the successor and
its backlog as they were; a fault that stays (a damaged backlog) drops it in one line; what was durable is never
lost."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import statekv
from statekv import Stream
from statekv.testing import make_tiny_checkpoint

from conftest import random_frames
from test_handover import fingerprint, pushed

FRAMES = random_frames(40, seed=3, height=32, width=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    short = {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    return make_tiny_checkpoint("internvl", tmp_path_factory.mktemp("faults") / "ckpt", text_config=short,
                                vision_config={"image_size": 112})


def loaded(checkpoint, layout: str | None = None, **settings) -> statekv.VideoQA:
    return statekv.VideoQA.from_pretrained(checkpoint, method="statekv", budget=24, reserve_tokens=24,
                                           bounded_layout=layout, attention="eager", **settings)


def on_disk(checkpoint, tmp_path) -> statekv.VideoQA:
    return loaded(checkpoint, offload="disk", offload_dir=str(tmp_path / "disk"))


@pytest.fixture(scope="module")
def cache_layout(checkpoint):
    """The cache-layout stream of every frame: what a handover stream is once past the range."""
    with pushed(loaded(checkpoint, "cache"), FRAMES) as stream:
        yield fingerprint(stream.prefill)


def test_a_backlog_unreadable_for_a_moment_puts_the_replay_off(checkpoint, tmp_path, cache_layout, monkeypatch,
                                                               caplog):
    """Before: an OSError reading ``backlog.bin`` dropped the successor for good (the stream own-then-cache past
    the range, and its backlog gone at the next resume)."""
    stream = pushed(on_disk(checkpoint, tmp_path), FRAMES[:3])
    real, failed = os.pread, []

    def flaky(fd, length, offset):
        if not failed and os.readlink(f"/proc/self/fd/{fd}").endswith("backlog.bin"):
            failed.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, length, offset)
    monkeypatch.setattr(os, "pread", flaky)
    for frame in FRAMES[3:]:
        stream.push(frame)
    assert failed and stream.handover == "handed over"
    assert "Input/output error" in caplog.text and "replay stopped" in caplog.text
    assert fingerprint(stream.prefill) == cache_layout
    stream.close()


def test_a_replay_out_of_memory_is_put_off_and_the_handover_goes_on_later(checkpoint, cache_layout, monkeypatch,
                                                                           caplog):
    """Before: the model out of memory for one replayed step (rolled back, the successor as it was) dropped the
    successor for good: past the range the stream was own-then-cache, not the cache-layout stream."""
    stream = pushed(loaded(checkpoint), FRAMES[:3])
    decoder, failed = stream.prefill.decoder, []
    forward = decoder.forward

    def short_once(*args, **kwargs):
        if not failed and stream.successor is not None and kwargs.get("past_key_values") is stream.successor.cache:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore advice")
        return forward(*args, **kwargs)
    monkeypatch.setattr(decoder, "forward", short_once)
    with caplog.at_level(logging.WARNING, logger="statekv"):
        for frame in FRAMES[3:]:
            stream.push(frame)
    assert failed and stream.handover == "handed over"
    assert "replay stopped" in caplog.text and "CUDA out of memory. Tried to allocate 2.00 GiB" in caplog.text
    assert "more advice" not in caplog.text  # one line
    assert fingerprint(stream.prefill) == cache_layout
    stream.close()


def test_a_handover_the_disk_refuses_before_it_is_marked_goes_on_later(checkpoint, tmp_path, cache_layout,
                                                                      monkeypatch, caplog):
    """Before: a full disk for a moment as the handover was being marked (its successor's every step replayed)
    dropped the successor for good; now the stream and its successor stay as they were, a later push or catch_up
    hands over, and the folder resumes as the cache-layout stream."""
    from statekv.steps.jobs import ReplayPutOff

    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, FRAMES[:3])
    folder, real, refused = stream.durability.folder, os.replace, []

    def full(source, target, *args, **kwargs):
        if len(refused) < 2 and str(target).endswith("handover.json"):
            refused.append(target)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(source, target, *args, **kwargs)
    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="statekv"):
        pushes = iter(FRAMES[3:])
        while not refused:
            stream.push(next(pushes))
        assert stream.handover == "beside" and stream.handover_due and not stream.backlog.steps
        assert not (folder / "handover.json").exists()
        assert "its handover stopped before it was marked" in caplog.text and "No space left" in caplog.text
        with pytest.raises(ReplayPutOff, match="No space left on device") as again:
            stream.catch_up()
        assert "\n" not in str(again.value) and stream.handover == "beside"
        stream.catch_up()
        assert stream.handover == "handed over" and "streams on without its successor" not in caplog.text
    for frame in pushes:
        stream.push(frame)
    assert fingerprint(stream.prefill) == cache_layout
    stream.close()
    with Stream.load(folder, qa) as resumed:
        assert resumed.frames == 40 and resumed.frames_lost == 0 and resumed.handover == "handed over"
        assert fingerprint(resumed.prefill) == cache_layout


def test_memory_short_again_once_the_backlog_grew_drops_the_successor(checkpoint, monkeypatch):
    """Before: memory short at every replayed step put the replay off at every push for good, the successor kept
    beside the stream and its backlog growing by a step a push without bound; now memory short again at a later
    push's replay drops it, as before memory faults were put off (a quiet catch_up between pushes is not one)."""
    from statekv.steps.jobs import ReplayPutOff

    stream = pushed(loaded(checkpoint), FRAMES[:3])
    decoder = stream.prefill.decoder
    forward = decoder.forward

    def short(*args, **kwargs):
        if stream.successor is not None and kwargs.get("past_key_values") is stream.successor.cache:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return forward(*args, **kwargs)
    monkeypatch.setattr(decoder, "forward", short)
    pushes = iter(FRAMES[3:])
    while not stream.handover_due:
        stream.push(next(pushes))
    assert stream.handover == "beside" and stream.backlog.steps  # put off once
    with pytest.raises(ReplayPutOff, match="out of memory"):
        stream.catch_up()  # no step streamed since: still put off
    assert stream.handover == "beside"
    stream.push(next(pushes))
    assert stream.handover.startswith("alone: ") and "out of memory" in stream.handover
    assert not stream.backlog.steps and stream.successor is None
    for frame in pushes:
        stream.push(frame)
    stream.close()


def test_memory_short_reading_a_backlog_step_puts_the_replay_off(checkpoint, monkeypatch, cache_layout):
    """Before: memory short as the backlog's step was read back or moved to the model's device (not in the step
    itself) escaped the replay: the push whose frame was streamed raised it, as if its frame were not taken."""
    from statekv.api.handover import Backlog

    stream = pushed(loaded(checkpoint), FRAMES[:3])
    real, failed = Backlog.first, []

    def short_once(backlog):
        if not failed and stream.handover_due:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(backlog)
    monkeypatch.setattr(Backlog, "first", short_once)
    for frame in FRAMES[3:]:
        stream.push(frame)
    assert failed and stream.frames == 40 and stream.handover == "handed over"
    assert fingerprint(stream.prefill) == cache_layout
    stream.close()


def test_a_disk_full_for_good_backs_the_replay_off_then_drops_the_successor(checkpoint, tmp_path, monkeypatch,
                                                                            caplog):
    """Before: the successor's disk refusing every replayed step was tried again at every push past the range (a
    step of the successor's computed and refused each time) and its backlog grew by a step a push without bound;
    now the replay is tried again after 1, 2, 4, ... steps and `PUT_OFF_TRIES` refusals drop the successor, in two
    log lines, the stream losing no frame."""
    from statekv.api.handover import PUT_OFF_TRIES
    from statekv.core.disk.tier import DiskTier
    from statekv.errors import OutputError

    frames = random_frames(60, seed=3, height=32, width=32)
    qa = on_disk(checkpoint, tmp_path)
    stream = pushed(qa, frames[:3])
    folder, real, taken, refused = stream.durability.folder, DiskTier.commit_step, [], []

    def full(tier, *args, **kwargs):
        if tier.folder != folder:  # the successor's file set, in a subfolder: its disk full after two steps
            if len(taken) >= 2:
                refused.append(stream.frames)
                raise OutputError(f"cannot write the disk cache in {tier.folder}: No space left on device")
            taken.append(True)
        return real(tier, *args, **kwargs)
    monkeypatch.setattr(DiskTier, "commit_step", full)
    with caplog.at_level(logging.WARNING, logger="statekv"):
        for frame in frames[3:]:
            stream.push(frame)
    assert len(refused) == PUT_OFF_TRIES and refused[-1] - refused[0] == 2 ** (PUT_OFF_TRIES - 1) - 1
    assert stream.handover.startswith(f"alone: the disk refused its replay {PUT_OFF_TRIES} times in a row")
    assert stream.successor is None and not stream.backlog.steps
    assert caplog.text.count("replay stopped") == 1 and caplog.text.count("without its successor") == 1
    assert stream.frames == 60 and stream.ask("What is shown?", max_new_tokens=2).strip() is not None
    stream.close()
    with Stream.load(folder, qa) as resumed:
        assert resumed.frames == 60 and resumed.frames_lost == 0


def test_a_handover_the_disk_refuses_for_good_backs_off_then_drops_the_successor(checkpoint, tmp_path, monkeypatch):
    """Before: a handover the disk refused was tried again at every push for good (the step replayed before each
    try counted as a success, so its refusals never added up to `PUT_OFF_TRIES`); now its tries back off as a
    refused replay's do, and `PUT_OFF_TRIES` of them drop the successor, the stream losing no frame."""
    from statekv.api.durability import Durability
    from statekv.api.handover import PUT_OFF_TRIES
    from statekv.errors import OutputError

    frames = random_frames(60, seed=3, height=32, width=32)
    stream = pushed(on_disk(checkpoint, tmp_path), frames[:3])
    refused = []

    def full(*args, **kwargs):
        refused.append(stream.frames)
        raise OutputError("cannot write the disk cache: No space left on device")
    monkeypatch.setattr(Durability, "hand_over", full)
    for frame in frames[3:]:
        stream.push(frame)
    assert len(refused) == PUT_OFF_TRIES and refused[-1] - refused[0] == 2 ** (PUT_OFF_TRIES - 1) - 1, refused
    assert stream.handover.startswith(f"alone: the disk refused its handover {PUT_OFF_TRIES} times in a row")
    assert stream.successor is None and stream.frames == 60
    stream.close()
