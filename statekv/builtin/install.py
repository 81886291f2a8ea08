"""Installing trained weights as the built-in model (the package's ``statekv/builtin/weights`` folder)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..errors import ConfigurationError, OutputError
from ..flushing import flush_file
from . import WEIGHTS_DIR

MAX_WEIGHT_BYTES = 20 * 2**20  # the built-in model ships with the package: keep it small
_SKIPPED = {"training_args.bin"}


def install_weights(model_dir: Path | str, target: Path = WEIGHTS_DIR) -> Path:
    """Replace ``target``'s checkpoint with the one in ``model_dir`` (a ``save_pretrained`` folder). Every file is
    copied beside the old ones before any is replaced, so a copy that fails (a full disk, a folder not writable)
    leaves the installed model as it was; a one-line `OutputError` says why."""
    model_dir = Path(model_dir)
    weights = model_dir / "model.safetensors"
    if not (model_dir / "config.json").is_file() or not weights.is_file():
        raise ConfigurationError(f"{model_dir} holds no trained checkpoint (config.json, model.safetensors)")
    if weights.stat().st_size > MAX_WEIGHT_BYTES:
        raise ConfigurationError(f"{weights} is {weights.stat().st_size / 2**20:.1f} MiB; the built-in model must "
                                 f"stay under {MAX_WEIGHT_BYTES // 2**20} MiB")
    files = [path for path in sorted(model_dir.iterdir()) if path.is_file() and path.name not in _SKIPPED]
    try:
        copies = _copied_beside(files, target)
    except OSError as error:
        raise OutputError(f"cannot install the weights in {target} ({error.strerror or error}); the model "
                          "installed there is as it was") from None
    try:
        for old in target.iterdir():
            if old.is_file() and old.name != "__init__.py" and old.name not in copies and old not in copies.values():
                old.unlink()
        for name, copy in copies.items():
            os.replace(copy, target / name)
    except OSError as error:
        raise OutputError(f"cannot install the weights in {target} ({error.strerror or error})") from None
    return target


def _copied_beside(files: list[Path], target: Path) -> dict[str, Path]:
    """Each of ``files`` copied and flushed into ``target`` under a name of its own, by its name; none is left
    when one cannot be."""
    copies: dict[str, Path] = {}
    try:
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            copies[path.name] = target / f"{path.name}.partial"
            shutil.copy2(path, copies[path.name])
            flush_file(copies[path.name])
    except BaseException:
        for copy in copies.values():
            with contextlib.suppress(OSError):
                copy.unlink(missing_ok=True)
        raise
    return copies
