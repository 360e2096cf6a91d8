"""Do the shipped environments learn? Held-out reward of the packaged agent model (the
model the shipped environments ask for) on the guessing game and the calculator tool (as an
environment, and as an agent on the ``openai`` SDK through the capturing endpoint),
before and after an engine run, over seeds.

    python -m benchmarks.learning_envs                          # 20 steps, 3 seeds, all
    python -m benchmarks.learning_envs --quick                  # 2 steps, 1 seed (smoke)
    python -m benchmarks.learning_envs --envs calculator --seeds 1,2,3,4,5
    python -m benchmarks.learning_envs --envs calculator openai-calculator \
        --out benchmarks/results/agents_learning    # the environment against the agent
    python -m benchmarks.learning_envs --envs agent-process --steps 10 \
        --out benchmarks/results/agent_process     # the agent as a process per episode

Each run is ``python -m engine.run --local --task NAME --env-max-tokens 256`` with the
engine's defaults (8 problems x 6 episodes per step, temperature 0.8, K=1, the lr and
LoRA rank the server recommends) for ``--steps`` steps. "Before" is a fresh LoRA client
(B = 0: exactly the base model), "after" the run's final sampler. Both play one greedy
episode (temperature 0) per held-out problem of the task (``eval_problems()``: pairs the
training source never draws), through the engine's own episode runner, and report the
mean episode reward and the solved rate (reward > 0); the calculator also reports how
often the model called the tool.
Writes ``learning_envs.json`` and ``learning_envs.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio
import mint
from tinker import types

from benchmarks.report import load_average, markdown_table, run_context, write_json
from engine import Engine, EngineConfig
from engine.catalog import load_task
from engine.core.datums import Completion
from engine.envs import EnvContext, EnvTask, EpisodeLimits, Observation, StopCondition
from engine.envs.rollout import EpisodeRunner, SampledAction
from engine.local import LocalServer
from engine.local.config import AGENT_MODEL_DIR
from engine.tasks.render import TaskContext

__all__ = ["ENVS", "evaluate", "main"]

API_KEY = "tml-benchmarks-learning-envs"
ENVS = ("guess-sum", "calculator", "openai-calculator")
"""What a run without ``--envs`` measures."""
AGENT_PROCESS = (
    f"agent-cmd:{sys.executable} {Path(__file__).resolve().parents[1]}/examples/agent_process.py"
)
SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "openai-calculator": ("examples.openai_calculator_agent:task", {}),
    "agent-process": (
        AGENT_PROCESS,
        {"op": "*", "min_operand": "10", "max_operand": "99", "eval_size": "64"},
    ),
}
"""Names whose ``--task`` spec (and arguments) is not the name: the calculator as an
agent on the ``openai`` SDK trained through the capturing endpoint, as a function
(examples/openai_calculator_agent.py) and as a process started per episode
(examples/agent_process.py, the same problems; not in the default set: a Python
process per episode is slow here). See docs/agents.md."""
MAX_TOKENS = 16
CONTEXT = 256
"""Episodes stop before it (``--env-max-tokens 256``): the first agent model's context
(the rebuilt one has 512), kept so the figures compare across the two."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


async def evaluate(sampler: Any, tokenizer: Any, task: EnvTask) -> dict[str, float]:
    """One greedy episode per held-out problem of ``task``, all concurrently: mean
    reward, solved rate and (where the task has a tool) tool-use rate."""
    eos = tokenizer.eos_token_id
    context = EnvContext(
        TaskContext(tokenizer),
        StopCondition(stop_token_ids=(eos,), max_tokens=MAX_TOKENS),
        EpisodeLimits(max_tokens=CONTEXT),
    )

    async def sample(
        observation: Observation, n: int, room: int | None, *, episode: int, turn: int
    ) -> list[SampledAction]:
        stop = observation.stop
        limit = stop.max_tokens or MAX_TOKENS
        params = types.SamplingParams(
            max_tokens=limit if room is None else max(1, min(limit, room)),
            temperature=0.0,
            stop=list(stop.stop_token_ids) or None,
        )
        prompt = types.ModelInput.from_ints(list(observation.tokens))
        response = await sampler.sample_async(prompt, n, params)
        return [
            SampledAction(Completion(tuple(s.tokens), None, str(s.stop_reason)), 0)
            for s in response.sequences
        ]

    runner = EpisodeRunner(sample, context.limits)
    problems = task.eval_problems()  # type: ignore[attr-defined]
    rewards: list[float] = [0.0] * len(problems)
    tools: list[float] = [0.0] * len(problems)

    async def play(i: int) -> None:
        builder = task.group_builder(problems[i], 1, context)
        rollout = await runner.run_group(builder, problems[i])
        trajectory = rollout.trajectories[0]
        rewards[i] = trajectory.total_reward
        tools[i] = float(
            any(
                t.metrics.get("tool_calls", 0) or t.logs.get("tool_calls") for t in trajectory.turns
            )
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(problems)):
            tg.start_soon(play, i)
    return {
        "reward": statistics.fmean(rewards),
        "solved": sum(r > 0 for r in rewards) / len(rewards),
        "tool_use": statistics.fmean(tools),
    }


