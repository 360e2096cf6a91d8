"""Do the shipped environments learn, and how fast per step and per second for each K and
loss? Held-out reward of the packaged agent model (the model the shipped environments ask
for) on the guessing game and the calculator tool (as an environment, and as an agent on
the ``openai`` SDK through the capturing endpoint), before, during and after engine runs,
over a grid of K (``--max-steps-off-policy``) x loss configurations x seeds.

    python -m benchmarks.learning_envs                          # 20 steps, 3 seeds, all
    python -m benchmarks.learning_envs --quick                  # 2 steps, 1 seed (smoke)
    python -m benchmarks.learning_envs --envs calculator --seeds 1,2,3,4,5
    python -m benchmarks.learning_envs --envs calculator openai-calculator \
        --out benchmarks/results/agents_learning    # the environment against the agent
    python -m benchmarks.learning_envs --envs agent-process --steps 10 \
        --out benchmarks/results/agent_process     # the agent as a process per episode
    python -m benchmarks.learning_envs --envs calculator --steps 8 --curve-every 2 \
        --ks 0,1,2 --configs ppo,is --seeds 1,2,3,4,5 --latency mint \
        --out benchmarks/results/learning_envs_grid  # the K x loss grid on the mint clock
    python -m benchmarks.learning_envs \
        --replot benchmarks/results/learning_envs_grid/learning_envs.json  # no runs

Each run is ``python -m engine.run --local --task NAME --env-max-tokens 256`` with the
engine's defaults (8 problems x 6 episodes per step, temperature 0.8, the lr and LoRA rank
the server recommends) but for K and the loss of its grid cell (default: the engine's
default, ``ppo`` at K=1), for ``--steps`` steps, one run after another on one server
(``--latency``: its simulated hosted clock, e.g. ``mint``). "Before" is a fresh LoRA client
(B = 0: exactly the base model), "after" the run's final sampler, and with
``--curve-every N`` the run's sampler snapshot of every N-th step (the per-version
``sampler-vN`` weights the engine saves as it trains; evaluated after the run, so the
run's wall-clock excludes them). Each plays one greedy episode (temperature 0) per held-out
problem of the task (``eval_problems()``: pairs the training source never draws), through
the engine's own episode runner: the mean episode reward and the solved rate (reward > 0);
the calculator also reports how often the model called the tool.

Per grid cell (env, config, K) over its seeds: the mean held-out reward and gain with
their standard error (SE = sample standard deviation / sqrt(seeds)), the gain relative to
K=0 of the same config (at the final step, and averaged over the curve's points: the area
under the curve, which still tells learning speed apart once the reward saturates), the
wall-clock of a run (from the engine's start to its last step) and its pace, and the time
to K=0's final mean reward (the first curve point whose mean reaches it; its wall-clock is
that step's end). Wall-clock figures are medians over the seeds: on a shared machine one
run that meets a load spike would move a mean by minutes. Each run records the load
average before and after it. Writes ``learning_envs.json``, ``learning_envs.md`` and (with
matplotlib) ``learning_envs.png`` to ``--out`` after every run, so a grid cut short keeps
what ran.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import anyio
import mint
from tinker import types

from benchmarks.learning import QUICKSTART_TEMPERATURE
from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from engine import Engine, EngineConfig
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.catalog import load_task
from engine.common.extras import missing
from engine.core.datums import Completion
from engine.envs import EnvContext, EnvTask, EpisodeLimits, Observation, StopCondition
from engine.envs.rollout import EpisodeRunner, SampledAction
from engine.local import LocalServer
from engine.local.profiles import SERVICES
from engine.session.sdk_calls import snapshot_name
from engine.tasks.render import TaskContext

__all__ = ["CONFIGS", "ENVS", "evaluate", "main", "summarize"]

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
CONFIGS: dict[str, Mapping[str, Any]] = {
    "ppo": {"loss": "ppo", "loss_temperature": "off"},
    "is": {"loss": "importance_sampling", "loss_temperature": "off"},
    "ppo-t": {"loss": "ppo", "loss_temperature": "sampling"},
    "tis-t": {"loss": "importance_sampling", "tis_cap": 2.0, "loss_temperature": "sampling"},
    "icepop-t": {
        "loss": "importance_sampling",
        "mask_low": 0.5,
        "mask_high": 2.0,
        "loss_temperature": "sampling",
    },
    "is-rc": {
        "loss": "importance_sampling",
        "loss_temperature": "off",
        "rollout_correction": "mis",
    },
    "ppo-t1": {"loss": "ppo", "loss_temperature": "off", "temperature": 1.0},
}
"""Loss configurations of the grid: ``--configs`` key -> engine settings by
``EngineConfig`` field name (K comes from ``--ks``; docs/losses.md): the engine's default
``ppo``, plain ``importance_sampling`` (``is``), and with the loss scored at the sampling
temperature (``-t``: on-policy ratio 1): ppo, TIS (cap 2), IcePop (mask [0.5, 2]); what a
hosted service takes (``--service mint``): importance sampling with MinT's session-level
rollout correction (``is-rc``), ppo sampled at temperature 1 (``ppo-t1``)."""
MAX_TOKENS = 16
CONTEXT = 256
"""Episodes stop before it (``--env-max-tokens 256``): the first agent model's context
(the rebuilt one has 512), kept so the figures compare across the two."""
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
NAME = "learning_envs"


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


@dataclass(frozen=True)
class _Trained:
    """What the benchmark reads from one engine run."""

    final_path: str
    model_id: str
    """Where the per-version sampler snapshots live (``sampler-vN``)."""
    steps: int
    step_ends: list[float]
    """Each step's end, seconds from entering the engine (opening its session included)."""
    train_reward: list[float | None]


