"""Start-up: process start to the first and the Nth trained step, engine vs quickstart.

    python -m benchmarks.startup                       # 8x6x16, 10 steps, mint profile
    python -m benchmarks.startup --workload 32x8x16 --steps 10 --latency mint

One local server (a child process, latency profile ``--latency``) serves both loops, one
after the other, each in a fresh Python process started by this one: ``python -m
engine.run`` (the CLI, default settings, the server's recommended ones for the rest) and
the quickstart loop (``benchmarks.quickstart_loop``, the same workload and settings).
Each ``Step N:`` line is stamped when it arrives, in seconds since its process was
started, so imports, connecting, the session, the step-0 checkpoint and the pipeline's
fill all count. Reported per loop: time to the first step, to the last, the pace over
the steps after the first two ((t_last - t_first) / (n - 1)) in seconds and clock
cycles, and the engine's speedup to the last step. Writes ``startup.json`` and
``startup.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.measure import pace, steady
from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from benchmarks.runners import TEMPERATURE, Target, Workload, bench_server
from benchmarks.stamp import stamp_steps

__all__ = ["main", "run_startup"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
CHILD_TIMEOUT_S = 900.0
"""A loop process that has not finished by then is killed (a hung server)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.startup",
        description="Process start to the first and last step: engine CLI vs quickstart loop.",
    )
    p.add_argument("--steps", type=int, default=10, help="steps per loop (default 10)")
    p.add_argument("--workload", default="8x6x16", metavar="BxGxT", help="default 8x6x16")
    p.add_argument("--latency", default="mint", metavar="PROFILE", help="default mint")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where results go")
    p.add_argument("--quickstart-child", help=argparse.SUPPRESS)
    return p


def _quickstart_child(spec: str) -> int:
    """Run the quickstart loop in this (fresh) process, printing its lines."""
    from benchmarks.quickstart_loop import run_quickstart_loop

    run_quickstart_loop(**json.loads(spec), echo=lambda line: print(line, flush=True))
    return 0


def _timed(command: list[str], env: dict[str, str]) -> dict[int, float]:
    """Run ``command``; step number -> seconds from its start (the stamps start right
    after the process is spawned) to its ``Step N:`` line."""
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as process:
        assert process.stdout is not None
        with open(os.devnull, "w") as sink:
            stamps = stamp_steps(process.stdout, sink)
        code = process.wait(timeout=CHILD_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {code}")
    return stamps


def run_startup(target: Target, workload: Workload, *, steps: int) -> list[dict[str, Any]]:
    """Both loops against ``target``: one row per loop."""
    profile, task = target.profile, target.task()
    assert profile.lora_rank is not None and profile.learning_rate is not None
    env = {
        **os.environ,
        "MINT_BASE_URL": target.base_url,
        "MINT_API_KEY": target.api_key,
        "PYTHONUNBUFFERED": "1",
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="engine-startup-") as tmp:
        engine_cmd = [
            sys.executable,
            "-m",
            "engine.run",
            "--steps",
            str(steps),
            "--batch",
            str(workload.batch),
            "--group",
            str(workload.group),
            "--max-tokens",
            str(workload.max_tokens),
            "--run-dir",
            str(Path(tmp) / "run"),
        ]
        spec = {
            "base_url": target.base_url,
            "api_key": target.api_key,
            "base_model": target.model_name,
            "rank": profile.lora_rank,
            "steps": steps,
            "batch": workload.batch,
            "group": workload.group,
            "lr": profile.learning_rate,
            "max_tokens": workload.max_tokens,
            "temperature": TEMPERATURE,
            "op": task.op,
            "min_operand": task.min_operand,
            "max_operand": task.max_operand,
        }
        quickstart_cmd = [
            sys.executable,
            "-m",
            "benchmarks.startup",
            "--quickstart-child",
            json.dumps(spec),
        ]
        for name, command in (("quickstart loop", quickstart_cmd), ("engine CLI", engine_cmd)):
            print(f"[startup {workload.name}] {name}...", file=sys.stderr, flush=True)
            stamps = _timed(command, env)
            ends = [stamps[s] for s in sorted(stamps)]
            rows.append(_row(name, ends, steps, target.cycle_s))
    baseline = rows[0]["last_step_s"]
    for row in rows:
        row["speedup_to_last"] = baseline / row["last_step_s"] if row["last_step_s"] else None
    return rows


def _row(name: str, ends: list[float], steps: int, cycle: float | None) -> dict[str, Any]:
    if len(ends) != steps:
        raise RuntimeError(f"{name}: {len(ends)} step lines read, {steps} expected")
    steady_ends = steady(ends)
    seconds = pace(steady_ends) if len(steady_ends) >= 2 else None
    return {
        "loop": name,
        "step_ends_s": ends,
        "first_step_s": ends[0],
        "last_step_s": ends[-1],
        "pace_s": seconds,
        "cycles_per_step": seconds / cycle if seconds is not None and cycle else None,
    }


HEADERS = (
    "loop",
    "first step s",
    "last step s",
    "pace s/step (steps 3..n)",
    "cycles/step",
    "x quickstart (to last step)",
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    return markdown_table(
        HEADERS,
        [
            [
                r["loop"],
                fmt(r["first_step_s"], ".1f"),
                fmt(r["last_step_s"], ".1f"),
                fmt(r["pace_s"], ".2f"),
                fmt(r["cycles_per_step"], ".2f"),
                fmt(r["speedup_to_last"], ".2f"),
            ]
            for r in rows
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quickstart_child is not None:
        return _quickstart_child(args.quickstart_child)
    try:
        workload = Workload.parse(args.workload)
    except ValueError as exc:
        parser.error(str(exc))
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    context = run_context(vars(args))
    with bench_server(args.latency) as target:
        rows = run_startup(target, workload, steps=args.steps)
    context["load_average_end"] = load_average()
    text = table(rows)
    write_json(args.out / "startup.json", {"context": context, "rows": rows})
    (args.out / "startup.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
