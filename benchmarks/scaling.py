"""Scaling: the engine's client-side CPU and memory as the step grows from 8 to 512
problems and from 4 to 16 samples per problem.

    python -m benchmarks.scaling                    # full run (a few minutes)
    python -m benchmarks.scaling --quick            # two tiny sizes
    python -m benchmarks.scaling --profile          # + where the event loop's CPU goes

The question it answers: does the client's cost grow linearly with the work, and is the
engine ever the bottleneck? One local server runs in a child process (bare model by
default, few tokens per sample, so the large sizes finish in minutes on two cores); each
size runs the engine in a FRESH child process of its own, so that process's CPU time
(user + system, all threads) is the client's alone and its peak resident memory belongs
to that size only. Reported per size: client CPU per step, per 1,000 samples, split by
thread (the event loop that runs the engine, the SDK's I/O thread, worker threads that
score), the client's CPU as a share of the step's wall time against the server's, and
the peak memory growth during the run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pstats
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from benchmarks.measure import RunRecord
from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from benchmarks.runners import VARIANTS, Target, Variant, Workload, bench_server, run_engine

__all__ = ["main", "measure_size", "run_scaling"]

DEFAULT_SIZES = ("8x16", "32x16", "128x16", "512x16", "32x4", "32x8")
"""A batch sweep at the largest group, and a group sweep at batch 32 (problems x samples)."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_SIZES = ("2x4", "8x4")
PROFILE_SIZE = "128x16"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.scaling",
        description="Client CPU and memory per sample of the engine, from small to large steps.",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        metavar="BxG",
        help=f"problems x samples per step (default {' '.join(DEFAULT_SIZES)})",
    )
    p.add_argument("--steps", type=int, default=2, help="steps per size (default 2)")
    p.add_argument(
        "--max-tokens", type=int, default=4, help="max tokens per sample (default 4: cheap server)"
    )
    p.add_argument(
        "--k", type=int, default=1, choices=(0, 1, 2), help="max steps off-policy (default 1)"
    )
    p.add_argument(
        "--latency", default="off", metavar="PROFILE", help="server latency profile (default off)"
    )
    p.add_argument("--seed", type=int, default=42, help="problem seed (default 42)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    p.add_argument("--quick", action="store_true", help=f"sizes {' '.join(QUICK_SIZES)} only")
    p.add_argument(
        "--profile",
        nargs="?",
        const=PROFILE_SIZE,
        default=None,
        metavar="BxG",
        help="after the measured runs, run one more size (default "
        f"{PROFILE_SIZE}) with the event loop's CPU profiled (cProfile, thread-CPU clock); "
        "writes scaling_profile.pstats and its top functions into the JSON",
    )
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once the engine's session is open, as `python -m engine.run` does "
        "(an embedded Engine leaves the process's GC alone); compare the GC columns with a "
        "run without it",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="only redraw the plot (into --out) from a scaling.json of an earlier run",
    )
    return p


def _workload(text: str, max_tokens: int) -> Workload:
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"size {text!r} must be BATCHxGROUP, e.g. 512x16")
    return Workload.parse(f"{text}x{max_tokens}")


def measure_size(
    target: Target,
    workload: Workload,
    variant: Variant,
    steps: int,
    seed: int,
    profile_path: Path | None,
    freeze_gc: bool = False,
) -> dict[str, Any]:
    """One size in this (fresh) process: the engine's run record as JSON."""
    record: RunRecord = run_engine(
        target,
        workload,
        variant,
        steps=steps,
        seed=seed,
        time_scores=False,
        profile_path=profile_path,
        freeze_gc=freeze_gc,
    )
    return record.to_json()


def run_scaling(
    *,
    workloads: Sequence[Workload],
    steps: int,
    k: int,
    latency: str,
    seed: int,
    profile: tuple[Workload, Path] | None = None,
    freeze_gc: bool = False,
) -> list[dict[str, Any]]:
    """Every size, each in a fresh child process, against one server; then, with
    ``profile``, one more profiled run (not among the points: profiling slows it)."""
    variant = VARIANTS[f"k{k}"]
    points = []
    with bench_server(latency) as target:
        for workload in workloads:
            run = _in_child(target, workload, variant, steps, seed, None, freeze_gc)
            point = _point(workload, run)
            points.append(point)
            print(
                f"[scaling {point['workload']}] {point['cpu_ms_per_1k_samples']:.0f} ms client "
                f"CPU per 1k samples, client busy {100 * point['client_cpu_share']:.1f}% of "
                f"wall, peak memory +{point['rss_growth_mb']:.0f} MB",
                file=sys.stderr,
                flush=True,
            )
        if profile is not None:
            _in_child(target, profile[0], variant, steps, seed, profile[1], freeze_gc)
    return points


