"""One object for how a `VideoQA` is built, shared by the Python API, the command line, the evaluation harness,
the lmms-eval plugin and the benchmarks.

    options = ModelOptions(model="OpenGVLab/InternVL3-1B-hf", method="statekv", budget=4096, dtype="bfloat16")
    qa = VideoQA.from_options(options)
    ModelOptions.add_arguments(parser); ModelOptions.from_args(parser.parse_args())     # --model --method ...
    ModelOptions.from_strings({"model": "ckpt", "offload": "off"})                      # lmms-eval model args

Every option is declared once, as a `Setting` in `SETTINGS` (its name, default, kind of value, help): the
dataclass field, its check when the object is made (before any model is loaded), its command-line flag and its
text form are all made from that entry, so a new option is one more entry. A method's sizes (budget, frames,
sinks) take their defaults and checks from `MethodSettings`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar

from .core.attention import BACKENDS
from .core.limits import CACHE_LIMITS, DEFAULT_CACHE_LIMIT
from .core.positions import POSITIONS
from .core.quantized import KV_CACHE_BITS, check_kv_cache_dtype
from .core.retrieval import DEFAULT_RETRIEVAL, RETRIEVAL_RULES, retrieval_rule
from .methods import MethodSettings, MethodSpec, method, method_names
from .errors import ConfigurationError
from .values import (
    BOOLEAN,
    BYTES,
    DEVICE,
    DTYPE,
    POSITIVE,
    TEXT,
    Kind,
    Option,
    Parser,
    boolean,
    check_choice,
    check_int,
    check_output_dir,
    one_of,
    parse_options,
)

DEFAULT_RESERVE_TOKENS = 1024  # room for the question and the answer after the video (sets the RoPE horizon)


@dataclass(frozen=True)
class Setting:
    """One option of `ModelOptions`, declared once.

    name: the field (the flag is ``--name`` with dashes; a boolean that defaults to True is ``--no-name``).
    default: its value when not given. kind: the values it takes (`statekv.values.Kind`: the Python check, the
    text parser, the command-line type and choices). help: the flag's help (argparse expands ``%(default)s``),
    or a function making it when the parser is built. metavar: the flag's placeholder. check: instead of the
    kind's check. offered_by: an `ModelOptions.add_arguments` switch that must be on for the flag to be offered
    (``"reserve"``).
    """

    name: str
    default: Any
    kind: Kind
    help: str | Callable[[], str]
    metavar: str | None = None
    check: Parser | None = None
    offered_by: str | None = None

    def validate(self, value: Any) -> None:
        """Raise a one-line `ConfigurationError` naming the setting if ``value`` is not one it takes."""
        (self.check or self.kind.check)(value, self.name)

    @property
    def text_option(self) -> Option:
        """How the setting is read from text (lmms-eval model args; see `statekv.values.parse_options`)."""
        return Option(self.name, self.kind.parse, self.default)

    @property
    def flag(self) -> str:
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.default is True else f"--{dashed}"

    def add_to(self, group: argparse._ArgumentGroup, **overrides: Any) -> None:
        """Add the setting's flag to ``group`` (``overrides``: argparse keywords replacing the derived ones)."""
        arguments: dict[str, Any] = {"help": self.help() if callable(self.help) else self.help}
        if self.kind.annotation.startswith("bool"):  # a switch: on (or, by default on, off) when given
            arguments.update(action="store_false" if self.default is True else "store_true", dest=self.name)
            if self.default is None:
                arguments["default"] = None
        else:
            arguments.update(default=self.default, metavar=self.metavar)
            if self.kind.cli is not None:
                arguments["type"] = self.kind.cli
            if self.kind.choices is not None:
                arguments["choices"] = tuple(self.kind.choices())
        arguments.update(overrides)
        group.add_argument(self.flag, **arguments)


def method_size(name: str, metavar: str, help: str) -> Setting:
    """A method's size as an option: its default, kind and check are `MethodSettings`' own."""
    return Setting(name, getattr(MethodSettings, name), MethodSettings.kind(name), help, metavar,
                   check=lambda value, _: MethodSettings(**{name: value}))


