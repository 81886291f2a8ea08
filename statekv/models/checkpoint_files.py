"""Reading the small files beside a checkpoint's weights (preprocessing settings, chat templates)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers.utils import cached_file

from ..errors import InputError


def checkpoint_json(path: str | Path, *names: str) -> dict[str, Any] | None:
    """The first of ``names`` (e.g. ``preprocessor_config.json``) found in a checkpoint folder or hub repo,
    parsed; ``None`` when it has none of them."""
    for name in names:
        found = cached_file(str(path), name, _raise_exceptions_for_missing_entries=False)
        if found is None:
            continue
        try:
            return json.loads(Path(found).read_text())
        except json.JSONDecodeError as error:
            raise InputError(f"{path}: {name} is not valid JSON ({error})") from None
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(folder: str | Path) -> bool:
    """Whether a checkpoint folder holds a tokenizer (without one, transformers builds an empty one)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def normalisation(path: str | Path, default: tuple[Sequence[float], Sequence[float]]
                  ) -> tuple[Sequence[float], Sequence[float]]:
    """Image mean and std from ``preprocessor_config.json``, else ``default``."""
    config = checkpoint_json(path, "preprocessor_config.json") or {}
    return config.get("image_mean", default[0]), config.get("image_std", default[1])


def processor_chat_template(path: str | Path) -> str | None:
    """The chat template a processor ships apart from the tokenizer (``chat_template.jinja`` / ``.json``)."""
    found = cached_file(str(path), "chat_template.jinja", _raise_exceptions_for_missing_entries=False)
    if found is not None:
        return Path(found).read_text()
    config = checkpoint_json(path, "chat_template.json")
    return None if config is None else config["chat_template"]


def square_side(image_size: int | Sequence[int]) -> int:
    """The side of a square vision input given as ``448`` or ``[448, 448]``."""
    if isinstance(image_size, int):
        return image_size
    height, width = image_size
    if height != width:
        raise InputError(f"this vision tower takes square frames, but its config says {height}x{width}")
    return int(height)