def _run(server: LocalServer, name: str, seed: int, steps: int, run_dir: Path) -> str:
    """An engine run of the environment ``name``; its final sampler path."""

    async def go() -> str:
        config = EngineConfig(
            base_url=server.base_url,
            api_key=API_KEY,
            task=_spec(name)[0],
            task_args=_spec(name)[1],
            steps=steps,
            seed=seed,
            run_dir=run_dir,
            progress=False,
            env_max_tokens=CONTEXT,
        )
        async with Engine(config) as engine:
            result = await engine.run()
        assert result.final_path is not None
        return result.final_path

    return anyio.run(go)


def _spec(name: str) -> tuple[str, dict[str, str]]:
    return SPECS.get(name, (name, {}))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.learning_envs",
        description="Held-out reward of the packaged agent model on the shipped environments "
        "before and after an engine run, over seeds.",
    )
    p.add_argument("--envs", nargs="+", default=list(ENVS), choices=[*ENVS, "agent-process"])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 20)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 1,2,3)")
    p.add_argument("--quick", action="store_true", help="2 steps, seed 1")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (2 if args.quick else 20)
    try:
        seeds = [int(s) for s in (args.seeds or ("1" if args.quick else "1,2,3")).split(",")]
    except ValueError:
        parser.error("--seeds must be comma-separated integers")
    if steps < 1:
        parser.error("--steps must be >= 1")
    context = run_context(vars(args))
    rows: list[dict[str, Any]] = []
    server_cm = LocalServer(AGENT_MODEL_DIR, api_key=API_KEY)
    with server_cm as server, tempfile.TemporaryDirectory() as tmp:
        service = mint.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        fresh = service.create_lora_training_client(base_model=server.model_name, rank=16)
        tokenizer = fresh.get_tokenizer()
        base = fresh.save_weights_and_get_sampling_client()
        for name in args.envs:
            task: Any = load_task(*_spec(name))
            before = anyio.run(evaluate, base, tokenizer, task)
            print(f"{name} base model: {before}", file=sys.stderr, flush=True)
            for seed in seeds:
                start = time.perf_counter()
                path = _run(server, name, seed, steps, Path(tmp) / f"{name}-{seed}")
                wall = time.perf_counter() - start
                sampler = service.create_sampling_client(model_path=path)
                after = anyio.run(evaluate, sampler, tokenizer, task)
                rows.append(
                    {
                        "env": name,
                        "seed": seed,
                        "steps": steps,
                        "held_out": len(task.eval_problems()),
                        "before": before,
                        "after": after,
                        "gain": after["reward"] - before["reward"],
                        "wall_s": round(wall, 1),
                    }
                )
                print(f"{name} seed {seed}: {before} -> {after} ({wall:.0f} s)", file=sys.stderr)
    context["load_average_end"] = load_average()
    summary = []
    for name in args.envs:
        mine = [r for r in rows if r["env"] == name]
        gains = [r["gain"] for r in mine]
        summary.append(
            [
                name,
                f"{mine[0]['before']['reward']:.3f}",
                f"{statistics.fmean(r['after']['reward'] for r in mine):.3f}",
                f"{statistics.fmean(gains):+.3f}",
                " ".join(f"{g:+.3f}" for g in gains),
                f"{mine[0]['before']['solved']:.0%} -> "
                f"{statistics.fmean(r['after']['solved'] for r in mine):.0%}",
                f"{mine[0]['before']['tool_use']:.0%} -> "
                f"{statistics.fmean(r['after']['tool_use'] for r in mine):.0%}",
            ]
        )
    table = markdown_table(
        [
            "env",
            "reward before",
            "after (mean)",
            "gain (mean)",
            "gain per seed",
            "solved",
            "tool use",
        ],
        summary,
    )
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.learning_envs", *given])
    write_json(args.out / "learning_envs.json", {"context": context, "runs": rows})
    (args.out / "learning_envs.md").write_text(
        f"# Learning on the shipped environments\n\n`{command}`\n\n{table}\n"
        f"{steps} steps per run, seeds {seeds}; held-out: one greedy episode per problem. "
        f"Load average at start {context['load_average_start']}, at end "
        f"{context['load_average_end']}; commit {context['commit']}.\n"
    )
    print(table)


if __name__ == "__main__":
    main()
