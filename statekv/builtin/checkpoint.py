"""Writing the built-in model as an ordinary transformers checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from ..settings.options import BUILTIN_RECIPE_FILE
from ..video import IMAGENET_MEAN, IMAGENET_STD
from .architecture import IMAGE_SIZE, generation_config


def save_checkpoint(model, tokenizer, path: str | Path, *, recipe: dict[str, Any] | None = None) -> Path:
    """Save ``model`` (safetensors), its config, generation config, tokenizer and image processor config to
    ``path``, loadable with ``from_pretrained``; ``recipe`` is kept beside them as `BUILTIN_RECIPE_FILE`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GotOcr2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=IMAGENET_MEAN,
                             image_std=IMAGENET_STD, crop_to_patches=False).save_pretrained(path)
    if recipe is not None:
        (path / BUILTIN_RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n", encoding="utf-8")
    return path
