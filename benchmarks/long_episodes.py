"""Heavy-tailed agent episodes: how today's schedule copes with stragglers. The engine's
configurations against a batch-synchronous loop, on the hosted-like latency clock, side
by side on one local server, with the workload run as a native environment and as an
unmodified ``openai`` agent through the capturing endpoint.

    python -m benchmarks.long_episodes              # 12 steps of 4 x 4 per configuration and agent
    python -m benchmarks.long_episodes --quick      # 3 steps of 4 x 2 episodes (smoke test)

The clock: ``mint:scale=0.3`` (a 3 s cycle; ``--quick``: ``mint``, 0.5 s), so that the
local server's real compute (1.5-2.5 s per step of 4 x 4 episodes on a 2-core machine) is
a small share of a step and the figures are the schedule's, not the machine's (each
row's ``server_compute_share``).

The workload (:func:`draw_episode`, seeded by problem and episode, so every configuration
and both agents play the same episodes): an addition question, then a number of turns
drawn from a log-normal distribution (median ``3``, sigma ``1.2``: p99 about 49), each a
short reply of the model; after every reply but the last a tool answers (a hint, the
guessing game's ``Too high.``/``Too low.``) after a wait drawn from a log-normal
distribution (median a quarter of a clock cycle, sigma ``1.1``: p99 about 13x the median;
real sleeps, on the clock's scaled time). The model's context (the packaged agent model's
512 byte tokens: some 20 turns) and the run's ``--env-max-turns`` (32) truncate the longer
episodes (outcome ``max_tokens`` or ``max_turns``, reward 0: a mix of finished and
truncated episodes; the table's notes give the turns as drawn and as played). The
reward is the arithmetic reward of the first reply, so groups differ.

* ``native``: a message environment (:class:`~benchmarks.episode_runs.ScriptedEnv` in a
  :class:`~engine.envs.messages.ChatGroup`): the engine runs the tool.
* ``openai``: :class:`LongAgent`, an agent that only knows the ``openai`` SDK (each turn a
  ``chat.completions.create`` call to the capturing endpoint, the tool its own sleep),
  trained as an :class:`~engine.agents.AgentTask`.

Configurations, each a full engine run on the same server, problems and seed: ``sync``
(the batch-synchronous schedule: K=0, every episode of step s finishes before s trains,
and s+1 samples only from s's weights), ``default`` (the engine's defaults: K=1), ``k2``
and ``k4`` (``--max-steps-off-policy`` 2 and 4), ``c1`` and ``c2`` (``--step-order
completion`` at K=1 and 2: a step trains the first groups to finish in the window), and
``wWkK`` (completion order with ``--start-window`` W below K: a drawn step's groups
start once the newest weights are at most W steps behind it, and a straggler may train
up to K - W steps after its step). A plain run measures sync, default, k2, w2k3 and
w2k6.

Reported per configuration and agent, over the steady steps (:mod:`benchmarks.episode_runs`):
steps/s and ``x_sync`` (over the synchronous loop's, same agent), cycles per step, server
busy share (1 - idle), straggler share (the window's share with no training in flight and
at most a quarter of a step's episodes still running), the staleness histogram per turn
and per trajectory (steps behind the training step, from the sampler versions the engine
records), sampled tokens per trained token, and discarded episodes (started, never
trained: a tied group is skipped today). Writes ``long_episodes.json``,
``long_episodes.md`` and (with matplotlib) ``long_episodes.png``, a timeline of the
native workload's episodes under ``sync``, ``default`` and ``w2k6`` (those measured), to
``--out``.
"""

from __future__ import annotations

import importlib.util
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.episode_runs import (
    BenchParser,
    EpisodeLog,
    ScriptedEnv,
    run_engine,
    speedups,
    staleness,
    summarize_run,
    volumes,
)
from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from benchmarks.runners import Target, bench_server, server_counters
from engine import StepResult
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.common.extras import missing
from engine.envs.examples import guess_sum
from engine.envs.messages import ChatGroup
from engine.envs.types import EnvContext, EnvGroupBuilder
from engine.local.latency import LatencyProfile, LatencyProfileError
from engine.tasks import ArithmeticTask, Problem, ProblemSource
from engine.tasks.arithmetic import score_arithmetic

