"""Watches: standing questions about a live stream (`Stream.watch`, `statekv.api.watch`, `statekv.core.watching`).

Through the built-in model: events and cadence, the evaluation against `ask` where they must agree (full attention
reads everything either way), what an evaluation reads (never more than the carried state, the new frames, the
prompt and the answer, however long the stream), several streams' evaluations as one batch, saving and loading,
steering, and bad input."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

import statekv
import statekv.api.watch as watch_module
import statekv.api.watch_saving as watch_saving
import statekv.core.answering.rows as rows_module
from statekv.api.stream_disk import kept_watches_files
from statekv.errors import InputError
from statekv.synthetic.plans import plan_video
from statekv.synthetic.prompts import question_prompt
from statekv.synthetic.scenes import render
from statekv.synthetic.seeds import video_rng

from conftest import random_frames

COUNT = question_prompt("How many times did the video show red?", ["1", "2", "3", "4"])
COLOUR = question_prompt("What colour was the circle?", ["red", "green", "blue", "yellow"])


@pytest.fixture(scope="module")
def frames():
    plan = plan_video(video_rng(4141, 0), 48)
    return [render(still) for still in plan.stills]


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin")


@pytest.fixture(scope="module")
def full(qa):
    return qa.with_options(method="full")


def push(stream, frames, start, stop):
    for k in range(start, stop):
        stream.push(frames[k], float(k))


def test_a_watch_reports_when_its_answer_changes(qa, frames):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 3)
    watch = stream.watch(COUNT, every=4)
    assert stream.watches == [watch] and watch.evaluations == 1  # evaluated when opened: the answer now
    assert watch.events[0].frame == 3 and watch.events[0].seconds == 2.0
    push(stream, frames, 3, 15)
    assert watch.evaluations == 4  # after frames 7, 11, 15
    assert [event.frame for event in watch.events] == sorted({event.frame for event in watch.events})
    for before, after in zip(watch.events, watch.events[1:]):
        assert before.answer != after.answer  # an event only when the answer changed
    assert all(event.answer in "ABCD" and event.seconds == event.frame - 1 for event in watch.events)
    assert watch.to_dict()["events"][0] == {"frame": 3, "seconds": 2.0, "answer": watch.events[0].answer}
    watch.close()
    push(stream, frames, 15, 20)
    assert watch.evaluations == 4 and stream.watches == []
    stream.close()


def test_a_watch_opened_after_a_dropped_frame_dates_its_answer_by_the_last_frame_kept(qa, frames, tmp_path):
    """Before: its first event's time was the dropped frame's, a frame the answer never saw."""
    stream = qa.stream(max_fps=1)
    stream.push(frames[0], 0.0)
    stream.push(frames[1], 1.0)
    assert not stream.push(frames[2], 1.5)  # dropped: within frame 1's second
    watch = stream.watch(COUNT, every=4)
    assert (watch.events[0].frame, watch.events[0].seconds) == (2, 1.0)
    loaded = statekv.Stream.load(stream.save(tmp_path / "s.safetensors"), qa)  # kept with the stream
    assert loaded.kept_timestamp == 1.0 and loaded.last_timestamp == 1.5
    assert loaded.watches[0].last_seconds == 1.0
    disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "tier"))
    tiered = statekv.Stream.load(tmp_path / "s.safetensors", disk)  # into the disk tier, then resumed from there
    folder = tiered.prefill.disk.folder
    tiered.close()
    resumed = statekv.Stream.load(folder, disk)
    assert resumed.kept_timestamp == 1.0 and resumed.last_timestamp == 1.5
    resumed.push(frames[3], 2.0)  # the step's own frame is kept, and so is its time once resumed again
    resumed.close()
    assert statekv.Stream.load(folder, disk).kept_timestamp == 2.0
    stream.close()
    loaded.close()
    recent = qa.with_options(method="simplestream").stream(max_fps=1)  # before: dated by the dropped frame, 1.5
    assert [recent.push(frames[k], seconds) for k, seconds in enumerate((0.0, 1.0, 1.5))] == [True, True, False]
    assert (recent.watch(COUNT, every=4).events[0].seconds, recent.watches[0].last_seconds) == (1.0, 1.0)


def test_a_watch_opened_while_frames_wait_for_their_batch_is_dated_by_the_last_frame_encoded(qa, frames, tmp_path):
    """Before: its first event had no time (None), and after a load so had a new watch's, so one timed by
    ``every_seconds`` came due at the next step whatever the time."""
    stream = qa.stream(max_fps=None, vision_batch=4)
    push(stream, frames, 0, 6)  # frames 0-3 encoded at 0-3 s, 4 and 5 waiting for their batch: encoded first
    watch = stream.watch(COUNT, every_seconds=3.0)
    assert (watch.events[0].frame, watch.events[0].seconds, watch.last_seconds) == (6, 5.0, 5.0)
    push(stream, frames, 6, 8)  # waiting for their batch as the stream is saved
    loaded = statekv.Stream.load(stream.save(tmp_path / "s.safetensors"), qa)
    assert loaded.encoded_timestamp == 5.0 and loaded.watches[0].last_seconds == 5.0
    other = loaded.watch(COLOUR, every=4)
    assert (other.events[0].frame, other.events[0].seconds) == (8, 7.0)
    for each in (stream, loaded):
        each.close()


def test_a_watch_first_answers_from_every_frame_a_question_would_read(qa, frames):
    """Before: opened while complete steps waited for their vision batch, its first answer was evaluated without
    them (none at all with fewer frames than a batch: no answer, no event), where `ask` encodes them first."""
    stream = qa.stream(max_fps=None, vision_batch=4)
    push(stream, frames, 0, 3)  # three complete steps, waiting for their batch of four
    watch = stream.watch(COUNT, every=2)
    assert stream.frames == 3 and not stream.pending
    assert watch.evaluations == 1 and [(event.frame, event.seconds) for event in watch.events] == [(3, 2.0)]
    assert watch.answer == stream.ask(COUNT, max_new_tokens=watch.max_new_tokens)
    stream.close()


def test_every_seconds_counts_stream_time(qa, frames):
    stream = qa.stream()
    push(stream, frames, 0, 2)
    watch = stream.watch(COLOUR, every_seconds=5.0)
    for k in range(2, 14):
        stream.push(frames[k], 2.0 * k)  # two seconds apart: due every third frame
    assert [event.frame for event in watch.events][0] == 2
    assert watch.evaluations == 1 + 4  # at 8, 14, 20, 26 seconds after opening at 2
    stream.close()


def test_every_seconds_keeps_its_period_at_an_epochs_time(qa, frames):
    """A camera's timestamps are seconds since 1970, where two frames 2 s apart differ by 2 only to within 2.4e-7:
    each is still due (a fixed epsilon judged most of them early, and skipped them)."""
    counts = []
    for start in (0.0, 1.7e9 + 0.1):
        stream = qa.stream()
        watch = stream.watch(COLOUR, every_seconds=0.2)
        for k in range(12):
            stream.push(frames[k], start + 0.2 * k)
        counts.append(watch.evaluations)
        stream.close()
    assert counts == [12, 12]


@pytest.mark.parametrize("horizon", [None, 40])
def test_under_full_attention_an_evaluation_is_the_answer_to_ask(full, frames, horizon, monkeypatch):
    """Full attention carries every token, so the carried state and the new frames are the whole stream: an
    evaluation reads exactly what `ask` reads, every token once, at the same positions (bounded, or the
    stream's own)."""
    read = []
    original = rows_module.masked_attention

    def spy(q, keys, values, valid, scale, **kwargs):
        read.append((q.shape[2], int(valid[0, 0].sum())))
        return original(q, keys, values, valid, scale, **kwargs)

    monkeypatch.setattr("statekv.core.answering.rows.masked_attention", spy)
    stream = full.stream(horizon, max_fps=1)
    push(stream, frames, 0, 6)
    watch = stream.watch(COUNT, max_new_tokens=4)
    for stop in (13, 21, 30):
        push(stream, frames, stream.frames, stop)
        read.clear()
        assert watch.evaluate() == stream.ask(COUNT, max_new_tokens=4)
        tokens, valid = read[0]  # the prompt's forward (its last answer after it, the draft it checks first)
        assert valid - tokens == stream.tokens  # read every token of the stream once
    layers = len(stream.prefill.cache.layers)
    assert len(read) == layers  # the answer did not change: the prompt's forward checked it whole, no other forward
    read.clear()
    evaluations = watch.evaluations
    assert watch.evaluate() == watch.answer and read == [] and watch.evaluations == evaluations  # nothing new
    stream.close()


def test_an_evaluation_reads_the_carried_state_and_the_new_frames_only(qa, frames, monkeypatch):
    read = []
    original = rows_module.masked_attention

    def spy(q, keys, values, valid, scale, **kwargs):
        read.append(int(valid[0, 0].sum()))
        return original(q, keys, values, valid, scale, **kwargs)

    monkeypatch.setattr(rows_module, "masked_attention", spy)
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    watch = stream.watch(COUNT, every=2, max_new_tokens=1, steer=False)
    push(stream, frames, 2, 40)
    prompt = stream.adapter.question_ids(COUNT, stream.state).shape[1]
    budget = stream.prefill.policy.steady_budget(0)
    new = 2 * 4  # two frames of four tokens since the last evaluation
    assert stream.tokens > budget + new + prompt + 40  # the stream outgrew what an evaluation reads
    assert max(read) <= budget + new + prompt + 1
    assert watch.evaluations == 20
    stream.close()


def test_evaluating_a_watch_with_frames_pending_evaluates_it_once(qa, frames):
    stream = qa.stream(max_fps=None, vision_batch=4)
    watch = stream.watch(COUNT, every=2)
    heard = []
    watch.subscribe(lambda watch, event: heard.append(stream.frames))
    push(stream, frames, 0, 7)  # 4 encoded, 3 waiting for their batch
    before = watch.evaluations
    watch.evaluate()  # the waiting steps encoded, then the watch evaluated: once
    assert stream.frames == 7 and watch.evaluations == before + 1 and heard[-1] == 7 and heard.count(7) == 1


def test_a_listener_that_asks_saves_or_evaluates_sees_each_frame_pushed_once(qa, frames, tmp_path, caplog):
    plain = qa.stream(max_fps=None)
    plain_watch = plain.watch(COUNT, every=4)
    push(plain, frames, 0, 12)
    stream = qa.stream(max_fps=None)
    watch = stream.watch(COUNT, every=4)
    saved = []

    def listener(watch, event):
        stream.ask(COUNT, max_new_tokens=2)
        path = tmp_path / f"at{stream.frames}.safetensors"
        stream.save(path)
        evaluations = watch.evaluations
        saved.append((path, stream.frames, watch.evaluate(), watch.evaluations - evaluations))  # answered already

    watch.subscribe(listener)
    push(stream, frames, 0, 12)
    assert stream.frames == stream.pushed == 12 and list(stream.step_frames) == list(plain.step_frames)
    assert watch.evaluations == plain_watch.evaluations == 3 and "failed" not in caplog.text
    assert [event.to_dict() for event in watch.events] == [event.to_dict() for event in plain_watch.events]
    assert stream.ask(COLOUR) == plain.ask(COLOUR)
    assert [frames_then for _, frames_then, _, _ in saved] == [4, 8, 12]
    answers = {event.frame: event.answer for event in plain_watch.events}
    assert [again for _, _, _, again in saved] == [0, 0, 0]
    for _, frames_then, evaluated, _ in saved:  # the answer the stream without the listener had at those frames
        assert evaluated == answers[max(frame for frame in answers if frame <= frames_then)]
    for path, frames_then, _, _ in saved:
        loaded = statekv.Stream.load(path, qa)
        assert loaded.frames == loaded.pushed == frames_then
        loaded.close()
    for one in (stream, plain):
        one.close()


def test_a_listener_told_after_streams_pushed_together_sees_its_stream_as_pushed(qa, frames, caplog):
    first, second = qa.stream(max_fps=None), qa.stream(max_fps=None)
    watch = first.watch(COUNT, every=4)
    heard = []
    watch.subscribe(lambda watch, event: heard.append((watch.evaluate(), first.frames, first.pushed)))
    for k in range(8):
        qa.push_many([(first, frames[k], float(k)), (second, frames[47 - k], float(k))])
    assert first.frames == first.pushed == second.frames == 8
    assert [(frames_then, pushed) for _, frames_then, pushed in heard] == [(4, 4), (8, 8)]
    assert "failed" not in caplog.text
    for one in (first, second):
        one.close()


def test_a_watch_keeps_its_cadence_when_a_batch_passes_its_frame(qa, frames):
    stream = qa.stream(max_fps=None, vision_batch=3)
    watch = stream.watch(COUNT, every=4)
    heard = []
    watch.subscribe(lambda watch, event: heard.append(stream.frames))
    push(stream, frames, 0, 24)  # batches end at frames 3, 6, ..., 24: due at 4, 8, ..., 24
    assert watch.evaluations == 6 and heard == [6, 9, 12, 18, 21, 24]


def test_many_streams_evaluate_their_watches_together(qa, frames, monkeypatch):
    batches = []
    original = watch_module.evaluate

    def spy(evaluations, head):
        batches.append(len(evaluations))
        return original(evaluations, head)

    streams = [qa.stream(max_fps=1) for _ in range(3)]
    for stream in streams:
        push(stream, frames, 0, 2)
    watches = [stream.watch(COLOUR, every=3, steer=False) for stream in streams]
    monkeypatch.setattr(watch_module, "evaluate", spy)
    for k in range(2, 11):
        qa.push_many([(stream, frames[k], float(k)) for stream in streams])
    assert batches == [3, 3, 3]  # every stream's watch, one batch per due push
    monkeypatch.setattr(watch_module, "evaluate", original)
    alone = qa.stream(max_fps=1)
    push(alone, frames, 0, 2)
    reference = alone.watch(COLOUR, every=3, steer=False)
    push(alone, frames, 2, 11)
    assert [w.events for w in watches] == [reference.events] * 3
    for stream in [*streams, alone]:
        stream.close()


def test_a_listener_runs_on_the_thread_that_pushed_its_stream_and_may_close_its_watch(qa, frames, monkeypatch):
    """Streams pushed from threads are stepped in batches one of the threads runs. Before: every listener ran on
    that thread, so a listener closing its watch waited for the stream another thread held while that thread waited
    for the batch: both hung for good."""
    streams = [qa.stream(max_fps=1, name=f"pusher-{index}") for index in range(2)]
    for stream in streams:
        push(stream, frames, 0, 1)
    heard, queued = {}, threading.Barrier(2)
    scheduler = qa.step_scheduler
    run_batch = scheduler.run_batch

    def together(batch):  # the first batch waits for the other thread's job, so the two are stepped together
        if len(batch) == 1 and not heard.get("batched"):
            heard["batched"] = True
            deadline = time.monotonic() + 10
            while not scheduler.queue and time.monotonic() < deadline:
                time.sleep(0.01)
            batch = batch + scheduler.queue
            scheduler.queue.clear()
        run_batch(batch)
    monkeypatch.setattr(scheduler, "run_batch", together)

    def one_shot(watch, event):
        heard.setdefault(watch.stream.name, []).append(threading.current_thread().name)
        watch.close()
    for stream in streams:
        stream.watch(COLOUR, every=1, steer=False).subscribe(one_shot)
        heard[stream.name] = []

    def pushing(stream):
        queued.wait()
        push(stream, frames, 1, 3)
    threads = [threading.Thread(target=pushing, args=(stream,), name=stream.name, daemon=True) for stream in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a listener closing its watch hung the pushes"
    assert heard["batched"]
    for stream in streams:
        assert heard[stream.name] == [stream.name] and stream.watches == []  # its own thread, once: then closed
        stream.close()


def test_simplestream_pushes_from_two_threads_keep_their_times_in_order(qa, frames, monkeypatch):
    """Before: a push checked its time before taking its turn, so one overtaken by a later push appended its frame
    after it (times out of order), and one overtaken by a close added a frame to the closed stream."""
    import statekv.api.recent as recent_module

    stream = qa.with_options(method="simplestream").stream(max_fps=None)
    convert, entered, go = recent_module.rgb_frame, threading.Event(), threading.Event()

    def slow(image, **kwargs):  # the first push is held while it converts its frame
        if not entered.is_set():
            entered.set()
            go.wait(10)
        return convert(image, **kwargs)
    monkeypatch.setattr(recent_module, "rgb_frame", slow)
    outcome = []

    def early():
        try:
            outcome.append(stream.push(frames[0], 5.0))
        except InputError as error:
            outcome.append(str(error))
    thread = threading.Thread(target=early)
    thread.start()
    assert entered.wait(10)
    assert stream.push(frames[1], 6.0)  # a later time, pushed while the first waits
    go.set()
    thread.join(10)
    assert stream.frames == 1 and "non-decreasing" in outcome[0], outcome
    stream.close()


def carried(stream) -> list[torch.Tensor]:
    return [stream.prefill.carried_positions(layer).clone() for layer in range(len(stream.prefill.cache.layers))]


def test_steering_keeps_what_the_question_attends_to_and_stops_when_closed(qa, frames):
    plain, unsteered, steered = (qa.stream(max_fps=1) for _ in range(3))
    for stream in (plain, unsteered, steered):
        push(stream, frames, 0, 4)
    unsteered.watch(COUNT, every=4, steer=False)
    watch = steered.watch(COUNT, every=4)
    for stream in (plain, unsteered, steered):
        push(stream, frames, 4, 30)
    assert all(torch.equal(a, b) for a, b in zip(carried(plain), carried(unsteered)))  # steer=False: untouched
    assert not all(torch.equal(a, b) for a, b in zip(carried(plain), carried(steered)))
    watch.close()
    assert not steered.prefill.cache.guide.active
    for stream in (plain, unsteered, steered):
        stream.close()


def test_a_steered_stream_pushed_with_others_steers_as_it_does_alone(qa, frames):
    """A steered step reads its own stream's questions, so it is never batched (`batch_key`: not steady); pushed
    with others, a steered stream carries what it carries alone."""
    alone, together, other = (qa.stream(max_fps=1) for _ in range(3))
    for stream in (alone, together, other):
        push(stream, frames, 0, 4)
    watches = [stream.watch(COUNT, every=4) for stream in (alone, together)]
    push(alone, frames, 4, 30)
    for k in range(4, 30):
        qa.push_many([(together, frames[k], float(k)), (other, frames[k], float(k))])
    assert all(torch.equal(a, b) for a, b in zip(carried(alone), carried(together)))
    assert watches[0].events == watches[1].events
    for stream in (alone, together, other):
        stream.close()


def test_watches_are_saved_and_loaded_with_their_stream(qa, frames, tmp_path):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 3)
    first = stream.watch(COUNT, every=4)
    second = stream.watch(COLOUR, every_seconds=3.0, max_new_tokens=2, steer=False)
    push(stream, frames, 3, 12)
    path = stream.save(tmp_path / "s.safetensors")
    loaded = statekv.Stream.load(path, qa)
    assert [w.to_dict() for w in loaded.watches] == [first.to_dict(), second.to_dict()]
    push(stream, frames, 12, 30)
    push(loaded, frames, 12, 30)  # steered the same way: the same carried state and events
    assert [w.to_dict() for w in loaded.watches] == [first.to_dict(), second.to_dict()]
    assert all(torch.equal(a, b) for a, b in zip(carried(stream), carried(loaded)))
    stream.close()
    loaded.close()


def seen(stream) -> list[dict]:
    """What each of the stream's watches saw (its settings, evaluations and events), its id aside."""
    return [{key: value for key, value in watch.to_dict().items() if key != "id"} for watch in stream.watches]


def test_a_disk_tier_folder_closed_with_its_watches_reopens_them_as_they_stood(qa, frames, tmp_path, caplog):
    """Before: `Stream.load(folder)` reopened no watch (a saved file's did): a library caller's watches went
    silently with every close. Closed, the folder keeps them; synced then killed, it keeps them as they stood at the
    sync; a damaged or stray file is logged and the stream goes on without them."""
    import shutil

    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    never, closed = on_disk.stream(max_fps=1, name="never"), on_disk.stream(max_fps=1, name="closed")
    for stream in (never, closed):
        push(stream, frames, 0, 3)
        stream.watch(COUNT, every=4)
        stream.watch(COLOUR, every_seconds=3.0, max_new_tokens=2, steer=False)
        push(stream, frames, 3, 12)
    folder = closed.folder
    closed.close()
    shutil.copytree(folder, tmp_path / "damaged")
    with statekv.Stream.load(folder, on_disk) as resumed:
        shutil.copytree(folder, tmp_path / "at_once", ignore=shutil.ignore_patterns("lock"))  # killed at once
        with statekv.Stream.load(tmp_path / "at_once", on_disk) as again:
            assert seen(again) == seen(never)
        assert seen(resumed) == seen(never)
        before = [watch["evaluations"] for watch in seen(never)]
        push(never, frames, 12, 30)
        push(resumed, frames, 12, 30)  # steered the same way: the same carried state and events
        assert seen(resumed) == seen(never)
        assert all(watch["evaluations"] > count for watch, count in zip(seen(never), before))
        assert all(torch.equal(a, b) for a, b in zip(carried(never), carried(resumed)))
        resumed.prefill.sync()
        shutil.copytree(folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
    expected = seen(never)
    never.close()
    with statekv.Stream.load(tmp_path / "killed", on_disk) as killed:
        assert killed.frames == 30 and seen(killed) == expected
    with statekv.Stream.load(folder, on_disk) as last:
        assert seen(last) == expected
        for watch in last.watches:
            watch.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="statekv"), statekv.Stream.load(folder, on_disk) as closed_again:
        assert not closed_again.watches and not caplog.text  # closed with none open: none, and no word of them
        assert not kept_watches_files(folder)  # what files of them were left went
    unwatched = on_disk.stream(max_fps=1, name="unwatched")
    push(unwatched, frames, 0, 3)
    unwatched.close()
    for stray in (folder, unwatched.folder):
        for path in kept_watches_files(tmp_path / "killed"):
            shutil.copy(path, stray)
    with caplog.at_level("WARNING", logger="statekv"), statekv.Stream.load(folder, on_disk) as again:
        assert not again.watches and not caplog.text  # its journal says none are open: strays go, silently
        assert not kept_watches_files(folder)
    with caplog.at_level("WARNING", logger="statekv"), statekv.Stream.load(unwatched.folder, on_disk) as again:
        assert not again.watches
        assert " are not reopened: no record after the checkpoint it resumed from vouches for them" in caplog.text
    for damaged in kept_watches_files(tmp_path / "damaged"):
        damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    with caplog.at_level("WARNING", logger="statekv"), statekv.Stream.load(tmp_path / "damaged", on_disk) as again:
        assert again.frames == 12 and not again.watches
        assert "the 2 watch(es) open at its last checkpoint are not reopened: watches." in caplog.text
        assert ".safetensors is not the file its record vouches for" in caplog.text


@pytest.mark.parametrize("killed_after", [13, 14, 15, 16])
def test_a_disk_tier_stream_killed_reopens_its_watches_as_they_stood_at_its_last_checkpoint(qa, frames, tmp_path,
                                                                                           monkeypatch, killed_after):
    """Before: a disk-tier stream killed (never closed) was resumed without its watches, and without a word: they
    are now kept at each checkpoint. Resumed at that checkpoint and given the frames it lost again, it sees what the
    stream that never stopped saw: the same evaluations, events and carried state (a watch due at the checkpoint's
    step is evaluated as the resume opens it, as it was then)."""
    import shutil

    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1, name="never") as never:
        push(never, frames, 0, 3)
        never.watch(COUNT, every=3)
        never.watch(COLOUR, every_seconds=2.0, max_new_tokens=2)
        push(never, frames, 3, killed_after)
        shutil.copytree(never.folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
        with statekv.Stream.load(tmp_path / "killed", on_disk) as killed:
            assert 3 < killed.frames <= killed_after and len(killed.watches) == 2
            push(killed, frames, killed.frames, 30)
            push(never, frames, killed_after, 30)
            assert seen(killed) == seen(never)
            assert all(torch.equal(a, b) for a, b in zip(carried(never), carried(killed)))


def test_a_disk_tier_stream_killed_while_a_checkpoint_writes_its_watches_reopens_them(qa, frames, tmp_path,
                                                                                     monkeypatch):
    """Before: a checkpoint journaled its record, then replaced the one file of watches, then journaled the record
    vouching for it: killed in between, the folder resumed at that checkpoint, or at the one before with a file it
    no longer vouched for, and reopened none. Now the file goes beside the last one, and the checkpoint's records are
    one write: killed before or after the file is written, the folder resumes at the last checkpoint with its
    watches."""
    import shutil

    import statekv.api.durability as durability
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    write, kills = durability.write_watches, []

    def killed_around(folder, *args):
        if len(kills) == 2:  # at the third checkpoint with watches open: a kill just before, and just after
            shutil.copytree(folder, tmp_path / "before", ignore=shutil.ignore_patterns("lock"))
        record = write(folder, *args)
        if len(kills) == 2:
            shutil.copytree(folder, tmp_path / "after", ignore=shutil.ignore_patterns("lock"))
        kills.append(record)
        return record

    monkeypatch.setattr(durability, "write_watches", killed_around)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1, name="never") as never:
        push(never, frames, 0, 2)
        never.watch(COUNT, every=3)
        never.watch(COLOUR, every_seconds=2.0, max_new_tokens=2)
        push(never, frames, 2, 20)
        assert len(kills) > 3
        for copy in ("before", "after"):
            with statekv.Stream.load(tmp_path / copy, on_disk) as killed:
                assert len(killed.watches) == 2, copy


