"""Sandbox throughput: runs per second of engine.sandbox and its overhead over a bare
subprocess of the same interpreter, on this machine.

    python -m benchmarks.sandbox                 # 40 runs per cell
    python -m benchmarks.sandbox --runs 10       # quicker
    python -m benchmarks.sandbox --backend unshare --runs 20   # without bubblewrap

Two workloads: ``print(1)`` (the cost of a run itself: bubblewrap, the launcher, the
interpreter's start) and 100 ms of CPU (a short test suite). Each runs ``--runs`` times
at concurrency 1 and at the CPU count, as a bare ``python -I -c`` subprocess (anyio's)
and in the sandbox (``Sandbox(max_concurrent=...)``), in rounds of that many runs at once,
bare and sandboxed rounds alternating (so a shared machine's drifting load falls on both).
Reported per cell: runs per second (runs / the rounds' wall time), each run's median wall
time, and the sandbox's overhead per run (its median minus the bare one). Writes
``sandbox.json`` and ``sandbox.md`` to ``--out`` (``--backend unshare``, the namespaces
made directly where bubblewrap is missing: ``sandbox_unshare.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from engine.common.cli import OneLineErrorParser, positive_int
from engine.sandbox import Sandbox, SandboxLimits, default_python
from engine.sandbox.isolation import BACKENDS, Backend

__all__ = ["WORKLOADS", "main", "measure"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
WORKLOADS = {
    "print(1)": "print(1)",
    "100 ms CPU": (
        "import time\nstart = time.process_time()\n"
        "while time.process_time() - start < 0.1:\n    pass\nprint(1)"
    ),
}
LIMITS = SandboxLimits(wall_s=60, cpu_s=10)


async def _round(code: str, size: int, sandbox: Sandbox | None, walls: list[float]) -> float:
    """``size`` runs at once, bare or in ``sandbox``; each run's wall time is appended to
    ``walls``; returns the round's wall time."""
    python = default_python()

    async def one() -> None:
        if sandbox is not None:
            result = await sandbox.run_python(code)
            if not result.ok:
                raise RuntimeError(f"a benchmark run failed: {result.reason}: {result.stderr}")
            walls.append(result.wall_s)
            return
        start = time.monotonic()
        await anyio.run_process([python, "-I", "-c", code], env={})
        walls.append(time.monotonic() - start)

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(size):
            tg.start_soon(one)
    return time.monotonic() - start


async def _cells(
    code: str, runs: int, concurrency: int, backend: Backend | None
) -> dict[str, dict[str, float]]:
    """Bare and sandboxed rounds of ``concurrency`` runs, alternated (load on a shared
    machine drifts: both see the same), until each has made ``runs`` runs."""
    sandbox = Sandbox(LIMITS, max_concurrent=concurrency, backend=backend)
    walls: dict[str, list[float]] = {"bare": [], "sandbox": []}
    spent = {"bare": 0.0, "sandbox": 0.0}
    done = 0
    while done < runs:
        size = min(concurrency, runs - done)
        spent["bare"] += await _round(code, size, None, walls["bare"])
        spent["sandbox"] += await _round(code, size, sandbox, walls["sandbox"])
        done += size
    return {
        mode: {
            "runs_per_s": round(runs / spent[mode], 2),
            "median_ms": round(1000 * statistics.median(walls[mode]), 1),
        }
        for mode in walls
    }


async def measure(
    runs: int, concurrencies: Sequence[int], backend: Backend | None = None
) -> list[dict[str, Any]]:
    async with Sandbox(LIMITS, backend=backend):  # refuses in one line where it cannot isolate
        pass
    rows = []
    for name, code in WORKLOADS.items():
        for concurrency in concurrencies:
            cells = await _cells(code, runs, concurrency, backend)
            bare, boxed = cells["bare"], cells["sandbox"]
            rows.append(
                {
                    "workload": name,
                    "concurrency": concurrency,
                    "runs": runs,
                    "bare": bare,
                    "sandbox": boxed,
                    "overhead_ms": round(boxed["median_ms"] - bare["median_ms"], 1),
                    "load_after": load_average(),
                }
            )
            print(f"{name} x{concurrency}: bare {bare} sandbox {boxed}", file=sys.stderr)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    return markdown_table(
        [
            "workload",
            "concurrency",
            "bare runs/s",
            "sandbox runs/s",
            "bare median ms",
            "sandbox median ms",
            "overhead ms/run",
        ],
        [
            [
                r["workload"],
                str(r["concurrency"]),
                fmt(r["bare"]["runs_per_s"], ".1f"),
                fmt(r["sandbox"]["runs_per_s"], ".1f"),
                fmt(r["bare"]["median_ms"], ".0f"),
                fmt(r["sandbox"]["median_ms"], ".0f"),
                fmt(r["overhead_ms"], ".0f"),
            ]
            for r in rows
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m benchmarks.sandbox",
        description="Sandbox runs per second and overhead over a bare subprocess.",
    )
    parser.add_argument("--runs", type=positive_int, default=40, help="runs per cell (default 40)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="isolate with this one (default: bubblewrap, else unshare)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where results go")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    context = run_context(vars(args))
    concurrencies = sorted({1, os.cpu_count() or 1})
    rows = anyio.run(measure, args.runs, concurrencies, args.backend)
    context["load_average_end"] = load_average()
    flags = ["--backend", args.backend] if args.backend else []
    stem = f"sandbox_{args.backend}" if args.backend == "unshare" else "sandbox"
    text = (
        f"`{command_line('benchmarks.sandbox', [*flags, '--runs', str(args.runs)])}` on "
        f"{context['cpus']} CPUs, {context['platform']}, commit {context['commit']}, "
        f"load {context['load_average_start']} -> {context['load_average_end']}.\n\n" + table(rows)
    )
    write_json(args.out / f"{stem}.json", {"context": context, "rows": rows})
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
