"""`statekv.stopping.whole`: a Ctrl-C at the moments a region installs and gives back its handler.

Python runs a signal's handler after the call during which the signal arrived, so a signal sent by a wrapper of
`signal.signal` right after it swaps the handler arrives exactly in the window between that call and the region's
next step.
"""

from __future__ import annotations

import contextlib
import signal

import pytest

from statekv import stopping
from statekv.stopping import Stopped, open_regions, pending_stop, whole


@pytest.fixture
def pythons_ctrl_c():
    """Python's own Ctrl-C handler, as in a program that installed none (what `whole` swaps for its own); the
    SIGTERM and SIGHUP handlers a stop changes are put back after the test."""
    numbers = (signal.SIGINT, *stopping.STOPPING_SIGNALS)
    install = signal.signal  # the tests wrap it; put back what they found with the real one
    previous = {number: signal.getsignal(number) for number in numbers}
    install(signal.SIGINT, signal.default_int_handler)
    yield
    for number, handler in previous.items():
        install(number, handler)
    left = open_regions(), pending_stop()
    if left[1] is not None:  # a stale stop must not reach later tests: a region raises it as it ends, as in a program
        with contextlib.suppress(KeyboardInterrupt), whole():
            pass
    assert left == (0, None)


def ctrl_c_at_swapping(monkeypatch, handler, before: bool = False, error: BaseException | None = None) -> list[int]:
    """Send SIGINT to this process right after (``before``: right before) ``signal.signal`` installs ``handler``
    for it, or raise ``error`` right after, as another signal's handler would; returns the list the sends are
    counted in."""
    real = signal.signal
    sent = []

    def swapping(number, installed):
        chosen = number == signal.SIGINT and installed is handler and not sent
        if chosen and before:
            sent.append(number)
            signal.raise_signal(signal.SIGINT)  # its handler (the one in place) runs as this call returns
        previous = real(number, installed)
        if chosen and not before:
            sent.append(number)
            if error is not None:
                raise error
            signal.raise_signal(signal.SIGINT)
        return previous

    monkeypatch.setattr(signal, "signal", swapping)
    return sent


def test_a_ctrl_c_just_after_a_region_installs_its_handler_waits_for_the_region(monkeypatch, pythons_ctrl_c):
    sent = ctrl_c_at_swapping(monkeypatch, stopping.request_stop)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with whole():
            done.append("the region's work")
    assert sent and done == ["the region's work"]  # before: raised as the region began, its work not done
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # before: the region's handler stayed


def test_a_ctrl_c_as_a_region_gives_its_handler_back_leaves_no_stop_for_the_next_region(monkeypatch,
                                                                                         pythons_ctrl_c):
    sent = ctrl_c_at_swapping(monkeypatch, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as raised:
        with whole():
            stopping.request_stop(signal.SIGTERM)  # a SIGTERM inside the region: raised as it ends
    assert sent and isinstance(raised.value, Stopped)  # the SIGTERM asked first wins over the Ctrl-C
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        with whole():  # before: raised the first region's SIGTERM, left pending when the Ctrl-C cut its end short
            pass
    except KeyboardInterrupt as stop:  # failed here, not as a Ctrl-C that would end the test session
        pytest.fail(f"a stale stop was raised by a region that received none: {stop!r}")
    assert pending_stop() is None


def test_a_ctrl_c_just_before_a_region_gives_its_handler_back_is_raised_and_the_handler_is_back(monkeypatch,
                                                                                                pythons_ctrl_c):
    sent = ctrl_c_at_swapping(monkeypatch, signal.default_int_handler, before=True)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with whole():
            done.append("the region's work")
    assert sent and done == ["the region's work"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # before: the region's handler stayed


def test_a_stop_inside_nested_regions_is_raised_once_the_outermost_ends(pythons_ctrl_c):
    order = []
    with pytest.raises(Stopped) as raised:
        with whole():
            with whole():
                stopping.request_stop(signal.SIGTERM)
                order.append("inner")
            order.append("outer")
    assert order == ["inner", "outer"] and raised.value.exit_status == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_as_a_region_gives_its_handler_back_with_nothing_pending_is_raised_at_once(monkeypatch,
                                                                                             pythons_ctrl_c):
    sent = ctrl_c_at_swapping(monkeypatch, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as raised:
        with whole():
            pass
    assert sent and not isinstance(raised.value, Stopped)
    assert open_regions() == 0 and signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("pending", [None, signal.SIGTERM], ids=["nothing pending", "SIGTERM pending"])
def test_another_handlers_error_as_a_region_ends_leaves_it_uncounted_and_the_stop_asked_for_wins(monkeypatch,
                                                                                                pending,
                                                                                                pythons_ctrl_c):
    """A timeout's handler raising as the region puts Python's handler back: before, the region stayed counted and
    every later Ctrl-C waited for a region end that never came."""
    ctrl_c_at_swapping(monkeypatch, signal.default_int_handler, error=TimeoutError("a timeout's handler"))
    expected = TimeoutError if pending is None else Stopped
    with pytest.raises(expected) as raised:
        with whole():
            if pending is not None:
                stopping.request_stop(pending)
    if pending is not None:
        assert isinstance(raised.value.__cause__, TimeoutError)  # the error is kept, not hidden
    assert open_regions() == 0 and pending_stop() is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def swallowing(number: int) -> None:
    """Send ``number`` to this process and swallow the stop it raises, as numpy's ``Generator.choice`` of a list
    does with a Ctrl-C landing in it."""
    with contextlib.suppress(KeyboardInterrupt):
        signal.raise_signal(number)
        signal.raise_signal(number)  # not reached: the handler raised at the first


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_a_library_swallowed_is_raised_at_the_next_stop_point_once(pythons_ctrl_c, number):
    """Before: a Ctrl-C that landed in numpy while `statekv synthetic make` planned a video was lost, and the make
    went on writing videos (about half the Ctrl-Cs sent)."""
    with pytest.raises(KeyboardInterrupt) as raised, stopping.signals_stop_like_ctrl_c():
        swallowing(number)
        stopping.stop_point()
        pytest.fail("the swallowed stop was not raised")
    assert isinstance(raised.value, Stopped) == (number != signal.SIGINT)
    stopping.stop_point()  # raised once; and a stop point outside a command raises nothing


def test_a_stop_point_raises_nothing_once_the_command_that_was_stopped_has_ended(pythons_ctrl_c):
    with pytest.raises(KeyboardInterrupt), stopping.signals_stop_like_ctrl_c():
        signal.raise_signal(signal.SIGINT)
    with stopping.signals_stop_like_ctrl_c():
        stopping.stop_point()  # the next command (`main` called again in one process) starts unstopped


def test_a_sigterm_swallowed_after_a_ctrl_c_was_is_the_stop_raised(pythons_ctrl_c):
    with pytest.raises(Stopped), stopping.signals_stop_like_ctrl_c():
        swallowing(signal.SIGINT)
        swallowing(signal.SIGTERM)
        stopping.stop_point()
