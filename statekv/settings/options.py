"""One object for how a `VideoQA` is built, shared by the Python API, the command line, the evaluation harness,
the lmms-eval plugin and the benchmarks.

    options = ModelOptions(model="OpenGVLab/InternVL3-1B-hf", method="statekv", budget=4096, dtype="bfloat16")
    qa = VideoQA.from_options(options)
    ModelOptions.add_arguments(parser); ModelOptions.from_args(parser.parse_args())     # --model --method ...
    ModelOptions.from_strings({"model": "ckpt", "offload": "off"})                      # lmms-eval model args

Every option is declared once, as a `statekv.settings.setting.Setting` in `SETTINGS` (its name, default, kind of value,
help): the dataclass field, its check when the object is made (before any model is loaded), its command-line flag
and its text form are all made from that entry, so a new option is one more entry. The engine's settings are the
entries of `statekv.settings.engine.ENGINE_SETTINGS`, included here: `ModelOptions.engine` gathers them into the
`EngineSettings` a `VideoQA` hands to every stream. A method's sizes (budget, frames, sinks) take their defaults
and checks from `MethodSettings`, but for the budget of the built-in model, its own (`default_budget`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from typing import Any, ClassVar

from ..errors import ConfigurationError
from .engine import ENGINE_SETTINGS, OFFLOAD_TIERS, EngineSettings, check_cache_options
from .methods import (DEFAULT_RETRIEVAL, READ_BY_SOME, SIZES, MethodSettings, MethodSpec, method,
                      method_names, refuse_unread, retrieval_rule, retrieval_rule_names)
from .setting import Setting, settings_class
from .values import BOOLEAN, DEVICE, DTYPE, PATH_TEXT, POSITIVE, TEXT, Option, one_of, parse_options

DEFAULT_RESERVE_TOKENS = 1024  # room for the question and the answer after the video (sets the RoPE horizon)
BUILTIN_NAME = "builtin"  # ``--model builtin``: the small model shipped with statekv (`statekv.builtin`)
# The built-in model's default StateKV budget, in tokens per layer and KV head: 16 of its 4-token frames (recency's
# default window). The engine's default (4096) would carry every token of any video it can hold, so StateKV would
# choose nothing.
BUILTIN_BUDGET = 64
BUILTIN_RECIPE_FILE = "statekv_recipe.json"  # beside the weights `statekv train-builtin` writes: how they were trained


def is_builtin(model: object) -> bool:
    """Whether ``model`` (a name or path given as ``--model``) means the built-in model."""
    return isinstance(model, str) and model == BUILTIN_NAME


def is_builtin_kind(model: object) -> bool:
    """Whether ``model`` is the built-in model or a checkpoint folder `statekv train-builtin` wrote (it holds
    `BUILTIN_RECIPE_FILE`): either reads the built-in's prompt layout and takes its default budget."""
    if is_builtin(model):
        return True
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
        return False
    try:
        return os.path.isfile(os.path.join(model, BUILTIN_RECIPE_FILE))
    except (OSError, ValueError):  # a name no file system takes (too long, a NUL byte): not a folder here
        return False


def method_size(name: str, metavar: str, help: str) -> Setting:
    """A method's size as an option: its default, kind and check are `MethodSettings`' own. (Its flag defaults to
    None, so ``help`` names the default itself: ``%(default)s`` is replaced here.)"""
    default = getattr(MethodSettings, name)
    return Setting(name, default, MethodSettings.kind(name), help.replace("%(default)s", str(default)), metavar,
                   check=lambda value, _: MethodSettings(**{name: value}))


def default_budget(model: str | os.PathLike | None) -> int:
    """The budget a setup gets when none is given: the built-in model's own (`BUILTIN_BUDGET`; also for weights
    trained by `statekv train-builtin`), else `MethodSettings`' default."""
    return BUILTIN_BUDGET if is_builtin_kind(model) else MethodSettings.budget


def _method_help() -> str:
    methods = "; ".join(f"{name}: {method(name).summary}" for name in method_names())
    return "(default: %(default)s) " + methods.replace("%", "%%")


def normalize_argv(argv: list[str]) -> list[str]:
    """``--offload`` followed by anything but a tier name becomes ``--offload=memory``, so the plain flag never
    takes the next argument (a video path) as its value."""
    return [f"{arg}=memory" if arg == "--offload" and (i + 1 == len(argv) or argv[i + 1] not in OFFLOAD_TIERS)
            else arg for i, arg in enumerate(argv)]


