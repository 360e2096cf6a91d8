"""The run report: ``report.png`` (the panels a run's own metrics fill:
:mod:`engine.observe.report_panels`) and a self-contained ``report.html``, for one run
or several overlaid; a finished run draws its own (:func:`finished_run_report`).
``python -m engine.report`` is the command (docs/run-directory.md lists the panels).
Needs the ``report`` extra (matplotlib).
"""

from __future__ import annotations

import base64
import html
import statistics
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from engine.common.extras import require
from engine.errors import ConfigError
from engine.observe.headline import headline_figures
from engine.observe.report_panels import components, draw_panels
from engine.observe.run_data import RunData, load_run
from engine.observe.tokens import tokens_summary, totals_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_SMOOTHING",
    "REPORT_HTML",
    "REPORT_PNG",
    "draw_report",
    "finished_run_report",
    "load_runs",
    "plot_report",
    "smooth",
    "write_report",
    "write_runs",
]

REPORT_PNG = "report.png"
REPORT_HTML = "report.html"
DEFAULT_SMOOTHING = 0.6


def smooth(values: Sequence[float | None], weight: float) -> list[float | None]:
    """TensorBoard's smoothing: an exponential moving average with weight ``weight``
    (0: none) and its start-up bias removed; missing values stay missing and are skipped."""
    out: list[float | None] = []
    average, debias = 0.0, 0.0
    for value in values:
        if value is None:
            out.append(None)
            continue
        average = weight * average + (1 - weight) * value
        debias = weight * debias + (1 - weight)
        out.append(average / debias)
    return out


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [d.name for d in run_dirs]
    return [str(d) if names.count(d.name) > 1 else d.name for d in run_dirs]


def plot_report(runs: Sequence[RunData], path: Path, smoothing: float = DEFAULT_SMOOTHING) -> Path:
    """The picture of ``runs`` (one colour per run) as a PNG at ``path``."""
    require("report", "the report picture")
    from engine.observe.plotting import save

    return save(draw_report(runs, smoothing), path)


def draw_report(runs: Sequence[RunData], smoothing: float = DEFAULT_SMOOTHING) -> Figure:
    """The figure of :func:`plot_report`: the panels of :mod:`engine.observe.report_panels`
    that the runs' metrics fill (each axes' gid names its panel, the reward first), with
    each run's name and settings (:attr:`RunData.settings`), and why a run trained
    nothing, as its title."""
    if len(runs) == 1:
        lines = [runs[0].label, runs[0].settings]
    else:
        lines = [f"{run.label}: {run.settings}" if run.settings else run.label for run in runs]
    for run in runs:
        reason = run.trained_nothing
        if reason is not None:
            lines.append(f"{run.label} trained nothing: {reason}")
    return draw_panels(
        runs,
        lambda values: smooth(values, smoothing),
        "\n".join(line for line in lines if line),
        smoothed=f"smoothed (weight {smoothing:g})",
    )


def _table(runs: Sequence[RunData]) -> str:
    head = (
        "run",
        "settings",
        "status",
        "steps",
        "reward first / last / best",
        "objective, first -> last",
        "components, mean of the last 5 steps",
        "held-out reward first / last",
        "median step (s)",
        "tokens billed",
        "final sampler",
    )
    rows = []
    for run in runs:
        rewards = [v for v in run.series("avg_reward")[1] if v is not None]
        times = [v for v in run.series("time/step")[1] if v is not None]
        held_out = [v for v in run.eval_series("eval/reward/total")[1] if v is not None]
        summary = run.summary or {}
        cells = (
            str(run.run_dir),
            run.settings or "n/a",
            str(summary.get("status", "n/a"))
            + (f"; trained nothing: {run.trained_nothing}" if run.trained_nothing else ""),
            str(len(run.steps)),
            f"{rewards[0]:.3f} / {rewards[-1]:.3f} / {max(rewards):.3f}" if rewards else "n/a",
            "; ".join(f.line for f in headline_figures(run.steps, run.evals)) or "n/a",
            _component_means(run),
            f"{held_out[0]:.3f} / {held_out[-1]:.3f}" if held_out else "n/a",
            f"{statistics.median(times):.2f}" if times else "n/a",
            totals_text(tokens)
            if (tokens := tokens_summary(run.steps[-1] if run.steps else {}))
            else "n/a",
            str(summary.get("final_path") or "not saved"),
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def _component_means(run: RunData) -> str:
    means = []
    for name in components([run]):
        values = [v for v in run.series(f"env/all/{name}")[1][-5:] if v is not None]
        if values:
            means.append(f"{name} {statistics.mean(values):.3f}")
    return ", ".join(means) or "n/a"


def write_html(runs: Sequence[RunData], png: Path, path: Path) -> Path:
    """A single file: the runs' table and the picture inlined as a data URL."""
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    title = "engine report: " + ", ".join(run.label for run in runs)
    path.write_text(
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}img{max-width:100%}"
        f"</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>written {datetime.now().isoformat(timespec='seconds')}</p>{_table(runs)}"
        f"<p><img alt='report' src='data:image/png;base64,{image}'></p></body></html>\n",
        encoding="utf-8",
    )
    return path


def write_report(
    run_dirs: Sequence[Path], out_dir: Path, smoothing: float = DEFAULT_SMOOTHING
) -> tuple[Path, Path]:
    """report.png and report.html of ``run_dirs`` in ``out_dir``."""
    return write_runs(load_runs(run_dirs), out_dir, smoothing)


def load_runs(run_dirs: Sequence[Path]) -> list[RunData]:
    require("report", "the report picture")
    return [load_run(d, label) for d, label in zip(run_dirs, _labels(run_dirs), strict=True)]


def write_runs(runs: Sequence[RunData], out_dir: Path, smoothing: float) -> tuple[Path, Path]:
    png = plot_report(runs, out_dir / REPORT_PNG, smoothing)
    return png, write_html(runs, png, out_dir / REPORT_HTML)


def finished_run_report(run_dir: Path) -> str | None:
    """Draw a finished run's report.png (and report.html). Returns None when drawn,
    else the one line that says why not and how to get it (never raises: the run is
    done, a picture must not fail it)."""
    later = f"python -m engine.report {run_dir}"
    try:
        write_report([run_dir], run_dir)
    except ConfigError as exc:
        return f"No {REPORT_PNG}: {exc}; then: {later}"
    except Exception as exc:
        return f"No {REPORT_PNG}: drawing failed ({exc!r}); retry with: {later}"
    return None