__all__ = ["AGENTS", "CONFIGS", "LongAgent", "LongEpisodesTask", "draw_episode", "main"]

CONFIGS: Mapping[str, tuple[str, int | None, Mapping[str, Any]]] = {
    "sync": ("batch-synchronous (K=0)", 0, {}),
    "default": ("engine default (K=1)", None, {}),
    "k2": ("engine K=2", 2, {}),
    "k4": ("engine K=4", 4, {}),
    "c1": ("completion order, K=1", 1, {"step_order": "completion"}),
    "c2": ("completion order, K=2", 2, {"step_order": "completion"}),
    "w1k2": ("completion order, W=1, K=2", 2, {"step_order": "completion", "start_window": 1}),
    "w1k3": ("completion order, W=1, K=3", 3, {"step_order": "completion", "start_window": 1}),
    "w2k3": ("completion order, W=2, K=3", 3, {"step_order": "completion", "start_window": 2}),
    "w2k4": ("completion order, W=2, K=4", 4, {"step_order": "completion", "start_window": 2}),
    "w2k6": ("completion order, W=2, K=6", 6, {"step_order": "completion", "start_window": 2}),
    "w3k6": ("completion order, W=3, K=6", 6, {"step_order": "completion", "start_window": 3}),
    "w4k6": ("completion order, W=4, K=6", 6, {"step_order": "completion", "start_window": 4}),
}
"""Configuration key -> (label, --max-steps-off-policy (None: the engine's default),
further settings: --step-order, --start-window W)."""
DEFAULT_CONFIGS = ("sync", "default", "k2", "w2k3", "w2k6")
"""What a plain run measures (``--configs`` picks others)."""
PICTURED = ("sync", "default", "w2k6")
"""The configurations whose native timeline the picture shows."""
AGENTS = ("native", "openai")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_LATENCY = "mint:scale=0.3"
QUICK_LATENCY = "mint"
MAX_TOKENS = 8
MAX_TURNS = 32
"""--env-max-turns: the episodes drawn longer are truncated."""

TURNS_MEDIAN, TURNS_SIGMA = 3.0, 1.2
TOOL_MEDIAN_CYCLES, TOOL_SIGMA = 0.25, 1.1


def draw_episode(problem_id: int, index: int, cycle_s: float) -> tuple[int, dict[int, float]]:
    """Episode ``index`` of problem ``problem_id``: its turns (before truncation) and the
    tool's wait in seconds after each turn but the last (``cycle_s``: the clock cycle)."""
    rng = random.Random(f"long:{problem_id}:{index}")
    turns = max(1, round(rng.lognormvariate(math.log(TURNS_MEDIAN), TURNS_SIGMA)))
    median_s = TOOL_MEDIAN_CYCLES * cycle_s
    waits = {t: rng.lognormvariate(math.log(median_s), TOOL_SIGMA) for t in range(1, turns)}
    return turns, waits


def _key(problem_id: int, index: int) -> str:
    return f"{problem_id}:{index}"


def _problem_and_index(key: str) -> tuple[int, int]:
    problem, index = key.split(":")
    return int(problem), int(index)


class LongEpisodesTask:
    """Two-digit additions as heavy-tailed :class:`~benchmarks.episode_runs.ScriptedEnv`
    episodes (:func:`draw_episode`), the engine running the tool."""

    def __init__(self, cycle_s: float, max_turns: int = MAX_TURNS) -> None:
        self.name = "long-episodes"
        self.cycle_s = cycle_s
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
            turns, waits = draw_episode(problem.id, index, self.cycle_s)
            key = _key(problem.id, index)
            envs.append(ScriptedEnv(problem, turns, waits, self.log, cap=self.max_turns, key=key))
        return ChatGroup(envs, context)