MODEL_SETTINGS: tuple[Setting, ...] = (  # the model and the method
    Setting("model", None, replace(TEXT.optional, cli=PATH_TEXT), "checkpoint folder or hub id (InternVL3 -hf, "
            "Qwen3-VL, Eagle2.5), or builtin: the small InternVL3 trained here on synthetic videos", "M"),
    Setting("method", "statekv", one_of(method_names), _method_help, "METHOD"),
    Setting("budget", None, MethodSettings.kind("budget").optional,
            f"statekv, keynorm: tokens carried per layer and KV head (default: {BUILTIN_BUDGET} for the built-in "
            f"model and weights trained by train-builtin, else {MethodSettings.budget})", "B",
            check=lambda value, _: value is None or MethodSettings(budget=value)),
    method_size("frames", "R", "recency, rekv: the window of frames carried (default: %(default)s)"),
    method_size("sinks", "N", "rekv: attention-sink tokens kept after the prompt prefix (default: %(default)s)"),
    method_size("window", "N", "simplestream: each question sees the last N frames only, encoded afresh with it "
                "(default: %(default)s)"),
    Setting("retrieve", None, POSITIVE.optional, "answer from the K frames per layer that best match the question "
            "(default: the whole detailed cache; rekv: 64)", "K"),
    Setting("retrieval", None, one_of(retrieval_rule_names, lambda value, _: retrieval_rule(value)).optional,
            "how --retrieve picks the frames: attention (each frame's share of the question's attention, over the "
            "layers so far), rekv (ReKV's mean key . mean query), recent (the last K frames) (default: attention; "
            "rekv: rekv)", "RULE"),
    Setting("steer", True, BOOLEAN, "a stream's watches (standing questions) steer what it carries while they are "
            "open, under methods that carry by attention (statekv); --no-steer leaves the carried state as it would "
            "be without them"),
    Setting("layout", None, TEXT.optional,
            "prompt layout of the model family (default: the paper's; chat for the built-in model and weights "
            "trained by train-builtin)"),
    Setting("dtype", None, DTYPE.optional, "e.g. bfloat16, float32 (default: the checkpoint's)"),
    Setting("device", None, DEVICE.optional, "e.g. cuda, cuda:1, cpu (default: cuda if available)"),
)
VIDEO_SETTINGS: tuple[Setting, ...] = (  # how videos are planned and vision-encoded
    Setting("reserve_tokens", DEFAULT_RESERVE_TOKENS, POSITIVE,
            "tokens kept after the video for question and answer (default: %(default)s)", "N", offered_by="reserve"),
    Setting("trust_remote_code", False, BOOLEAN,
            "allow checkpoints that ship their own modelling code (Eagle2.5)"),
    Setting("vision_batch", None, POSITIVE.optional, "frames per vision-tower call, run ahead of the language model "
            "(default: 16 on CUDA, 4 on CPU; statekv stream: 1)", "N"),
)


def options_table(engine: tuple[Setting, ...] = ENGINE_SETTINGS) -> tuple[Setting, ...]:
    """`ModelOptions`' settings: the model and the method, the ``engine``'s settings (`ENGINE_SETTINGS`: an
    entry added there is an option everywhere), then the video's."""
    return MODEL_SETTINGS + engine + VIDEO_SETTINGS


SETTINGS = options_table()


