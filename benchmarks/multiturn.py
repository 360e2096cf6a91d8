"""Multi-turn throughput: episodes of uneven length, the engine against a
batch-synchronous loop, on the hosted-like latency clock, side by side on one server.

    python -m benchmarks.multiturn                  # 10 steps per configuration
    python -m benchmarks.multiturn --quick          # 4 steps (smoke test)

The workload (:class:`UnevenTask`): every episode opens with an addition question and
runs a length drawn uniformly from 1..``max_turns`` (6) turns, each a short reply of
the model followed by a hint (``Too high.``/``Too low.``, the guessing game's); after a
reply, a *slow tool* answers on a third of the turns (``tool_s`` hosted seconds, one
clock cycle by default). The reward is the arithmetic reward of the first reply, so
groups differ and every step trains.

Configurations, each a full engine run on the same server, problems and seed:

* ``sync``: the batch-synchronous schedule of tinker-cookbook's sync mode: every
  episode of step s finishes before step s trains, and step s+1 samples only from
  step s's weights (the engine at ``--max-steps-off-policy 0``);
* ``k1`` / ``k2``: the engine's default (off-by-1) and off-by-2: episodes of the next
  steps start while this step's slowest episode and its training run.

Reported per configuration over the steady steps (defined in
:mod:`benchmarks.episode_runs`): steps/s, cycles per step, server idle, straggler wait.

Writes ``multiturn.json`` and ``multiturn.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.episode_runs import (
    BenchParser,
    EpisodeLog,
    ScriptedEnv,
    run_engine,
    speedups,
    summarize_run,
)
from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from benchmarks.runners import Target, bench_server
from engine.envs.messages import ChatGroup
from engine.envs.types import EnvContext, EnvGroupBuilder
from engine.local.latency import LatencyProfile
from engine.tasks import ArithmeticTask, Problem, ProblemSource

__all__ = ["CONFIGS", "UnevenTask", "main"]

CONFIGS: Mapping[str, tuple[str, int]] = {
    "sync": ("batch-synchronous (cookbook sync)", 0),
    "k1": ("engine K=1 (default)", 1),
    "k2": ("engine K=2", 2),
}
"""Configuration key -> (label, --max-steps-off-policy)."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_LATENCY = "mint"
MAX_TOKENS = 8


class UnevenTask:
    """Two-digit additions as :class:`~benchmarks.episode_runs.ScriptedEnv` episodes:
    lengths uniform in 1..``max_turns`` per episode, a third of the turns slow (seeded by
    problem and episode, so every configuration plays the same episodes)."""

    def __init__(self, tool_s: float, max_turns: int = 6) -> None:
        self.name = "uneven-episodes"
        self.tool_s = tool_s
        self.max_turns = max_turns
        self.problems = ArithmeticTask("+", 10, 99)
        self.log: list[EpisodeLog] = []

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self.problems.source(seed, state)

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        envs = []
        for index in range(group_size):
            rng = random.Random(f"{problem.id}:{index}")
            length = rng.randint(1, self.max_turns)
            waits = {t: self.tool_s for t in range(1, length + 1) if rng.random() < 1 / 3}
            envs.append(ScriptedEnv(problem, length, waits, self.log))
        return ChatGroup(envs, context)


def run_config(
    target: Target, key: str, *, steps: int, batch: int, group: int, tool_s: float, seed: int
) -> dict[str, Any]:
    """One engine run of the uneven workload in configuration ``key``."""
    _, k = CONFIGS[key]
    task = UnevenTask(tool_s)
    results = run_engine(
        target,
        task,
        k=k,
        steps=steps,
        batch=batch,
        group=group,
        seed=seed,
        max_turns=task.max_turns,
        max_tokens=MAX_TOKENS,
    )
    profile = LatencyProfile.parse(target.latency)
    assert profile is not None
    return summarize_run(results, task.log, profile.cycle)


def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(
        prog="python -m benchmarks.multiturn",
        description="Steps/s of the engine vs a batch-synchronous loop on multi-turn episodes "
        "of uneven length (1-6 turns, a slow tool on some turns), hosted-like latency.",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 10; quick 4)")
    p.add_argument("--batch", type=int, default=8, help="problems per step")
    p.add_argument("--group", type=int, default=4, help="episodes per problem")
    p.add_argument(
        "--latency", default=DEFAULT_LATENCY, help="the server's --latency profile (not off)"
    )
    p.add_argument(
        "--tool-cycles",
        type=float,
        default=1.0,
        help="a slow tool's wait, in latency clock cycles (default 1)",
    )
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 steps per configuration")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    steps = args.steps if args.steps is not None else (4 if args.quick else 10)
    if steps < 3 or args.batch < 1 or args.group < 2 or args.tool_cycles < 0:
        build_parser().error("--steps >= 3, --batch >= 1, --group >= 2, --tool-cycles >= 0")
    profile = LatencyProfile.parse(args.latency)
    if profile is None:
        build_parser().error("--latency must be a profile (the benchmark measures the clock)")
    tool_s = args.tool_cycles * profile.cycle
    context = run_context(vars(args))
    rows: dict[str, dict[str, Any]] = {}
    with bench_server(args.latency) as target:
        for key in args.configs:
            print(f"{key}: {steps} steps of {args.batch}x{args.group} episodes...", file=sys.stderr)
            rows[key] = run_config(
                target,
                key,
                steps=steps,
                batch=args.batch,
                group=args.group,
                tool_s=tool_s,
                seed=args.seed,
            )
    context["load_average_end"] = load_average()
    speedups(rows, "sync")
    table = markdown_table(
        ["config", "steps/s", "vs sync", "cycles/step", "server idle", "straggler wait"],
        [
            [
                CONFIGS[key][0],
                fmt(r["steps_per_s"], ".3f"),
                fmt(r["speedup_vs_sync"], ".2f") + "x" if r["speedup_vs_sync"] else "n/a",
                fmt(r["cycles_per_step"], ".2f"),
                fmt(r["server_idle"], ".0%"),
                fmt(r["straggler_wait"], ".0%"),
            ]
            for key, r in rows.items()
        ],
    )
    out: Path = args.out
    write_json(out / "multiturn.json", {"context": context, "cycle_s": profile.cycle, "runs": rows})
    command = command_line("benchmarks.multiturn", argv)
    (out / "multiturn.md").write_text(
        f"# Multi-turn throughput\n\n`{command}`\n\n{table}\n"
        f"Load average at start {context['load_average_start']}, at end "
        f"{context['load_average_end']}; cycle {profile.cycle:g} s; commit {context['commit']}.\n"
    )
    print(table)


if __name__ == "__main__":
    main()
