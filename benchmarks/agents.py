"""The agent endpoint's cost against the native environment API, on the same episodes:
the calculator as an environment (``--task calculator``: ChatEnv, the tool run by the
engine) and as an agent written against the ``openai`` SDK
(examples/openai_calculator_agent.py: every call a request to the capturing endpoint),
the agent on the engine's event loop and in agent worker processes (``--workers``, a
``--score-workers`` value, default ``processes:2``).

    python -m benchmarks.agents                 # 6 steps per configuration
    python -m benchmarks.agents --quick         # 3 steps (smoke test)

Two measurements:

* **per call** (no server): the same groups (16 problems x 4 episodes, each a tool call
  then the answer) through the engine's episode runner with an instant scripted sampler,
  so what is timed is the episode machinery alone; reported as wall and CPU (this
  process's: the engine's, not the agent workers') ms per call (turn), the median of 3
  repeats, and the CPU over the environment's: the endpoint's overhead per call on the
  engine's event loop. The CPU figure moves less with the machine's load.
* **steps/s** (the local server with the hosted-like ``--latency mint`` clock, the
  packaged agent model): full engine runs of each, same seed and settings, two of each
  alternated (the mean is reported; ``--repeats``); the server in a process of its own,
  as the hosted service runs apart from the client (``--server thread``: on a thread of
  this process, sharing its GIL); the pace over the steady steps (step 2 to the
  last), (n - 1) / (t_last - t_first).

Writes ``agents.json`` and ``agents.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import anyio

from benchmarks.report import command_line, load_average, markdown_table, run_context, write_json
from engine import Engine, EngineConfig, StepResult
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.config.values import parse_score_workers
from engine.core.datums import Completion
from engine.envs import EnvContext, EnvTask, EpisodeLimits, Observation, StopCondition
from engine.envs.examples.calculator import CalculatorTask, tool_call_text
from engine.envs.executors import Workers, env_workers, on_workers
from engine.envs.rollout import EpisodeRunner, SampledAction
from engine.local import LocalServer
from engine.local.launch import SpawnedServer, spawn_local_server
from engine.tasks import TaskContext
from examples.openai_calculator_agent import task as agent_task

__all__ = ["CallCost", "main", "per_call_ms"]

API_KEY = "tml-benchmarks-agents"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
_QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(AGENT_MODEL_DIR))


class CallCost(NamedTuple):
    wall_ms: float
    cpu_ms: float


async def per_call_ms(
    task: EnvTask, tokenizer: Any, groups: int, group: int, workers: str = "threads"
) -> CallCost:
    """Wall and CPU ms (this process's: the engine's) per turn of ``groups`` groups run
    one after another on an instant sampler (a tool call, then the product), the
    task's work on ``workers`` (a ``--score-workers`` value)."""
    async with contextlib.AsyncExitStack() as stack:
        pool = env_workers(parse_score_workers(workers), task)
        if pool is not None:
            await stack.enter_async_context(pool)
            await _calls(task, tokenizer, 1, group, pool)  # the workers started
        return await _calls(task, tokenizer, groups, group, pool)


async def _calls(
    task: EnvTask, tokenizer: Any, groups: int, group: int, pool: Workers | None
) -> CallCost:
    eos = tokenizer.eos_token_id
    calls = 0

    async def sample(
        observation: Observation, n: int, room: int | None, *, episode: int, turn: int
    ) -> list[SampledAction]:
        nonlocal calls
        calls += n
        text = tokenizer.decode(list(observation.tokens))
        a, b = (int(x) for x in _QUESTION.findall(text)[-1])
        reply = str(a * b) if "Result:" in text else tool_call_text(a, b)
        tokens = (*tokenizer.encode(reply, add_special_tokens=False), eos)
        return [SampledAction(Completion(tokens, (-0.1,) * len(tokens), "stop"), 0)] * n

    context = EnvContext(
        TaskContext(tokenizer),
        StopCondition(stop_token_ids=(eos,), max_tokens=96),
        EpisodeLimits(max_tokens=256),
    )
    runner = EpisodeRunner(sample, context.limits)
    source = task.source(0)
    problems = [source.next() for _ in range(groups)]
    start, cpu = time.perf_counter(), time.process_time()
    for problem in problems:
        assert problem is not None
        builder = task.group_builder(problem, group, context)
        placed = builder if pool is None else on_workers(builder, pool)
        rollout = await runner.run_group(placed, problem)
        assert rollout.error is None and all(t.total_reward == 1.0 for t in rollout.trajectories)
    return CallCost(
        (time.perf_counter() - start) * 1000 / calls, (time.process_time() - cpu) * 1000 / calls
    )


