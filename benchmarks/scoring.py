"""Scoring: one step's rewards through the engine's scorer, against the ideal.

    python -m benchmarks.scoring            # 8 groups x 6 responses, 3 repeats per config
    python -m benchmarks.scoring --quick    # 2 groups x 2 responses, 1 repeat

The scorer stage rewards every response of every arrived group concurrently. Two kinds
of slow reward, each scored as one step (all groups at once, as when a step's groups
arrive together):

* ``judge``: an ``async def`` reward that waits 0.25 s (a judge model over HTTP). Ideal:
  one call's latency, whatever the number of responses.
* ``cpu``: a plain reward that burns ~0.1 s of pure-Python CPU (a verifier), in worker
  threads (the GIL serialises them: the ideal is N x 0.1 s) and in 2 worker processes
  (ideal N x 0.1 s / 2 on 2 cores).

Reported: the step's scoring wall time (what ``time/score`` measures), the ideal and
their ratio. The single-call CPU cost is measured first in this process, so the ideal
follows the machine. Writes ``scoring.json`` and ``scoring.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.report import fmt, load_average, markdown_table, run_context, write_json
from engine.config.values import parse_score_workers
from engine.core.problems import Problem, RewardBreakdown, SeededSource
from engine.envs.scoring import Scorer

__all__ = ["main"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
JUDGE_S = 0.25
CPU_ITERATIONS = 2_000_000
"""Loop iterations of the CPU-bound reward (about 0.1 s of CPU here; measured per run)."""


class JudgeTask:
    """A reward that waits like a remote judge."""

    name = "judge"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"p{i}", i), seed, state)

    def prompt(self, problem: Problem) -> str:
        return problem.question

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:
        await anyio.sleep(JUDGE_S)
        return RewardBreakdown(1.0)


class CpuTask(JudgeTask):
    """A reward that burns CPU in pure Python (module level: picklable for processes)."""

    name = "cpu"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:  # type: ignore[override]
        return RewardBreakdown(float(burn(CPU_ITERATIONS) % 2))


def burn(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


async def _score_step(scorer: Scorer, groups: int, group: int) -> float:
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for g in range(groups):
            responses = [f"{g} {i}" for i in range(group)]
            tg.start_soon(scorer.score, Problem(g, f"p{g}", g), responses)
    return time.perf_counter() - start


def _measure(task: Any, workers: str, groups: int, group: int, repeats: int) -> list[float]:
    async def go() -> list[float]:
        scorer = Scorer(task, concurrency=64, workers=parse_score_workers(workers))
        await _score_step(scorer, 1, 4)  # warm-up: worker processes start, imports load
        return [await _score_step(scorer, groups, group) for _ in range(repeats)]

    return anyio.run(go)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scoring", description=__doc__)
    p.add_argument("--groups", type=int, default=8, help="groups per step (default 8)")
    p.add_argument("--group", type=int, default=6, help="responses per group (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="steps per config (default 3)")
    p.add_argument("--quick", action="store_true", help="2 x 2 responses, 1 repeat")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.group, args.repeats = 2, 2, 1
    n = args.groups * args.group
    start = time.process_time()
    burn(CPU_ITERATIONS)
    call_s = time.process_time() - start
    configs = [
        ("judge 0.25 s, async on the loop", JudgeTask(), "threads", JUDGE_S),
        ("cpu, worker threads", CpuTask(), "threads", n * call_s),
        ("cpu, 2 worker processes", CpuTask(), "processes:2", n * call_s / 2),
    ]
    rows, results = [], []
    for label, task, workers, ideal in configs:
        times = _measure(task, workers, args.groups, args.group, args.repeats)
        median = statistics.median(times)
        results.append({"config": label, "workers": workers, "times_s": times, "ideal_s": ideal})
        rows.append([label, str(n), fmt(median, ".2f"), fmt(ideal, ".2f"), fmt(median / ideal)])
        print(f"{label}: {median:.2f} s for {n} responses (ideal {ideal:.2f} s)", file=sys.stderr)
    headers = ("reward", "responses", "time/score s (median)", "ideal s", "x ideal")
    text = markdown_table(headers, rows)
    context = run_context(vars(args))
    context.update(cpu_call_s=call_s, load_average_end=load_average())
    write_json(args.out / "scoring.json", {"context": context, "results": results})
    (args.out / "scoring.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
