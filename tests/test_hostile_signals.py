"""A signal only asks to stop: the stop happens where a push, a step, a save or an answer is whole, so what a
stream holds (and saves) when it stops always loads and equals the stream up to its last whole push.

Each test delivers a real signal to this process at a chosen point inside the work (the handler runs there, as
it would if the signal arrived at that bytecode), then checks the stream against one that pushed the same frames
and never stopped; a bounded loop delivers them at random moments.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from statekv import Stream
from statekv.console import Stopped, run_command, signals_stop_like_ctrl_c
from statekv.errors import OutputError
from statekv.stopping import note_kept
from statekv.models import load_adapter
from hostile import noise_frames, small_qa

STRESS_SECONDS = 3.0  # each random-moment loop stops after this long (after at least MIN_TRIALS)
MIN_TRIALS = 3


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return load_adapter(checkpoint)


FRAMES = noise_frames(32)


def _state(stream) -> list[torch.Tensor]:
    counts = [torch.tensor([stream.frames, stream.pushed, len(stream.pending), stream.next_tick])]
    if not stream.prefill.seen_tokens:
        return counts
    tensors, metadata = stream.prefill.state_dict()
    return [tensors[name].clone() for name in sorted(tensors)] + [torch.tensor(metadata["chunk_lengths"])] + counts


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(adapter):
    """The state of an unstopped stream after each number of pushes."""
    stream = small_qa(adapter).stream(horizon_frames=len(FRAMES), max_fps=2, vision_batch=2)
    states = [_state(stream)]
    for index, frame in enumerate(FRAMES):
        stream.push(frame, index / 2)
        states.append(_state(stream))
    return states


def _stopped_stream(adapter, number=signal.SIGTERM, *, install=True, prepare=None,
                    timer: threading.Timer | None = None) -> Stream:
    """A stream pushed until a signal stops it (under the command line's handlers when ``install``); ``prepare``
    is given its VideoQA first; ``timer`` (one that signals) runs only while the pushes run, so its signal can
    never land outside the block that expects it, however slow the machine."""
    qa = small_qa(adapter)
    if prepare is not None:
        prepare(qa)
    stream = qa.stream(horizon_frames=len(FRAMES), max_fps=2, vision_batch=2)
    handlers = signals_stop_like_ctrl_c() if install else _nothing()
    with pytest.raises(KeyboardInterrupt) as stop, handlers:
        if timer is not None:
            timer.start()
        for index, frame in enumerate(FRAMES):
            stream.push(frame, index / 2)
        if timer is not None:  # every push done before it fired: it must not fire once the block has ended
            timer.cancel()
            timer.join()
        os.kill(os.getpid(), number)  # not stopped inside: stop now
    assert isinstance(stop.value, Stopped) == (number != signal.SIGINT)
    return stream


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check_whole(stream, reference, tmp_path) -> None:
    """The stream as its last whole push left it, in memory and saved."""
    assert 0 <= stream.pushed <= len(FRAMES)  # on a loaded machine a signal can land in the first push
    assert _equal(_state(stream), reference[stream.pushed]), f"stopped after {stream.pushed} pushes, cut"
    if not stream.tokens:  # nothing encoded yet to save: the first frame waits for its batch
        return
    loaded = Stream.load(stream.save(tmp_path / "stopped.safetensors"), stream.qa)
    assert _equal(_state(loaded), reference[stream.pushed])


def _signal_inside(monkeypatch, owner, name: str, number=signal.SIGTERM, after: int = 5) -> None:
    """Deliver ``number`` to this process from inside ``owner.name`` on its ``after``-th call (the handler runs
    right there)."""
    real, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == after:
            os.kill(os.getpid(), number)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("where", ["a step's commit, after its device part",
                                   "a push, its frame pending but not accepted",
                                   "the step scheduler, just after it released its condition"])
def test_a_signal_inside_a_push_stops_after_it(where, adapter, reference, monkeypatch, tmp_path):
    from statekv.api.durability import Durability
    from statekv.core.cache.two_state import TwoStateCache

    if where.startswith("a step's"):
        _signal_inside(monkeypatch, TwoStateCache, "commit_host")
    elif where.startswith("a push"):
        _signal_inside(monkeypatch, Durability, "pushed")
    prepare = None
    if where.startswith("the step scheduler"):  # where a stop raised at once released the condition twice
        def prepare(qa):
            condition = qa.step_scheduler.changed
            release, calls = condition.release, []

            def signalled_release():  # `run` releases it by this name while a batch runs (`with` does not)
                release()
                calls.append(1)
                if len(calls) == 5:
                    os.kill(os.getpid(), signal.SIGTERM)

            condition.release = signalled_release
    stream = _stopped_stream(adapter, prepare=prepare)
    monkeypatch.undo()
    _check_whole(stream, reference, tmp_path)
    assert stream.pushed < len(FRAMES)  # it did stop early, right after the push the signal came in


def test_a_signal_inside_a_save_stops_after_the_file_is_whole(adapter, reference, monkeypatch, tmp_path):
    import statekv.api.stream_file as stream_file

    stream = small_qa(adapter).stream(horizon_frames=len(FRAMES), max_fps=2, vision_batch=2)
    for index, frame in enumerate(FRAMES[:5]):
        stream.push(frame, index / 2)
    _signal_inside(monkeypatch, stream_file, "save_file", signal.SIGHUP, after=1)
    target = tmp_path / "s.safetensors"
    with pytest.raises(Stopped), signals_stop_like_ctrl_c():
        stream.save(target)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]  # whole, nothing left beside it
    assert _equal(_state(Stream.load(target, stream.qa)), reference[5])


# SIGINT's handler as the tests begin: Python's, or, where the runner ignores SIGINT, the conftest's stand-in
SIGINT_AT_START = signal.getsignal(signal.SIGINT)


@pytest.fixture
def pythons_ctrl_c():
    """Python's own Ctrl-C handler, as a program that installed none has it: a test run a shell started in the
    background inherits SIGINT ignored, and Python then installs no handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    assert previous in (signal.default_int_handler, SIGINT_AT_START)  # no handler an earlier test left behind
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_program_that_installed_no_handler_also_waits_for_the_push(adapter, reference, monkeypatch,
                                                                              tmp_path, pythons_ctrl_c):
    from statekv.core.cache.two_state import TwoStateCache

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _signal_inside(monkeypatch, TwoStateCache, "commit_host", signal.SIGINT)
    stream = _stopped_stream(adapter, signal.SIGINT, install=False)
    monkeypatch.undo()
    _check_whole(stream, reference, tmp_path)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_signals_at_random_moments_always_stop_between_whole_pushes(number, adapter, reference, tmp_path,
                                                                   pythons_ctrl_c):
    """Many signals in a row, each at a random moment of a stream's pushes (bounded in time)."""
    rng = np.random.default_rng()
    push_seconds = _push_seconds(adapter)
    trials, started = 0, time.monotonic()
    while trials < MIN_TRIALS or time.monotonic() - started < STRESS_SECONDS:
        delay = rng.uniform(0.05, 0.6) * push_seconds * len(FRAMES)
        timer = threading.Timer(delay, os.kill, (os.getpid(), number))
        try:
            stream = _stopped_stream(adapter, number, install=number != signal.SIGINT, timer=timer)
        finally:
            timer.cancel()
            if timer.is_alive():
                timer.join()
        _check_whole(stream, reference, tmp_path)
        stream.close()
        trials += 1


def _push_seconds(adapter) -> float:
    stream = small_qa(adapter).stream(horizon_frames=8, vision_batch=2)
    started = time.perf_counter()
    for frame in FRAMES[:8]:
        stream.push(frame)
    return (time.perf_counter() - started) / 8


KEPT = "the 3 frames streamed before it were saved to kept.safetensors"


def _stopped_then(then: str) -> None:
    """A command's body: stopped by Ctrl-C, whose handler notes what it kept and then meets ``then``."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as stop:
        note_kept(stop, KEPT)
        if then == "a second ctrl-c":
            raise KeyboardInterrupt()  # its context: the first, which holds the note
        if then == "an error":
            raise OutputError("could not write the summary")
        if then == "a sigterm":
            raise Stopped(signal.SIGTERM)  # outranks the Ctrl-C it came during
        raise


@pytest.mark.parametrize("then, status, said", [
    ("nothing", 130, "interrupted"), ("a second ctrl-c", 130, "interrupted"),
    ("a sigterm", 128 + signal.SIGTERM, "stopped by SIGTERM"), ("an error", 2, "error: could not write the summary")])
def test_a_stop_says_what_was_kept_in_its_one_line(then, status, said, capsys):
    assert run_command("stream", lambda: _stopped_then(then)) == status
    assert capsys.readouterr().err == f"statekv stream: {said}; {KEPT}\n"


def test_what_a_stop_kept_is_said_even_when_stdout_closes_in_its_handler(tmp_path):
    script = f"""
import sys
from statekv.console import run_command
from statekv.stopping import note_kept

def body():
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as stop:
        note_kept(stop, {KEPT!r})
        raise BrokenPipeError  # the summary printed to a reader that left with the same Ctrl-C
sys.exit(run_command("stream", body))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 130 and result.stderr == f"statekv stream: interrupted; {KEPT}\n"  # as the stop