class LongAgent:
    """The same episodes as an agent on the ``openai`` SDK alone: each turn a chat
    completion, then (but after the last) its tool (a sleep) and the hint as the next
    user message; the reward is the first reply's. Its episodes of a problem are numbered
    in the order they start (a group starts its agents in order). Times itself into
    ``log``."""

    def __init__(self, cycle_s: float) -> None:
        self.cycle_s = cycle_s
        self.log: list[EpisodeLog] = []
        self._started: Counter[int] = Counter()

    async def __call__(self, client: Any, problem: Problem) -> float:
        index = self._started[problem.id]
        self._started[problem.id] += 1
        turns, waits = draw_episode(problem.id, index, self.cycle_s)
        record = EpisodeLog(time.perf_counter(), key=_key(problem.id, index))
        self.log.append(record)
        # A call past the run's turn limit is refused (409): no retries, so that the record
        # ends when the episode did.
        client = client.with_options(max_retries=0)
        messages: list[dict[str, str]] = [{"role": "user", "content": problem.question}]
        reward = 0.0
        try:
            for turn in range(1, turns + 1):
                asked = time.perf_counter()
                response = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=MAX_TOKENS
                )
                record.sampling.append((asked, time.perf_counter()))
                reply = response.choices[0].message.content or ""
                if turn == 1:
                    reward = score_arithmetic(reply, int(problem.answer)).total
                if turn == turns:
                    break
                await anyio.sleep(waits[turn])
                guess = guess_sum.parse_guess(reply)
                answer = int(problem.answer)
                hint = guess_sum.feedback(guess, answer) if guess is not None else None
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": hint or guess_sum.TOO_LOW},
                ]
            return reward
        finally:
            record.end = time.perf_counter()


def _agent_task(cycle_s: float) -> tuple[Any, list[EpisodeLog]]:
    from engine.agents import AgentTask

    agent = LongAgent(cycle_s)
    task = AgentTask(agent, ArithmeticTask("+", 10, 99), name="long-episodes", local_model=None)
    return task, agent.log


def workload(
    log: Sequence[EpisodeLog], results: Sequence[StepResult], cycle_s: float
) -> dict[str, Any]:
    """The episodes a run started as drawn (turns before truncation, the tool's waits in
    clock cycles) and as played (the turns of the trajectories its steps scored, and the
    share that a limit cut: the turn limit, or the model's context)."""
    draws = [draw_episode(*_problem_and_index(e.key), cycle_s) for e in log]
    drawn = sorted(turns for turns, _ in draws)
    waits = sorted(w / cycle_s for _, ws in draws for w in ws.values())
    played = sorted(len(t.turns) for r in results for g in r.groups for t in g.trajectories)
    cut = sum(t.outcome != "done" for r in results for g in r.groups for t in g.trajectories)

    def q(values: Sequence[float], share: float) -> float:
        return values[min(len(values) - 1, int(share * len(values)))]

    return {
        "episodes": len(drawn),
        "turns_median": statistics.median(drawn),
        "turns_p90": q(drawn, 0.9),
        "turns_p99": q(drawn, 0.99),
        "turns_max": drawn[-1],
        "tool_median_cycles": statistics.median(waits) if waits else None,
        "tool_p99_cycles": q(waits, 0.99) if waits else None,
        "played_median": statistics.median(played),
        "played_p99": q(played, 0.99),
        "played_max": played[-1],
        "truncated_share": cut / len(played),
    }


def timeline(
    results: Sequence[StepResult], log: Sequence[EpisodeLog], *, first: int, last: int
) -> dict[str, Any]:
    """Steps ``first``..``last`` (1-based) of a run for the picture: each episode of those
    steps (its step, start and end) and each step's training, in seconds since the first
    of them started."""
    step_of = {
        _key(g.problem.id, i): r.step
        for r in results
        for g in r.groups
        for i in range(len(g.trajectories))
    }
    episodes = [
        (step_of[e.key], e.start, e.end)
        for e in log
        if e.end is not None and first <= step_of.get(e.key, 0) <= last
    ]
    t0 = min(start for _, start, _ in episodes)
    return {
        "episodes": [[s, a - t0, b - t0] for s, a, b in sorted(episodes, key=lambda e: e[1])],
        "train": [
            [r.step, r.timeline.train_start - t0, r.timeline.train_end - t0]
            for r in results
            if first <= r.step <= last
        ],
    }