def _run(
    server: LocalServer,
    name: str,
    seed: int,
    steps: int,
    run_dir: Path,
    settings: Mapping[str, Any],
) -> _Trained:
    """An engine run of the environment ``name`` with ``settings`` (loss, K...)."""
    ends: list[float] = []

    async def go() -> _Trained:
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
            **settings,
        )
        start = time.perf_counter()
        async with Engine(config) as engine:
            engine.add_step_hook(lambda _: ends.append(time.perf_counter() - start))
            result = await engine.run()
            model_id = engine.session.model_id
        assert result.final_path is not None and model_id is not None
        rewards = [m.get("avg_reward") for m in result.metrics]
        return _Trained(result.final_path, model_id, result.steps_completed, ends, rewards)

    return anyio.run(go)


def _spec(name: str) -> tuple[str, dict[str, str]]:
    return SPECS.get(name, (name, {}))


def _curve(
    service: Any, tokenizer: Any, task: EnvTask, trained: _Trained, every: int
) -> dict[int, dict[str, float]]:
    """Held-out figures of the run's snapshot after every ``every``-th step (not the last:
    the final sampler is evaluated as "after")."""
    out: dict[int, dict[str, float]] = {}
    for step in range(every, trained.steps, every) if every else ():
        path = f"tinker://{trained.model_id}/sampler_weights/{snapshot_name(step)}"
        out[step] = anyio.run(
            evaluate, service.create_sampling_client(model_path=path), tokenizer, task
        )
    return out


def _mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample standard deviation / sqrt(n); None for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def _pace(ends: Sequence[float]) -> float | None:
    """Seconds per step over the steady steps (from the second step's end):
    (t_last - t_first) / (n - 1)."""
    steady = ends[1:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else None


def summarize(
    rows: Sequence[Mapping[str, Any]], target_reward: float | None = None
) -> list[dict[str, Any]]:
    """One cell per (env, config, K) over its seeds: held-out reward and gain (mean, SE),
    the mean curve, wall-clock and pace (medians), and against K=0 of the same env and config: the
    gain ratio (final, and averaged over the curve's points), the time to K=0's final
    mean reward and its ratio to K=0's own, and the same for ``target_reward``."""
    cells: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["env"], r["config"], r["k"]) for r in rows):
        mine = [r for r in rows if (r["env"], r["config"], r["k"]) == key]
        steps = sorted({int(s) for r in mine for s in r["curve"]})
        curve = []
        for step in steps:
            at = [r for r in mine if str(step) in r["curve"]]
            mean, se = _mean_se([r["curve"][str(step)]["reward"] for r in at])
            wall = statistics.median(r["step_end_s"][step - 1] if step else 0.0 for r in at)
            curve.append({"step": step, "reward_mean": mean, "reward_se": se, "wall_s": wall})
        after, after_se = _mean_se([r["after"]["reward"] for r in mine])
        gain, gain_se = _mean_se([r["gain"] for r in mine])
        walls = [r["wall_s"] for r in mine]
        paces = [p for p in (_pace(r["step_end_s"]) for r in mine) if p is not None]
        before = mine[0]["before"]["reward"]
        cells.append(
            {
                "env": key[0],
                "config": key[1],
                "k": key[2],
                "cell": f"{key[1]} K={key[2]}",
                "seeds": [r["seed"] for r in mine],
                "steps": mine[0]["steps"],
                "before": before,
                "after_mean": after,
                "after_se": after_se,
                "gain_mean": gain,
                "gain_se": gain_se,
                "curve_gain_mean": statistics.fmean(p["reward_mean"] - before for p in curve[1:])
                if len(curve) > 1
                else None,
                "solved_after": statistics.fmean(r["after"]["solved"] for r in mine),
                "tool_use_after": statistics.fmean(r["after"]["tool_use"] for r in mine),
                "wall_s": statistics.median(walls),
                "wall_s_range": [min(walls), max(walls)],
                "pace_s": statistics.median(paces) if paces else None,
                "curve": curve,
                "loads": [r["load_before"] for r in mine],
            }
        )
    for cell in cells:
        k0 = _k0(cells, cell)
        cell["target"] = None if k0 is None else k0["after_mean"]
        for name, target in (("target", cell["target"]), ("reward", target_reward)):
            reached = next(
                (
                    p
                    for p in cell["curve"][1:]
                    if target is not None and p["reward_mean"] >= target - 1e-9
                ),
                None,
            )
            cell[f"steps_to_{name}"] = None if reached is None else reached["step"]
            cell[f"wall_s_to_{name}"] = None if reached is None else reached["wall_s"]
    for cell in cells:
        k0 = _k0(cells, cell)
        for field in ("gain_mean", "curve_gain_mean", "wall_s_to_target", "wall_s_to_reward"):
            cell[f"{field}_vs_k0"] = _ratio(cell[field], None if k0 is None else k0[field])
    return cells


