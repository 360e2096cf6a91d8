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

Reported per configuration, over the steady steps (step 2 to the last):

* steps/s as a pace: (n - 1) / (t_last - t_first) over the step end instants;
* cycles per step: the pace in latency clock cycles (1.0 is the clock's limit: one
  forward_backward + optim_step per cycle);
* server idle: the share of that window with no sample request and no training in
  flight (the time the model is asked nothing);
* straggler wait: the share of that window with no training in flight and at most a
  quarter of a step's episodes running (the rest of the step waits for its slowest
  episodes).

Writes ``multiturn.json`` and ``multiturn.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import anyio

from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from benchmarks.runners import TEMPERATURE, Target, bench_server
from engine import Engine, EngineConfig, StepResult
from engine.envs.examples import guess_sum
from engine.envs.messages import ChatGroup, MessageStep
from engine.envs.types import EnvContext, EnvGroupBuilder
from engine.local.latency import LatencyProfile
from engine.tasks import ArithmeticTask, Problem, ProblemSource
from engine.tasks.arithmetic import score_arithmetic
from engine.tasks.render import ChatMessage

__all__ = ["CONFIGS", "UnevenTask", "busy_share", "main", "summarize_run"]

CONFIGS: Mapping[str, tuple[str, int]] = {
    "sync": ("batch-synchronous (cookbook sync)", 0),
    "k1": ("engine K=1 (default)", 1),
    "k2": ("engine K=2", 2),
}
"""Configuration key -> (label, --max-steps-off-policy)."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_LATENCY = "mint"
MAX_TOKENS = 8


@dataclass
class EpisodeLog:
    """When an episode ran, and when it waited for the model (sample requests)."""

    start: float
    end: float | None = None
    sampling: list[tuple[float, float]] = field(default_factory=list)


class UnevenEnv:
    """An episode of ``length`` turns; a hint follows each reply but the last, after a
    ``tool_s`` wait on the ``slow`` turns. Times itself into ``log``."""

    def __init__(
        self, problem: Problem, length: int, slow: set[int], tool_s: float, log: list[EpisodeLog]
    ) -> None:
        self.problem = problem
        self.length = length
        self.slow = slow
        self.tool_s = tool_s
        self._log = log
        self._turns = 0
        self._reward = 0.0
        self._record: EpisodeLog | None = None
        self._asked = 0.0

    async def initial_messages(self) -> Sequence[ChatMessage]:
        now = time.perf_counter()
        self._record = EpisodeLog(now)
        self._log.append(self._record)
        self._asked = now
        return [{"role": "user", "content": self.problem.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        assert self._record is not None
        self._record.sampling.append((self._asked, time.perf_counter()))
        self._turns += 1
        reply = str(messages[-1].get("content", ""))
        if self._turns == 1:
            self._reward = score_arithmetic(reply, int(self.problem.answer)).total
        if self._turns in self.slow:
            await anyio.sleep(self.tool_s)
        if self._turns >= self.length:
            self._record.end = time.perf_counter()
            return MessageStep(reward=self._reward, done=True, metrics={"turns": self._turns})
        guess = guess_sum.parse_guess(reply)
        hint = guess_sum.feedback(guess, int(self.problem.answer)) if guess is not None else None
        self._asked = time.perf_counter()
        return MessageStep(messages=[{"role": "user", "content": hint or guess_sum.TOO_LOW}])


class UnevenTask:
    """Two-digit additions as :class:`UnevenEnv` episodes: lengths uniform in
    1..``max_turns`` per episode, a third of the turns slow (seeded by problem and
    episode, so every configuration plays the same episodes)."""

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
            slow = {t for t in range(1, length + 1) if rng.random() < 1 / 3}
            envs.append(UnevenEnv(problem, length, slow, self.tool_s, self.log))
        return ChatGroup(envs, context)


def busy_share(
    intervals: Sequence[tuple[float, float]], lo: float, hi: float, *, at_least: int = 1
) -> float:
    """The share of [lo, hi] during which at least ``at_least`` of ``intervals`` are open."""
    events = sorted(
        [(max(a, lo), 1) for a, b in intervals if b > lo and a < hi]
        + [(min(b, hi), -1) for a, b in intervals if b > lo and a < hi]
    )
    open_now, last, covered = 0, lo, 0.0
    for instant, delta in events:
        if open_now >= at_least:
            covered += instant - last
        open_now += delta
        last = instant
    return covered / (hi - lo) if hi > lo else 0.0


def summarize_run(
    results: Sequence[StepResult], log: Sequence[EpisodeLog], cycle_s: float
) -> dict[str, Any]:
    """Steps/s (pace over steps 2..n), cycles per step, server idle and straggler wait
    shares over the same window."""
    ends = [r.timeline.train_end for r in results]
    first, last = ends[1], ends[-1]
    pace = (last - first) / (len(ends) - 2)
    train = [(r.timeline.train_start, r.timeline.train_end) for r in results]
    sampling = [s for e in log for s in e.sampling]
    episodes = [(e.start, e.end) for e in log if e.end is not None]
    asked = busy_share([*sampling, *train], first, last)
    training = busy_share(train, first, last)
    # Waiting for stragglers: no training, and at most a quarter of a step's episodes
    # still running (the rest of the step is done and waits for them).
    crowd = math.ceil(len(episodes) / len(results) / 4) + 1
    working = busy_share([*train, *_overlapping(episodes, crowd)], first, last)
    return {
        "steps": len(results),
        "steady_steps": len(ends) - 1,
        "pace_s": pace,
        "steps_per_s": 1 / pace,
        "cycles_per_step": pace / cycle_s,
        "server_idle": 1 - asked,
        "straggler_wait": 1 - working,
        "training_share": training,
        "episodes": len(episodes),
        "turns": sum(len(e.sampling) for e in log),
        "mean_reward": sum(float(r.metrics.get("avg_reward", 0.0)) for r in results) / len(results),
    }


def _overlapping(intervals: Sequence[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    """The periods during which at least ``k`` of ``intervals`` are open."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    out: list[tuple[float, float]] = []
    open_now, since = 0, 0.0
    for instant, delta in events:
        before = open_now
        open_now += delta
        if before < k <= open_now:
            since = instant
        elif before >= k > open_now:
            out.append((since, instant))
    return out