def _method_help() -> str:
    methods = "; ".join(f"{name}: {method(name).summary}" for name in method_names())
    return "(default: %(default)s) " + methods.replace("%", "%%")


def check_cache_options(offload: Any, offload_dir: Any, max_cache_bytes: Any, cache_limit: Any) -> None:
    """Where the detailed cache goes and its cap, checked together (one-line `ConfigurationError`)."""
    if offload is not None and offload != "disk" and not isinstance(offload, bool):
        raise ConfigurationError(f"offload must be True, False or 'disk', got {offload!r}")
    if offload == "disk":
        if offload_dir is None:
            raise ConfigurationError("offload='disk' needs offload_dir (the folder for each stream's files)")
        check_output_dir(offload_dir, "offload_dir")
    elif offload_dir is not None:
        raise ConfigurationError(f"offload_dir={offload_dir!r} is only used with offload='disk'")
    if max_cache_bytes is not None:
        check_int(max_cache_bytes, "max_cache_bytes")
    check_choice(cache_limit, "cache_limit", CACHE_LIMITS)
    if cache_limit != DEFAULT_CACHE_LIMIT and max_cache_bytes is None:
        raise ConfigurationError(f"cache_limit={cache_limit} needs max_cache_bytes (the cap it acts at)")


OFFLOAD_TIERS = ("disk", "memory")


def _check_folder(value: Any, name: str) -> Any:
    """None, or a folder's path as text or a path object."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"{name} must be a folder's path, got {value!r}")
    return value


def normalize_argv(argv: list[str]) -> list[str]:
    """``--offload`` followed by anything but a tier name becomes ``--offload=memory``, so the plain flag never
    takes the next argument (a video path) as its value."""
    return [f"{arg}=memory" if arg == "--offload" and (i + 1 == len(argv) or argv[i + 1] not in OFFLOAD_TIERS)
            else arg for i, arg in enumerate(argv)]


def _offload_argument(text: str) -> bool | str:
    """``--offload``'s value: ``memory`` (CPU memory, as the plain flag) or ``disk``."""
    if text not in OFFLOAD_TIERS:
        raise argparse.ArgumentTypeError(f"expected disk or memory, got {text!r}")
    return True if text == "memory" else text


def _optional_offload(value: Any, name: str) -> bool | str | None:
    """``disk``, ``memory`` or a boolean (on: CPU memory), or None (the method's default) from text."""
    if isinstance(value, str) and value.strip().lower() in ("disk", "memory"):
        return "disk" if value.strip().lower() == "disk" else True
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return boolean(value, name)