def _k0(cells: Sequence[Mapping[str, Any]], cell: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The K=0 cell of ``cell``'s env and config, if the grid has one."""
    return next(
        (c for c in cells if (c["env"], c["config"], c["k"]) == (cell["env"], cell["config"], 0)),
        None,
    )


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _pm(mean: float | None, se: float | None, spec: str = ".3f") -> str:
    """``mean ± se`` (``mean`` alone for one seed)."""
    if mean is None:
        return "n/a"
    return format(mean, spec) + ("" if se is None else f" ± {format(se, spec.lstrip('+'))}")


def report(
    rows: Sequence[Mapping[str, Any]], context: Mapping[str, Any], commands: Sequence[str]
) -> tuple[list[dict[str, Any]], str]:
    """The grid's cells and its markdown page."""
    target_reward = context["args"].get("target_reward")
    cells = summarize(rows, target_reward)
    ran = "\n".join(f"`{c}`  " for c in commands)
    parts = [f"# Learning on the shipped environments\n\n{ran}\n"]
    for env in dict.fromkeys(c["env"] for c in cells):
        mine = [c for c in cells if c["env"] == env]
        held_out = next(r["held_out"] for r in rows if r["env"] == env)
        parts.append(
            f"## {env}\n\nHeld-out reward before (the base model): {mine[0]['before']:.3f} "
            f"({held_out} problems, one greedy episode each). Rewards: mean ± SE over "
            "seeds; wall-clock (from entering the engine) and s/step (steady pace): median "
            "over seeds, robust to a run that met a load spike; ratios against K=0 of the "
            "same config.\n"
        )
        parts.append(
            markdown_table(
                [
                    "config",
                    "seeds",
                    "after",
                    "gain",
                    "gain vs K=0",
                    "curve gain vs K=0",
                    "solved",
                    "tool use",
                    "wall per run s (min-max)",
                    "s/step",
                    "time to K=0's final s",
                    "vs K=0",
                    f"time to {fmt(target_reward, '.2f')} s",
                    "vs K=0",
                ][: None if target_reward is not None else -2],
                [
                    [
                        c["cell"],
                        str(len(c["seeds"])),
                        _pm(c["after_mean"], c["after_se"]),
                        _pm(c["gain_mean"], c["gain_se"], "+.3f"),
                        fmt(c["gain_mean_vs_k0"]),
                        fmt(c["curve_gain_mean_vs_k0"]),
                        f"{c['solved_after']:.0%}",
                        f"{c['tool_use_after']:.0%}",
                        "{:.1f} ({:.0f}-{:.0f})".format(c["wall_s"], *c["wall_s_range"]),
                        fmt(c["pace_s"]),
                        "not reached"
                        if c["target"] is not None and c["wall_s_to_target"] is None
                        else fmt(c["wall_s_to_target"], ".1f"),
                        fmt(c["wall_s_to_target_vs_k0"]),
                        fmt(c["wall_s_to_reward"], ".1f"),
                        fmt(c["wall_s_to_reward_vs_k0"]),
                    ][: None if target_reward is not None else -2]
                    for c in mine
                ],
            )
        )
        steps = sorted({p["step"] for c in mine for p in c["curve"]})
        if len(steps) > 2:
            parts.append("Held-out reward by step (mean ± SE; median wall-clock to that step):\n")
            parts.append(
                markdown_table(
                    ["step", *(c["cell"] for c in mine)],
                    [
                        [str(step)]
                        + [
                            next(
                                (
                                    f"{_pm(p['reward_mean'], p['reward_se'])} ({p['wall_s']:.1f} s)"
                                    for p in c["curve"]
                                    if p["step"] == step
                                ),
                                "",
                            )
                            for c in mine
                        ]
                        for step in steps
                    ],
                )
            )
    parts.append("Runs, in the order they ran:\n")
    parts.append(
        markdown_table(
            ["env", "config", "seed", "before", "after", "gain", "wall s", "load before"],
            [
                [
                    r["env"],
                    f"{r['config']} K={r['k']}",
                    str(r["seed"]),
                    f"{r['before']['reward']:.3f}",
                    f"{r['after']['reward']:.3f}",
                    f"{r['gain']:+.3f}",
                    f"{r['wall_s']:.1f}",
                    " ".join(str(x) for x in r["load_before"] or ()),
                ]
                for r in rows
            ],
        )
    )
    parts.append(
        f"{rows[0]['steps']} steps per run, latency profile {context['args'].get('latency')}, "
        f"service {context['args'].get('service', 'local')}; "
        f"load average at start {context['load_average_start']}, at end "
        f"{context.get('load_average_end')}; commit {context['commit']}.\n"
    )
    return cells, "\n".join(parts)


def write_report(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
    commands: Sequence[str],
) -> list[Path]:
    """``learning_envs.json``, ``.md`` and (with matplotlib) ``.png`` in ``out``."""
    cells, page = report(rows, context, commands)
    data = {"context": context, "commands": list(commands), "runs": list(rows), "summary": cells}
    paths = [write_json(out / f"{NAME}.json", data)]
    (out / f"{NAME}.md").write_text(page)
    paths.append(out / f"{NAME}.md")
    if not missing("report"):
        from benchmarks.plotting import plot_learning_curves

        paths.append(
            plot_learning_curves(
                cells,
                out / f"{NAME}.png",
                ylabel="held-out episode reward (greedy)",
                latency=context["args"].get("latency"),
            )
        )
    return paths


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one value is needed")
    return values


def _ks(text: str) -> list[int]:
    values = _ints(text)
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"K must be >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def _configs(text: str) -> list[str]:
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown config {', '.join(bad) or '(none)'}; choose from {', '.join(CONFIGS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.learning_envs",
        description="Held-out reward of the packaged agent model on the shipped environments "
        "before, during and after engine runs, over K x loss configurations x seeds.",
    )
    p.add_argument("--envs", nargs="+", default=list(ENVS), choices=[*ENVS, "agent-process"])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 20)")
    p.add_argument("--seeds", type=_ints, default=None, help="comma-separated (default 1,2,3)")
    p.add_argument(
        "--ks",
        type=_ks,
        default=[1],
        help="comma-separated --max-steps-off-policy values (default 1, the engine's)",
    )
    p.add_argument(
        "--configs",
        type=_configs,
        default=["ppo"],
        help=f"comma-separated loss configurations from {', '.join(CONFIGS)} "
        "(default ppo, the engine's; see CONFIGS in benchmarks/learning_envs.py)",
    )
    p.add_argument(
        "--curve-every",
        type=int,
        default=0,
        help="also evaluate every N-th step's sampler snapshot (default 0: before/after only)",
    )
    p.add_argument(
        "--target-reward",
        type=float,
        default=None,
        help="also report each cell's time to this mean held-out reward (a level below "
        "saturation; default: only the time to K=0's final mean)",
    )
    p.add_argument(
        "--latency",
        default="off",
        help="the server's latency profile, as `python -m engine.local --latency` takes it "
        "(default off; mint: wall-clock on the hosted-like clock)",
    )
    p.add_argument(
        "--service",
        choices=SERVICES,
        default="local",
        help="the local server's service profile (mint, tinker: what a hosted one takes)",
    )
    p.add_argument("--quick", action="store_true", help="2 steps, seed 1")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of --out's learning_envs.json (measured with the same --steps, "
        "--curve-every, --latency) and run this grid's others: continue a grid cut short, "
        "or extend it with more seeds, Ks or configs",
    )
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="rewrite the markdown and plot of a saved learning_envs.json beside it (with "
        "--target-reward: that column too); no runs",
    )
    return p


