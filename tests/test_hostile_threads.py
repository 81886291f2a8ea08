"""Hostile use of the library from several threads at once, without the server (a camera thread pushing, a UI thread
asking, a timer saving, a shutdown closing): found by hunting, each test a defect's repro (before the fix it failed
as its docstring says). Threads are held at the racy point by a public hook (a streamer, the video's lock) and
joined with a timeout."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import statekv
import statekv.api.recent as recent_module
from statekv.errors import InputError
from statekv.models import load_adapter
from statekv.video import Frame

from conftest import random_frames, tiny_qa

FRAMES = 8
JOIN_SECONDS = 30
QUESTIONS = ("How many frames show a dog running?", "Who?")


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint):
    return load_adapter(tiny_checkpoint("internvl"))


def encoded_video(adapter, **settings):
    """A video of `FRAMES` random frames encoded by a tiny InternVL, with room for `QUESTIONS` and their answers."""
    qa = tiny_qa(adapter, reserve_tokens=120, **settings)
    return qa.encode(list(random_frames(FRAMES, seed=5)), max_fps=1, max_frames=FRAMES)


def simplestream_qa(adapter):
    """A simplestream `VideoQA` over ``adapter``: its streams keep their last frames and no cache."""
    return statekv.VideoQA.with_adapter(adapter, statekv.ModelOptions(method="simplestream", attention="eager",
                                                                      reserve_tokens=120))


class HeldAt:
    """A streamer that holds the asking thread at the ``at``-th call of ``put`` (the first: before the prompt's
    forward) until `go` is set."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def put(self, tokens) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            assert self.go.wait(JOIN_SECONDS), "the held thread was never let go"

    def end(self) -> None:
        pass


class WaitSeen:
    """Wraps a video's or stream's lock (a plain one where the video has none): ``seen`` is set once a thread other
    than ``owner`` comes to take it."""

    def __init__(self, video, owner: threading.Thread, seen: threading.Event):
        self.lock, self.owner, self.seen = getattr(video, "lock", threading.RLock()), owner, seen

    def __enter__(self):
        if threading.current_thread() is not self.owner:
            self.seen.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def in_thread(target, done: threading.Event | None = None) -> tuple[threading.Thread, list]:
    """``target`` started on a thread; the list gets its result or the exception it raised, then ``done`` is set."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as error:  # reported by the test
            outcome.append(error)
        finally:
            if done is not None:
                done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def second_caller(video, first: threading.Thread, target) -> tuple[threading.Thread, list]:
    """``target`` called on another thread while ``first`` is held; returns once it waits for its turn at the
    video's lock, or (a video that takes no turns) has run."""
    progressed = threading.Event()
    video.lock = WaitSeen(video, first, progressed)
    thread, outcome = in_thread(target, progressed)
    assert progressed.wait(JOIN_SECONDS)
    return thread, outcome