def _in_child(
    target: Target,
    workload: Workload,
    variant: Variant,
    steps: int,
    seed: int,
    profile_path: Path | None,
    freeze_gc: bool,
) -> dict[str, Any]:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        future = pool.submit(
            measure_size, target, workload, variant, steps, seed, profile_path, freeze_gc
        )
        return future.result()


def _point(workload: Workload, run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    samples = s["samples"]
    wall = s["wall_s"]
    per_1k = 1e6 / samples  # seconds -> ms per 1,000 samples
    return {
        "workload": f"{workload.batch}x{workload.group}",
        "batch": workload.batch,
        "group": workload.group,
        "max_tokens": workload.max_tokens,
        "steps": s["steps"],
        "samples_per_step": workload.batch * workload.group,
        "samples": samples,
        "wall_s": wall,
        "step_time_s": s["step_time_s"],
        "cpu_s": run["client_cpu_s"],
        "cpu_ms_per_step": s["client_cpu_ms_per_step"],
        "cpu_ms_per_1k_samples": run["client_cpu_s"] * per_1k,
        "threads_ms_per_1k_samples": {
            role: seconds * per_1k for role, seconds in run["threads_cpu_s"].items()
        },
        "engine_loop_ms_per_1k_samples": run["threads_cpu_s"].get("main", 0.0) * per_1k,
        "client_cpu_share": run["client_cpu_s"] / wall,
        "engine_loop_share": run["threads_cpu_s"].get("main", 0.0) / wall,
        "gc_ms_per_1k_samples": run["gc"].get("total_s", 0.0) * per_1k,
        "gc_full_passes": run["gc"].get("gen2_passes", 0),
        "server_cpu_share": (run["server_cpu_s"] / wall) if run["server_cpu_s"] else None,
        "rss_start_mb": run["rss_start_mb"],
        "rss_peak_mb": run["rss_peak_mb"],
        "rss_growth_mb": max(0.0, (run["rss_peak_mb"] or 0.0) - (run["rss_start_mb"] or 0.0)),
        "run": run,
    }


def profile_summary(path: Path, top: int = 25) -> dict[str, Any]:
    """Where the event loop's CPU went: seconds by code origin (the engine's own modules,
    the SDK, anyio/asyncio, numpy/pydantic/tokenizers...) and the top functions by own
    time."""
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    by_origin: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in raw.items():
        origin = _origin(filename)
        by_origin[origin] = by_origin.get(origin, 0.0) + tottime
        rows.append(
            {
                "function": f"{_short(filename)}:{line}({name})",
                "origin": origin,
                "calls": calls,
                "own_s": tottime,
                "cumulative_s": cumtime,
            }
        )
    rows.sort(key=lambda r: r["own_s"], reverse=True)
    cumulative = sorted(
        (r for r in rows if r["origin"] == "engine"), key=lambda r: r["cumulative_s"], reverse=True
    )
    return {
        "total_s": sum(by_origin.values()),
        "own_s_by_origin": dict(sorted(by_origin.items(), key=lambda kv: -kv[1])),
        "top_own": rows[:top],
        "top_engine_cumulative": cumulative[:top],
    }


def _origin(filename: str) -> str:
    f = filename.replace("\\", "/")
    if "/engine/" in f and "/site-packages/" not in f:
        return "engine"
    for name in (
        "tinker",
        "mint",
        "anyio",
        "httpx",
        "httpcore",
        "pydantic",
        "numpy",
        "transformers",
        "tokenizers",
    ):
        if f"/{name}/" in f:
            return name
    if "asyncio" in f:
        return "asyncio"
    if f.startswith("~") or f.startswith("<"):
        return "builtins"
    return "other"


def _short(filename: str) -> str:
    f = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/work/main/", "/lib/python3"):
        if marker in f:
            return f.split(marker, 1)[1]
    return f


def linear_fit(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """CPU per step = fixed + marginal x samples per step, least squares, for the client
    and for each thread role: ``fixed_ms_per_step``, ``marginal_ms_per_1k_samples`` and
    ``r2`` (1.0 = perfectly linear)."""
    xs = np.array([p["samples_per_step"] for p in points], dtype=float)
    series = {"client": [p["cpu_ms_per_step"] for p in points]}
    roles = sorted({r for p in points for r in p["threads_ms_per_1k_samples"]})
    for role in roles:
        series[role] = [
            p["threads_ms_per_1k_samples"].get(role, 0.0) * p["samples"] / 1000 / p["steps"]
            for p in points
        ]
    fits: dict[str, dict[str, float]] = {}
    if len(set(xs.tolist())) < 2:
        return fits
    for name, values in series.items():
        ys = np.array(values, dtype=float)
        slope, intercept = np.polyfit(xs, ys, 1)
        residual = ys - (slope * xs + intercept)
        spread = float(((ys - ys.mean()) ** 2).sum())
        fits[name] = {
            "fixed_ms_per_step": float(intercept),
            "marginal_ms_per_1k_samples": float(slope * 1000),
            "r2": 1.0 - float((residual**2).sum()) / spread if spread > 0 else 1.0,
        }
    return fits


def fit_table(fits: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            name,
            fmt(f["fixed_ms_per_step"], ".1f"),
            fmt(f["marginal_ms_per_1k_samples"], ".1f"),
            fmt(f["r2"], ".3f"),
        ]
        for name, f in fits.items()
    ]
    headers = ("CPU of", "fixed ms/step", "marginal ms/1k samples", "R^2 of linear fit")
    return markdown_table(headers, rows)


TABLE_HEADERS = (
    "problems x samples",
    "samples/step",
    "step time s",
    "client CPU ms/step",
    "client CPU ms/1k samples",
    "engine loop ms/1k",
    "SDK thread ms/1k",
    "workers ms/1k",
    "GC ms/1k (full passes)",
    "client CPU % wall",
    "server CPU % wall",
    "peak RSS growth MB",
)


def table(points: Sequence[dict[str, Any]]) -> str:
    rows = []
    for p in sorted(points, key=lambda p: (p["samples_per_step"], p["batch"])):
        t = p["threads_ms_per_1k_samples"]
        rows.append(
            [
                p["workload"],
                str(p["samples_per_step"]),
                fmt(p["step_time_s"], ".2f"),
                fmt(p["cpu_ms_per_step"], ".0f"),
                fmt(p["cpu_ms_per_1k_samples"], ".0f"),
                fmt(t.get("main"), ".1f"),
                fmt(t.get("sdk"), ".0f"),
                fmt(t.get("workers"), ".1f"),
                f"{fmt(p['gc_ms_per_1k_samples'], '.0f')} ({p['gc_full_passes']})",
                fmt(100 * p["client_cpu_share"], ".1f"),
                fmt(None if p["server_cpu_share"] is None else 100 * p["server_cpu_share"], ".0f"),
                fmt(p["rss_growth_mb"], ".0f"),
            ]
        )
    return markdown_table(TABLE_HEADERS, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot is not None:
        try:
            saved = json.loads(args.replot.read_text())
            points, fits = saved["points"], saved["fit"]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--replot {args.replot}: not a scaling.json ({exc})")
        from benchmarks.plotting import plot_scaling

        print(f"plot: {plot_scaling(points, fits, args.out / 'scaling.png')}")
        return 0
    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        workloads = [_workload(s, args.max_tokens) for s in sizes]
        profile_size = None if args.profile is None else _workload(args.profile, args.max_tokens)
        from engine.local import LatencyProfile

        LatencyProfile.parse(args.latency)
    except ValueError as exc:
        parser.error(str(exc))
    out: Path = args.out
    profile_path = out / "scaling_profile.pstats"
    profile = None if profile_size is None else (profile_size, profile_path)
    context = run_context(vars(args))
    points = run_scaling(
        workloads=workloads,
        steps=args.steps,
        k=args.k,
        latency=args.latency,
        seed=args.seed,
        profile=profile,
        freeze_gc=args.gc_freeze,
    )
    context["load_average_end"] = load_average()
    fits = linear_fit(points)
    plots: list[str] = []
    if not args.no_plots:
        from benchmarks.plotting import plot_scaling

        plots.append(str(plot_scaling(points, fits, out / "scaling.png")))
    names = [Path(p).name for p in plots]  # relative to the JSON's own directory
    result: dict[str, Any] = {"context": context, "plots": names, "fit": fits, "points": points}
    if profile is not None:
        result["profile"] = {"size": args.profile, **profile_summary(profile_path)}
    write_json(out / "scaling.json", result)
    text = table(points) + "\n" + fit_table(fits)
    (out / "scaling.md").write_text(text)
    print(text)
    for path in plots:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
