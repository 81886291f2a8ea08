"""matplotlib, imported on first use with the file-only Agg backend (plots are written, never shown); a plot's
file checked before the work that draws it (`check_plot_file`) and written as named (`save_figure`)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, OutputError
from .flushing import write_whole

NEEDS_LATEX = {"pgf"}  # matplotlib writes it only through a LaTeX installation


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend; a one-line error naming the extra when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError("plotting needs matplotlib: pip install 'statekv[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_file(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a `Path` if a plot can be written there: matplotlib is installed, and the path is a file
    (`check_output_file`) of a kind matplotlib writes by itself, by its extension (none: a PNG); else a one-line
    error (``name``: the flag, for the message)."""
    from .settings.values import check_output_file

    path = check_output_file(path, name)
    pyplot()  # one line if matplotlib is missing
    from matplotlib.backend_bases import FigureCanvasBase

    kind = path.suffix[1:].lower()
    if kind and (kind not in FigureCanvasBase.get_supported_filetypes() or kind in NEEDS_LATEX):
        raise OutputError(f"{name} {path}: statekv writes no .{kind} plots; give a .png, .svg or .pdf file")
    return path


def save_figure(figure: Any, path: str | os.PathLike, dpi: int) -> Path:
    """Write ``figure`` to ``path`` as it is named (matplotlib would add ``.png`` to a name without an extension),
    its folders made, whole or not at all: a file there before is kept as it was when the new one cannot be written
    (a full disk), and a one-line `OutputError` says why. Returns ``path``."""
    path = Path(path)
    drawn = io.BytesIO()
    figure.savefig(drawn, dpi=dpi, format=path.suffix[1:].lower() or "png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, drawn.getvalue())
    except OSError as error:
        raise OutputError(f"cannot write the plot {path} ({error.strerror or error})") from None
    return path
