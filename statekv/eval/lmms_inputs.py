"""What the lmms-eval plugin (`statekv.eval.lmms_plugin`) is given, read strictly: its ``--model_args`` text
(`model_args_from_string`), a request's generation kwargs; how a video that cannot be read is reported.

lmms-eval's own reading (``lmms.create_from_arg_string``) splits the text at commas into ``key=value`` pairs,
converts each value itself and calls the model with them and its own flags (``--batch_size``, ``--device``).
There a pair without ``=`` (``budget4096``) and a key its flags give too (``device=cpu`` with ``--device``, or
``batch_size=1``, which lmms-eval always passes) end with a traceback in lmms-eval, and exit status 0; a key given
twice keeps its last value and an empty value (``budget=``) reaches the model as ``""``, read as not given: both
are silently ignored. The statekv model refuses each in one line, and is handed the values as text, which it
reads as the command line's (`statekv.settings.values`).
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Mapping
from typing import Any

from statekv.errors import ConfigurationError, InputError, VideoError, VideoNotFoundError
from statekv.settings.values import LARGEST_INT, is_finite_number, shown

DEFAULT_MAX_NEW_TOKENS = 1024  # lmms-eval's chat models' default when a task sets none


def model_args_from_string(text: Any, flags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{key: value}`` of ``--model_args`` ``text`` (``key=value`` pairs separated by commas; already a mapping:
    its items), merged with lmms-eval's own ``flags`` (None values: not given). A one-line `ConfigurationError`
    for a pair that is not ``key=value``, a key given twice or without a value, or one whose flag says otherwise."""
    args = dict(text) if isinstance(text, Mapping) else _pairs(text)
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key in args and not _same(args[key], value):
            raise ConfigurationError(f"--model_args gives {key}={args[key]}, but lmms-eval's --{key} is {value} (as "
                                     f"given, or its default); give {key} once, as --{key}")
        args.setdefault(key, value)
    return args


def _same(given: Any, flag: Any) -> bool:
    """Whether a model arg and lmms-eval's flag say the same: as text, or as numbers (``01``, ``1.0`` and 1)."""
    if str(given) == str(flag):
        return True
    try:
        return float(str(given)) == float(str(flag))
    except ValueError:
        return False


def _pairs(text: Any) -> dict[str, str]:
    if not isinstance(text, str):
        raise ConfigurationError(f"--model_args must be text (key=value,...), got {shown(text)}")
    args: dict[str, str] = {}
    for pair in text.split(","):
        if not pair.strip():
            continue  # a trailing comma, as lmms-eval reads it
        key, equals, value = (part.strip() for part in pair.partition("="))
        if not equals or not key:
            raise ConfigurationError(f"--model_args: {shown(pair.strip())} is not key=value (pairs are separated "
                                     "by commas)")
        if key in args:
            raise ConfigurationError(f"--model_args gives {key} twice ({key}={args[key]} and {key}={value}); give "
                                     "it once")
        if not value:
            raise ConfigurationError(f"--model_args gives {key} no value; give {key}=<value>, or leave it out for "
                                     "its default")
        args[key] = value
    return args


def messages_of(doc_to_messages: Any, doc: Any, *, where: str, **round_args: Any) -> Any:
    """The chat messages the task makes of ``doc`` (``round_args``: a multi-round task's round); a one-line
    `InputError` naming the document when the task's own code cannot read it (a ``video`` that is a list or null:
    lmms-eval's own ``TypeError`` otherwise) or its own check of the video fails (lmms-eval's ovobench task asserts
    that a clip exists, naming it)."""
    try:
        return doc_to_messages(doc, **round_args)
    except AssertionError as error:
        said = " ".join(str(error).split())[:300] or "no message"
        raise InputError(f"{where}: the task's own check failed ({said}); is a video file it names missing?") from None
    except (TypeError, ValueError, KeyError) as error:
        raise InputError(f"{where}: the task cannot make its chat messages ({type(error).__name__}: "
                         f"{str(error)[:160]}); a document names one video by its path") from None


# -- a request's generation kwargs -----------------------------------------------------------------------------


def finite(value: Any) -> bool:
    """A real number (not a bool; numpy's scalars too) that a float holds finite."""
    return isinstance(value, numbers.Real) and is_finite_number(value if isinstance(value, int) else float(value))


def max_new_tokens(gen_kwargs: dict[str, Any]) -> int:
    """The request's ``max_new_tokens`` (a whole number, 1 or more; absent or None: `DEFAULT_MAX_NEW_TOKENS`)."""
    value = gen_kwargs.get("max_new_tokens")
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (integral or finite(value) and value == int(value)) or value < 1:
        raise InputError(f"the request's max_new_tokens must be a whole number of tokens, 1 or more; got "
                         f"{shown(value)}")
    if value > LARGEST_INT:
        raise InputError(f"the request's max_new_tokens must be at most {LARGEST_INT:,}; got {shown(value)}")
    return int(value)


