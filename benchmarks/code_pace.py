"""Does a code task keep the pipeline at the clock? RL cycles per step on the ``mint``
latency clock: the arithmetic task against a code task whose tests take ~100 ms.

    python -m benchmarks.code_pace                  # mint at hosted speed (10 s cycles), 12 steps
    python -m benchmarks.code_pace --quick          # 4 steps, 2x2x8, a 0.5 s clock (smoke test)

One local server with the packaged model and ``--latency`` (default ``mint:scale=1``:
the hosted clock's real 10 s cycle, so the tests' real 100 ms weigh against the cycle
as they would on hosted MinT; the benchmarks' usual ``scale=0.05`` would make them 20
times heavier) serves two runs of the engine's default configuration (K=1, submit-ahead
1) with the same workload, seed and problems:

* ``arithmetic``: the default task, scored in-process (microseconds);
* ``code``: the same problems as a code task (:class:`~engine.tasks.code.CodeTask`):
  each response runs in the sandbox as the program ``answer = <response as a string>``,
  whose setup spins 100 ms of CPU and whose four tests grade the answer as the
  arithmetic reward does (a number; within a half, a quarter of the sum's scale; exact).
  (The packaged model answers arithmetic, not code: a response as the program itself
  would be a syntax error that stops before the tests. This way every response costs a
  sandbox start and 100 ms of tests, and its rewards spread as arithmetic's do, so as
  many groups tie and skip training.)

Each run's pace is (t_last - t_first) / (n - 1) over the step ends after the warm-up
(:mod:`benchmarks.measure`), in seconds and clock cycles; ``time/score`` is each step's
scoring time. Writes ``code_pace_<workload>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.measure import pace, positive_int, steady
from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from benchmarks.runners import VARIANTS, Target, Workload, bench_server, engine_config
from engine import Engine, StepResult
from engine.core.problems import Problem, RewardBreakdown, Task
from engine.sandbox import SandboxLimits
from engine.tasks.arithmetic import MIN_DISTANCE_SCALE
from engine.tasks.code import CodeTask

__all__ = ["SPIN_S", "AnswerAsCode", "main", "measure_run"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
QUICK_LATENCY = "mint:scale=0.05"
SPIN_S = 0.1
"""CPU seconds each response's tests take in the sandbox."""
SETUP = (
    "import re, time\n_start = time.process_time()\n"
    f"while time.process_time() - _start < {SPIN_S}:\n    pass\n"
    "def first_int(text):\n    return int(re.search(r'-?\\d+', text).group())\n"
)
PROBLEMS = 512
"""Rows of the code task's file (the steps draw batch x steps of them)."""


class AnswerAsCode(CodeTask):
    """A code task whose program is ``answer = <the response as a string literal>``."""

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:
        return await super().score(f"answer = {response!r}\n", problem)


def tests_of(answer: int) -> list[str]:
    """Tests that grade an answer as the arithmetic reward does: a number, its
    closeness (within a half, a quarter of the answer's scale), exactness."""
    scale = max(abs(answer), MIN_DISTANCE_SCALE)
    return [
        "assert re.search(r'-?\\d+', answer)",
        f"assert abs(first_int(answer) - {answer}) <= {scale / 2}",
        f"assert abs(first_int(answer) - {answer}) <= {scale / 4}",
        f"assert first_int(answer) == {answer}",
    ]


def code_problems(task: Task, path: Path, count: int, seed: int) -> Path:
    """``count`` of ``task``'s problems (its training draws for ``seed``) as code
    problems: its prompt, the spinning setup, one test of the answer."""
    source = task.source(seed)
    with path.open("w") as f:
        for _ in range(count):
            problem = source.next()
            assert problem is not None  # the arithmetic source never runs out
            row = {
                "prompt": task.prompt(problem),
                "test_setup_code": SETUP,
                "tests": tests_of(int(problem.answer)),
            }
            f.write(json.dumps(row) + "\n")
    return path


