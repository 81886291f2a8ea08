"""Every error statekv raises on purpose, each with a one-line message that names the problem.

Everything a user can cause (a bad argument, a malformed input, a model or file that cannot be used) is a
:class:`StateKVError`; the command line turns exactly these into one line on stderr and exit status 2. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any


class StateKVError(Exception):
    """Base class of every error statekv raises on purpose."""


class ConfigurationError(StateKVError, ValueError):
    """An argument or setting is invalid (for example a budget that is not a positive integer)."""


class InputError(StateKVError, ValueError):
    """A chunk, prompt, question or saved stream given to statekv is malformed."""


class OtherSetupError(InputError):
    """A saved stream was made with another model, layout, dtype, engine setting or method than the one loading it:
    its files are sound, and load with the setup they were saved with."""


class ForeignFilesError(InputError):
    """A saved stream or disk-tier file set that is not the one asked for as it is: another stream's, another
    owner's, its owner recorded by another installation, or in a format this statekv does not read (an earlier one
    ``statekv reown`` binds anew). Its files are sound: nothing is wrong with them for the stream they are."""


class UnsupportedModelError(StateKVError, ValueError):
    """The model cannot be used (unknown family, or attention that bypasses transformers' AttentionInterface)."""


class HorizonError(StateKVError, ValueError):
    """The planned or reached sequence length is beyond what the model's RoPE or the declared horizon allows."""


class QuestionTooLong(HorizonError):
    """A question of ``prompt`` tokens and its answer of up to ``answer`` tokens do not fit in the ``room`` tokens a
    stream has for them: those left before its horizon, or (``limit``, a bounded stream's range) the positions an
    evaluation of a watch has beside the stream's carried state."""

    def __init__(self, prompt: int, answer: int, room: int, limit: int | None = None):
        where = ("tokens left before the stream's horizon; declare a longer horizon (a VideoQA: a larger "
                 "reserve_tokens)") if limit is None else (
            f"positions an evaluation has beside the carried state in the model's {limit}; ask a shorter question "
            "or fewer answer tokens")
        super().__init__(f"the question ({prompt} tokens) and answer ({answer}) do not fit in the {room} {where}")
        self.prompt, self.answer, self.room = prompt, answer, room


class RetrievalTooWide(HorizonError):
    """Past a bounded stream's range, the ``steps`` steps a question retrieves, of up to ``widest`` positions each,
    and its prompt and answer (``room`` positions) do not fit in the model's ``limit`` positions; ``fitting`` steps
    (at least 1) would. ``unit``, ``per_step``: what the count the question asked in is (``frames``, 2 per step for
    Qwen3-VL) and ``retrieved``, how many of them the steps read."""

    def __init__(self, steps: int, widest: int, room: int, limit: int, fitting: int, unit: str = "steps",
                 per_step: int = 1, retrieved: int | None = None, least: bool = False):
        read = f"{steps} retrieved steps" if unit == "steps" else f"{retrieved} retrieved {unit} ({steps} steps)"
        span = f"at least {widest}" if least else f"up to {widest}"  # least: of steps a stream has yet to take
        super().__init__(f"{read} of {span} positions and the question ({room} tokens) do not fit in the "
                         f"model's {limit} positions; retrieve at most {fitting * per_step} {unit}")
        self.steps, self.widest, self.room, self.limit, self.fitting = steps, widest, room, limit, fitting
        self.least = least

    def counted_in(self, unit: str, per_step: int, retrieved: int) -> "RetrievalTooWide":
        """The same refusal counted in ``unit``, ``per_step`` of them a step, the steps holding ``retrieved``."""
        return RetrievalTooWide(self.steps, self.widest, self.room, self.limit, self.fitting, unit, per_step,
                                retrieved, self.least)


class VideoError(StateKVError, ValueError):
    """A video source cannot be read: wrong type, corrupt, truncated, without frames."""


class VideoNotFoundError(VideoError, FileNotFoundError):
    """The path given as a video source does not exist."""


class FrameDecodeError(VideoError):
    """A frame in the middle of a source cannot be decoded or read.

    index: the frame's index in the source; timestamp: its time in seconds (estimated from the frame rate
    when the decoder stopped before it). encoded: set by `statekv.VideoQA.encode` to the `EncodedVideo` of
    every sampled frame before this one, which can still be asked; None elsewhere. reason: the message as raised,
    before any caller added what it kept.
    """

    def __init__(self, message: str, *, index: int, timestamp: float):
        super().__init__(message)
        self.index = index
        self.timestamp = timestamp
        self.encoded = None
        self.reason = message


class DataError(StateKVError, ValueError):
    """A benchmark's data (annotations, a results file, a question file) is missing or malformed."""


class MissingFileError(DataError, FileNotFoundError):
    """A file a benchmark needs does not exist."""


class OutputError(StateKVError, OSError):
    """An output (a saved stream, a run directory, a report) cannot be written where it was asked to go."""


class RankLostError(StateKVError, RuntimeError):
    """A rank of a data-parallel run lost the others while it waited for them: one of them stopped or failed (its
    own lines say why), or its node went away."""


class HandoverError(OutputError):
    """A disk-tier stream's handover to its successor's file set stopped after it was marked: the stream was
    closed, and resuming its folder finishes the handover. ``folder``: the stream's folder; ``cause``: why it
    stopped (one line); ``stopped``: the message without how to resume the stream."""

    def __init__(self, folder: Any, cause: str):
        self.folder, self.cause = Path(folder), cause
        self.stopped = f"{folder}: the stream's handover to its successor's file set stopped ({cause})"
        super().__init__(f"{self.stopped}; Stream.load({str(folder)!r}) finishes it and resumes the stream")

    def __reduce__(self) -> tuple:
        return type(self), (self.folder, self.cause)


class CacheLimitError(StateKVError, ValueError):
    """A step would take a stream's detailed cache past its ``max_cache_bytes`` and was refused: nothing streamed
    before it is lost, and the stream still answers from it.

    encoded: set by `statekv.VideoQA.encode` to the `EncodedVideo` of every sampled frame that fit (encoding stops
    at the first that does not; its ``stats.frames`` says how many), which can still be asked; None elsewhere, and
    when not even the prompt fits.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.encoded = None


def os_reason(error: OSError) -> str:
    """Why ``error`` happened, for a one-line message: its ``strerror``; for too many open files, the limit and how
    to raise it."""
    if error.errno == errno.EMFILE:
        import resource  # POSIX only, as the limit it names

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        return (f"too many open files: this process may hold {soft} (a disk-tier stream holds a few a layer); "
                f"raise the limit with `ulimit -n` before starting it (at most its hard limit, {shown}: "
                "`ulimit -Hn`, raised by root, or LimitNOFILE= in a systemd unit)")
    if error.errno == errno.ENFILE:
        return "too many open files in the system: raise its limit (sysctl fs.file-max) or close other programs"
    return error.strerror or str(error)