def sampling(gen_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request's ``temperature`` (a number, 0 or more: 0 or absent is greedy), ``top_p`` (in (0, 1]),
    ``do_sample`` (false: greedy, whatever the temperature; true: sampled, at temperature 1 unless it names another)
    and ``num_beams`` (1: statekv decodes one sequence) as `generate` options, checked. What transformers'
    `generate` does with the same keys, except that a temperature of 0 is greedy (as lmms-eval's tasks mean it)."""
    beams = gen_kwargs.get("num_beams")
    if beams is not None and (isinstance(beams, bool) or not finite(beams) or beams != 1):
        raise InputError(f"the request's num_beams must be 1 (statekv decodes one sequence, greedy or sampled); got "
                         f"{shown(beams)}")
    do_sample = gen_kwargs.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InputError(f"the request's do_sample must be true or false; got {shown(do_sample)}")
    temperature = gen_kwargs.get("temperature")
    if temperature is None:
        temperature = 1 if do_sample else 0
    if not finite(temperature) or temperature < 0:
        raise InputError(f"the request's temperature must be a number, 0 or more; got {shown(temperature)}")
    if temperature == 0 or do_sample is False:
        return {}
    options = {"do_sample": True, "temperature": float(temperature)}
    top_p = gen_kwargs.get("top_p")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
            raise InputError(f"the request's top_p must be a number in (0, 1]; got {shown(top_p)}")
        options["top_p"] = float(top_p)
    return options


READ = frozenset({"max_new_tokens", "until", "stop_strings", "temperature", "top_p", "do_sample", "num_beams"})
SAMPLING_ONLY = frozenset({"top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"})  # nothing when greedy


def passed_on(gen_kwargs: dict[str, Any], sampled: bool) -> dict[str, Any]:
    """The request's other transformers generation settings (``top_k``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``min_new_tokens``, ...), for `generate` (`EncodedVideo.ask` checks each value): those
    that shape sampling only when the answer is ``sampled``."""
    from statekv.core.answering.generation_args import ENGINE_ARGUMENTS

    known = _generation_settings()
    return {name: value for name, value in gen_kwargs.items()
            if name not in READ and name not in ENGINE_ARGUMENTS and name in known and value is not None
            and (sampled or name not in SAMPLING_ONLY)}


def unread(gen_kwargs: dict[str, Any]) -> list[str]:
    """The request's generation kwargs statekv does not apply: another model's (``image_aspect_ratio``), lmms-eval's
    own (``visual_cot``), or misspelt."""
    from statekv.core.answering.generation_args import ENGINE_ARGUMENTS

    known = _generation_settings()
    return sorted(name for name in gen_kwargs
                  if name not in READ and (name not in known or name in ENGINE_ARGUMENTS))


@functools.cache
def _generation_settings() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(vars(GenerationConfig()))


def greedy_only(gen_kwargs: dict[str, Any]) -> None:
    """Refuse (one line) the request's settings a watch's evaluation cannot apply (it decodes greedily, without
    transformers' other generation settings): a forward round is answered by its watch."""
    sampled = sampling(gen_kwargs)
    applied = sorted({*sampled, *passed_on(gen_kwargs, bool(sampled))})
    if applied:
        raise InputError(f"a forward round is answered by its watch, greedily, without {', '.join(applied)}: leave "
                         "them out of the task's generation kwargs")


def before_stops(text: str, stops: list[str]) -> str:
    """``text`` cut before the first of ``stops`` it holds (generate() keeps the stop string; lmms-eval's answers
    end before it)."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


def stop_strings(gen_kwargs: dict[str, Any]) -> list[str]:
    """The request's ``until`` and transformers' ``stop_strings``: each a string or a list of strings (empty ones
    and None dropped)."""
    stops: list[str] = []
    for name in ("until", "stop_strings"):
        given = gen_kwargs.get(name) or []
        if isinstance(given, str):
            given = [given]
        if not isinstance(given, (list, tuple)) or not all(stop is None or isinstance(stop, str) for stop in given):
            raise InputError(f"the request's {name} must be a string or a list of strings; got {shown(given)}")
        stops += [stop for stop in given if stop and stop not in stops]
    return stops


# -- the videos -------------------------------------------------------------------------------------------------


def report_unreadable(error: VideoError, questions: int, where: str = "") -> None:
    """Say in one line that a video could not be read (``error``) and its ``questions`` are answered empty: the
    run goes on (lmms-eval scores them wrong), as `statekv eval` goes on past such a video. lmms-eval's
    ``--use_cache`` keeps no empty answer, so a rerun with it asks only those again. A missing video (a wrong path,
    not a damaged file) is raised again: it ends the run in one line, as before."""
    if isinstance(error, VideoNotFoundError):
        raise error
    plural = "" if questions == 1 else "s"
    print(f"statekv (lmms-eval model): cannot read a video{' ' + where if where else ''}: {error}; {questions} "
          f"question{plural} answered empty (scored wrong; a rerun with --use_cache asks only them again)",
          file=sys.stderr, flush=True)


def feed_clip(stream: Any, clip: str, pushed: float, max_fps: float, until: float) -> float:
    """Push the frames of ``clip`` (a prefix of the stream's source) after the one pushed last (at ``pushed``
    seconds) and before ``until`` seconds (a question's time, rounded up), until the stream has encoded one: what
    `statekv eval` shows it (`statekv.eval.answering.answer_streamed`), whatever the clip holds from ``until`` on;
    return the timestamp of the last frame pushed."""
    from statekv.video import open_video

    for frame in open_video(clip).sample_at_rate(max_fps):
        if frame.timestamp + 1e-6 >= until and stream.frames:
            break
        if frame.timestamp > pushed + 1e-6:
            stream.push(frame)
            pushed = frame.timestamp
    return pushed
