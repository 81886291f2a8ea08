"""Installing trained weights as the built-in model (the package's ``statekv/builtin/weights`` folder)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import ConfigurationError
from . import WEIGHTS_DIR

MAX_WEIGHT_BYTES = 20 * 2**20  # the built-in model ships with the package: keep it small
_SKIPPED = {"training_args.bin"}


def install_weights(model_dir: Path | str, target: Path = WEIGHTS_DIR) -> Path:
    """Replace ``target``'s checkpoint with the one in ``model_dir`` (a ``save_pretrained`` folder)."""
    model_dir = Path(model_dir)
    weights = model_dir / "model.safetensors"
    if not (model_dir / "config.json").is_file() or not weights.is_file():
        raise ConfigurationError(f"{model_dir} holds no trained checkpoint (config.json, model.safetensors)")
    if weights.stat().st_size > MAX_WEIGHT_BYTES:
        raise ConfigurationError(f"{weights} is {weights.stat().st_size / 2**20:.1f} MiB; the built-in model must "
                                 f"stay under {MAX_WEIGHT_BYTES // 2**20} MiB")
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():
        if old.is_file() and old.name != "__init__.py":
            old.unlink()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name not in _SKIPPED:
            shutil.copy2(path, target / path.name)
    return target