def run_config(
    target: Target, key: str, *, steps: int, batch: int, group: int, tool_s: float, seed: int
) -> dict[str, Any]:
    """One engine run of the uneven workload in configuration ``key``."""
    _, k = CONFIGS[key]
    task = UnevenTask(tool_s)
    results: list[StepResult] = []

    async def go() -> None:
        with tempfile.TemporaryDirectory(prefix="engine-bench-multiturn-") as tmp:
            config = EngineConfig(
                base_url=target.base_url,
                api_key=target.api_key,
                steps=steps,
                batch=batch,
                group=group,
                max_tokens=MAX_TOKENS,
                temperature=TEMPERATURE,
                seed=seed,
                max_steps_off_policy=k,
                loss="importance_sampling" if k == 0 else "ppo",
                run_dir=Path(tmp) / "run",
                progress=False,
                env_max_turns=task.max_turns,
            )
            # Engine's task parameter is typed for single-turn tasks; it runs an EnvTask.
            engine_task: Any = task
            async with Engine(config, task=engine_task, on_step=results.append) as engine:
                await engine.run()

    anyio.run(go)
    profile = LatencyProfile.parse(target.latency)
    assert profile is not None
    return summarize_run(results, task.log, profile.cycle)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    base = rows.get("sync")
    for row in rows.values():
        row["speedup_vs_sync"] = row["steps_per_s"] / base["steps_per_s"] if base else None
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
