"""Plot outputs: matplotlib on demand (Agg) and the check of a --plot path, light enough to run
before torch or a model loads."""

from __future__ import annotations

from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.fileio import check_output_path


def require_matplotlib():
    """The pyplot module (Agg backend); KvtoolError with the install command when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise KvtoolError(f'--plot needs matplotlib ({exc}): install it with pip install -e ".[plots]"') from exc
    return plt


def check_plot_path(path: str | Path) -> Path:
    """Fail before any work unless ``path`` is a writable file path ending in .png."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise KvtoolError(f"--plot writes a PNG image: give a path ending in .png, not '{path}'")
    require_matplotlib()
    return check_output_path(path)
