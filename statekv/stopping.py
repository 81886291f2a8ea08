"""Stopping between whole steps: a signal asks to stop, and the stop happens where no step, save or answer is half
done.

Python runs a signal's handler in the main thread between two bytecodes, wherever that thread is; a handler
that raises there can cut a streaming step after its carried state changed and before its lengths did, or a
save between its data and its metadata. So statekv's handlers never raise inside a `whole` region (a push, a
step, a save, an answer, a record written): they note the signal, and the region raises it as it ends, the
work inside it done. Outside every region a stop is raised at once, as before.

A stop raised at once can still be lost: a library running when it lands may swallow it (numpy's
``Generator.choice`` of a list clears it). Long loops call `stop_point` where their next piece of work begins,
which raises again a stop raised earlier that never got out.

    with whole():              # e.g. around Stream.push: a signal here waits for the push to end
        stream.step(...)

`signals_stop_like_ctrl_c` installs the handlers for a command (``statekv ...``): SIGTERM and SIGHUP raise
`Stopped` (a `KeyboardInterrupt`, so whatever keeps work on Ctrl-C keeps it on them too), Ctrl-C raises
`KeyboardInterrupt`. In a program that installed nothing, a `whole` region defers Ctrl-C while Python's own
handler is in place. Only the main thread receives signals; regions on other threads defer nothing (nothing
is raised there).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPPING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal other than Ctrl-C (SIGTERM, SIGHUP): handled wherever Ctrl-C is, so the
    work a command keeps on Ctrl-C is kept; ``signal_number`` says which."""

    def __init__(self, signal_number: int):
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number

    @property
    def exit_status(self) -> int:
        return 128 + self.signal_number


def note_kept(stop: BaseException, text: str) -> None:
    """Note on ``stop`` (a Ctrl-C or `Stopped` on its way out) what the command kept; `statekv.console` says it
    in the stop's one line. The notes are Python's own (``__notes__``, shown with a traceback), set directly so
    that Python 3.10, which has no ``add_note``, keeps them too."""
    stop.__notes__ = [*getattr(stop, "__notes__", ()), text]


def _handled(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then each exception it was raised while handling, the earliest last."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__context__


def stop_of(error: BaseException) -> KeyboardInterrupt | None:
    """The stop (a Ctrl-C or `Stopped`) among ``error`` and the exceptions it was raised while handling: a closed
    stdout while a stop was handled ends the command as that stop. A SIGTERM or SIGHUP outranks a Ctrl-C, as
    `request_stop` ranks them; else the earliest Ctrl-C."""
    stops = [each for each in _handled(error) if isinstance(each, KeyboardInterrupt)]
    signalled = [each for each in stops if isinstance(each, Stopped)]
    return (signalled or stops[::-1] or [None])[0]


def notes_kept(error: BaseException | None) -> list[str]:
    """What the stops among ``error`` and the exceptions it was raised while handling noted as kept
    (`note_kept`), the earliest first: a second Ctrl-C during the first one's handler carries the first's notes."""
    notes = []
    for each in _handled(error):
        if isinstance(each, KeyboardInterrupt):
            notes[:0] = [note for note in getattr(each, "__notes__", ()) if isinstance(note, str)]
    return notes


_depth = 0  # whole regions the main thread is inside
_pending: int | None = None  # a signal received inside one, raised when the outermost ends
_raised: int | None = None  # the stop last raised outside every region, by a command's handlers (see stop_point)


def _stop(number: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if number == signal.SIGINT else Stopped(number)


def request_stop(number: int, frame: object = None) -> None:
    """The handler of a stopping signal: raise the stop now, or, inside a `whole` region, when it ends. After a
    first SIGTERM or SIGHUP the others are ignored, so a second one cannot cut short the work the first keeps."""
    global _pending, _raised
    if number in STOPPING_SIGNALS:
        for other in STOPPING_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
    if _depth:
        if _pending is None or _pending == signal.SIGINT:
            _pending = number
        return
    if _raised is None or _raised == signal.SIGINT:
        _raised = number
    raise _stop(number)


def stop_point() -> None:
    """Raise, in the main thread, a stop a command's handler raised earlier that never got out (a library
    swallowed it): a long loop calls this where its next piece of work begins. Once a command is stopped its loops
    are done, so a stop that did get out is never raised twice: the mark lasts until `signals_stop_like_ctrl_c`
    ends."""
    global _raised
    if _raised is not None and threading.current_thread() is threading.main_thread():
        number, _raised = _raised, None
        raise _stop(number)


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """A region no stop cuts: a stopping signal received inside it is raised as it ends (also when it ends with
    an error: the stop, asked for, wins). Nested regions end with the outermost."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # CPython runs a signal's handler only at a call or a backward jump, so the region is counted before any call
    # can let one in: a signal arriving once our handler is in waits for the region's end, one arriving before
    # is raised by Python's own handler inside the try, and either way the region is uncounted
    swapped = False
    _depth += 1
    try:
        if _depth == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            swapped = True  # before the swap: a handler's error as it returns still has it put back
            signal.signal(signal.SIGINT, request_stop)
        yield
    except BaseException as error:
        number = _leave(swapped)
        if number is not None and not isinstance(error, KeyboardInterrupt):
            raise _stop(number) from error
        raise
    number = _leave(swapped)
    if number is not None:
        raise _stop(number)


def _leave(swapped: bool) -> int | None:
    """Leave a region; the signal to raise now that the outermost ended (None: none, or not yet). Python's handler
    is put back while the region still counts (a Ctrl-C then waits, as inside it). Whatever a handler raises as it
    is back (a Ctrl-C, another handler's error) is raised once the region is uncounted, the stop already asked for
    winning over it (a SIGTERM over a Ctrl-C, as in `request_stop`). The pending stop is taken and the region
    uncounted with no call in between (see `whole`), so nothing is left pending for the next region."""
    global _depth, _pending
    interrupted = None
    try:
        if swapped and signal.getsignal(signal.SIGINT) is request_stop:  # unless someone installed another meanwhile
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except BaseException as error:  # noqa: BLE001 -- raised below, once the region is uncounted
        interrupted = error
    number = None
    if _depth == 1:
        number, _pending = _pending, None
    _depth -= 1
    if interrupted is not None:
        if number is None or (number == signal.SIGINT and isinstance(interrupted, KeyboardInterrupt)):
            raise interrupted
        raise _stop(number) from interrupted
    return number


def pending_stop() -> int | None:
    """The signal a `whole` region of the main thread received and raises as the outermost ends (None: none)."""
    return _pending


def open_regions() -> int:
    """How many `whole` regions the main thread is inside (nested ones counted)."""
    return _depth


def handled_signals() -> tuple[int, ...]:
    """The stopping signals and SIGINT, less those ignored now: a command started by ``nohup`` (SIGHUP ignored)
    or in a shell's background (SIGINT ignored) keeps running when its terminal closes or a Ctrl-C reaches the
    foreground, as the one who started it asked."""
    return tuple(number for number in (*STOPPING_SIGNALS, signal.SIGINT)
                 if signal.getsignal(number) is not signal.SIG_IGN)


@contextlib.contextmanager
def signals_stop_like_ctrl_c() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise `Stopped` and Ctrl-C `KeyboardInterrupt` in the main thread, at the
    end of the `whole` region they arrive in (a no-op on other threads, where Python cannot install handlers);
    a signal the process was started ignoring stays ignored (`handled_signals`); the previous handlers come back
    on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _raised
    _raised = None
    previous = {number: signal.signal(number, request_stop) for number in handled_signals()}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _raised = None