SETTINGS: tuple[Setting, ...] = (
    Setting("model", None, TEXT.optional, "checkpoint folder or hub id (InternVL3 -hf, Qwen3-VL, Eagle2.5), or "
            "builtin: the small InternVL3 trained here on synthetic videos", "M"),
    Setting("method", "statekv", one_of(method_names), _method_help),
    method_size("budget", "B", "statekv, keynorm: tokens carried per layer and KV head (default: %(default)s)"),
    method_size("frames", "R", "recency, rekv: the window of frames carried (default: %(default)s)"),
    method_size("sinks", "N", "rekv: attention-sink tokens kept after the prompt prefix (default: %(default)s)"),
    Setting("retrieve", None, POSITIVE.optional, "answer from the K frames per layer that best match the question "
            "(default: the whole detailed cache; rekv: 64)", "K"),
    Setting("retrieval", None, one_of(lambda: tuple(RETRIEVAL_RULES), lambda value, _: retrieval_rule(value)).optional,
            "how --retrieve picks the frames: attention (each frame's share of the question's attention, over the "
            "layers so far), rekv (ReKV's mean key . mean query), recent (the last K frames) (default: attention; "
            "rekv: rekv)", "RULE"),
    Setting("layout", None, TEXT.optional, "prompt layout of the model family (default: the paper's)"),
    Setting("attention", "auto", one_of(lambda: BACKENDS, lambda value, _: check_choice(value, "attention backend",
                                                                                       BACKENDS)),
            "scoring backend (default: auto = triton on CUDA, chunked on CPU)"),
    Setting("dtype", None, DTYPE.optional, "e.g. bfloat16, float32 (default: the checkpoint's)"),
    Setting("device", None, DEVICE.optional, "e.g. cuda, cuda:1, cpu (default: cuda if available)"),
    Setting("offload", None, Kind("str | bool | None", lambda value, name: value, lambda value, name:
                                  _optional_offload(value, name), _offload_argument),
            "keep the detailed cache in CPU memory while encoding (rekv always does); --offload disk: in a "
            "memory-mapped file set per stream under --offload-dir, only the retrieval summaries in RAM", "disk"),
    Setting("offload_dir", None, Kind("str | None", _check_folder, lambda value, name: TEXT.optional.parse(value, name)),
            "with --offload disk: the folder each stream's file set is made in", "DIR"),
    Setting("max_cache_bytes", None, BYTES.optional, "a hard cap on each stream's detailed cache, e.g. 512M, 20G "
            "(default: none)", "SIZE"),
    Setting("cache_limit", DEFAULT_CACHE_LIMIT, one_of(lambda: CACHE_LIMITS),
            "at --max-cache-bytes: refuse further frames (default; nothing is lost), or evict the oldest or the "
            "least attended frames"),
    Setting("kv_cache_dtype", None, one_of(lambda: ("auto", *KV_CACHE_BITS),
                                           lambda value, name: check_kv_cache_dtype(value, name)).optional,
            "store the detailed cache quantized: int8 or int4 (keys per channel, values per token; the carried "
            "state stays in the model's dtype) (default: auto = the model's dtype)", "DTYPE"),
    Setting("positions", None, one_of(lambda: POSITIONS).optional,
            "RoPE positions: stream (each token at its index in the whole stream: exactly the model's one-shot "
            "forward, for a horizon inside the model's range) or bounded (kept inside the range the model was "
            "trained on: no horizon, a stream never ends; a question reads the whole cache when it fits, else "
            "retrieved frames) (default: stream where the horizon fits, else bounded)", "P"),
    Setting("reserve_tokens", DEFAULT_RESERVE_TOKENS, POSITIVE,
            "tokens kept after the video for question and answer (default: %(default)s)", "N", offered_by="reserve"),
    Setting("trust_remote_code", False, BOOLEAN,
            "allow checkpoints that ship their own modelling code (Eagle2.5)"),
    Setting("cuda_graph", True, BOOLEAN,
            "run every streaming step eagerly (default on CUDA: replay steady steps from a graph)"),
    Setting("vision_batch", None, POSITIVE.optional, "frames per vision-tower call, run ahead of the language model "
            "(default: 16 on CUDA, 4 on CPU; statekv stream: 1)", "N"),
)


def options_class(settings: tuple[Setting, ...]) -> Callable[[type], type]:
    """A class decorator making a frozen dataclass whose fields are ``settings`` (names, defaults and types, in
    order); the class reads its checks, flags and text forms from ``cls.SETTINGS``."""

    def build(cls: type) -> type:
        cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}),
                               **{setting.name: setting.kind.annotation for setting in settings}}
        for setting in settings:
            setattr(cls, setting.name, setting.default)
        cls.SETTINGS = settings
        return dataclass(frozen=True)(cls)

    return build


