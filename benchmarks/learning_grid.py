"""Which loss and K learn soonest in wall-clock time? The learning grid of issue 34.

Held-out greedy exact rate (the learning benchmark's set and evaluation,
:mod:`benchmarks.learning`) against steps and against wall-clock seconds on a latency
profile (default ``mint``, the hosted-like clock), for cells ``correction@K``, each over
several seeds (repeatable runs: every sampling request is seeded from ``--seed``). Runs go
one after another, seed by seed (every cell of a seed, then the next seed), so a grid cut
short still holds whole seeds of every cell; the JSON is rewritten after every run, and
``--resume`` skips the runs an earlier, interrupted grid already wrote there.

Per cell the summary has the final held-out mean and its standard error, the gain per
step relative to the K=0 baseline (``is@0``, the quickstart's algorithm), the mean curve
against steps and against the runs' mean wall-clock seconds, and the time to reach the
baseline's final accuracy (the first crossing of the linearly interpolated mean curve),
also as a fraction of the baseline's own.

    python -m benchmarks.learning_grid                     # the committed grid (~60 min)
    python -m benchmarks.learning_grid --quick             # 2 steps, 20 held-out, 2 cells
    python -m benchmarks.learning_grid --cells is@0,ppo@1,is-tis-temp@2 --seeds 1,2
    python -m benchmarks.learning_grid --replot benchmarks/results/learning_grid.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine_cli import TINKER_PYTHON
from benchmarks.learning import (
    API_KEY,
    QUICKSTART_TEMPERATURE,
    RunSpec,
    evaluate,
    held_out,
    measure_run,
)
from benchmarks.measure import positive_int
from benchmarks.plotting import plot_learning_grid
from benchmarks.report import command_line, fmt, markdown_table, run_context, write_json
from engine.local import LocalServer
from engine.local.profiles import SERVICES

__all__ = [
    "CORRECTIONS",
    "DEFAULT_CELLS",
    "cell_list",
    "cell_spec",
    "crossing",
    "main",
    "resume_report",
    "seed_list",
    "standard_error",
    "summarize",
]

CORRECTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "is": ("importance_sampling", {"loss_temperature": "off"}),
    "ppo": ("ppo", {"loss_temperature": "off"}),
    "ppo-temp": ("ppo", {"loss_temperature": "sampling"}),
    "ppo-lr625": ("ppo", {"loss_temperature": "off", "learning_rate": 6.25e-4}),
    "is-tis-temp": ("importance_sampling", {"tis_cap": 2.0, "loss_temperature": "sampling"}),
    "ppo-mis-temp": (
        "ppo",
        {"mask_low": 0.5, "mask_high": 2.0, "loss_temperature": "sampling"},
    ),
    "is-mis-temp": (
        "importance_sampling",
        {"mask_low": 0.5, "mask_high": 2.0, "loss_temperature": "sampling"},
    ),
    # what a hosted service takes (--service mint / tinker)
    "is-rc": ("importance_sampling", {"loss_temperature": "off", "rollout_correction": "mis"}),
    "ppo-t1": ("ppo", {"loss_temperature": "off", "temperature": 1.0}),
    "is-t1": ("importance_sampling", {"loss_temperature": "off", "temperature": 1.0}),
    "is-rc-t1": (
        "importance_sampling",
        {"loss_temperature": "off", "rollout_correction": "mis", "temperature": 1.0},
    ),
    "sr": ("stable_reinforce", {"loss_temperature": "off"}),
}
"""The corrections a cell names: its loss and the engine settings that correct it
(docs/losses.md: TIS cap 2, IcePop's mask [0.5, 2], the loss at the sampling
temperature; ``off`` spelled out, as the local server recommends ``sampling``).
``ppo-lr625`` is ``ppo`` at 1.25x the packaged model's learning rate (5e-4): the ``1/T``
scale the tempered gradient carries at temperature 0.8, without the temperature. The
hosted ones: ``is-rc`` is importance sampling with MinT's session-level rollout correction
(``--rollout-correction mis``), ``*-t1`` samples at temperature 1 (where the sampler's
tempered logprobs are the model's own), ``sr`` is Tinker's ``stable_reinforce`` (``--sdk
tinker``)."""
BASELINE = "is@0"
"""The reference every cell is compared with: K=0 importance sampling, the quickstart."""
DEFAULT_CELLS = (
    BASELINE,
    "ppo@1",
    "ppo-temp@1",
    "ppo-temp@2",
    "is-tis-temp@2",
    "ppo@2",
    "ppo-temp@4",
    "ppo-temp@0",
)
"""Each seed runs the cells in this order (the ones the default decision rests on first);
eight cells x 5 seeds fit an hour on a loaded 2-core machine. At K=0 with the loss
temperature every ratio is 1, so ppo, importance sampling and TIS train alike:
``ppo-temp@0`` stands for all three, and separates what the temperature does to the
gradient from what K does to the clock."""
DEFAULT_OUT = Path(__file__).parent / "results" / "learning_grid.json"


def cell_spec(cell: str) -> RunSpec:
    """The run of ``correction@K``; ValueError naming the choices otherwise."""
    correction, _, k = cell.partition("@")
    if correction not in CORRECTIONS or not k.isdigit():
        raise ValueError(
            f"not a cell: {cell!r} (CORRECTION@K, CORRECTION one of {', '.join(CORRECTIONS)})"
        )
    loss, settings = CORRECTIONS[correction]
    return RunSpec(cell, loss, int(k), settings={"temperature": QUICKSTART_TEMPERATURE, **settings})


def cell_list(text: str) -> list[str]:
    cells = [c.strip() for c in text.split(",") if c.strip()]
    try:
        for cell in cells:
            cell_spec(cell)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if BASELINE not in cells:
        raise argparse.ArgumentTypeError(f"the cells must include the baseline {BASELINE}")
    return cells


def seed_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


# --------------------------------------------------------------------------- measuring


def resume_report(report: dict[str, Any], out: Path) -> None:
    """Take into ``report`` the runs an earlier, interrupted report at ``out`` wrote, and
    the commands that wrote them (the page lists them before its own)."""
    earlier = json.loads(out.read_text())
    report["runs"] = earlier["runs"]
    report["earlier_commands"] = [
        *earlier.get("earlier_commands", []),
        earlier.get("command", "?"),
    ]


def measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "learning_grid",
        "command": command,
        "context": run_context(vars(args) | {"out": str(args.out)}),
        "steps": args.steps,
        "heldout": args.heldout,
        "latency": args.latency,
        "service": args.service,
        "sdk": args.sdk,
        "cells": args.cells,
        "seeds": args.seeds,
        "runs": [],
    }
    if args.resume and args.out.is_file():
        resume_report(report, args.out)
    done = {(r["config"], r["seed"]) for r in report["runs"]}
    with (
        LocalServer(api_key=API_KEY, latency=args.latency, service=args.service) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        base = held_out(server, args.heldout, args.seeds, args.steps, args.batch)
        before = evaluate(base.base_sampler, base.tokenizer, base.problems, base.stop)
        print(f"base model: greedy exact {before:.1%} on {len(base.problems)} held-out")
        for seed, cell in itertools.product(args.seeds, args.cells):
            if (cell, seed) in done:
                continue
            run_dir = Path(tmp) / f"{cell.replace('@', '-k')}-s{seed}"
            row = measure_run(args, server, base, before, cell_spec(cell), seed, run_dir)
            report["runs"].append(row)
            report["summary"] = summarize(report["runs"])
            write_json(args.out, report)
    report["summary"] = summarize(report["runs"])
    return report


# --------------------------------------------------------------------------- the summary


def standard_error(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first x where the polyline through ``(x, y)`` points reaches ``target``."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return points[-1][0] if points and points[-1][1] >= target else None


def _curve(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The cell's mean curve: per evaluated step (0: the base model) the mean and
    standard error of the exact rate, and the mean wall-clock seconds to that step's end."""
    steps = sorted({int(k) for r in rows for k in r["curve"]} | {0})
    out = []
    for step in steps:
        mine = [r for r in rows if step == 0 or str(step) in r["curve"]]
        rates = [r["exact_before"] if step == 0 else r["curve"][str(step)] for r in mine]
        ends = [0.0 if step == 0 else r["step_end_s"][step - 1] for r in mine]
        out.append(
            {
                "step": step,
                "exact_mean": statistics.fmean(rates),
                "exact_se": standard_error(rates),
                "wall_s_mean": statistics.fmean(ends),
            }
        )
    return out


def summarize(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (in the order first run): the figures of the module's docstring. The
    baseline's final mean is the target; gains are over the base model."""
    cells: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        cells.setdefault(r["config"], []).append(r)
    out = []
    for name, rows in cells.items():
        finals = [r["exact_after"] for r in rows]
        curve = _curve(rows)
        out.append(
            {
                "cell": name,
                "loss": rows[0]["loss"],
                "max_steps_off_policy": rows[0]["max_steps_off_policy"],
                "settings": rows[0].get("settings", {}),
                "seeds": sorted(r["seed"] for r in rows),
                "final_mean": statistics.fmean(finals),
                "final_se": standard_error(finals),
                "gain_mean": statistics.fmean(r["delta"] for r in rows),
                "wall_s_mean": statistics.fmean(r["step_end_s"][-1] for r in rows),
                "kl_sample_train_v2": statistics.fmean(
                    r["kl_sample_train_v2_mean"] for r in rows if r.get("kl_sample_train_v2_mean")
                )
                if any(r.get("kl_sample_train_v2_mean") for r in rows)
                else None,
                "load_mean": statistics.fmean(r["load_before"][0] for r in rows)
                if all(r.get("load_before") for r in rows)
                else None,
                "curve": curve,
            }
        )
    baseline = next((c for c in out if c["cell"] == BASELINE), None)
    for c in out:
        c.update(_against(c, baseline))
    return out


def _against(cell: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> dict[str, Any]:
    """How ``cell`` compares with the baseline: its gain per step as a fraction of the
    baseline's (same steps, so the ratio of the final gains; and of the mean gain over the
    evaluated steps, which weighs the whole curve), the final difference and its standard
    error, and the wall-clock seconds to the baseline's final mean accuracy."""
    if baseline is None:
        return {}
    target = baseline["final_mean"]
    base_gain = baseline["gain_mean"]
    gains = [p["exact_mean"] - cell["curve"][0]["exact_mean"] for p in cell["curve"][1:]]
    base_gains = [
        p["exact_mean"] - baseline["curve"][0]["exact_mean"] for p in baseline["curve"][1:]
    ]
    time_to = crossing([(p["wall_s_mean"], p["exact_mean"]) for p in cell["curve"]], target)
    base_time = crossing([(p["wall_s_mean"], p["exact_mean"]) for p in baseline["curve"]], target)
    step_to = crossing([(p["step"], p["exact_mean"]) for p in cell["curve"]], target)
    diff_se = math.hypot(cell["final_se"], baseline["final_se"])
    return {
        "gain_ratio": cell["gain_mean"] / base_gain if base_gain > 0 else None,
        "curve_gain_ratio": statistics.fmean(gains) / statistics.fmean(base_gains)
        if gains and len(gains) == len(base_gains) and statistics.fmean(base_gains) > 0
        else None,
        "final_vs_baseline": cell["final_mean"] - target,
        "final_vs_baseline_se": diff_se,
        "final_within_one_se": cell["final_mean"] >= target - diff_se,
        "target": target,
        "steps_to_target": step_to,
        "wall_s_to_target": time_to,
        "time_ratio_to_baseline": time_to / base_time if time_to and base_time else None,
    }


# --------------------------------------------------------------------------- the report


def table(summary: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [
            c["cell"],
            str(len(c["seeds"])),
            f"{c['final_mean']:.1%} ± {c['final_se']:.1%}",
            f"{c['gain_mean']:+.1%}",
            fmt(c.get("gain_ratio"), ".2f"),
            fmt(c.get("curve_gain_ratio"), ".2f"),
            fmt(c.get("steps_to_target"), ".1f"),
            fmt(c.get("wall_s_to_target"), ".1f"),
            fmt(c.get("time_ratio_to_baseline"), ".2f"),
            f"{c['wall_s_mean']:.1f}",
            fmt(c.get("kl_sample_train_v2"), ".4f"),
            fmt(c.get("load_mean"), ".1f"),
        ]
        for c in summary
    ]
    return markdown_table(
        [
            "cell (correction@K)",
            "seeds",
            "final held-out (mean ± SE)",
            "gain",
            "gain/step vs K=0",
            "curve gain vs K=0",
            "steps to K=0's final",
            "s to K=0's final",
            "time vs K=0",
            "s for all steps",
            "kl v2",
            "load",
        ],
        rows,
    )


def write_report(report: dict[str, Any], out: Path, command: str) -> None:
    """The JSON, the markdown page beside it (the command, the load, the table) and the
    plot (``<out>.png``)."""
    report["summary"] = summarize(report["runs"])
    write_json(out, report)
    plot_learning_grid(report["summary"], out.with_suffix(".png"), report.get("latency"))
    loads = [r["load_before"][0] for r in report["runs"] if r.get("load_before")]
    context = report["context"]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"
    earlier = "".join(f"`{c}`, then " for c in report.get("earlier_commands", []))
    out.with_suffix(".md").write_text(
        f"{earlier}`{command}` (commit {context['commit']}, {context['date']}, "
        f"{context['cpus']} CPUs; "
        f"1-minute load average {load} at the runs' starts, each run's in the JSON; "
        f"latency {report['latency']}, service {report.get('service', 'local')}, SDK "
        f"{report.get('sdk', 'mint')}, {report['steps']} steps, {report['heldout']} held-out)\n\n"
        + table(report["summary"])
        + f"\n![held-out accuracy against steps and seconds]({out.with_suffix('.png').name})\n"
    )
    print(table(report["summary"]))
    print(f"wrote {out}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--heldout", type=positive_int, default=200, help="held-out problems")
    parser.add_argument("--seeds", type=seed_list, default=[1, 2, 3, 4, 5], help="training seeds")
    parser.add_argument("--batch", type=positive_int, default=8, help="problems per step")
    parser.add_argument(
        "--cells",
        type=cell_list,
        default=list(DEFAULT_CELLS),
        help=f"CORRECTION@K, comma-separated (corrections: {', '.join(CORRECTIONS)}; "
        f"default {','.join(DEFAULT_CELLS)})",
    )
    parser.add_argument("--curve-every", type=positive_int, default=5, help="evaluate every N")
    parser.add_argument("--latency", default="mint", help="the server's latency profile")
    parser.add_argument(
        "--service",
        choices=SERVICES,
        default="local",
        help="the local server's service profile (mint, tinker: what a hosted one takes)",
    )
    parser.add_argument(
        "--sdk",
        choices=("mint", "tinker"),
        default="mint",
        help="the engine's SDK (tinker: engine.run in .venv-tinker, for gspo/stable_reinforce)",
    )
    parser.add_argument("--resume", action="store_true", help="skip the runs --out holds")
    parser.add_argument("--replot", type=Path, help="rewrite the report of this JSON, no runs")
    parser.add_argument("--quick", action="store_true", help="2 steps, 20 held-out, 2 cells")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.heldout, args.curve_every = 2, 20, 1
        args.seeds, args.cells = args.seeds[:1], [BASELINE, "is-tis-temp@1"]
    args.tinker_python = TINKER_PYTHON  # what benchmarks.learning's tinker runs read
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # what repeats the grid: an interrupted one resumed ran the same runs
    command = command_line("benchmarks.learning_grid", argv, leave_out=("--resume",))
    if args.replot is not None:
        report = json.loads(args.replot.read_text())
        write_report(report, args.replot, report["command"])
        return 0
    report = measure(args, command)
    write_report(report, args.out, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
