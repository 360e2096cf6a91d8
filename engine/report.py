"""``python -m engine.report RUN_DIR [RUN_DIR ...]``: a picture of one run, or several
overlaid, from their ``metrics.jsonl``.

Writes ``report.png``, the panels that the run's own metrics fill and no others
(:mod:`engine.observe.report_panels`): the mean reward (raw and smoothed) and each
reward component of the task; the objective's own signals (SFT's training and held-out
loss per token, distillation's reverse KL to the teacher and the teacher's share of each
step, preference pairs' loss, accuracy and implicit rewards); for an environment, the
turns, tool calls, tool errors and other counts per episode and how the episodes ended;
the held-out means of ``eval.jsonl`` (from ``--eval-every``, step 0 included); loss, KL,
entropy and gradient norm where logged; staleness; response lengths and the fractions of
trained groups and of truncated and empty responses; the stages' seconds per step, as
medians and against wall clock; throughput. A run that trained nothing says so in words,
on the picture and in the page. Also a self-contained ``report.html`` (the picture
embedded, a table per run). One run: into its own directory; several, overlaid one
colour each: into ``--out`` (default ``reports/<timestamp>``). A finished run draws its
own ``report.png`` (:func:`finished_run_report`).

Needs the ``report`` extra (matplotlib); without it the command says how to install it
(exit 2). Damaged lines of metrics.jsonl / eval.jsonl are skipped with a warning that
names them. Exit codes: 0 written; 1 written from the readable lines (some were
damaged); 2 bad arguments, a directory without steps, or no matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from engine.common.cli import OneLineErrorParser, add_version_flag, program_name
from engine.errors import ConfigError
from engine.observe.run_report import DEFAULT_SMOOTHING, load_runs, write_runs

__all__ = ["build_parser", "main"]


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
        runs = load_runs(args.run_dirs)
        warnings = [w for run in runs for w in run.warnings]
        for warning in warnings:
            print(warning, file=sys.stderr)
        png, page = write_runs(runs, out, args.smoothing)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(png)
    print(page)
    return 1 if warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
