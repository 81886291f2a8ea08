"""One object for how a `VideoQA` is built, shared by the Python API, the command line, the evaluation harness,
the lmms-eval plugin and the benchmarks.

    options = ModelOptions(model="OpenGVLab/InternVL3-1B-hf", method="statekv", budget=4096, dtype="bfloat16")
    qa = VideoQA.from_options(options)
    ModelOptions.add_arguments(parser); ModelOptions.from_args(parser.parse_args())     # --model --method ...
    ModelOptions.from_strings({"model": "ckpt", "offload": "off"})                      # lmms-eval model args

Every field is checked when the object is made, before any model is loaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .core.attention import BACKENDS
from .core.limits import CACHE_LIMITS, DEFAULT_CACHE_LIMIT
from .errors import ConfigurationError
from .core.retrieval import DEFAULT_RETRIEVAL, RETRIEVAL_RULES, retrieval_rule
from .methods import MethodSettings, MethodSpec, method, method_names
from .values import (
    BYTE_SIZE,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    Option,
    boolean,
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_output_dir,
    choice,
    non_negative_int,
    optional_byte_size,
    optional_positive_int,
    optional_text,
    parse_options,
    positive_int,
    torch_dtype,
)

DEFAULT_RESERVE_TOKENS = 1024  # room for the question and the answer after the video (sets the RoPE horizon)


@dataclass(frozen=True)
class ModelOptions:
    """How to build a `VideoQA`.

    model: checkpoint folder or hub id. method: a registered method (`statekv.methods`); budget (tokens), frames
    (the recency window R, in frames) and sinks (ReKV) size it. retrieve: frames per layer each question is
    answered from (None: the method's default; the whole detailed cache for all but ``rekv``). retrieval: the
    rule that picks them (``attention``, ``rekv``, ``recent``; None: the method's default, ReKV's own rule for
    ``rekv`` and ``attention`` for the others). layout: the
    family's prompt layout. attention: the scoring backend. dtype, device: where the model runs (default: the
    checkpoint's dtype; CUDA when available). offload: keep the detailed cache in CPU memory (None: the
    method's default; ``"disk"``: in an append-only, memory-mapped file set per stream under ``offload_dir``,
    only the retrieval summaries in RAM). reserve_tokens: room for the question and answer after the video.
    cuda_graph: replay steady steps from a CUDA graph. vision_batch: frames per vision-tower call (None: 16 on
    CUDA, 4 on CPU). max_cache_bytes: a hard cap on each stream's detailed cache (None: none); cache_limit: what
    happens at the cap (``refuse``, ``evict-oldest``, ``evict-least-attended``; see `statekv.core.limits`).
    """

    model: str | None = None
    method: str = "statekv"
    budget: int = MethodSettings.budget  # the method's sizes: defaults and checks live in MethodSettings
    frames: int = MethodSettings.frames
    sinks: int = MethodSettings.sinks
    retrieve: int | None = None
    retrieval: str | None = None
    layout: str | None = None
    attention: str = "auto"
    dtype: str | None = None
    device: str | None = None
    offload: bool | str | None = None
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS
    trust_remote_code: bool = False
    cuda_graph: bool = True
    vision_batch: int | None = None
    offload_dir: str | None = None
    max_cache_bytes: int | None = None
    cache_limit: str = DEFAULT_CACHE_LIMIT

    def __post_init__(self) -> None:
        method(self.method)
        _ = self.settings  # MethodSettings checks budget, frames and sinks
        check_int(self.reserve_tokens, "reserve_tokens")
        for name in ("retrieve", "vision_batch"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        check_choice(self.attention, "attention backend", BACKENDS)
        if self.retrieval is not None:
            retrieval_rule(self.retrieval)
        torch_dtype(self.dtype)
        if self.device is not None:
            check_device(self.device)
        for name in ("trust_remote_code", "cuda_graph"):
            check_bool(getattr(self, name), name)
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
        return label

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
    def offloaded(self) -> bool:
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

    @staticmethod
    def string_options() -> list[Option]:
        """How each field is read from text (see `statekv.values.parse_options`)."""
        return _string_options()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelOptions":
        """Options from a namespace parsed with :meth:`add_arguments` (absent fields keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, *, model_required: bool = True, reserve: bool = True,
                      device_help: str = "e.g. cuda, cuda:1, cpu (default: cuda if available)"):
        """--model and the method settings every video command takes; returns the argument group.

        reserve: offer --reserve-tokens (commands that size the room for questions themselves do not).
        """
        group = parser.add_argument_group("model and method")
        methods = "; ".join(f"{name}: {method(name).summary}" for name in method_names())
        group.add_argument("--model", required=model_required, metavar="M",
                           help="checkpoint folder or hub id (InternVL3 -hf, Qwen3-VL, Eagle2.5), or builtin: the small "
                                "InternVL3 trained here on synthetic videos")
        group.add_argument("--method", choices=method_names(), default="statekv", help=f"(default: statekv) {methods}")
        sizes = MethodSettings()
        group.add_argument("--budget", type=POSITIVE_INT, default=sizes.budget, metavar="B",
                           help=f"statekv, keynorm: tokens carried per layer and KV head (default: {sizes.budget})")
        group.add_argument("--frames", type=POSITIVE_INT, default=sizes.frames, metavar="R",
                           help=f"recency, rekv: the window of frames carried (default: {sizes.frames})")
        group.add_argument("--sinks", type=NON_NEGATIVE_INT, default=sizes.sinks, metavar="N",
                           help=f"rekv: attention-sink tokens kept after the prompt prefix (default: {sizes.sinks})")
        group.add_argument("--retrieve", type=POSITIVE_INT, default=None, metavar="K",
                           help="answer from the K frames per layer that best match the question (default: the "
                                "whole detailed cache; rekv: 64)")
        group.add_argument("--retrieval", choices=tuple(RETRIEVAL_RULES), default=None, metavar="RULE",
                           help="how --retrieve picks the frames: attention (each frame's share of the question's "
                                "attention, over the layers so far), rekv (ReKV's mean key . mean query), recent "
                                "(the last K frames) (default: attention; rekv: rekv)")
        group.add_argument("--layout", default=None, help="prompt layout of the model family (default: the paper's)")
        group.add_argument("--attention", choices=BACKENDS, default="auto",
                           help="scoring backend (default: auto = triton on CUDA, chunked on CPU)")
        group.add_argument("--dtype", default=None, help="e.g. bfloat16, float32 (default: the checkpoint's)")
        group.add_argument("--device", default=None, help=device_help)
        group.add_argument("--offload", nargs="?", const=True, default=None, type=_offload_argument,
                           metavar="disk",
                           help="keep the detailed cache in CPU memory while encoding (rekv always does); "
                                "--offload disk: in a memory-mapped file set per stream under --offload-dir, only "
                                "the retrieval summaries in RAM")
        group.add_argument("--offload-dir", default=None, metavar="DIR",
                           help="with --offload disk: the folder each stream's file set is made in")
        group.add_argument("--max-cache-bytes", type=BYTE_SIZE, default=None, metavar="SIZE",
                           help="a hard cap on each stream's detailed cache, e.g. 512M, 20G (default: none)")
        group.add_argument("--cache-limit", choices=CACHE_LIMITS, default=DEFAULT_CACHE_LIMIT,
                           help="at --max-cache-bytes: refuse further frames (default; nothing is lost), or "
                                "evict the oldest or the least attended frames")
        group.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                           help="run every streaming step eagerly (default on CUDA: replay steady steps from a graph)")
        group.add_argument("--vision-batch", type=POSITIVE_INT, default=None,
                           metavar="N", help="frames per vision-tower call, run ahead of the language model "
                                             "(default: 16 on CUDA, 4 on CPU; statekv stream: 1)")
        if reserve:
            group.add_argument("--reserve-tokens", type=POSITIVE_INT,
                               default=DEFAULT_RESERVE_TOKENS, metavar="N",
                               help=f"tokens kept after the video for question and answer (default: "
                                    f"{DEFAULT_RESERVE_TOKENS})")
        group.add_argument("--trust-remote-code", action="store_true",
                           help="allow checkpoints that ship their own modelling code (Eagle2.5)")
        return group


