"""The built-in model: a small InternVL3 (``-hf``) trained here on synthetic long videos, shipped with statekv.

``--model builtin`` on the command line or ``VideoQA.from_pretrained("builtin")`` load it (through
transformers' ``from_pretrained``, from the package folder `WEIGHTS_DIR`) with the prompt layout it was
trained on (InternVL's ``chat`` layout): `resolve_model` turns the name into that folder and layout. Its architecture and
tokenizer are in `statekv.builtin.architecture`, its training in `statekv.builtin.training`
(``statekv train-builtin``), and its accuracy in ``docs/accuracy.md``.

Whether a name given as ``--model`` means the built-in model, and its default budget, are the options'
(`statekv.settings.options.is_builtin`, ``BUILTIN_BUDGET``). Weights trained by ``statekv train-builtin`` load from
their folder with the same layout and budget (`statekv.settings.options.is_builtin_kind`: the folder holds the
training recipe).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MissingFileError
from ..settings.options import is_builtin, is_builtin_kind

BUILTIN_LAYOUT = "chat"
WEIGHTS_DIR = Path(__file__).resolve().with_name("weights")


class MissingWeightsError(MissingFileError):
    """The built-in weights are not in the installed package."""


def builtin_checkpoint() -> Path:
    """The folder holding the built-in checkpoint (config, safetensors weights, tokenizer)."""
    if not (WEIGHTS_DIR / "config.json").is_file():
        raise MissingWeightsError(f"the built-in model's weights are missing from {WEIGHTS_DIR}; reinstall statekv "
                                  "or train them with `statekv train-builtin --install`")
    return WEIGHTS_DIR


def resolve_model(model: str | Path, layout: str | None) -> tuple[str | Path, str | None]:
    """``(checkpoint, layout)`` to load for ``model`` and ``layout`` as given: the shipped folder and its
    trained layout (unless one is given) for the built-in model's name (`is_builtin`; a local folder named
    ``builtin`` is ``./builtin``); a folder `statekv train-builtin` wrote with that layout too (unless one is
    given); anything else unchanged."""
    if not is_builtin(model):
        return model, BUILTIN_LAYOUT if layout is None and is_builtin_kind(model) else layout
    return builtin_checkpoint(), BUILTIN_LAYOUT if layout is None else layout
