"""Throughput: the quickstart's sequential loop against the engine, side by side.

    python -m benchmarks.throughput                 # full run (a few minutes)
    python -m benchmarks.throughput --quick         # tiny run (seconds per config)
    python -m benchmarks.throughput --latency mint:scale=0.02 --workloads 8x6x16

For each latency profile (default: ``mint``, the hosted-MinT-like clock, time-scaled,
and ``off``, the bare local model) ONE local server is started in a child process and
every workload runs through every configuration against it, one after another:

* ``quickstart``: ``benchmarks.quickstart_loop`` (sample one problem at a time,
  forward_backward THEN optim_step, a snapshot per step);
* ``k0``: the engine on-policy (the quickstart's algorithm, pipelined I/O);
* ``k1`` / ``k2``: sampling may run 1 / 2 steps ahead of training;
* ``stream``: on-policy with forward_backward per 2 arrived groups.

Reported per configuration: steps/s, samples/s, tokens/s (end to end), the steady pace
(seconds per step over the steps after the warm-up, never a median of intervals) next
to it in clock cycles per step, speedups over the quickstart, the clock floor (the
fastest pace the latency clock allows the configuration) and pipeline efficiency (floor /
pace, never above 1), and the client's CPU time. Definitions are in
``benchmarks.measure``. Writes ``throughput.json``, ``throughput.md`` and three PNGs
(step times, stage timeline, and per clock cycle what the server computed and what the
client waited on: ``throughput_cycles.png``) to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.measure import RunRecord, stages_alone, summarize
from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from benchmarks.runners import VARIANTS, Target, Workload, bench_server, run_engine, run_quickstart
from benchmarks.train_stage import measure_trainer

__all__ = ["CONFIGS", "main", "run_throughput"]

CONFIGS = ("quickstart", *VARIANTS)
DEFAULT_WORKLOADS = ("8x6x16", "32x8x16")
"""The quickstart's defaults (8 problems x 6 samples x 16 tokens) and a larger step."""
DEFAULT_LATENCY = ("mint", "off")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_STEPS = 3
QUICK_WORKLOADS = ("4x4x8",)
QUICK_LATENCY = ("mint:scale=0.01",)
"""--quick: a 10 s hosted clock cycle lasts 0.1 s."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.throughput",
        description="Steps/s of the quickstart loop vs the engine (K=0, K=1, K=2, streaming) "
        "against one local server per latency profile.",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 6; quick 3)")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        metavar="BxGxT",
        help=f"batch x group x max_tokens (default {' '.join(DEFAULT_WORKLOADS)})",
    )
    p.add_argument(
        "--latency",
        nargs="+",
        default=None,
        metavar="PROFILE",
        help="server latency profiles, each as `python -m engine.local --latency` takes it, "
        f"or off (default: {' '.join(DEFAULT_LATENCY)}; quick: {QUICK_LATENCY[0]})",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=CONFIGS,
        metavar="CONFIG",
        help=f"which loops to run, of {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument("--seed", type=int, default=42, help="problem seed (default 42)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    p.add_argument("--quick", action="store_true", help="a tiny run: 3 steps of 4x4x8, one profile")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="only redraw the plots (into --out) from a throughput.json of an earlier run",
    )
    return p


def _settings(args: argparse.Namespace) -> tuple[int, list[Workload], list[str]]:
    steps: int = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else 6)
    if steps < 2:
        raise ValueError(f"--steps must be at least 2 (a step interval is needed), got {steps}")
    workload_texts = args.workloads or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    latency: list[str] = args.latency or list(QUICK_LATENCY if args.quick else DEFAULT_LATENCY)
    from engine.local import LatencyProfile  # parse now: a typo fails before any server starts

    for text in latency:
        LatencyProfile.parse(text)
    return steps, [Workload.parse(w) for w in workload_texts], latency


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_throughput(
    *,
    steps: int,
    workloads: Sequence[Workload],
    latency: Sequence[str],
    configs: Sequence[str],
    seed: int,
) -> list[dict[str, Any]]:
    """Every (profile, workload, config) run; one dict per run with its summary, steps
    and spans, and ``speedup`` fields relative to the quickstart when it ran."""
    runs: list[dict[str, Any]] = []
    ordered = [c for c in CONFIGS if c in configs]  # the baseline first
    for profile in latency:
        _say(f"[{profile}] starting the local server...")
        with bench_server(profile) as target:
            for workload in workloads:
                baseline: dict[str, Any] | None = None
                trainer = measure_trainer(target, workload, steps=steps, mode="submit-ahead")
                engine_alone: dict[str, float] | None = None
                for config in ordered:
                    record = _run_one(target, workload, config, steps=steps, seed=seed)
                    if config == "k0":
                        on_policy = stages_alone(record)
                        engine_alone = {**on_policy, "train": trainer["mean_step_s"]}
                    alone = None if config == "quickstart" else engine_alone
                    summary = summarize(record, alone)
                    row = {
                        "profile": target.latency,
                        "workload": workload.name,
                        "config": config,
                        "label": _label(config),
                        "stages_alone_from": (
                            "own run" if alone is None else "k0 run + trainer alone"
                        ),
                        "trainer_alone": trainer,
                        **record.to_json(spans=True, alone=alone),
                    }
                    if config == "quickstart":
                        baseline = summary
                    row["speedup"] = _ratio(summary["steps_per_s"], baseline, "steps_per_s")
                    row["speedup_steady"] = _inverse_ratio(
                        summary["step_time_s"], baseline, "step_time_s"
                    )
                    runs.append(row)
                    _say(
                        f"[{target.latency} {workload.name}] {config}: "
                        f"{summary['steps']} steps, {summary['steps_per_s']:.3f} steps/s, "
                        f"pace {summary['step_time_s']:.2f} s/step "
                        f"({fmt(summary['cycles_per_step'])} cycles), "
                        f"efficiency {fmt(summary['efficiency'])}"
                    )
    return runs


def _label(config: str) -> str:
    return "quickstart loop" if config == "quickstart" else VARIANTS[config].label


def _run_one(
    target: Target, workload: Workload, config: str, *, steps: int, seed: int
) -> RunRecord:
    if config == "quickstart":
        return run_quickstart(target, workload, steps=steps, seed=seed)
    # As `python -m engine.run` runs it: gc.freeze() once the session is open.
    return run_engine(target, workload, VARIANTS[config], steps=steps, seed=seed, freeze_gc=True)


def _ratio(value: Any, baseline: dict[str, Any] | None, key: str) -> float | None:
    if baseline is None or not baseline.get(key) or value is None:
        return None
    return float(value) / float(baseline[key])


def _inverse_ratio(value: Any, baseline: dict[str, Any] | None, key: str) -> float | None:
    if baseline is None or baseline.get(key) is None or not value:
        return None
    return float(baseline[key]) / float(value)


TABLE_HEADERS = (
    "profile",
    "workload",
    "config",
    "steps/s",
    "x quickstart",
    "pace s/step",
    "cycles/step",
    "x (steady)",
    "samples/s",
    "tokens/s",
    "clock floor s",
    "efficiency",
    "client CPU ms/step",
    "client CPU % wall",
    "server compute % wall",
)


def table(runs: Sequence[dict[str, Any]]) -> str:
    """The markdown table of every run."""
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append(
            [
                r["profile"],
                r["workload"],
                r["label"],
                fmt(s["steps_per_s"], ".3f"),
                fmt(r["speedup"], ".2f"),
                fmt(s["step_time_s"], ".2f"),
                fmt(s["cycles_per_step"], ".2f"),
                fmt(r["speedup_steady"], ".2f"),
                fmt(s["samples_per_s"], ".1f"),
                fmt(s["tokens_per_s"], ".0f"),
                fmt(s["ideal_step_time_s"], ".2f"),
                fmt(s["efficiency"], ".2f"),
                fmt(s["client_cpu_ms_per_step"], ".0f"),
                fmt(100 * s["client_cpu_share"], ".1f"),
                fmt(
                    None if s["server_compute_share"] is None else 100 * s["server_compute_share"],
                    ".0f",
                ),
            ]
        )
    return markdown_table(TABLE_HEADERS, rows)


def _plots(runs: Sequence[dict[str, Any]], out: Path) -> list[str]:
    from benchmarks.plotting import plot_cycles, plot_step_times, plot_timeline

    paths = [
        plot_step_times(
            [
                {
                    "profile": r["profile"],
                    "workload": r["workload"],
                    "config": r["config"],
                    "step_time_s": r["summary"]["step_time_s"],
                    "speedup": r["speedup_steady"],
                }
                for r in runs
            ],
            out / "throughput_step_time.png",
        )
    ]
    first = runs[0]
    panels = [
        (f"{r['label']} ({r['profile']}, {r['workload']})", r["spans"])
        for r in runs
        if r["profile"] == first["profile"]
        and r["workload"] == first["workload"]
        and r["config"] in ("quickstart", "k0", "k1")
    ]
    paths.append(plot_timeline(panels, out / "throughput_timeline.png"))
    clocked = [
        r for r in runs if r["config"] == "k1" and r.get("server_timeline", {}).get("cycle_starts")
    ]
    if clocked:
        paths.append(plot_cycles(clocked[0], out / "throughput_cycles.png"))
    return [str(p) for p in paths]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot is not None:
        try:
            runs = json.loads(args.replot.read_text())["runs"]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--replot {args.replot}: not a throughput.json ({exc})")
        for path in _plots(runs, args.out):
            print(f"plot: {path}")
        return 0
    try:
        steps, workloads, latency = _settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    context = run_context({**vars(args), "steps": steps, "latency": latency})
    runs = run_throughput(
        steps=steps, workloads=workloads, latency=latency, configs=args.configs, seed=args.seed
    )
    context["load_average_end"] = load_average()
    out: Path = args.out
    text = table(runs)
    plots = [] if args.no_plots else _plots(runs, out)
    names = [Path(p).name for p in plots]  # relative to the JSON's own directory
    write_json(out / "throughput.json", {"context": context, "plots": names, "runs": runs})
    (out / "throughput.md").write_text(text)
    print(text)
    for path in plots:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
