"""`statekv.stopping.whole`: a Ctrl-C at the moments a region installs and gives back its handler.

Python runs a signal's handler after the call during which the signal arrived, so a signal sent by a wrapper of
`signal.signal` right after it swaps the handler arrives exactly in the window between that call and the region's
next step.
"""

from __future__ import annotations

import os
import signal

import pytest

from statekv import stopping
from statekv.stopping import Stopped, whole


@pytest.fixture
def pythons_ctrl_c():
    """Python's own Ctrl-C handler, as in a program that installed none (what `whole` swaps for its own); the
    SIGTERM and SIGHUP handlers a stop changes are put back after the test."""
    numbers = (signal.SIGINT, *stopping.STOPPING_SIGNALS)
    previous = {number: signal.getsignal(number) for number in numbers}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)
    assert stopping._depth == 0 and stopping._pending is None


def ctrl_c_after_swapping(monkeypatch, handler) -> list[int]:
    """Send SIGINT to this process right after ``signal.signal`` installs ``handler`` for it; returns the list
    the sends are counted in."""
    real = signal.signal
    sent = []

    def swapping(number, installed):
        previous = real(number, installed)
        if number == signal.SIGINT and installed is handler and not sent:
            sent.append(number)
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs as this call returns
        return previous

    monkeypatch.setattr(signal, "signal", swapping)
    return sent


def test_a_ctrl_c_just_after_a_region_installs_its_handler_waits_for_the_region(monkeypatch, pythons_ctrl_c):
    sent = ctrl_c_after_swapping(monkeypatch, stopping.request_stop)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with whole():
            done.append("the region's work")
    assert sent and done == ["the region's work"]  # before: raised as the region began, its work not done
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # before: the region's handler stayed


def test_a_ctrl_c_while_a_region_gives_its_handler_back_leaves_no_stop_for_the_next_region(monkeypatch,
                                                                                           pythons_ctrl_c):
    sent = ctrl_c_after_swapping(monkeypatch, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        with whole():
            stopping.request_stop(signal.SIGTERM)  # a SIGTERM inside the region: raised as it ends
    assert sent
    monkeypatch.undo()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with whole():  # before: raised the first region's SIGTERM, left pending when the Ctrl-C cut its end short
        pass
    assert stopping._pending is None


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