def _string_options() -> list[Option]:
    """How each field is read from text (lmms-eval model args and similar)."""
    defaults = ModelOptions.__dataclass_fields__
    parsers = {"model": optional_text, "method": _registered_method, "budget": positive_int,
               "frames": positive_int, "sinks": non_negative_int, "retrieve": optional_positive_int,
               "retrieval": _optional_rule,
               "layout": optional_text, "attention": choice(BACKENDS), "dtype": optional_text,
               "device": optional_text, "offload": _optional_offload, "reserve_tokens": positive_int,
               "trust_remote_code": boolean, "cuda_graph": boolean, "vision_batch": optional_positive_int,
               "offload_dir": optional_text, "max_cache_bytes": optional_byte_size,
               "cache_limit": choice(CACHE_LIMITS)}
    return [Option(name, parsers[name], defaults[name].default) for name in parsers]


def _optional_rule(value: Any, name: str) -> str | None:
    """A retrieval rule's name, or None (the method's default)."""
    text = optional_text(value, name)
    return None if text is None else choice(tuple(RETRIEVAL_RULES))(text, name)


def _registered_method(value: Any, name: str) -> str:
    """A method registered now (looked up at parse time: methods registered later are accepted too)."""
    return choice(method_names())(value, name)


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


def normalize_argv(argv: list[str]) -> list[str]:
    """``--offload`` followed by anything but a tier name becomes ``--offload=memory``, so the plain flag never
    takes the next argument (a video path) as its value."""
    return [f"{arg}=memory" if arg == "--offload" and (i + 1 == len(argv) or argv[i + 1] not in OFFLOAD_TIERS)
            else arg for i, arg in enumerate(argv)]


OFFLOAD_TIERS = ("disk", "memory")


def _offload_argument(text: str) -> bool | str:
    """``--offload``'s value: ``memory`` (CPU memory, as the plain flag) or ``disk``."""
    if text not in OFFLOAD_TIERS:
        raise argparse.ArgumentTypeError(f"expected disk or memory, got {text!r}")
    return True if text == "memory" else text


def _optional_offload(value: Any, name: str) -> bool | str | None:
    """``disk``, a boolean (on: CPU memory), or None (the method's default)."""
    if isinstance(value, str) and value.strip().lower() == "disk":
        return "disk"
    if isinstance(value, str) and value.strip().lower() == "memory":
        return True
    return _optional_boolean(value, name)


def _optional_boolean(value: Any, name: str) -> bool | None:
    """A boolean, or None (the method's default) for None, ``""``, ``none``, ``null``."""
    if isinstance(value, str) and optional_text(value, name) is None:
        return None
    return None if value is None else boolean(value, name)