def measure_run(
    target: Target, task: Task, name: str, *, workload: Workload, steps: int, seed: int, out: Path
) -> dict[str, Any]:
    """One RL run of ``task`` in the engine's default configuration: step ends, the
    steady pace in seconds and cycles, each step's scoring time."""
    ends: list[float] = []
    score_s: list[float] = []
    rewards: list[float] = []
    datums: list[int] = []

    def on_step(result: StepResult) -> None:
        ends.append(result.timeline.train_end)
        score_s.append(float(result.metrics["time/score"]))
        rewards.append(float(result.metrics["env/all/reward/total"]))
        datums.append(int(result.metrics["datums"]))

    async def go() -> None:
        config = engine_config(
            target, workload, VARIANTS["k1"], steps=steps, seed=seed, run_dir=out / name
        )
        async with Engine(config, task=task, on_step=on_step) as engine:
            await engine.run()

    anyio.run(go)
    steady_ends = steady(ends)
    seconds = pace(steady_ends)
    cycle = target.cycle_s
    return {
        "task": name,
        "steps": len(ends),
        "steady_steps": len(steady_ends),
        "step_ends_s": [e - ends[0] for e in ends],
        "pace_s": seconds,
        "cycles_per_step": seconds / cycle if cycle else None,
        "score_s_median": statistics.median(score_s),
        "score_s_max": max(score_s),
        "reward_mean": statistics.fmean(rewards),
        "datums": datums,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.code_pace",
        description="RL cycles per step on the mint clock: arithmetic vs a code task "
        "whose tests take ~100 ms.",
    )
    p.add_argument("--steps", type=positive_int, default=12, help="steps per run (default 12)")
    p.add_argument(
        "--workload",
        type=Workload.parse,
        default=Workload(8, 6, 16),
        metavar="BxGxT",
        help="batch x group x max tokens (default 8x6x16)",
    )
    p.add_argument("--latency", default="mint:scale=1", metavar="PROFILE", help="mint:scale=1")
    p.add_argument("--seed", type=int, default=42, help="problem and sampling seed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--quick", action="store_true", help=f"4 steps of 2x2x8, {QUICK_LATENCY}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.steps, args.workload, args.latency = 4, Workload(2, 2, 8), QUICK_LATENCY
    context = run_context({**vars(args), "workload": args.workload.name})
    with bench_server(args.latency) as target, tempfile.TemporaryDirectory() as tmp:
        arithmetic = target.task()
        problems = code_problems(arithmetic, Path(tmp) / "code.jsonl", PROBLEMS, args.seed)
        code = AnswerAsCode(
            problems, chat=False, eval_size=0, limits=SandboxLimits(wall_s=30.0, cpu_s=10.0)
        )
        runs = [
            measure_run(
                target,
                task,
                name,
                workload=args.workload,
                steps=args.steps,
                seed=args.seed,
                out=Path(tmp),
            )
            for name, task in (("arithmetic", arithmetic), ("code", code))
        ]
        cycle = target.cycle_s
    context["load_average_end"] = load_average()
    ratio = runs[1]["pace_s"] / runs[0]["pace_s"]
    headers = (
        "task",
        "steps",
        "pace s/step",
        "cycles/step",
        "time/score median s",
        "max s",
        "mean reward",
        "steps trained",
    )
    rows = [
        [
            r["task"],
            str(r["steps"]),
            fmt(r["pace_s"], ".2f"),
            fmt(r["cycles_per_step"], ".2f"),
            fmt(r["score_s_median"], ".2f"),
            fmt(r["score_s_max"], ".2f"),
            fmt(r["reward_mean"], ".2f"),
            str(sum(d > 0 for d in r["datums"])),
        ]
        for r in runs
    ]
    text = (
        f"`{command_line('benchmarks.code_pace', argv)}` on {context['cpus']} CPUs, commit "
        f"{context['commit']}, workload {args.workload.name}, latency {args.latency}, load "
        f"{context['load_average_start']} -> {context['load_average_end']}.\n\n"
        + markdown_table(headers, rows)
        + f"\ncode / arithmetic pace: {ratio:.2f}\n"
    )
    stem = f"code_pace_{args.workload.name}"
    write_json(
        args.out / f"{stem}.json",
        {"context": context, "cycle_s": cycle, "ratio": ratio, "runs": runs},
    )
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
