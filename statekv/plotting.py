"""matplotlib, imported on first use with the file-only Agg backend (plots are written, never shown)."""

from __future__ import annotations

from .errors import ConfigurationError


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend; a one-line error naming the extra when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError("plotting needs matplotlib: pip install 'statekv[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
