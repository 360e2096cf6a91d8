"""Supervised fine-tuning on the hosted-like clock: does ``--objective sft`` keep the
server's clock full?

    python -m benchmarks.sft_pace                   # mint profile, 20 steps, --submit-ahead 1 and 0
    python -m benchmarks.sft_pace --quick           # 4 steps on a 100x faster clock (smoke test)

One local server with ``--latency mint`` (hosted MinT's 10 s training cycle, time-scaled
to 0.5 s) serves every run; each run is docs/sft.md's command (examples/sft_repeat.jsonl,
batch 16, lr 2e-3, no evaluation) with one ``--submit-ahead`` value. Its pace is measured
as RL's is (:mod:`benchmarks.measure`): (t_last - t_first) / (n - 1) over the step ends
after the warm-up, in seconds and in clock cycles per step, beside the clock floor.
Nothing is sampled, so only ``--submit-ahead`` bounds the steps in flight: with 1 (the
default) step s+1's forward_backward is submitted before step s's result returns and the
floor is one cycle per step; with 0 each step is awaited before the next is submitted.
Writes ``sft_pace.json`` and ``sft_pace.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.measure import clock_floor, pace, positive_int, steady
from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from benchmarks.runners import Target, bench_server
from engine import Engine, EngineConfig, StepResult

__all__ = ["main", "measure_sft"]

DATA = Path(__file__).resolve().parent.parent / "examples" / "sft_repeat.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_LATENCY = "mint:scale=0.01"
"""--quick: a 10 s hosted cycle lasts 0.1 s."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sft_pace",
        description="SFT steps per latency-clock cycle, by --submit-ahead.",
    )
    p.add_argument("--steps", type=positive_int, default=20, help="steps per run (default 20)")
    p.add_argument("--batch", type=positive_int, default=16, help="conversations per step")
    p.add_argument(
        "--submit-ahead",
        type=int,
        nargs="+",
        default=[1, 0],
        metavar="N",
        help="one run per value (default 1 0)",
    )
    p.add_argument("--latency", default="mint", metavar="PROFILE", help="default mint")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--quick", action="store_true", help=f"4 steps, batch 4, {QUICK_LATENCY}")
    return p


def measure_sft(
    target: Target, *, steps: int, batch: int, submit_ahead: int, out: Path
) -> dict[str, Any]:
    """One SFT run against ``target``: each step's end (seconds since the first step's
    training began), the steady pace and, on a clocked server, the pace in cycles and
    the clock floor."""
    ends: list[float] = []
    starts: list[float] = []

    def on_step(result: StepResult) -> None:
        starts.append(result.timeline.train_start)
        ends.append(result.timeline.train_end)

    async def go() -> None:
        config = EngineConfig(
            base_url=target.base_url,
            api_key=target.api_key,
            objective="sft",
            task=f"jsonl:{DATA}",
            steps=steps,
            batch=batch,
            learning_rate=2e-3,
            submit_ahead=submit_ahead,
            run_dir=out / f"run-submit-ahead-{submit_ahead}",
            progress=False,
        )
        async with Engine(config, on_step=on_step) as engine:
            await engine.run()

    anyio.run(go)
    steady_ends = steady(ends)
    seconds = pace(steady_ends)
    cycle = target.cycle_s
    # Nothing is sampled: --submit-ahead alone bounds the steps in flight.
    floor = clock_floor(len(steady_ends), cycle, submit_ahead + 1) if cycle else None
    return {
        "submit_ahead": submit_ahead,
        "steps": len(ends),
        "steady_steps": len(steady_ends),
        "step_ends_s": [e - starts[0] for e in ends],
        "pace_s": seconds,
        "cycles_per_step": seconds / cycle if cycle else None,
        "clock_floor_s": floor,
        "efficiency": floor / seconds if floor else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.latency = 4, 4, QUICK_LATENCY
    context = run_context(vars(args))
    with bench_server(args.latency) as target, tempfile.TemporaryDirectory() as tmp:
        runs = [
            measure_sft(target, steps=args.steps, batch=args.batch, submit_ahead=n, out=Path(tmp))
            for n in args.submit_ahead
        ]
        cycle = target.cycle_s
    context["load_average_end"] = load_average()
    headers = ("--submit-ahead", "steps", "pace s/step", "cycles/step", "clock floor s")
    rows = [
        [
            str(r["submit_ahead"]),
            str(r["steps"]),
            fmt(r["pace_s"], ".3f"),
            fmt(r["cycles_per_step"], ".2f"),
            fmt(r["clock_floor_s"], ".3f"),
        ]
        for r in runs
    ]
    text = markdown_table(headers, rows)
    write_json(args.out / "sft_pace.json", {"context": context, "cycle_s": cycle, "runs": runs})
    (args.out / "sft_pace.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
