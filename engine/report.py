"""``python -m engine.report RUN_DIR [RUN_DIR ...]``: a picture of one run, or several
overlaid, from their ``metrics.jsonl``.

Writes ``report.png`` (six panels: reward and exact rate, raw and smoothed; median step
time by stage; staleness; KL between sampler and trainer; throughput; and, when a run
has ``eval.jsonl`` from ``--eval-every``, a row of held-out panels: greedy mean reward
and the rate of each reward component by step, step 0 included) and a self-contained
``report.html`` (the picture embedded, a table per run). One run: into
its own directory; several: into ``--out`` (default ``reports/<timestamp>``). A finished
run draws its own ``report.png`` (:func:`finished_run_report`).

Needs the ``report`` extra (matplotlib); without it the command says how to install it
(exit 2). Damaged lines of metrics.jsonl / eval.jsonl are skipped with a warning that
names them. Exit codes: 0 written; 1 written from the readable lines (some were
damaged); 2 bad arguments, a directory without steps, or no matplotlib.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.common.cli import OneLineErrorParser, add_version_flag, program_name
from engine.common.extras import require
from engine.errors import ConfigError
from engine.loop.evaluation import EVAL_FILE
from engine.rundir.steplog import StepLines, read_step_lines

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "REPORT_HTML",
    "REPORT_PNG",
    "RunData",
    "draw_report",
    "finished_run_report",
    "load_run",
    "main",
    "plot_report",
    "smooth",
    "write_report",
]

REPORT_PNG = "report.png"
REPORT_HTML = "report.html"
DEFAULT_SMOOTHING = 0.6
STAGES: dict[str, str] = {  # time/<stage> metric -> axis label
    "sample": "sample",
    "score": "score",
    "train": "train",
    "wait": "trainer\nwaits",
    "step": "whole\nstep",
}


@dataclass(frozen=True)
class RunData:
    label: str
    run_dir: Path
    steps: list[dict[str, Any]]
    summary: dict[str, Any] | None
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The held-out evaluations (``eval.jsonl``), step 0 first; empty without one."""
    warnings: list[str] = field(default_factory=list)
    """One line per file whose damaged lines were skipped."""

    def series(self, name: str) -> tuple[list[int], list[float | None]]:
        """(step numbers, values) of one metric; None where a step lacks it."""
        return _series(self.steps, name)

    def eval_series(self, name: str) -> tuple[list[int], list[float | None]]:
        """(step numbers, values) of one ``eval/*`` metric, one point per evaluation."""
        return _series(self.evals, name)

    def eval_rates(self) -> list[str]:
        """The ``eval/<component>/rate`` metrics of the run's evaluations."""
        return sorted({k for e in self.evals for k in e if k.endswith("/rate")})

    def has(self, name: str) -> bool:
        return any(_number(m.get(name)) is not None for m in self.steps)