def run_config(
    target: Target,
    key: str,
    agent: str,
    *,
    steps: int,
    batch: int,
    group: int,
    seed: int,
    cycle_s: float,
) -> dict[str, Any]:
    """One engine run of the heavy-tailed workload as ``agent``, in configuration ``key``."""
    label, k, settings = CONFIGS[key]
    if agent == "native":
        native = LongEpisodesTask(cycle_s)
        task, log = native, native.log
    else:
        task, log = _agent_task(cycle_s)
    before, cpu = server_counters(target), time.process_time()
    results = run_engine(
        target,
        task,
        k=k,
        steps=steps,
        batch=batch,
        group=group,
        seed=seed,
        max_turns=MAX_TURNS,
        max_tokens=MAX_TOKENS,
        settings=settings,
    )
    cpu = time.process_time() - cpu
    after = server_counters(target)
    summary = summarize_run(results, log, cycle_s)
    compute = (after["compute_busy_s"] - before["compute_busy_s"]) / steps
    row: dict[str, Any] = {
        "config": key,
        "label": label,
        "agent": agent,
        "busy_share": 1 - summary["server_idle"],
        "straggler_share": summary["straggler_wait"],
        **summary,
        **volumes(results, len(log)),
        # Where the time went besides the clock: the local server's compute (sampling
        # and training; it can outgrow the clock on a loaded machine) and this process's
        # CPU (the engine and, for the openai agent, the agents), per step.
        "server_compute_s_per_step": compute,
        # Its share of a step's wall-clock: the schedule's figures hold where it is small.
        "server_compute_share": compute / summary["pace_s"],
        "client_cpu_s_per_step": cpu / steps,
        "staleness": staleness(results),
        # Each step's training end, in clock cycles since the first step's.
        "train_ends_cycles": [
            (r.timeline.train_end - results[0].timeline.train_end) / cycle_s for r in results
        ],
        "workload": workload(log, results, cycle_s),
    }
    if agent == "native" and key in PICTURED:
        row["timeline"] = timeline(results, log, first=2, last=min(steps, 5))
    return row