def test_a_checkpoint_writes_the_watches_only_when_evaluated_since(qa, frames, tmp_path, monkeypatch):
    """A real model's watch steers with queries of every layer (megabytes): checkpoints between two evaluations
    journal the last file's record again instead of writing the same watches anew."""
    import shutil

    import statekv.api.durability as durability
    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 2)
    write, written = durability.write_watches, []
    monkeypatch.setattr(durability, "write_watches", lambda *args: written.append(args[1]) or write(*args))
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1) as stream:
        push(stream, frames, 0, 2)
        stream.watch(COUNT, every=12)
        push(stream, frames, 2, 13)  # a checkpoint every 2 steps, and no evaluation before the 14th frame
        assert written == ["watches.0.safetensors"]
        push(stream, frames, 13, 17)
        assert written == ["watches.0.safetensors", "watches.1.safetensors"]
        expected = seen(stream)
        shutil.copytree(stream.folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
    with statekv.Stream.load(tmp_path / "killed", on_disk) as killed:
        assert seen(killed) == expected


def test_a_disk_tier_stream_whose_watches_all_closed_leaves_no_file_of_them(qa, frames, tmp_path, monkeypatch,
                                                                             caplog):
    """Before: the checkpoint after the last watch closed kept the file the checkpoint before vouched for (a kill
    between them reopens it), and no later checkpoint or close removed it: killed or closed, every resume after
    named it in a warning, and it stayed in the folder for good."""
    import shutil

    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    stream = on_disk.stream(max_fps=1)
    push(stream, frames, 0, 3)
    watch = stream.watch(COUNT, every=3)
    push(stream, frames, 3, 10)
    watch.close()
    push(stream, frames, 10, 26)  # checkpoints after it, none open
    folder = stream.folder
    shutil.copytree(folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
    stream.close()
    for resumed in (tmp_path / "killed", folder):
        caplog.clear()
        assert not kept_watches_files(resumed)
        with caplog.at_level("WARNING", logger="statekv"), statekv.Stream.load(resumed, on_disk) as again:
            assert not again.watches and "not reopened" not in caplog.text


def test_a_checkpoint_torn_by_a_kill_resumes_at_the_one_before_with_its_watches(qa, frames, tmp_path, monkeypatch):
    """A checkpoint's record and the records written with it (frames waiting, watches) are one write, which a kill
    or a power cut may tear. Before: the whole checkpoint record was taken, the torn records after it dropped, so
    the folder resumed there without its watches. Now the record counts its followers, and a torn one gives way to
    the checkpoint before, whole."""
    import shutil

    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    append, writes = tier.DiskTier.append, []

    def kept_append(disk, *records):
        before = disk.journal_bytes
        append(disk, *records)
        if records and "carry" in records[0] and len(records) > 1:
            writes.append((before, disk.journal_bytes, (disk.folder / "journal").read_bytes(), records[0]["carry"]))

    monkeypatch.setattr(tier.DiskTier, "append", kept_append)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1) as stream:
        push(stream, frames, 0, 3)
        stream.watch(COUNT, every=3)
        stream.watch(COLOUR, every_seconds=2.0, max_new_tokens=2)
        push(stream, frames, 3, 14)
        folder = stream.folder
        (_, _, _, earlier), (before, after, journal, last) = writes[-2:]
        for cut in (after - 3, after - (after - before) // 3):  # torn inside its last record, and its first after it
            torn = tmp_path / f"torn{cut}"
            shutil.copytree(folder, torn, ignore=shutil.ignore_patterns("lock"))
            (torn / "journal").write_bytes(journal[:cut])
            with statekv.Stream.load(torn, on_disk) as resumed:
                assert resumed.frames == earlier and len(resumed.watches) == 2
    assert earlier < last


def test_a_folder_resumed_at_a_checkpoint_and_killed_at_once_resumes_there_again(qa, frames, tmp_path, monkeypatch):
    """Before: a resume cut the journal just after its checkpoint's record, dropping the records the checkpoint
    counts as written with it (here the one saying the last watch closed): killed before they were written again,
    the folder read that checkpoint as torn and resumed at the one before, and once the next checkpoint had
    written over that one's slot, not at all (its carried state failed its checksum)."""
    import shutil

    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    append, killed, writes = tier.DiskTier.append, [], []
    unlocked = shutil.ignore_patterns("lock")

    def kept_append(disk, *records):
        append(disk, *records)
        if records and "carry" in records[0]:
            if {"watches": 0} in records[1:] and not killed:  # the first checkpoint after the watch closed
                shutil.copytree(disk.folder, tmp_path / "killed", ignore=unlocked)
                killed.append(records[0]["carry"])
            writes.append((disk.journal_bytes, (disk.folder / "journal").read_bytes()))

    monkeypatch.setattr(tier.DiskTier, "append", kept_append)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1) as stream:
        push(stream, frames, 0, 3)
        watch = stream.watch(COUNT, every=3)
        push(stream, frames, 3, 10)
        watch.close()
        push(stream, frames, 10, 16)
    assert killed
    with statekv.Stream.load(tmp_path / "killed", on_disk) as resumed:
        at = resumed.frames
        shutil.copytree(tmp_path / "killed", tmp_path / "at_once", ignore=unlocked)
        writes.clear()
        push(resumed, frames, at, at + 5)  # a checkpoint, into the slot of the one before the resume
        assert len(writes) == 1
        shutil.copytree(tmp_path / "killed", tmp_path / "torn", ignore=unlocked)
        end, journal = writes[-1]
        (tmp_path / "torn" / "journal").write_bytes(journal[:end - 3])  # a kill tears its write
    for copy in ("at_once", "torn"):
        with statekv.Stream.load(tmp_path / copy, on_disk) as again:
            assert again.frames == at and not again.watches, copy


def test_a_checkpoint_the_disk_refused_keeps_the_watches_file_the_last_one_names(qa, frames, tmp_path, monkeypatch):
    """Before: a checkpoint whose write the disk refused still took the watches file it had written as the one to
    keep, so the next checkpoint wrote over the file the last journaled one names: killed before that checkpoint's
    record, the folder resumed without its watches."""
    import shutil

    import statekv.api.durability as durability
    import statekv.core.disk.tier as tier
    from statekv.errors import OutputError

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 4)
    append, write, refuse, kill = tier.DiskTier.append, durability.write_watches, [True], [False]

    def refusing(disk, *records):
        if records and "carry" in records[0] and disk.checkpoints == 3 and refuse:
            refuse.clear()
            raise OutputError("the disk is full")
        append(disk, *records)

    def killed_after(folder, *args):
        record = write(folder, *args)
        if kill[0]:
            kill[0] = False
            shutil.copytree(folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
        return record

    monkeypatch.setattr(tier.DiskTier, "append", refusing)
    monkeypatch.setattr(durability, "write_watches", killed_after)
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with on_disk.stream(max_fps=1) as stream:
        push(stream, frames, 0, 3)
        watch = stream.watch(COUNT, every=1)
        for index in range(3, 30):
            try:
                stream.push(frames[index], float(index))
            except OutputError:
                watch.evaluate()  # evaluated since: the next checkpoint writes the watches anew
                kill[0] = True  # and is killed just after it wrote them
        assert not refuse and not kill[0]
    with statekv.Stream.load(tmp_path / "killed", on_disk) as resumed:
        assert len(resumed.watches) == 1


def test_a_folder_closed_by_the_release_before_reopens_its_watches_from_its_one_file(qa, frames, tmp_path):
    """The release before kept a closed folder's watches in ``watches.safetensors``, its record naming no file."""
    import json

    from statekv.core.disk.files import journal_line

    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    stream = on_disk.stream(max_fps=1)
    push(stream, frames, 0, 3)
    stream.watch(COUNT, every=4)
    push(stream, frames, 3, 8)
    expected, folder = seen(stream), stream.folder
    stream.close()
    lines = (folder / "journal").read_bytes().splitlines(keepends=True)
    last = max(number for number, line in enumerate(lines) if b'"watches":1' in line)
    record = json.loads(lines[last].split(b" ", 1)[1])
    (folder / record.pop("file")).rename(folder / "watches.safetensors")
    lines[last] = journal_line(record)
    (folder / "journal").write_bytes(b"".join(lines))
    with statekv.Stream.load(folder, on_disk) as resumed:
        assert seen(resumed) == expected


def test_a_saved_stream_loaded_onto_the_disk_tier_keeps_its_watches_from_its_first_checkpoint(qa, frames, tmp_path,
                                                                                                monkeypatch):
    """Before: a stream file loaded onto the disk tier took its first checkpoint before its watches were reopened,
    so killed before its next checkpoint the folder reopened none of them (and the stream was steered no more)."""
    import shutil

    import statekv.core.disk.tier as tier

    monkeypatch.setattr(tier, "CHECKPOINT_STEPS", 8)
    never = qa.stream(max_fps=1)
    push(never, frames, 0, 2)
    never.watch(COUNT, every=3)
    never.watch(COLOUR, every_seconds=2.0, max_new_tokens=2)
    push(never, frames, 2, 10)
    path = never.save(tmp_path / "saved.safetensors")
    on_disk = qa.with_options(offload="disk", offload_dir=str(tmp_path / "disk"))
    with statekv.Stream.load(path, on_disk) as loaded:
        push(loaded, frames, 10, 12)
        shutil.copytree(loaded.folder, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
    with statekv.Stream.load(tmp_path / "killed", on_disk) as killed:
        assert killed.frames == 10 and len(killed.watches) == 2
        push(killed, frames, 10, 30)
        push(never, frames, 10, 30)
        assert seen(killed) == seen(never)
        assert all(torch.equal(a, b) for a, b in zip(carried(never), carried(killed)))
    never.close()


@pytest.mark.parametrize("cadence", [{"every": 3}, {"every_seconds": 3.0}, {"every_seconds": 5e-324}])
def test_a_watch_reopened_from_a_record_newer_than_its_streams_save_evaluates_the_frames_again(qa, frames, tmp_path,
                                                                                           cadence):
    """As the service brings a stream back from a save older than its watch's record (killed after the watch
    evaluated more frames) and the frames since are pushed again. Before: the watch kept the record's later answer
    and events, so the frames pushed again gave its events twice, out of order (and a period too short to count
    in the time gone by, an OverflowError, had the service quarantine the stream)."""
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 3)
    path = stream.save(tmp_path / "s.safetensors")  # before the watch opened
    watch = stream.watch(COLOUR, steer=False, max_new_tokens=2, **cadence)
    push(stream, frames, 3, 24)
    back = statekv.Stream.load(path, qa)
    watch_saving.restore(back, watch_saving.records(stream))  # the record written after the save
    assert back.watches[0].events == [event for event in watch.events if event.frame <= 3]
    push(back, frames, 3, 24)
    assert [w.to_dict() for w in back.watches] == [watch.to_dict()] and len(watch.events) > 1
    stream.close()
    back.close()


def test_a_watch_opened_after_its_streams_save_and_off_its_period_reopens_as_a_valid_watch(qa, frames, tmp_path):
    """Turned back to a save taken before the watch opened, off its period: its clock went below zero, and the
    stream's next save could not be loaded again (caught by a review)."""
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    path = stream.save(tmp_path / "s.safetensors")
    push(stream, frames, 2, 3)
    stream.watch(COLOUR, steer=False, max_new_tokens=2, every=4)  # opened at frame 3: evaluated at 3, 7, 11, ...
    push(stream, frames, 3, 24)
    back = statekv.Stream.load(path, qa)
    reopened = watch_saving.restore(back, watch_saving.records(stream))[0]
    assert reopened.events == [] and reopened.evaluations == 0 and reopened.last_frames == 0
    push(back, frames, 2, 24)
    again = statekv.Stream.load(back.save(tmp_path / "again.safetensors"), qa)
    assert [w.to_dict() for w in again.watches] == [reopened.to_dict()] and reopened.events
    stream.close()
    back.close()
    again.close()


def test_simplestream_watches_answer_from_the_last_frames(qa, frames):
    stream = qa.with_options(method="simplestream").stream(max_fps=1)
    push(stream, frames, 0, 2)
    watch = stream.watch(COLOUR, every=2)
    push(stream, frames, 2, 8)
    assert watch.evaluations == 4 and watch.answer == stream.ask(COLOUR, max_new_tokens=16)
    again = qa.with_options(method="simplestream").stream(max_fps=1)  # as a server reopens a record's watches:
    again.continue_from(stream.pushed, stream.frames, stream.last_timestamp)  # its counts kept, its frames not
    reopened = watch_saving.restore(again, watch_saving.records(stream))
    assert [w.to_dict() for w in reopened] == [watch.to_dict()]
    push(again, frames, 8, 10)
    assert (reopened[0].evaluations, reopened[0].last_frames) == (5, 10)
    empty = qa.with_options(method="simplestream").stream(max_fps=1)  # nothing kept: it starts again at frame 0
    rewound = watch_saving.restore(empty, watch_saving.records(stream))[0]
    assert rewound.events == [] and rewound.last_frames == 0
    push(empty, frames, 0, 2)
    assert (rewound.evaluations, rewound.last_frames) == (1, 2) and rewound.events  # on its period again
    for each in (stream, again, empty):
        each.close()


def test_a_watch_that_cannot_be_evaluated_fails_alone_and_never_its_push(qa, frames, monkeypatch):
    streams = [qa.stream(max_fps=1) for _ in range(2)]
    for stream in streams:
        push(stream, frames, 0, 2)
    watches = [stream.watch(COLOUR, every=2, steer=False) for stream in streams]
    original = watch_module.evaluate

    def failing(evaluations, head):
        if any(evaluation.prefill is streams[0].prefill for evaluation in evaluations):
            raise InputError("broken")
        return original(evaluations, head)

    monkeypatch.setattr(watch_module, "evaluate", failing)
    for k in range(2, 6):
        qa.push_many([(stream, frames[k], float(k)) for stream in streams])  # the pushes are taken
    assert [stream.frames for stream in streams] == [6, 6]
    assert watches[0].error == "broken" and watches[1].error is None and watches[1].evaluations == 3
    for stream in streams:
        stream.close()


def test_watches_reopen_all_or_none(qa, frames):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 3)
    stream.watch(COLOUR, every=2, steer=False)
    saved = watch_saving.records(stream)
    again = qa.stream(max_fps=1)
    push(again, frames, 0, 3)
    with pytest.raises(InputError, match=r"watches\[1\]"):
        watch_saving.restore(again, [saved[0], {"question": 3}])
    assert again.watches == []
    for each in (stream, again):
        each.close()


