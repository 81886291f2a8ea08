"""The methods and the retrieval rules, named once: what ``--method statekv`` and ``--retrieval rekv`` mean to the
CLI, the evaluation harness, the lmms-eval plugin, the benchmarks and the FLOPs accounting.

A method is a carry policy plus how it is described and sized (the built-in ones: `BUILTIN_METHODS`, whose
policies load the engine's rules when first made, so a method is described without the engine):

    register_method(MethodSpec("valuenorm", "carry the tokens with the largest values", size="budget",
                               policy=lambda settings, frames_per_step: ValueNorm(budget=settings.budget),
                               history=at_most_budget, display="ValueNorm"))

and from then on every command and the evaluation harness accept it (``--method valuenorm``).

Sizes are in the units people set them in: ``budget`` in tokens (per layer and KV head), ``frames`` (the
recency window R) in sampled frames. A family that puts several frames in one streaming step (Qwen3-VL: 2) has
a window of ``ceil(R / frames_per_step)`` steps -- the same definition in evaluation and in FLOPs.

A retrieval rule is registered by name in `RETRIEVAL_RULES` where it is defined
(`statekv.core.answering.retrieval`); ``retrieval=NAME`` then chooses it everywhere.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from typing import Any

import numpy as np

from ..errors import ConfigurationError
from .values import NON_NEGATIVE, POSITIVE, Kind, shown


@dataclass(frozen=True)
class MethodSettings:
    """The sizes a method may read: ``budget`` (tokens carried per layer and KV head), ``frames`` (the recency
    window R, in frames), ``sinks`` (ReKV's attention sinks after the prompt prefix, in tokens) and ``window``
    (SimpleStream's N: a question sees the last N frames only)."""

    budget: int = field(default=4096, metadata={"kind": POSITIVE})
    frames: int = field(default=16, metadata={"kind": POSITIVE, "what": "frames (the recency window R)"})
    sinks: int = field(default=4, metadata={"kind": NON_NEGATIVE})
    window: int = field(default=4, metadata={"kind": POSITIVE, "what": "window (the last N frames a question sees)"})

    def __post_init__(self) -> None:
        for size in fields(self):
            size.metadata["kind"].check(getattr(self, size.name), size.metadata.get("what", size.name))

    @staticmethod
    def kind(name: str) -> Kind:
        """The values the size ``name`` takes (how `ModelOptions` and the command line read it)."""
        return MethodSettings.__dataclass_fields__[name].metadata["kind"]

    def window_steps(self, frames_per_step: int) -> int:
        """The recency window in streaming steps."""
        return math.ceil(self.frames / frames_per_step)


# How many earlier tokens step ``s`` (0-based, elementwise over an array) may attend to, with ``t`` tokens and
# ``f`` frames per step: what the FLOPs accounting counts.
History = Callable[[MethodSettings, np.ndarray, int, int], np.ndarray]


def every_earlier_token(settings: MethodSettings, step: np.ndarray, t: int, f: int) -> np.ndarray:
    return step * t


def at_most_budget(settings: MethodSettings, step: np.ndarray, t: int, f: int) -> np.ndarray:
    return np.minimum(step * t, settings.budget)


def last_window(settings: MethodSettings, step: np.ndarray, t: int, f: int) -> np.ndarray:
    return np.minimum(step, settings.window_steps(f)) * t


def sinks_and_last_window(settings: MethodSettings, step: np.ndarray, t: int, f: int) -> np.ndarray:
    return np.minimum(step * t, settings.sinks + settings.window_steps(f) * t)


def within_recent_window(settings: MethodSettings, step: np.ndarray, t: int, f: int) -> np.ndarray:
    """A fresh encoding of the last N frames: a step sees the steps before it within those N frames."""
    return np.minimum(step, math.ceil(settings.window / f) - 1) * t


@dataclass(frozen=True)
class MethodSpec:
    """One method.

    name: what users type. summary: one line for help texts. size: the setting that sizes its carried state
    (``"budget"``, ``"frames"`` or None). policy: ``(settings, frames per step) -> CarryPolicy``. history: the
    tokens a step attends to besides its own (see `History`); it is how methods are matched for compute.
    retrieve: frames retrieved per question by default (None: the whole detailed cache). retrieval: the rule
    that retrieves them by default (a name in `statekv.core.answering.retrieval.RETRIEVAL_RULES`; None: the library's
    default rule). offload: keeps the
    detailed cache off the model's device by design. also_uses: settings it reads besides its size.
    recent_window: keeps no cache at all, only the last ``window`` frames, and answers each question from a fresh
    encoding of those frames under ``policy`` (SimpleStream; see `statekv.api.recent`).
    """

    name: str
    summary: str
    size: str | None
    policy: Callable[[MethodSettings, int], Any]  # a `statekv.core.rules` CarryPolicy
    history: History
    display: str
    retrieve: int | None = None
    offload: bool = False
    retrieval: str | None = None
    also_uses: tuple[str, ...] = ()
    recent_window: bool = False

    @property
    def uses(self) -> tuple[str, ...]:
        """Every `MethodSettings` field the method reads."""
        return ((self.size,) if self.size else ()) + self.also_uses

    @property
    def retrieves(self) -> bool:
        """Whether its questions may retrieve frames from a cache (``retrieve``, ``retrieval``): not a method that
        keeps none (``recent_window``)."""
        return not self.recent_window

    def label(self, settings: MethodSettings | None = None) -> str:
        """The name tables use: "StateKV B=4096", "Recency R=16", "SimpleStream N=4", "Full SA"."""
        settings = settings or MethodSettings()
        if self.size == "budget":
            return f"{self.display} B={settings.budget}"
        if self.size == "frames":
            return f"{self.display} R={settings.frames}"
        if self.size == "window":
            return f"{self.display} N={settings.window}"
        return self.display

    def size_value(self, settings: MethodSettings) -> int | None:
        """The value of its size setting (B, R or N), or None."""
        return None if self.size is None else getattr(settings, self.size)


def _rules() -> Any:
    """The engine's carry rules (`statekv.core.rules`), loaded when a built-in method's policy is first made: a
    method's description is read without the engine (a command refuses a bad flag before loading it)."""
    return importlib.import_module("statekv.core.rules")


BUILTIN_METHODS = (
    MethodSpec("statekv", "carry the top-B tokens by attention mass, per layer and KV head", "budget",
               lambda s, f: _rules().StateKV(budget=s.budget), at_most_budget, "StateKV"),
    MethodSpec("full", "carry everything: exact, quadratic in length", None,
               lambda s, f: _rules().FullAttention(), every_earlier_token, "Full SA"),
    MethodSpec("recency", "carry the last R frames (a sliding window: the paper's ReKV baseline)", "frames",
               lambda s, f: _rules().Recency(frames=s.window_steps(f)), last_window, "Recency"),
    MethodSpec("rekv", "ReKV: sinks + the last R frames while encoding; questions answered from the 64 frames per "
                       "layer that best match them, the detailed cache kept in CPU memory", "frames",
               lambda s, f: _rules().ReKV(frames=s.window_steps(f), sinks=s.sinks), sinks_and_last_window, "ReKV",
               retrieve=64, offload=True, also_uses=("sinks",), retrieval="rekv"),
    MethodSpec("keynorm", "carry the B tokens with the smallest key norm, per layer and KV head", "budget",
               lambda s, f: _rules().KeyNorm(budget=s.budget), at_most_budget, "KeyNorm"),
    MethodSpec("simplestream", "SimpleStream: no cache; each question is answered by the unmodified model from the "
                               "last N frames and the prompt alone, encoded afresh", "window",
               lambda s, f: _rules().FullAttention(), within_recent_window, "SimpleStream", recent_window=True),
)
METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in BUILTIN_METHODS}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add (or replace) a method; every command and the evaluation harness accept it from then on. A one-line
    `ConfigurationError` for what is no method: not a `MethodSpec`, a size or setting it reads that is none of
    `MethodSettings`', a policy that cannot be called."""
    if not isinstance(spec, MethodSpec):
        raise ConfigurationError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name:
        raise ConfigurationError(f"a method's name must be non-empty text, got {shown(spec.name)}")
    for read in ((spec.size,) if spec.size is not None else ()) + tuple(spec.also_uses):
        if read not in SIZES:
            raise ConfigurationError(f"method {spec.name!r}: {shown(read)} is no method setting; its size and "
                                     f"also_uses name some of {', '.join(SIZES)}")
    if not callable(spec.policy):
        raise ConfigurationError(f"method {spec.name!r}: policy must be a function (settings, frames per step) -> "
                                 f"CarryPolicy, got {type(spec.policy).__name__}")
    METHODS[spec.name] = spec
    return spec


def with_builtins() -> None:
    """Load the engine, where the built-in retrieval rules register themselves, so that a caller that imported only
    the settings finds them too (the package loads its names lazily)."""
    importlib.import_module("statekv.core")


def method(name: str) -> MethodSpec:
    """The registered method ``name``; a one-line ConfigurationError listing the others if there is none."""
    if name not in METHODS:
        raise ConfigurationError(f"unknown method {shown(name)}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


SIZES = tuple(size.name for size in fields(MethodSettings))
# what `refuse_unread` checks: the sizes, how many frames a question retrieves and by which rule, where the cache goes
READ_BY_SOME = SIZES + ("retrieve", "retrieval", "offload", "max_cache_bytes")


def refuse_unread(name: str, given: Mapping[str, Any], *, flags: bool = False) -> None:
    """Refuse (one-line `ConfigurationError`) a setting in ``given`` that method ``name`` never reads, so nothing is
    run or recorded as if it had changed something: a size it is not sized by (``window`` under ``statekv``),
    ``retrieve`` or ``retrieval`` under a method that keeps no cache to retrieve from, ``retrieval`` when nothing
    is retrieved, ``offload="disk"`` or ``max_cache_bytes`` under a method that keeps no cache.

    ``given``: the settings given explicitly, by name (None: not given; names outside `READ_BY_SOME` are not
    looked at). flags: name them as command-line flags (``--window 4``), else as keywords (``window=4``). Every
    entry point that runs one method calls this: the commands, `VideoQA.from_pretrained`, the lmms-eval plugin's
    model args and the service's stream settings."""
    spec = method(name)

    def named(setting: str, value: Any = None) -> str:
        if flags:
            flag = "--" + setting.replace("_", "-")
            return flag if value is None else f"{flag} {value}"
        return setting if value is None else f"{setting}={value!r}"

    given = {key: value for key, value in given.items() if key in READ_BY_SOME and value is not None}
    which = named("method", spec.name)
    for size in SIZES:
        if size in given and size not in spec.uses:
            takes = ", ".join(named(used) for used in spec.uses) or "no size"
            raise ConfigurationError(f"{named(size, given[size])} is not used by {which} (it takes {takes}); leave "
                                     "it out")
    if not spec.retrieves:
        for setting in ("retrieve", "retrieval"):
            if setting in given:
                raise ConfigurationError(f"{named(setting, given[setting])} is not used by {which}: it keeps no "
                                         "cache to retrieve from (each question sees its last frames, encoded "
                                         "afresh); leave it out")
        if given.get("offload") == "disk":
            raise ConfigurationError(f"{named('offload', 'disk')} is not used by {which}: the disk tier keeps a "
                                     "stream's cache in files to resume it, and this method keeps no cache (only "
                                     "its last frames); leave it out")
        if "max_cache_bytes" in given:
            raise ConfigurationError(f"{named('max_cache_bytes', given['max_cache_bytes'])} is not used by {which}: "
                                     "it keeps no cache to cap (only its last frames, encoded afresh for each "
                                     "question); leave it out")
    if "retrieval" in given and given.get("retrieve") is None and spec.retrieve is None:
        raise ConfigurationError(f"{named('retrieval', given['retrieval'])} picks the frames {named('retrieve')} "
                                 f"answers from, and {which} retrieves none: give {named('retrieve')} K too")


def labelled_policies(names: tuple[str, ...] = ("full", "recency", "statekv"), frames_per_step: int = 1,
                      **sizes: int) -> dict[str, Any]:
    """``{label: policy}`` of registered methods at the given sizes (``budget=``, ``frames=``, ``sinks=``): the
    methods a benchmark compares, named as tables name them."""
    settings = MethodSettings(**sizes)
    return {method(name).label(settings): method(name).policy(settings, frames_per_step) for name in names}


RETRIEVAL_RULES: dict[str, Any] = {}  # name -> `statekv.core.answering.retrieval.RetrievalRule`, registered there
DEFAULT_RETRIEVAL = "attention"  # the rule a question retrieves by when none is named


def retrieval_rule(name: str) -> Any:
    """The rule registered as ``name``; a one-line ConfigurationError naming the others if there is none."""
    with_builtins()
    if not isinstance(name, str) or name not in RETRIEVAL_RULES:
        raise ConfigurationError(f"unknown retrieval rule {shown(name)}; choose one of {', '.join(RETRIEVAL_RULES)}")
    return RETRIEVAL_RULES[name]


def retrieval_rule_names() -> tuple[str, ...]:
    with_builtins()
    return tuple(RETRIEVAL_RULES)