def joined(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"


@pytest.mark.parametrize("second_call", ["ask", "append"])
def test_an_answer_decoded_while_another_thread_asks_or_appends_is_the_answer_asked_alone(adapter, second_call):
    """Before: `VideoQA.encode`'s video took no turns (a `Stream` does): an answer is decoded into the detailed
    cache's room past its end, so a question asked from a second thread while the first was decoding overwrote the
    first's prompt and answer there, as did a frame appended meanwhile, and the first thread's answer came out as
    other tokens."""
    video = encoded_video(adapter)
    alone = {question: video.ask_tokens(question, max_new_tokens=12) for question in QUESTIONS}
    held = HeldAt(3)
    first, first_answer = in_thread(lambda: video.ask_tokens(QUESTIONS[0], max_new_tokens=12, streamer=held))
    assert held.reached.wait(JOIN_SECONDS)
    calls = {"ask": lambda: video.ask_tokens(QUESTIONS[1], max_new_tokens=12),
             "append": lambda: video.append([Frame(FRAMES, float(FRAMES), random_frames(1, seed=8)[0])])}
    second, second_outcome = second_caller(video, first, calls[second_call])
    held.go.set()
    joined(first, second)
    assert torch.equal(first_answer[0], alone[QUESTIONS[0]])
    if second_call == "ask":
        assert torch.equal(second_outcome[0], alone[QUESTIONS[1]])
    else:
        assert second_outcome == [None] and video.frames == FRAMES + 1
    video.close()


def test_an_encoded_video_closed_while_a_question_is_answered_answers_it_then_closes(adapter, tmp_path):
    """Before: closing a disk-tier video from a shutdown thread while another thread's question had not yet read
    the cache removed the file set under it: the question failed with an `OutputError` saying the folder "was moved,
    removed or replaced"."""
    video = encoded_video(adapter, offload="disk", offload_dir=str(tmp_path))
    alone = video.ask_tokens(QUESTIONS[0], max_new_tokens=6)
    held = HeldAt(1)
    asking, answer = in_thread(lambda: video.ask_tokens(QUESTIONS[0], max_new_tokens=6, streamer=held))
    assert held.reached.wait(JOIN_SECONDS)
    closing, closed = second_caller(video, asking, video.close)
    held.go.set()
    joined(asking, closing)
    assert torch.equal(answer[0], alone) and closed == [None]
    assert not any(tmp_path.iterdir())  # the encoding's files went with it


def test_a_simplestream_watch_evaluated_after_a_later_push_is_stamped_with_the_last_frames_time(adapter, monkeypatch):
    """Before: a simplestream push took its frame in one turn and evaluated the due watches in a second, with its
    own frame's time; a push from another thread taking its frame in between made the first push's evaluation read
    both frames but stamp the event with the first frame's time (frame 2 at 0.0 s, not 1.0 s)."""
    stream = simplestream_qa(adapter).stream(max_fps=None)
    watch = stream.watch(QUESTIONS[1], every=1)
    images = random_frames(2, seed=6)
    whole, turns = recent_module.whole, []
    first_taken, second_taken, first_done = threading.Event(), threading.Event(), threading.Event()

    @contextlib.contextmanager
    def between_turns():  # the first push waits, its frame taken, until the second push has taken its own
        with whole():
            yield
        turns.append(threading.current_thread())
        if len(turns) == 1:
            first_taken.set()
            assert second_taken.wait(JOIN_SECONDS)
        else:
            second_taken.set()
            assert first_done.wait(JOIN_SECONDS)

    monkeypatch.setattr(recent_module, "whole", between_turns)
    first, _ = in_thread(lambda: stream.push(images[0], 0.0), first_done)
    assert first_taken.wait(JOIN_SECONDS)
    second, _ = in_thread(lambda: stream.push(images[1], 1.0))
    joined(first, second)
    assert [(event.frame, event.seconds) for event in watch.events] == [(2, 1.0)]
    assert watch.last_seconds == stream.watching.seconds == 1.0
    stream.close()


@pytest.mark.parametrize("call", ["ask", "watch"])
def test_a_simplestream_stream_closed_while_a_call_waits_its_turn_refuses_it_as_closed(adapter, call):
    """Before: a simplestream question or watch checked that the stream was open before taking its turn; a close
    taking its turn first made the question fail with "no frame has been pushed since it went on from its counts"
    (its frames were pushed: the stream was closed), and the watch open on the closed stream."""
    stream = simplestream_qa(adapter).stream(max_fps=None)
    for second, image in enumerate(random_frames(2, seed=7)):
        stream.push(image, float(second))
    calls = {"ask": lambda: stream.ask_tokens(QUESTIONS[1], max_new_tokens=2),
             "watch": lambda: stream.watch(QUESTIONS[1], every=1)}
    with stream.lock:  # the close's turn comes first
        waiting, outcome = second_caller(stream, threading.current_thread(), calls[call])
        stream.close()
    joined(waiting)
    assert isinstance(outcome[0], InputError) and "closed" in str(outcome[0]), outcome
    assert stream.watches == []