def test_a_watch_whose_first_answer_fails_is_not_left_open(qa, frames, monkeypatch):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 3)

    def failing(watches, **kwargs):
        raise InputError("no answer")

    monkeypatch.setattr(watch_module, "run_evaluations", failing)
    with pytest.raises(InputError, match="no answer"):
        stream.watch(COLOUR, every=2)
    assert stream.watches == [] and not (stream.prefill.cache.guide and stream.prefill.cache.guide.active)
    stream.close()


def test_bad_watches_are_refused_with_one_line(qa, frames):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    for kwargs, words in [({"every": 2, "every_seconds": 1.0}, "not both"), ({"every": 0}, "every"),
                          ({"every_seconds": -1.0}, "every_seconds"), ({"max_new_tokens": 0}, "max_new_tokens"),
                          ({"retrieval": "nope"}, "retrieval")]:
        with pytest.raises(statekv.StateKVError, match=words):
            stream.watch(COUNT, **kwargs)
    with pytest.raises(InputError, match="empty"):
        stream.watch("  ", every=2)
    assert stream.watches == []
    watch = stream.watch(COUNT)
    watch.close()
    with pytest.raises(InputError, match="closed"):
        watch.evaluate()
    stream.close()


def test_a_saved_watch_record_that_is_malformed_is_refused(qa, frames):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    record = stream.watch(COUNT).record()
    bad = {**record, "events": [[1, 0.0]]}
    with pytest.raises(InputError, match=r"watches\[0\]\.events\[0\]"):
        watch_saving.restore(stream, [bad])
    with pytest.raises(InputError, match="lacks 'every'"):
        watch_saving.restore(stream, [{k: v for k, v in record.items() if k != "every"}])
    stream.close()