def build_parser() -> BenchParser:
    p = BenchParser(
        prog="python -m benchmarks.long_episodes",
        description="Steps/s, server busy share and straggler share of the engine's "
        "configurations against a batch-synchronous loop on heavy-tailed multi-turn agent "
        "episodes (a native environment and an openai agent), hosted-like latency.",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 12; quick 3)")
    p.add_argument("--batch", type=int, default=None, help="problems per step (4; quick 4)")
    p.add_argument("--group", type=int, default=None, help="episodes per problem (4; quick 2)")
    p.add_argument(
        "--latency",
        default=None,
        help=f"the server's --latency profile, not off (default {DEFAULT_LATENCY}; quick "
        f"{QUICK_LATENCY})",
    )
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS))
    p.add_argument("--agents", nargs="+", default=list(AGENTS), choices=AGENTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 steps of 4 x 2 episodes")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    return p


def _histogram(counts: Mapping[str, int]) -> str:
    total = sum(counts.values())
    return " ".join(f"{k}:{v / total:.0%}" for k, v in counts.items()) if total else "n/a"


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 12)
    batch = args.batch if args.batch is not None else 4
    group = args.group if args.group is not None else (2 if args.quick else 4)
    if steps < 3 or batch < 1 or group < 2:
        parser.error("--steps >= 3, --batch >= 1, --group >= 2")
    latency = args.latency or (QUICK_LATENCY if args.quick else DEFAULT_LATENCY)
    try:
        profile = LatencyProfile.parse(latency)
    except LatencyProfileError as exc:
        parser.error(f"--latency: {exc}")
    if profile is None:
        parser.error("--latency must be a profile (the benchmark measures the clock)")
    if "openai" in args.agents and importlib.util.find_spec("openai") is None:
        parser.error("--agents openai needs the openai SDK: pip install '.[agents]'")
    context = run_context(vars(args))
    rows: list[dict[str, Any]] = []
    with bench_server(latency, model_dir=AGENT_MODEL_DIR) as target:
        for agent in args.agents:
            by_config: dict[str, dict[str, Any]] = {}
            for key in args.configs:
                print(f"{agent} {key}: {steps} steps of {batch}x{group}...", file=sys.stderr)
                by_config[key] = run_config(
                    target,
                    key,
                    agent,
                    steps=steps,
                    batch=batch,
                    group=group,
                    seed=args.seed,
                    cycle_s=profile.cycle,
                )
            speedups(by_config, "sync")
            for row in by_config.values():
                row["x_sync"] = row.pop("speedup_vs_sync")
            rows += by_config.values()
    context["load_average_end"] = load_average()
    table = markdown_table(
        [
            "agent",
            "config",
            "steps/s",
            "x sync",
            "cycles/step",
            "server busy",
            "straggler wait",
            "staleness per turn",
            "per trajectory",
            "sampled/trained tokens",
            "discarded",
            "server compute s/step",
            "compute share",
            "client CPU s/step",
        ],
        [
            [
                r["agent"],
                r["label"],
                fmt(r["steps_per_s"], ".3f"),
                fmt(r["x_sync"], ".2f") + "x" if r["x_sync"] else "n/a",
                fmt(r["cycles_per_step"], ".2f"),
                fmt(r["busy_share"], ".0%"),
                fmt(r["straggler_share"], ".0%"),
                _histogram(r["staleness"]["per_turn"]),
                _histogram(r["staleness"]["per_trajectory"]),
                fmt(r["sampled_per_trained_token"], ".2f"),
                f"{r['discarded']} of {r['episodes_started']}",
                fmt(r["server_compute_s_per_step"], ".2f"),
                fmt(r["server_compute_share"], ".0%"),
                fmt(r["client_cpu_s_per_step"], ".2f"),
            ]
            for r in rows
        ],
    )
    out: Path = args.out
    command = command_line("benchmarks.long_episodes", argv)
    write_json(
        out / "long_episodes.json",
        {"context": context, "command": command, "cycle_s": profile.cycle, "rows": rows},
    )
    drawn = rows[0]["workload"]
    (out / "long_episodes.md").write_text(
        f"# Heavy-tailed agent episodes\n\n`{command}`\n\n{table}\n"
        f"Workload ({drawn['episodes']} episodes per run; the first row's): turns drawn median "
        f"{drawn['turns_median']:g}, p90 {drawn['turns_p90']}, p99 {drawn['turns_p99']}, max "
        f"{drawn['turns_max']}; tool wait median {fmt(drawn['tool_median_cycles'], '.2f')} "
        f"cycles, p99 {fmt(drawn['tool_p99_cycles'], '.2f')}; turns played median "
        f"{drawn['played_median']:g}, p99 {drawn['played_p99']}, max {drawn['played_max']}, "
        f"{drawn['truncated_share']:.1%} of the episodes truncated (at {MAX_TURNS} turns or "
        "when the next turn would not fit the model's context). Staleness: steps behind the "
        "training step (share of turns / trajectories). Discarded: episodes started that no "
        "step trained (a group whose rewards tie is skipped). "
        f"Load average at start {context['load_average_start']}, at end "
        f"{context['load_average_end']}; cycle {profile.cycle:g} s; commit {context['commit']}.\n"
    )
    pictured = [(f"{r['agent']} {r['label']}", r["timeline"]) for r in rows if "timeline" in r]
    if pictured and not missing("report"):
        from benchmarks.plotting import plot_episode_timeline

        plot_episode_timeline(pictured, out / "long_episodes.png")
    print(table)


if __name__ == "__main__":
    main()