_WHERE = {"process": "in a process of its own", "thread": "on a thread of this process"}


def _server(where: str, tmp: Path) -> LocalServer | SpawnedServer:
    """The packaged agent model's local server on the ``mint`` clock, ``where`` it runs."""
    if where == "thread":
        return LocalServer(AGENT_MODEL_DIR, api_key=API_KEY, latency="mint")
    return spawn_local_server(
        AGENT_MODEL_DIR, data_dir=tmp / "server", api_key=API_KEY, latency="mint"
    )


def _pace(
    server: LocalServer | SpawnedServer, task: Any, workers: str, steps: int, run_dir: Path
) -> float:
    """Steps/s of an engine run over its steady steps."""
    ends: list[float] = []

    def on_step(result: StepResult) -> None:
        ends.append(time.perf_counter())

    async def go() -> None:
        config = EngineConfig(
            base_url=server.base_url,
            api_key=API_KEY,
            steps=steps,
            seed=1,
            run_dir=run_dir,
            progress=False,
            env_max_tokens=256,
            score_workers=workers,
        )
        async with Engine(config, task=task, on_step=[on_step]) as engine:
            await engine.run()

    anyio.run(go)
    return (len(ends) - 1) / (ends[-1] - ends[0])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 6)")
    parser.add_argument("--quick", action="store_true", help="3 steps")
    parser.add_argument(
        "--workers", default="processes:2", help="the agent's --score-workers row (processes:2)"
    )
    parser.add_argument(
        "--server",
        choices=("process", "thread"),
        default="process",
        help="the local server in a process of its own, as the hosted service is on machines "
        "of its own (default), or on a thread of this process, sharing its GIL",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each configuration, alternated (2)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 6)
    context = run_context(vars(args))
    tokenizer = _tokenizer()
    runs: dict[str, tuple[Any, str]] = {
        "environment": (CalculatorTask(), "threads"),
        "openai agent": (agent_task(), "threads"),
        f"openai agent, {args.workers}": (agent_task(), args.workers),
    }
    costs = {
        name: [anyio.run(per_call_ms, task, tokenizer, 16, 4, workers) for _ in range(3)]
        for name, (task, workers) in runs.items()
    }
    per_call = {name: statistics.median(c.wall_ms for c in cs) for name, cs in costs.items()}
    per_call_cpu = {name: statistics.median(c.cpu_ms for c in cs) for name, cs in costs.items()}
    paces: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp, _server(args.server, Path(tmp)) as server:
        for repeat in range(args.repeats):  # alternated, so that a change of load hits all alike
            for i, (name, (task, workers)) in enumerate(runs.items()):
                run_dir = Path(tmp) / f"{i}-{repeat}"
                paces[name].append(_pace(server, task, workers, steps, run_dir))
    pace = {name: statistics.fmean(values) for name, values in paces.items()}
    context["load_average_end"] = load_average()
    base = "environment"
    rows = [
        [
            name,
            f"{per_call[name]:.2f}",
            f"{per_call_cpu[name]:.2f}",
            f"{per_call_cpu[name] - per_call_cpu[base]:+.2f}" if name != base else "",
            f"{pace[name]:.3f}",
            " ".join(f"{v:.3f}" for v in paces[name]),
            f"{pace[name] / pace[base]:.2f}x",
        ]
        for name in runs
    ]
    table = markdown_table(
        [
            "calculator as",
            "ms per call (no server)",
            "engine CPU ms per call",
            "CPU over the environment",
            "steps/s (mint clock)",
            "each run",
            "pace",
        ],
        rows,
    )
    command = command_line("benchmarks.agents", argv)
    write_json(
        args.out / "agents.json",
        {
            "context": context,
            "per_call_ms": per_call,
            "per_call_cpu_ms": per_call_cpu,
            "steps_per_s": pace,
            "steps_per_s_runs": paces,
            "steps": steps,
            "server": args.server,
        },
    )
    (args.out / "agents.md").write_text(
        f"# The agent endpoint against the native environment API\n\n`{command}`\n\n{table}\n"
        "CPU is this process's (the engine's event loop, the agents' when they run on it; "
        "not the worker processes'). Pace: steps/s against the environment's, "
        f"{steps} steps per run, {args.repeats} runs of each alternated, steady steps "
        f"2..{steps}; the local server {_WHERE[args.server]}. "
        f"Load average at start {context['load_average_start']}, at end "
        f"{context['load_average_end']}; commit {context['commit']}.\n"
    )
    print(table)


if __name__ == "__main__":
    main()