@options_class(SETTINGS)
class ModelOptions:
    """How to build a `VideoQA`; its fields are `SETTINGS`.

    model: checkpoint folder or hub id. method: a registered method (`statekv.methods`); budget (tokens), frames
    (the recency window R, in frames) and sinks (ReKV) size it. retrieve: frames per layer each question is
    answered from (None: the method's default; the whole detailed cache for all but ``rekv``). retrieval: the
    rule that picks them (``attention``, ``rekv``, ``recent``; None: the method's default, ReKV's own rule for
    ``rekv`` and ``attention`` for the others). layout: the
    family's prompt layout. attention: the scoring backend. dtype, device: where the model runs (default: the
    checkpoint's dtype; CUDA when available). offload: keep the detailed cache in CPU memory (None: the
    method's default; ``"disk"``: in an append-only, memory-mapped file set per stream under ``offload_dir``, only
    the retrieval summaries in RAM). max_cache_bytes: a hard cap on each stream's detailed cache (None: none);
    cache_limit: what happens at the cap (``refuse``, ``evict-oldest``, ``evict-least-attended``; see
    `statekv.core.limits`). kv_cache_dtype: store the detailed cache quantized, ``int8`` or ``int4`` (None or ``auto``:
    the model's dtype). positions: ``stream`` or ``bounded`` RoPE positions (None: stream where the horizon fits
    in the model's range, else bounded; see `statekv.core.positions`). reserve_tokens: room for the question and
    answer after the video. cuda_graph: replay
    steady steps from a CUDA graph. vision_batch: frames per vision-tower call (None: 16 on CUDA, 4 on CPU).
    """

    SETTINGS: ClassVar[tuple[Setting, ...]]

    def __post_init__(self) -> None:
        for setting in self.SETTINGS:
            setting.validate(getattr(self, setting.name))
        check_cache_options(self.offload, self.offload_dir, self.max_cache_bytes, self.cache_limit)

    @property
    def spec(self) -> MethodSpec:
        return method(self.method)

    @property
    def settings(self) -> MethodSettings:
        return MethodSettings(budget=self.budget, frames=self.frames, sinks=self.sinks)

    @property
    def label(self) -> str:
        """The method as tables name it ("StateKV B=4096"), with the retrieval if it is not the default."""
        label = self.spec.label(self.settings)
        retrieve, rule = self.retrieve_frames, self.retrieval_rule
        if retrieve != self.spec.retrieve:
            label = f"{label} k={retrieve}"
        if retrieve is not None and rule != self.spec_retrieval:
            label = f"{label} ({rule})"
        stored = check_kv_cache_dtype(self.kv_cache_dtype)
        return label if stored is None else f"{label} {stored} cache"

    @property
    def retrieve_frames(self) -> int | None:
        return self.retrieve if self.retrieve is not None else self.spec.retrieve

    @property
    def spec_retrieval(self) -> str:
        """The method's own retrieval rule."""
        return self.spec.retrieval or DEFAULT_RETRIEVAL

    @property
    def retrieval_rule(self) -> str:
        """The name of the rule questions retrieve frames by (when they retrieve)."""
        return self.retrieval if self.retrieval is not None else self.spec_retrieval

    @property
    def offloaded(self) -> bool | str:
        return self.spec.offload if self.offload is None else self.offload

    def with_changes(self, **changes: Any) -> "ModelOptions":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- from text: the command line and lmms-eval's model args -------------------------------------------------
    @classmethod
    def from_strings(cls, given: Mapping[str, Any], *, what: str = "option") -> "ModelOptions":
        """Options from ``name=value`` settings whose values may be strings (``offload=off``); unknown names
        are refused, naming the known ones."""
        return cls(**parse_options(given, cls.string_options(), what=what))

    @classmethod
    def string_options(cls) -> list[Option]:
        """How each field is read from text (see `statekv.values.parse_options`)."""
        return [setting.text_option for setting in cls.SETTINGS]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelOptions":
        """Options from a namespace parsed with :meth:`add_arguments` (absent fields keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, model_required: bool = True, reserve: bool = True,
                      device_help: str | None = None):
        """A flag for every setting (--model, --method, --budget ...); returns the argument group.

        model_required: --model must be given. reserve: offer --reserve-tokens (commands that size the room for
        questions themselves do not). device_help: the --device help, for commands that place the model
        themselves.
        """
        group = parser.add_argument_group("model and method")
        switches = {"reserve": reserve}
        overrides = {"model": {"required": model_required}, "device": {"help": device_help} if device_help else {},
                     "offload": {"nargs": "?", "const": True}}  # --offload alone: CPU memory (see normalize_argv)
        for setting in cls.SETTINGS:
            if setting.offered_by is None or switches[setting.offered_by]:
                setting.add_to(group, **overrides.get(setting.name, {}))
        return group