def _series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float | None]]:
    return [int(m["step"]) for m in records], [_number(m.get(name)) for m in records]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def load_run(run_dir: Path, label: str | None = None) -> RunData:
    """The steps (and held-out evaluations, if any) of a run directory (ConfigError, one
    line, when it has no steps). Damaged lines are skipped and listed in
    :attr:`RunData.warnings`."""
    path = run_dir / "metrics.jsonl"
    try:
        read = read_step_lines(path)
    except OSError as exc:
        raise ConfigError(
            f"{run_dir} is not a run directory: cannot read {path.name} ({exc.strerror or exc})"
        ) from exc
    if not read.records:
        damage = f" ({len(read.damaged)} damaged line(s))" if read.damaged else ""
        raise ConfigError(f"{path} holds no steps yet{damage}")
    warnings = [read.warning()]
    try:
        evals = read_step_lines(run_dir / EVAL_FILE)
        warnings.append(evals.warning())
    except OSError:
        evals = StepLines(run_dir / EVAL_FILE)  # a run without --eval-every
    summary: dict[str, Any] | None = None
    try:
        loaded = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        summary = loaded if isinstance(loaded, dict) else None
    except (OSError, ValueError, RecursionError):
        pass
    return RunData(
        label or run_dir.name,
        run_dir,
        read.records,
        summary,
        evals.records,
        [w for w in warnings if w is not None],
    )


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
    """The figure of :func:`plot_report`; its first axes hold the reward curves, two
    lines per run (raw, smoothed), in the order of ``runs``; when a run has held-out
    evaluations, two more axes follow the six: held-out reward, held-out rates."""
    from engine.observe.plotting import color, new_figure

    evaluated = [run for run in runs if run.evals]
    fig = new_figure(15, 12.5 if evaluated else 8.5)
    grid = fig.add_gridspec(3 if evaluated else 2, 3)
    axes: list[Any] = [fig.add_subplot(grid[row, col]) for row in range(2) for col in range(3)]
    ax_reward, ax_exact, ax_time, ax_stale, ax_kl, ax_rate = axes

    def curve(ax: Any, i: int, run: RunData, name: str, scale: float = 1.0) -> None:
        steps, values = run.series(name)
        scaled = [None if v is None else v * scale for v in values]
        ax.plot(steps, scaled, color=color(i), alpha=0.3, lw=1)
        ax.plot(steps, smooth(scaled, smoothing), color=color(i), lw=2, label=run.label)

    for i, run in enumerate(runs):
        curve(ax_reward, i, run, "avg_reward")
        if run.has("exact_rate"):
            curve(ax_exact, i, run, "exact_rate", 100.0)
        curve(ax_rate, i, run, "throughput/samples_per_s")
        steps, stale = run.series("off_policy/staleness")
        ax_stale.step(steps, stale, where="mid", color=color(i), lw=2, label=run.label)
        for name, style in (("optim/kl_sample_train_v1", "-"), ("optim/kl_sample_train_v2", "--")):
            steps, kl = run.series(name)
            ax_kl.plot(steps, kl, style, color=color(i), lw=1.2, marker=".", ms=3)
    _stage_bars(ax_time, runs, color)

    smoothed = f"smoothed {smoothing:g}" if smoothing else "raw"
    ax_reward.set_title(f"mean reward per step (faint: raw, bold: {smoothed})")
    ax_exact.set_title("exact answers, % of samples")
    if not any(run.has("exact_rate") for run in runs):
        ax_exact.text(
            0.5, 0.5, "the task reports no exact_rate", ha="center", transform=ax_exact.transAxes
        )
    ax_stale.set_title("off-policy staleness (steps behind the trainer)")
    ax_stale.yaxis.get_major_locator().set_params(integer=True)
    most_stale = max(
        (v or 0 for run in runs for v in run.series("off_policy/staleness")[1]), default=0
    )
    ax_stale.set_ylim(-0.3, max(1.0, most_stale) + 0.3)
    ax_kl.set_title("KL(sampler || trainer): v1 solid, v2 dashed")
    ax_kl.axhline(0.0, color="grey", lw=0.6)
    ax_rate.set_title("throughput, samples per second")
    for ax in (ax_reward, ax_exact, ax_stale, ax_kl, ax_rate):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_reward.legend(fontsize=8)
    if evaluated:
        _eval_panels(fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1:]), runs, color)
    fig.suptitle(", ".join(run.label for run in runs), fontsize=11)
    fig.tight_layout()
    return fig


