"""Deprecated: the tiny checkpoints and test videos moved to `statekv.testing`; this alias will be removed."""

from __future__ import annotations

import warnings

from statekv.testing import *  # noqa: F401,F403
from statekv.testing import __all__  # noqa: F401
from statekv.testing.checkpoints import TinyEagleConfig, TinyEagleForConditionalGeneration  # noqa: F401

warnings.warn("statekv.tiny is deprecated: import statekv.testing instead", DeprecationWarning, stacklevel=2)