@settings_class(SETTINGS)
class ModelOptions:
    """How to build a `VideoQA`; its fields are `SETTINGS`.

    model: checkpoint folder or hub id. method: a registered method (`statekv.settings.methods`); budget (tokens;
    None: `default_budget`, 64 for the built-in model and weights trained by `statekv train-builtin`, else 4096),
    frames (the recency window R, in frames) and
    sinks (ReKV) size it. retrieve: frames per layer each question is answered from (None: the method's default; the whole detailed cache for all but ``rekv``). retrieval: the rule
    that picks them (``attention``, ``rekv``, ``recent``; None: the method's default, ReKV's own rule for ``rekv``
    and ``attention`` for the others). layout: the family's prompt layout. dtype, device: where the model runs
    (default: the checkpoint's dtype; CUDA when available). The engine's settings (`EngineSettings`: attention,
    offload, offload_dir, max_cache_bytes, cache_limit, kv_cache_dtype, cuda_graph, compile_step, positions,
    bounded_layout, question_span); offload None is the method's default. reserve_tokens: room for the question
    and answer after the video. vision_batch: frames per vision-tower call (None: 16 on CUDA, 4 on CPU).
    """

    SETTINGS: ClassVar[tuple[Setting, ...]]
    ENGINE: ClassVar[type[EngineSettings]] = EngineSettings  # the settings class `engine` makes

    def __post_init__(self) -> None:
        engine_settings = {setting.name for setting in self.ENGINE.SETTINGS}
        engine = None
        for setting in self.SETTINGS:  # in the table's order; the engine's, once, as the engine's class checks them
            if setting.name not in engine_settings:
                setting.validate(getattr(self, setting.name))
            elif engine is None:
                engine = self.engine
        if self.budget is None:  # not given: the model's own default
            object.__setattr__(self, "budget", default_budget(self.model))
        object.__setattr__(self, "max_cache_bytes", engine.max_cache_bytes)  # "20G" as the engine reads it

    @property
    def spec(self) -> MethodSpec:
        return method(self.method)

    @property
    def settings(self) -> MethodSettings:
        return MethodSettings(**{size.name: getattr(self, size.name) for size in fields(MethodSettings)})

    @property
    def sizes(self) -> dict[str, int]:
        """The sizes the method reads, by name (``{"budget": 64}`` for StateKV, ``{}`` for full attention)."""
        return {name: getattr(self, name) for name in self.spec.uses if name in SIZES}

    @property
    def label(self) -> str:
        """The method as tables name it ("StateKV B=4096"), with the retrieval if it is not the default."""
        label = self.spec.label(self.settings)
        retrieve, rule = self.retrieve_frames, self.retrieval_rule
        if retrieve != self.spec.retrieve:
            label = f"{label} k={retrieve}"
        if retrieve is not None and rule != self.spec_retrieval:
            label = f"{label} ({rule})"
        stored = self.engine.kv_cache_dtype
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

    @property
    def engine(self) -> EngineSettings:
        """The engine's settings these options name (offload: the method's default when not given)."""
        given = {setting.name: getattr(self, setting.name) for setting in self.ENGINE.SETTINGS}
        return self.ENGINE(**{**given, "offload": self.offloaded})

    @classmethod
    def given(cls, *, flags: bool = False, **given: Any) -> "ModelOptions":
        """Options made of the settings ``given`` explicitly, refusing (one line) one that their method never reads
        (`statekv.settings.methods.refuse_unread`): what one run of one method is made from. flags: name them as
        command-line flags in messages."""
        options = cls(**given)  # every value checked first
        refuse_unread(options.method, {name: getattr(options, name) for name in given if name in READ_BY_SOME
                                       and given[name] is not None}, flags=flags)
        # an evicting cap the method's cache cannot take: refused now, not when the first stream is made
        check_cache_options(options.offload, options.offload_dir, options.max_cache_bytes, options.cache_limit,
                            flags=flags, offloaded=bool(options.offloaded), successors=True)
        return options

    def with_changes(self, **changes: Any) -> "ModelOptions":
        """These options with ``changes`` (field names) made, checked again; unknown names refused."""
        known = [field.name for field in fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ConfigurationError(f"unknown option {unknown[0]!r}; known: {', '.join(known)}")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- from text: the command line and lmms-eval's model args -------------------------------------------------
    @classmethod
    def from_strings(cls, given: Mapping[str, Any], *, what: str = "option", all_used: bool = False) -> "ModelOptions":
        """Options from ``name=value`` settings whose values may be strings (``offload=off``); unknown names
        are refused, naming the known ones. all_used: a setting given that the method never reads is refused too
        (`given`)."""
        parsed = parse_options(given, cls.string_options(), what=what)
        if all_used:
            return cls.given(**{name: value for name, value in parsed.items() if name in given})
        return cls(**parsed)

    @classmethod
    def string_options(cls) -> list[Option]:
        """How each field is read from text (see `statekv.settings.values.parse_options`)."""
        return [setting.text_option for setting in cls.SETTINGS]

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, all_used: bool = False) -> "ModelOptions":
        """Options from a namespace parsed with :meth:`add_arguments` (absent fields keep their defaults). all_used:
        a flag given that the method never reads is refused (`given`): a command that runs one method (not
        ``statekv serve``, whose flags are the defaults of streams that choose their own method)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        given = {name: value for name, value in given.items() if value is not None or name not in SIZES}
        engine = {name: given.get(name, getattr(cls, name)) for name in ("offload", "offload_dir", "max_cache_bytes",
                                                                        "cache_limit")}
        offloaded = engine["offload"] if engine["offload"] is not None else method(given.get("method", cls.method)).offload
        # on the command line, before the model loads, its problems named by their flags
        check_cache_options(**engine, flags=True, offloaded=bool(offloaded), successors=True)
        return cls.given(flags=True, **given) if all_used else cls(**given)

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
                     "offload": {"nargs": "?", "const": True},  # --offload alone: CPU memory (see normalize_argv)
                     # a size not given is None, so a size given at its default value is still told apart
                     **{size: {"default": None} for size in SIZES}}
        for setting in cls.SETTINGS:
            if setting.offered_by is None or switches[setting.offered_by]:
                setting.add_to(group, **overrides.get(setting.name, {}))
        return group