def _replot(parser: argparse.ArgumentParser, path: Path, target_reward: float | None) -> None:
    try:
        data = json.loads(path.read_text())
        rows, context, commands = data["runs"], data["context"], data["commands"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--replot {path}: not a learning_envs.json with a grid ({exc})")
    if target_reward is not None:
        context["args"]["target_reward"] = target_reward
    for written in write_report(path.parent, rows, context, commands):
        print(f"wrote {written}")


def _resumed(
    parser: argparse.ArgumentParser, args: argparse.Namespace, steps: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """The saved runs of ``--out`` and the commands that ran them (none without a saved
    file); exit 2 if they were measured otherwise. Runs outside this grid stay in the
    report: a resumed grid only adds runs."""
    path = args.out / f"{NAME}.json"
    if not path.is_file():
        return [], []
    try:
        data = json.loads(path.read_text())
        saved, rows, commands = data["context"]["args"], data["runs"], data["commands"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--resume: {path} is not a learning_envs.json with a grid ({exc})")
    mine = (saved["curve_every"], saved["latency"], {r["steps"] for r in rows})
    if mine != (args.curve_every, args.latency, {steps}):
        parser.error(
            f"--resume: {path} was measured with --curve-every {saved['curve_every']}, "
            f"--latency {saved['latency']}, steps {sorted(mine[2])}; this run asks "
            f"{args.curve_every}, {args.latency}, {steps}"
        )
    return rows, commands


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot is not None:
        _replot(parser, args.replot, args.target_reward)
        return
    steps = args.steps if args.steps is not None else (2 if args.quick else 20)
    seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    if steps < 1:
        parser.error("--steps must be >= 1")
    if args.curve_every < 0:
        parser.error("--curve-every must be >= 0")
    command = command_line("benchmarks.learning_envs", argv)
    context = run_context(vars(args))
    rows, commands = _resumed(parser, args, steps) if args.resume else ([], [])
    commands.append(command)
    done = {(r["env"], r["config"], r["k"], r["seed"]) for r in rows}
    with (
        LocalServer(
            AGENT_MODEL_DIR, api_key=API_KEY, latency=args.latency, service=args.service
        ) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        service = mint.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        fresh = service.create_lora_training_client(base_model=server.model_name, rank=16)
        tokenizer = fresh.get_tokenizer()
        base = fresh.save_weights_and_get_sampling_client()
        for name in args.envs:
            task: Any = load_task(*_spec(name))
            before = anyio.run(evaluate, base, tokenizer, task)
            print(f"{name} base model: {before}", file=sys.stderr, flush=True)
            for seed in seeds:
                for config in args.configs:
                    for k in args.ks:
                        if (name, config, k, seed) in done:
                            continue
                        run_dir = Path(tmp) / f"{name}-{config}-k{k}-s{seed}-{len(rows)}"
                        settings = {
                            "temperature": QUICKSTART_TEMPERATURE,
                            **CONFIGS[config],
                            "max_steps_off_policy": k,
                        }
                        load = load_average()
                        start = time.perf_counter()
                        trained = _run(server, name, seed, steps, run_dir, settings)
                        wall = time.perf_counter() - start
                        load_after = load_average()
                        curve = _curve(service, tokenizer, task, trained, args.curve_every)
                        sampler = service.create_sampling_client(model_path=trained.final_path)
                        after = anyio.run(evaluate, sampler, tokenizer, task)
                        curve = {0: before, **curve, trained.steps: after}
                        rows.append(
                            {
                                "env": name,
                                "config": config,
                                "settings": settings,
                                "k": k,
                                "seed": seed,
                                "steps": trained.steps,
                                "held_out": len(task.eval_problems()),
                                "before": before,
                                "after": after,
                                "gain": after["reward"] - before["reward"],
                                "curve": {str(s): v for s, v in curve.items()},
                                "wall_s": round(trained.step_ends[-1], 2),
                                "run_s": round(wall, 2),
                                "step_end_s": [round(t, 3) for t in trained.step_ends],
                                "train_reward": trained.train_reward,
                                "load_before": load,
                                "load_after": load_after,
                            }
                        )
                        print(
                            f"{name} {config} K={k} seed {seed}: {before['reward']:.3f} -> "
                            f"{after['reward']:.3f} ({trained.step_ends[-1]:.1f} s, load {load})",
                            file=sys.stderr,
                            flush=True,
                        )
                        write_report(args.out, rows, context, commands)
    context["load_average_end"] = load_average()
    for written in write_report(args.out, rows, context, commands):
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
