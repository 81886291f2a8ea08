"""The engine's settings: one frozen, checked object a stream is made with, from `VideoQA` through `EncodedVideo`
to `StreamingPrefill`, recorded whole in a saved stream.

They are declared once, in `ENGINE_SETTINGS`; the option table of `statekv.settings.options` includes these
entries, so each is also a `ModelOptions` field, a command-line flag and a text option. A setting that reaches
the engine is one entry here plus the code that uses it.

    EngineSettings(offload=True, kv_cache_dtype="int8")          # checked when made (one-line ConfigurationError)
    settings.with_changes(cuda_graph=False)                       # another object, checked again
    StreamingPrefill(model, policy, settings, horizon=4096)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar


from ..errors import ConfigurationError, OutputError
from .setting import Setting, settings_class
from .values import (BOOLEAN, BYTES, NON_NEGATIVE, PATH_TEXT, TEXT, Kind, boolean, byte_size, check_choice,
                     check_int, check_output_dir, one_of, printable, too_long)

# the values the engine's settings take (the engine reads them from here)
BACKENDS = ("auto", "eager", "chunked", "triton")  # `statekv.core.attention.scored`
CACHE_LIMITS = ("refuse", "evict-oldest", "evict-least-attended")  # `statekv.core.storage.limits`
DEFAULT_CACHE_LIMIT = "refuse"
KV_CACHE_BITS = {"int8": 8, "int4": 4}  # `statekv.core.storage.quantized`
POSITIONS = ("stream", "bounded")  # `statekv.core.positions.placing`
BOUNDED_LAYOUTS = ("own-then-cache", "grouped", "cache")  # `statekv.core.positions.layouts.BOUNDED_LAYOUTS`
HANDOVER = "handover"  # a stream's engine and its successor, own-then-cache then cache (`statekv.api.handover`)
OFFLOAD_TIERS = ("disk", "memory")
# a disk-tier file set's folder under offload_dir (`statekv.core.disk.tier.DiskTier.create`: 40 characters of a
# name, a dash, 8 hex digits) and the longest name written in it (a layer buffer's description being replaced,
# `statekv.core.disk.buffers`, of a layer numbered up to 999)
FILE_SET_FOLDER, FILE_SET_LONGEST = "s" * 49, "layer999.segment_index.0.bin.json.partial"
# the longest path a stream's disk tier writes under offload_dir: in its successor's file set, inside its own
DISK_TIER_DEEPEST = f"{FILE_SET_FOLDER}/{FILE_SET_FOLDER}/{FILE_SET_LONGEST}"
OFFLOAD_DEVICE = re.compile(r"(cpu|cuda|mps)(:[0-9]+)?")  # device names offload takes (torch refuses cuda:banana)
# positions a question past the range spreads its retrieved frames over (`statekv.core.positions.placing`): the
# span of the built-in model's training videos; a model whose frames take more packs them as before
DEFAULT_QUESTION_SPAN = 384


@dataclass(frozen=True)
class CacheLimit:
    """At most ``max_bytes`` of detailed cache per stream; ``when_full`` one of `CACHE_LIMITS`."""

    max_bytes: int
    when_full: str = DEFAULT_CACHE_LIMIT

    def __post_init__(self) -> None:
        check_int(self.max_bytes, "max_cache_bytes")
        check_choice(self.when_full, "cache_limit", CACHE_LIMITS)

    @property
    def evicts(self) -> bool:
        return self.when_full != "refuse"


def check_kv_cache_dtype(value: object, name: str = "kv_cache_dtype") -> str | None:
    """``None`` or ``"auto"`` (the model's dtype: None), ``"int8"`` or ``"int4"``; a one-line ConfigurationError
    otherwise."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str) and value in KV_CACHE_BITS:  # spelt as the command line takes it
        return value
    raise ConfigurationError(f"{name} must be auto, int8 or int4, got {value!r}")


def check_positions(value: object, name: str = "positions") -> str:
    """``"stream"`` or ``"bounded"``; a one-line ConfigurationError otherwise."""
    if value not in POSITIONS:
        raise ConfigurationError(f"{name} must be stream or bounded, got {value!r}")
    return value


def is_torch_device(value: Any) -> bool:
    """Whether ``value`` is a `torch.device` (without importing torch: none can exist before it is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.device)


def check_offload(value: Any, name: str = "offload") -> Any:
    """None or False (with the model), True or ``"memory"`` (CPU memory, as ``--offload memory``), ``"disk"``, or a
    device name (``cpu``, ``cuda``, ``cuda:1``, ``mps``) or `torch.device`."""
    if value == "memory":
        return True
    if value is None or isinstance(value, bool) or is_torch_device(value) or value == "disk":
        return value
    if isinstance(value, str) and OFFLOAD_DEVICE.fullmatch(value):
        return value
    raise ConfigurationError(f"{name} must be True, False, 'memory', 'disk' or a device, got {value!r}")


def parse_offload(value: Any, name: str) -> bool | str | None:
    """``disk``, ``memory`` or a boolean (on: CPU memory), or None (the method's default) from text."""
    if isinstance(value, str) and value.strip().lower() in OFFLOAD_TIERS:
        return "disk" if value.strip().lower() == "disk" else True
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        return boolean(value, name)
    except ConfigurationError:
        raise ConfigurationError(f"{name} must be disk, memory, a boolean (on: CPU memory) or none, got "
                                 f"{value!r}") from None


def offload_argument(text: str) -> bool | str:
    """``--offload``'s value: ``memory`` (CPU memory, as the plain flag) or ``disk``."""
    if text not in OFFLOAD_TIERS:
        raise argparse.ArgumentTypeError(f"expected disk or memory, got {text!r}")
    return True if text == "memory" else text


def check_folder(value: Any, name: str) -> Any:
    """None, or a folder's path as text or a path object."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(f"{name} must be a folder's path, got {value!r}")
    return value


def check_disk_tier_room(offload_dir: str | os.PathLike, name: str, successors: bool = True) -> None:
    """A one-line `OutputError` when the system would refuse the paths of disk-tier files under ``offload_dir`` as
    too long: the deepest a stream writes, `DISK_TIER_DEEPEST`, or (``successors`` False) an engine's own file
    set's, one folder less (a stream's successor engine makes its file set inside the stream's)."""
    deepest = DISK_TIER_DEEPEST if successors else f"{FILE_SET_FOLDER}/{FILE_SET_LONGEST}"
    if (why := too_long(Path(os.path.expanduser(os.fspath(offload_dir))).absolute() / deepest)) is not None:
        raise OutputError(f"{name} {printable(offload_dir)}: too deep for the streams' file sets in it, whose files "
                          f"lie up to {len(deepest) + 1} bytes below it ({why}); give a folder of a shorter path")


def check_cache_options(offload: Any, offload_dir: Any, max_cache_bytes: Any, cache_limit: Any, *,
                        flags: bool = False, offloaded: bool | None = None, successors: bool = False) -> None:
    """Where the detailed cache goes and its cap, checked together (one-line `ConfigurationError`). flags: name
    the settings by their command-line flags (``--offload disk needs --offload-dir``), not as Python arguments.
    offloaded: whether the method's detailed cache leaves the model's device, when known before the engine is
    made (an evicting cap needs it to). successors: the disk tier's folder is the one streams are made in, their
    successors' file sets inside theirs (`check_disk_tier_room`); else an engine's own."""

    def named(name: str, value: Any = None, python: str = "") -> str:
        if not flags:
            return f"{name}{python}"
        flag = next(setting.flag for setting in ENGINE_SETTINGS if setting.name == name)
        return flag if value is None else f"{flag} {value}"

    if offload == "disk":
        if offload_dir is None:
            raise ConfigurationError(f"{named('offload', 'disk', '=' + repr('disk'))} needs {named('offload_dir')} "
                                     "(the folder for each stream's files)")
        check_output_dir(offload_dir, named("offload_dir"))
        check_disk_tier_room(offload_dir, named("offload_dir"), successors)
    elif offload_dir is not None:
        raise ConfigurationError(f"{named('offload_dir', offload_dir, '=' + repr(offload_dir))} is only used with "
                                 f"{named('offload', 'disk', '=' + repr('disk'))}")
    if max_cache_bytes is not None:
        check_int(max_cache_bytes, named("max_cache_bytes"))
    check_choice(cache_limit, named("cache_limit"), CACHE_LIMITS)
    if cache_limit != DEFAULT_CACHE_LIMIT and max_cache_bytes is None:
        raise ConfigurationError(f"{named('cache_limit', cache_limit, '=' + str(cache_limit))} needs "
                                 f"{named('max_cache_bytes')} (the cap it acts at)")
    if offloaded is False and cache_limit.startswith("evict") and max_cache_bytes is not None:
        where = f"{named('offload')} or {named('offload', 'disk')}" if flags else "offload=True or offload='disk'"
        raise ConfigurationError(f"{named('cache_limit', cache_limit, '=' + str(cache_limit))} needs the detailed "
                                 f"cache offloaded ({where}); with the model it can only refuse")


ENGINE_SETTINGS: tuple[Setting, ...] = (
    Setting("attention", "auto", one_of(lambda: BACKENDS, lambda value, _: check_choice(value, "attention backend",
                                                                                       BACKENDS)),
            "scoring backend (default: auto = triton on CUDA, chunked on CPU)"),
    Setting("offload", None, Kind("str | bool | None", check_offload, parse_offload, offload_argument),
            "keep the detailed cache in CPU memory while encoding (rekv always does); --offload disk: in a "
            "memory-mapped file set per stream under --offload-dir, only the retrieval summaries in RAM", "disk"),
    Setting("offload_dir", None, Kind("str | None", check_folder, lambda value, name: TEXT.optional.parse(value, name),
                                      PATH_TEXT),
            "with --offload disk: the folder each stream's file set is made in", "DIR"),
    Setting("max_cache_bytes", None, BYTES.optional, "a hard cap on what each stream's cache holds: its detailed "
            "cache with its scales, retrieval summaries and disk-tier journal, for the frames held (not the stats' "
            "cache_bytes, what was allocated ahead), e.g. 512M, 20G (default: none)", "SIZE"),
    Setting("cache_limit", DEFAULT_CACHE_LIMIT, one_of(lambda: CACHE_LIMITS),
            "at --max-cache-bytes: refuse further frames (default: what fit is kept and still answers), or evict "
            "the oldest or the least attended frames (evicting needs --offload or --offload disk)"),
    Setting("kv_cache_dtype", None, one_of(lambda: ("auto", *KV_CACHE_BITS),
                                           lambda value, name: check_kv_cache_dtype(value, name)).optional,
            "store the detailed cache quantized: int8 or int4 (keys per channel, values per token; the carried "
            "state stays in the model's dtype) (default: auto = the model's dtype)", "DTYPE", binding=True),
    Setting("cuda_graph", True, BOOLEAN,
            "run every streaming step eagerly (default on CUDA: replay steady steps from a graph)"),
    Setting("compile_step", False, BOOLEAN,
            "compile the decoder of steady streaming steps with torch.compile, fusing its small kernels (norms, "
            "RoPE, activations): results equal the eager step's up to rounding, not bit for bit; compiles once "
            "per step shape"),
    Setting("positions", None, one_of(lambda: POSITIONS).optional,
            "RoPE positions: stream (each token at its index in the whole stream: exactly the model's one-shot "
            "forward, for a horizon inside the model's range) or bounded (kept inside the range the model was "
            "trained on: no horizon, a stream never ends; a question reads the whole cache when it fits, else "
            "retrieved frames) (default: stream where the horizon fits, else bounded)", "P", binding=True),
    Setting("bounded_layout", None, one_of(lambda: (*BOUNDED_LAYOUTS, HANDOVER)).optional,
            "bounded positions: where the carried state sits while each frame is encoded: own-then-cache (each token "
            "at its own position while the stream fits the range, then in cache order), cache (in cache order "
            "right before each frame from the first: a stream that will run far past the range), handover "
            "(own-then-cache while the stream fits the range, each step's embeddings kept; the step that passes "
            "the range replays them in cache order, and the stream continues with that engine) or grouped "
            "(default: handover where the stream can have a successor, else own-then-cache)", "L"),
    Setting("question_span", DEFAULT_QUESTION_SPAN, NON_NEGATIVE,
            "bounded positions past the model's range: a question's retrieved frames are laid out in time order over "
            "the last N positions before the prompt, each where its time in the stream scales to (0: packed right "
            "before the prompt; frames that need more than N positions are packed) (default: %(default)s)", "N"),
)


@settings_class(ENGINE_SETTINGS)
class EngineSettings:
    """How a stream's engine runs; its fields are `ENGINE_SETTINGS`.

    attention: the scoring backend (``auto``: Triton on CUDA, else chunked). offload: where the detailed cache
    lives (None or False: with the model; True: CPU memory; ``"disk"``: a file set under ``offload_dir``; or a
    device). max_cache_bytes, cache_limit: a cap on the detailed cache and what happens at it
    (`statekv.core.storage.limits`). kv_cache_dtype: ``"int8"``/``"int4"`` to store it quantized (None or ``"auto"``:
    the model's dtype; kept as None). cuda_graph: on CUDA, replay steady steps from a graph. compile_step: run
    steady steps through the decoder compiled by ``torch.compile`` (`statekv.core.step.compiled`; equal up to
    rounding). positions: the RoPE positions tokens stream at (``"stream"``: their index in the whole stream;
    ``"bounded"``: kept inside the range the model was trained on, so a stream needs no horizon; None: ``stream``
    where the horizon fits the model's range, else ``bounded``, decided when a stream is made
    (`statekv.core.positions.placing.choose_positions`) and recorded as decided). bounded_layout: where bounded
    positions put the carried state while each step is encoded (`statekv.core.positions.layouts.BOUNDED_LAYOUTS`,
    or ``handover``, a stream's two engines, `statekv.api.handover`; None: a stream's default, ``handover``, and one
    engine's, ``own-then-cache``). question_span: under bounded
    positions past the range, the positions before the prompt a question's retrieved frames are spread over by
    their time (0: packed right before the prompt; `statekv.core.positions.placing.StreamPositions.question`).
    """

    SETTINGS: ClassVar[tuple[Setting, ...]]

    def __post_init__(self) -> None:
        for setting in self.SETTINGS:
            setting.validate(getattr(self, setting.name))
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        object.__setattr__(self, "offload", check_offload(self.offload))  # "memory" as True
        if isinstance(self.max_cache_bytes, str):  # "20G", as the command line takes it
            object.__setattr__(self, "max_cache_bytes", byte_size(self.max_cache_bytes, "max_cache_bytes"))
        check_cache_options(self.offload, self.offload_dir, self.max_cache_bytes, self.cache_limit)

    @classmethod
    def of(cls, settings: "EngineSettings | None" = None, **changes: Any) -> "EngineSettings":
        """``settings`` (default: every default) with ``changes`` (field names) made; unknown names refused."""
        base = cls() if settings is None else settings
        if not isinstance(base, EngineSettings):
            raise ConfigurationError(f"settings must be EngineSettings, got {type(base).__name__}")
        return base.with_changes(**changes) if changes else base

    def with_changes(self, **changes: Any) -> "EngineSettings":
        known = {field.name for field in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigurationError(f"unknown engine setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return replace(self, **changes)

    @property
    def cache_cap(self) -> CacheLimit | None:
        """The cap on the detailed cache (None: none)."""
        return None if self.max_cache_bytes is None else CacheLimit(self.max_cache_bytes, self.cache_limit)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as JSON-able values (what a saved stream records)."""
        recorded = {}
        for field in fields(self):
            value = getattr(self, field.name)
            recorded[field.name] = str(value) if isinstance(value, os.PathLike) or is_torch_device(value) else value
        return recorded

    def refusal(self, recorded: dict[str, Any], where: str) -> str | None:
        """Why a stream recorded with the settings ``recorded`` cannot go on under these (a binding setting
        differs), or None."""
        for setting in self.SETTINGS:
            if not setting.binding:
                continue
            saved, current = recorded.get(setting.name, setting.default), getattr(self, setting.name)
            if setting.name == "positions":  # None: as the stream was made; saved before it was recorded: stream
                saved, current = saved or "stream", current or saved or "stream"
            if saved != current:
                return (f"{where}: saved with {setting.name}={_shown(saved)}, but it is being loaded as "
                        f"{_shown(current)}; load it with {setting.name}={_shown(saved)} ({setting.flag} "
                        f"{_shown(saved)} on the command line)")
        return None


def _shown(value: Any) -> str:
    return "auto" if value is None else str(value)
