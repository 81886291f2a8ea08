"""Writing the built-in model as an ordinary transformers checkpoint folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from ..console import one_line
from ..errors import OutputError
from ..flushing import flush_file
from ..settings.options import BUILTIN_RECIPE_FILE
from ..video import IMAGENET_MEAN, IMAGENET_STD
from .architecture import IMAGE_SIZE, generation_config


def save_checkpoint(model, tokenizer, path: str | Path, *, recipe: dict[str, Any] | None = None) -> Path:
    """Save ``model`` (safetensors), its config, generation config, tokenizer and image processor config to
    ``path``, loadable with ``from_pretrained``; ``recipe`` is kept beside them as `BUILTIN_RECIPE_FILE`. Written
    whole: into ``<name>.partial`` beside it, then put in the place of a folder there before, so a stop or a full
    disk midway leaves no folder of that name without its weights; a one-line `OutputError` when it cannot be."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)  # what a stop left
        _write(model, tokenizer, partial, recipe)
        if path.is_dir():
            shutil.rmtree(path)
        os.replace(partial, path)
    except (OSError, SafetensorError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise OutputError(f"cannot write the checkpoint {path} ({one_line(error)[:200]})") from None
    return path


def _write(model, tokenizer, path: Path, recipe: dict[str, Any] | None) -> None:
    path.mkdir(parents=True)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GotOcr2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=IMAGENET_MEAN,
                             image_std=IMAGENET_STD, crop_to_patches=False).save_pretrained(path)
    if recipe is not None:
        (path / BUILTIN_RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n", encoding="utf-8")
    for written in path.iterdir():
        if written.is_file():
            flush_file(written)