def test_retrieval_adds_the_frames_that_match_the_question(qa, frames):
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    watch = stream.watch(COUNT, every=4, retrieve=4, steer=False)
    push(stream, frames, 2, 30)
    assert watch.read_steps and len(watch.read_steps) <= 4 * len(stream.prefill.cache.layers)
    assert all(step < len(stream.step_frames) for step in watch.read_steps)
    stream.close()


@pytest.mark.parametrize("method", ["full", "statekv"])
def test_past_the_models_range_an_evaluation_reads_the_stream_as_a_step_would(tmp_path, method):
    """Under bounded positions past the model's range the carried keys are rotated to where the layout puts them:
    an evaluation's first answer token is the one a step of the question itself would predict (the layout's
    grouped distances for full attention, the carried state packed before the chunk for StateKV)."""
    from statekv.core.watching.standing import Evaluation, evaluate
    from statekv.testing import make_tiny_checkpoint

    short = {"max_position_embeddings": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    checkpoint = make_tiny_checkpoint("internvl", tmp_path / "short", text_config=short,
                                      vision_config={"image_size": 112})
    images = np.random.default_rng(0).integers(0, 256, (14, 32, 32, 3), dtype=np.uint8)
    sizes = {"budget": 24} if method == "statekv" else {}
    qa = statekv.VideoQA.from_pretrained(checkpoint, method=method, reserve_tokens=24, **sizes)
    watched, stepped = qa.stream(), qa.stream()
    for image in images:
        watched.push(image)
        stepped.push(image)
    assert watched.tokens > 128 and watched.prefill.positions.bounded
    prompt = watched.adapter.prompt(watched.adapter.question_ids("Why?", watched.state), watched.state)
    standing = watch_module.standing_question(watched.prefill, prompt)
    evaluation = Evaluation(watched.prefill, standing, prompt, watched.tokens, 1)
    (answer,) = evaluate([evaluation], qa.adapter.model.get_output_embeddings())
    ids = prompt.input_ids
    hidden = stepped.prefill.step(input_ids=torch.cat([ids, ids[:, -1:]], 1))  # the question, and room for one
    expected = qa.adapter.model.get_output_embeddings()(hidden[:, ids.shape[1] - 1]).argmax(-1)
    assert int(answer[0, 0]) == int(expected[0])
    watched.close()
    stepped.close()


@pytest.mark.parametrize("placing", ["stream", "bounded, still", "bounded, placed"])
def test_steering_adds_each_questions_attention_mass_placed_after_the_chunk(placing):
    """`QuestionGuide.mass` against a direct computation: each question's queries rotated (RoPE's own rotation)
    from where they were evaluated to right after the step's chunk, softmaxed over the candidates, summed over
    its rows and the query heads of each KV group, scaled to the chunk's total and weighted. The chunk sits at its
    own positions under stream positions and under bounded ones while every step is (`StreamPositions.still`: the
    device's base is then not set and must not be read), else at the base the step was placed at."""
    from types import SimpleNamespace

    from statekv.core.positions.rotation import rotate
    from statekv.core.rules.steering import QuestionGuide
    from statekv.core.watching.standing import StandingQuestion

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, rotary = 4, 2, 16, 12  # a partial rotary: the last dims are not rotated
    frequencies = torch.rand(rotary // 2, generator=generator)
    questions = [StandingQuestion(torch.zeros(1, length, dtype=torch.long), frequencies,
                                  [torch.randn(1, heads, length, dim, generator=generator)], start=40)
                 for length in (5, 3)]
    guide = QuestionGuide()
    guide.add(questions[0], 1.0)
    guide.add(questions[1], 3.0)
    keys = torch.randn(1, kv_heads, 9, dim, generator=generator)
    chunk, seen, scale = 2, 57, 0.3
    base = {"stream": None, "bounded, still": seen + 100, "bounded, placed": seen}[placing]  # where the device says
    positions = SimpleNamespace(bounded=placing != "stream", still=placing == "bounded, still",
                                step_base=None if base is None else torch.tensor([base]))
    cache = SimpleNamespace(positions=positions, seen_device=torch.tensor(seen if base != seen else seen + 50),
                            step_index=7)
    expected = torch.zeros(1, kv_heads, 9)
    for question, weight in zip(questions, (1.0, 3.0)):
        queries = question.queries[0]
        placed = rotate(queries, torch.full(queries.shape[:3], seen + chunk - 40), frequencies)
        for head in range(heads):
            share = ((placed[0, head] @ keys[0, head // 2].T) * scale).softmax(-1).sum(0)
            expected[0, head // 2] += share * weight * chunk / question.length
    assert torch.allclose(guide.mass(cache, 0, keys, chunk, scale), expected, atol=1e-5)


def test_a_watch_on_a_bounded_m_rope_stream_opens_without_the_retrieval_its_method_would_default_to(
        tmp_path):
    """Before: under rekv, whose questions retrieve by default, a watch on a Qwen3-VL stream with no horizon (bounded
    positions, where a watch cannot retrieve) was refused for a retrieve its user never gave, in the library, the CLI
    and over HTTP alike."""
    from statekv.testing import make_tiny_checkpoint

    qwen = make_tiny_checkpoint("qwen3_vl", tmp_path / "qwen", text_config={"max_position_embeddings": 512})
    qa = statekv.VideoQA.from_pretrained(qwen, method="rekv")
    stream = qa.stream()
    for index, frame in enumerate(random_frames(4)):
        stream.push(frame, float(index))
    watch = stream.watch("Is it?", every=2, max_new_tokens=2)
    assert qa.retrieve is not None and watch.retrieve is None and watch.answer is not None
    with pytest.raises(InputError, match="cannot retrieve; open it without retrieve"):  # asked for: refused
        stream.watch("Is it?", every=2, retrieve=4)
    stream.close()
    # (a range its 64 frames fit past: in 512 positions they are refused as the watch opens, as too wide there)
    internvl = make_tiny_checkpoint("internvl", tmp_path / "internvl", text_config={"max_position_embeddings": 2048})
    other = statekv.VideoQA.from_pretrained(internvl, method="rekv").stream()  # one RoPE: it retrieves as asked
    assert other.watch("Is it?", every=2, max_new_tokens=2).retrieve == other.qa.retrieve
    other.close()


def test_watches_whose_long_answers_keep_changing_leave_their_stream_savable(qa, frames, tmp_path, monkeypatch):
    """A watch kept its latest 10,000 events however long their answers (up to its max_new_tokens): every save
    writes them whole into a saved stream's bounded metadata, so watches whose long answers kept changing made their
    stream refuse every save from then on. Their events now share `MAX_EVENT_CHARS` characters of the save's JSON,
    where a non-ASCII character takes six."""
    import statekv.api.stream_file as stream_file

    bound = 1 << 16
    monkeypatch.setattr(watch_module, "MAX_EVENT_CHARS", bound)
    monkeypatch.setattr(stream_file, "MAX_METADATA_CHARS", 2 * bound)
    stream = qa.stream(max_fps=1)
    push(stream, frames, 0, 2)
    watches = [stream.watch(COUNT, every=1), stream.watch("Anything else?", every=1)]
    long = bound // 100  # each answer's JSON six times as long: hundreds of them, many times the bound
    for watch in watches:
        watch.events[:] = [watch_module.WatchEvent(frame, None, f"{frame} " + "字" * long) for frame in range(300)]
        watch.answer_tokens = None
    told = iter(range(10**6))
    monkeypatch.setattr(stream.adapter, "decode", lambda tokens: f"new {next(told)} " + "語" * long)
    push(stream, frames, 2, 3)
    assert all(watch.events[-1].answer.startswith("new ") for watch in watches)
    stream.save(tmp_path / "s.safetensors")
    back = statekv.Stream.load(tmp_path / "s.safetensors", qa)
    for watch, loaded in zip(watches, back.watches):
        assert [event.answer for event in loaded.events] == [event.answer for event in watch.events]
    assert sum(len(json.dumps(event.answer)) for watch in watches for event in watch.events) <= bound
    back.close()
    stream.close()
