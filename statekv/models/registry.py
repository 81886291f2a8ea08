"""Which adapter serves a checkpoint: looked up by the ``model_type`` of its config."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import PretrainedConfig

from ..errors import InputError, StateKVError, UnsupportedModelError
from ..settings.options import BUILTIN_NAME
from ..settings.values import printable, too_long
from .base import VideoAdapter
from .checkpoint_files import TOKENIZER_FILES, has_tokenizer

_ADAPTERS: dict[str, type[VideoAdapter]] = {}


def register_adapter(adapter: type[VideoAdapter]) -> type[VideoAdapter]:
    """Class decorator: serve every ``adapter.model_types`` with ``adapter``."""
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter
    return adapter


def supported_model_types() -> dict[str, str]:
    """``{model_type: family}`` for every registered adapter."""
    return {model_type: adapter.family for model_type, adapter in sorted(_ADAPTERS.items())}


def adapter_for(model_type: str) -> type[VideoAdapter]:
    """The adapter class for ``model_type``; a one-line error listing the supported families otherwise."""
    try:
        return _ADAPTERS[model_type]
    except KeyError:
        families = sorted({adapter.family for adapter in _ADAPTERS.values()})
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported families: {', '.join(families)} "
            f"(model types {', '.join(sorted(_ADAPTERS))})"
        ) from None


def checkpoint_model_type(path: str | Path) -> str:
    """``model_type`` from a checkpoint's ``config.json`` (local folder or hub id), without running its code."""
    if (why := too_long(path)) is not None:  # else a bare OSError at the first look
        raise InputError(f"{printable(path)}: {why}")
    if isinstance(path, Path) or Path(str(path)).exists() or _looks_like_a_path(str(path)):
        if not Path(path).exists():
            raise InputError(f"{path}: no such checkpoint folder")
        if not Path(path).is_dir():
            raise InputError(f"{path}: a checkpoint must be a folder (or a hub id), not a file")
        if not (Path(path) / "config.json").exists():
            raise InputError(f"{path}: no config.json; not a transformers checkpoint folder")
    elif _close_to_builtin(str(path)):  # before the hub is asked (and retried) for a name meant as builtin
        raise InputError(f"no model {path!r} here; did you mean {BUILTIN_NAME} (the built-in model)?")
    try:
        config, _ = PretrainedConfig.get_config_dict(str(path))
    except (OSError, ValueError) as error:
        why = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        offline = "connect" in why.lower() or "offline" in why.lower()
        hint = ("; without the hub, give a checkpoint folder or --model builtin (HF_HUB_OFFLINE=1 reads the hub's "
                "local cache at once, without retrying)" if offline else "")
        raise InputError(f"cannot read the config of {path}: {why}{hint}") from None
    if "model_type" not in config:
        raise UnsupportedModelError(f"{path}: its config.json names no model_type")
    return config["model_type"]


def load_adapter(path: str | Path, **kwargs) -> VideoAdapter:
    """Load ``path`` with the adapter its ``model_type`` calls for (keyword arguments: see ``from_pretrained``)."""
    adapter = adapter_for(checkpoint_model_type(path))
    if adapter.needs_remote_code and not kwargs.get("trust_remote_code", False):
        raise UnsupportedModelError(
            f"{path} ships its own modelling code ({adapter.family}); pass trust_remote_code=True "
            "(--trust-remote-code) if you trust it"
        )
    try:
        if Path(path).is_dir() and not has_tokenizer(path):  # a hub id's files may be out of reach, not missing
            raise InputError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); cannot lay out a prompt")
        return adapter.from_pretrained(path, **kwargs)
    except StateKVError:
        raise
    except StrictDataclassError as error:
        why = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise InputError(f"cannot load {path}: its config.json is malformed: {why}") from None
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise InputError(f"cannot load {path}: its weights do not have the shapes its config.json describes") from None
    except (OSError, json.JSONDecodeError, SafetensorError) as error:  # missing, unreadable or corrupt files
        raise InputError(f"cannot load {path}: {str(error).strip().splitlines()[0]}") from None


def _looks_like_a_path(name: str) -> bool:
    """Hub ids are ``name`` or ``owner/name``; anything else is meant as a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _close_to_builtin(name: str) -> bool:
    """Whether ``name`` (no local folder) reads as a misspelt ``builtin``: no hub id is that close to it."""
    return "/" not in name and difflib.SequenceMatcher(None, name.lower(), BUILTIN_NAME).ratio() >= 0.75