def _eval_panels(ax_reward: Any, ax_rates: Any, runs: Sequence[RunData], color: Any) -> None:
    """The held-out evaluations: greedy mean reward, and each component's rate (one line
    style per component), one point per evaluation, one colour per run."""
    styles = ("-", "--", ":", "-.")
    rates = sorted({name for run in runs for name in run.eval_rates()})
    for i, run in enumerate(runs):
        if not run.evals:
            continue
        steps, values = run.eval_series("eval/reward/total")
        ax_reward.plot(steps, values, color=color(i), lw=2, marker="o", ms=4, label=run.label)
        for j, name in enumerate(rates):
            steps, values = run.eval_series(name)
            ax_rates.plot(
                steps,
                [None if v is None else v * 100.0 for v in values],
                styles[j % len(styles)],
                color=color(i),
                lw=2,
                marker="o",
                ms=4,
                label=f"{run.label}: {name.removeprefix('eval/').removesuffix('/rate')}",
            )
    ax_reward.set_title("held-out mean reward (greedy)")
    ax_rates.set_title("held-out rates, % of problems with the component > 0 (greedy)")
    for ax in (ax_reward, ax_rates):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if rates:
        ax_rates.legend(fontsize=8)


def _stage_bars(ax: Any, runs: Sequence[RunData], color: Any) -> None:
    """Median seconds per step in each stage, one bar per run: the stages overlap when
    sampling runs ahead, so they are side by side, not stacked."""
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        medians = []
        for stage in STAGES:
            values = [v for v in run.series(f"time/{stage}")[1] if v is not None]
            medians.append(statistics.median(values) if values else 0.0)
        xs = [x + (i - (len(runs) - 1) / 2) * width for x in range(len(STAGES))]
        bars = ax.bar(xs, medians, width, color=color(i), label=run.label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(len(STAGES)), list(STAGES.values()))
    ax.set_title("median seconds per step, by stage")
    ax.grid(axis="y", alpha=0.3)


def _table(runs: Sequence[RunData]) -> str:
    head = (
        "run",
        "status",
        "steps",
        "reward first / last / best",
        "exact rate, last 5",
        "held-out reward first / last",
        "median step (s)",
        "final sampler",
    )
    rows = []
    for run in runs:
        rewards = [v for v in run.series("avg_reward")[1] if v is not None]
        exact = [v for v in run.series("exact_rate")[1][-5:] if v is not None]
        times = [v for v in run.series("time/step")[1] if v is not None]
        held_out = [v for v in run.eval_series("eval/reward/total")[1] if v is not None]
        summary = run.summary or {}
        cells = (
            str(run.run_dir),
            str(summary.get("status", "n/a")),
            str(len(run.steps)),
            f"{rewards[0]:.3f} / {rewards[-1]:.3f} / {max(rewards):.3f}" if rewards else "n/a",
            f"{statistics.mean(exact):.1%}" if exact else "n/a",
            f"{held_out[0]:.3f} / {held_out[-1]:.3f}" if held_out else "n/a",
            f"{statistics.median(times):.2f}" if times else "n/a",
            str(summary.get("final_path") or "not saved"),
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


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
    return _write(_load_runs(run_dirs), out_dir, smoothing)


def _load_runs(run_dirs: Sequence[Path]) -> list[RunData]:
    require("report", "the report picture")
    return [load_run(d, label) for d, label in zip(run_dirs, _labels(run_dirs), strict=True)]


def _write(runs: Sequence[RunData], out_dir: Path, smoothing: float) -> tuple[Path, Path]:
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.report", "engine-report"),
        description="Plot runs from their metrics.jsonl: report.png and a self-contained "
        "report.html. Several run directories are overlaid in one picture.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to write (default: the run directory for one run, "
        "reports/<timestamp> for several)",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        metavar="W",
        help=f"exponential smoothing weight in [0, 1), 0 = none (default {DEFAULT_SMOOTHING})",
    )
    add_version_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.smoothing < 1:
        parser.error(f"--smoothing must be in [0, 1), got {args.smoothing}")
    out = args.out
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out = args.run_dirs[0] if len(args.run_dirs) == 1 else Path("reports") / stamp
    try:
        runs = _load_runs(args.run_dirs)
        warnings = [w for run in runs for w in run.warnings]
        for warning in warnings:
            print(warning, file=sys.stderr)
        png, page = _write(runs, out, args.smoothing)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(png)
    print(page)
    return 1 if warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
