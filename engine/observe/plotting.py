"""Figures through matplotlib's object API (``Figure``), never pyplot: no global backend,
no figure registry, so a library may draw in any thread and leave the process as it was.
Shared by the run report (:mod:`engine.observe.run_report`) and the benchmarks' pictures. Needs the
``report`` extra (matplotlib); import it only after :func:`engine.common.extras.require`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

__all__ = ["color", "new_figure", "save"]

_PALETTE = matplotlib.colormaps["tab10"]


def color(index: int) -> Any:
    """The ``index``-th colour of a ten-colour cycle (run, configuration, step...)."""
    return _PALETTE(index % 10)


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height))


def save(fig: Figure, path: Path, dpi: int = 110) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
