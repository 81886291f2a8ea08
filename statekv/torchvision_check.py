"""Name a torchvision that cannot load under the installed torch, before transformers hides why.

transformers imports torchvision whenever it is installed. A torchvision built for another torch (PyPI's
CUDA wheel beside a CPU torch, or one pinned to another torch version, as ``pip install lmms-eval`` brings)
fails with ``operator torchvision::nms does not exist``, which transformers then reports as an import error
of its own names (``Could not import module 'AttentionInterface'``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys


def check_torchvision() -> None:
    """Raise ImportError with the cause and the fix when torchvision is installed but cannot be imported."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # RuntimeError from its compiled operators, or an ImportError
        import torch

        raise ImportError(
            f"torchvision is installed but does not load with torch {torch.__version__} ({error}); install the "
            "torchvision build made for this torch, or `pip uninstall torchvision` (statekv needs it only for "
            "transformers' Qwen3-VL video processor)"
        ) from None


class _BeforeTransformers(importlib.abc.MetaPathFinder):
    """Checks torchvision as transformers is first imported, then leaves the import to the other finders."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            check_torchvision()
        return None


def check_before_transformers() -> None:
    """Run `check_torchvision` just before transformers is first imported (at once if it already is), so that
    importing statekv alone loads neither torchvision nor torch."""
    if "transformers" in sys.modules:
        check_torchvision()
    elif not any(isinstance(finder, _BeforeTransformers) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTransformers())
