"""Does an RL run of the engine make the local default model better at its task?

Held-out greedy exact rate (temperature 0, ``max_tokens`` 16, stop at EOS) of the local
server's default model on two-digit addition, before and after an engine run with the
local defaults (8 problems x 6 samples x 16 tokens, temperature 0.8; the lr, rank and
task arguments the server recommends for the model, which the engine resolves itself).
"Before" is a fresh LoRA client (its B matrices start at zero, so it samples exactly the
base model); "after" is the run's final sampler (``Saved:`` path),
loaded with ``ServiceClient.create_sampling_client(model_path=...)``.

A control run (``control``) repeats the K=0 loop with random rewards: same sampling,
same number of updates, no information about correctness.

With ``--sdk tinker`` each run is ``python -m engine.run`` in the tinker 0.38 environment
(``.venv-tinker``, no torch; :mod:`benchmarks.engine_cli`) against this process's server,
which is how ``gspo`` (a loss only 0.38 sends) is compared with ``ppo`` at K=1. Its
sampler snapshots are ephemeral, so there is no curve: before and after only.

Why the held-out set is built this way: the problems are drawn with their own seed
(``HELDOUT_SEED``), and every (a, b) pair the engine could train on -- a generous prefix of
each training seed's problem stream -- is excluded, so "after" measures generalisation,
not memorised training problems.

Why a background-thread server (``LocalServer``): the SDK's ``ServiceClient`` constructor
blocks its thread, so the evaluation clients cannot live on the server's event loop.

    python -m benchmarks.learning                       # 30 steps, 200 held-out, all configs
    python -m benchmarks.learning --quick               # 2 steps, 20 held-out (smoke test)
    python -m benchmarks.learning --configs k0 --seeds 42,7
    python -m benchmarks.learning --seeds 42,1,2,3,4    # what results/learning.json holds
    python -m benchmarks.learning --sdk tinker --configs k1,gspo --seeds 42,1,2 \
        --out benchmarks/results/learning_gspo.json     # gspo vs ppo at K=1 on tinker 0.38
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import mint
from tinker import types

from benchmarks.engine_cli import TINKER_PYTHON, run_engine_cli
from benchmarks.measure import positive_int
from benchmarks.quickstart_loop import run_quickstart_loop
from benchmarks.report import load_average
from engine import Engine, EngineConfig, RunResult
from engine.basemodels.recommended import LOCAL_TEMPERATURE
from engine.catalog import load_task
from engine.config import Profile
from engine.core.problems import Task
from engine.local import LocalServer
from engine.session.preflight import read_server_profile
from engine.session.sdk_calls import snapshot_name
from engine.tasks import ArithmeticTask, Problem, ProblemSource, RewardBreakdown
from engine.tasks.arithmetic import score_arithmetic

__all__ = [
    "CONFIGS",
    "HELDOUT_SEED",
    "QUICKSTART_TEMPERATURE",
    "HeldOut",
    "RunSpec",
    "evaluate",
    "held_out",
    "heldout_problems",
    "main",
    "measure_run",
]

API_KEY = "tml-benchmarks-learning"
HELDOUT_SEED = 20_261_129
"""Differs from every training seed the CLI accepts (it refuses this one)."""
MAX_TOKENS = 16
_TRAIN_PREFIX_FACTOR = 4
"""How many steps' worth of problems per training seed are kept out of the held-out set
(the engine draws ``batch`` problems per step; the margin covers redrawn problems)."""
DEFAULTS = EngineConfig()
"""The engine's defaults (group, max_tokens, temperature) the runs keep."""
Problem2 = tuple[int, int]
"""(a, b) of one addition problem."""
DEFAULT_OUT = Path(__file__).parent / "results" / "learning.json"


@dataclass(frozen=True)
class RunSpec:
    """One engine configuration to measure."""

    name: str
    loss: str
    max_steps_off_policy: int
    random_rewards: bool = False
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Further engine settings by field name (the off-policy corrections: ``tis_cap``,
    ``mask_low``/``mask_high``, ``loss_temperature``)."""


QUICKSTART_TEMPERATURE: Final = LOCAL_TEMPERATURE
"""The sampling temperature of a configuration that names none (the quickstart's, which
the local service recommends): pinned, as the engine's own default depends on the server
(docs/losses.md, "Against a hosted service")."""
_QUICKSTART: Final = {"loss_temperature": "off"}
"""K=0 importance sampling as the quickstart trains it: the loss at the model's logits
(the local server recommends the sampling temperature)."""
CONFIGS: dict[str, RunSpec] = {
    "k0": RunSpec("importance_sampling K=0", "importance_sampling", 0, settings=_QUICKSTART),
    "k1": RunSpec("ppo K=1 (default)", "ppo", 1),
    "control": RunSpec(
        "control: random rewards K=0", "importance_sampling", 0, True, settings=_QUICKSTART
    ),
    "gspo": RunSpec("gspo K=1", "gspo", 1),
}
DEFAULT_CONFIGS = {"mint": ["k0", "k1", "control"], "tinker": ["k1", "gspo"]}
"""What runs without ``--configs``: gspo needs ``--sdk tinker``, control the mint SDK."""


class _RandomRewardTask:
    """The local task with each response's reward replaced by a pseudo-random number in
    [0, 1) (a pure function of seed, problem and response, so it is thread-safe): the
    same loop and updates, no signal about correctness. A gain that survives this
    control would not come from the reward."""

    def __init__(self, inner: ArithmeticTask, seed: int) -> None:
        self._inner = inner
        self._seed = seed
        self.name = f"{self._inner.name}-random-reward"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self._inner.source(seed, state)

    def prompt(self, problem: Problem) -> str:
        return self._inner.prompt(problem)

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        real = self._inner.score(response, problem)
        noise = random.Random(f"{self._seed}:{problem.id}:{response}").random()
        return RewardBreakdown(noise, real.components)


def served_task(recommended: Mapping[str, Mapping[str, str]]) -> ArithmeticTask:
    """The arithmetic task with the arguments the server recommends (``task_args`` of
    its profile); SystemExit unless it is addition, which is what this benchmark
    evaluates."""
    task = load_task("arithmetic", recommended.get("arithmetic", {}))
    if not isinstance(task, ArithmeticTask) or task.op != "+":
        raise SystemExit(f"the server recommends {task.name}; this benchmark evaluates addition")
    return task


def heldout_problems(
    task: ArithmeticTask, n: int, train_seeds: Sequence[int], steps: int, batch: int
) -> list[Problem2]:
    """``n`` distinct (a, b) pairs of ``task``'s operand range drawn with ``HELDOUT_SEED``,
    none of which appears in the first ``_TRAIN_PREFIX_FACTOR * steps * batch`` problems of
    any training seed."""
    seen: set[tuple[int, int]] = set()
    for seed in train_seeds:
        source = task.source(seed)
        for _ in range(_TRAIN_PREFIX_FACTOR * steps * batch):
            seen.add(_operands(source.next().question))
    lo, hi = task.min_operand, task.max_operand
    free = (hi - lo + 1) ** 2 - len(seen)
    if n > free:
        raise SystemExit(f"--heldout {n} is more than the {free} problems left after training")
    rng = random.Random(HELDOUT_SEED)
    out: list[Problem2] = []
    while len(out) < n:
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def _operands(question: str) -> Problem2:
    # "What is {a} + {b}?"
    a, _, b = question.removeprefix("What is ").removesuffix("?").split()
    return int(a), int(b)


@dataclass(frozen=True)
class HeldOut:
    """A local server's held-out set and the base model to measure against: the served
    task, its held-out problems, the SDK's service client, the tokenizer, the stop tokens
    (EOS) and the sampler of a fresh LoRA client (exactly the base model)."""

    profile: Profile
    task: ArithmeticTask
    problems: list[Problem2]
    service: mint.ServiceClient
    tokenizer: Any
    stop: list[int] | None
    base_sampler: Any


def held_out(
    server: LocalServer, n: int, train_seeds: Sequence[int], steps: int, batch: int
) -> HeldOut:
    """The :class:`HeldOut` of ``server``'s default model (``n`` problems none of which the
    training seeds draw in their first steps, see :func:`heldout_problems`)."""
    profile = anyio.run(read_server_profile, server.base_url, API_KEY)
    task = served_task(profile.task_args)
    problems = heldout_problems(task, n, train_seeds, steps, batch)
    service = mint.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    assert profile.lora_rank is not None
    fresh = service.create_lora_training_client(
        base_model=server.model_name, rank=profile.lora_rank
    )
    tokenizer = fresh.get_tokenizer()
    eos = getattr(tokenizer, "eos_token_id", None)
    stop = [eos] if isinstance(eos, int) else None
    base = fresh.save_weights_and_get_sampling_client()
    return HeldOut(profile, task, problems, service, tokenizer, stop, base)


def evaluate(
    sampler: Any, tokenizer: Any, problems: Sequence[Problem2], stop: list[int] | None
) -> float:
    """Greedy exact rate of ``sampler`` on ``problems``: all requests are submitted, then
    awaited, so the server can batch them."""
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=stop)
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(tokenizer.encode(f"Question: What is {a} + {b}?\nAnswer:")),
            1,
            params,
        )
        for a, b in problems
    ]
    hits = 0
    for future, (a, b) in zip(futures, problems, strict=True):
        tokens = future.result().sequences[0].tokens
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        hits += score_arithmetic(text, a + b).components["exact_bonus"] > 0
    return hits / len(problems)


@dataclass(frozen=True)
class Trained:
    """What the benchmark reads from one engine run."""

    final_path: str
    steps_completed: int
    metrics: list[dict[str, Any]]
    step_ends: list[float]
    learning_rate: float | None
    lora_rank: int | None
    snapshots: Mapping[int, str]
    """Sampler weights by the step they were saved after (the curve's points)."""


def _train(
    args: argparse.Namespace,
    server: LocalServer,
    spec: RunSpec,
    seed: int,
    run_dir: Path,
    task: ArithmeticTask,
) -> Trained:
    """``spec``'s run in this process (mint) or as ``engine.run`` on tinker 0.38."""
    if args.sdk == "tinker":
        cli = [
            f"--steps={args.steps}",
            f"--batch={args.batch}",
            f"--seed={seed}",
            f"--loss={spec.loss}",
            f"--max-steps-off-policy={spec.max_steps_off_policy}",
            # tinker 0.38's snapshots are unnamed: the curve reads checkpoints' weights
            f"--checkpoint-every={args.curve_every}",
            *(f"--{key.replace('_', '-')}={value}" for key, value in spec.settings.items()),
        ]
        run = run_engine_cli(args.tinker_python, server.base_url, API_KEY, run_dir, cli)
        config = run.config
        return Trained(
            run.final_path,
            run.steps_completed,
            run.metrics,
            run.step_ends,
            config["training"]["learning_rate"],
            config["model"]["lora_rank"],
            {int(c["step"]): str(c["sampler_path"]) for c in run.checkpoints},
        )
    engine_config = EngineConfig(
        base_url=server.base_url,
        api_key=API_KEY,
        steps=args.steps,
        batch=args.batch,
        seed=seed,
        loss=spec.loss,  # type: ignore[arg-type]
        max_steps_off_policy=spec.max_steps_off_policy,
        run_dir=run_dir,
        progress=False,
        **spec.settings,
    )
    result, model_id, resolved, ends = run_engine(
        engine_config, _RandomRewardTask(task, seed) if spec.random_rewards else task
    )
    assert result.final_path is not None
    return Trained(
        result.final_path,
        result.steps_completed,
        list(result.metrics),
        ends,
        resolved.training.learning_rate,
        resolved.model.lora_rank,
        {
            step: f"tinker://{model_id}/sampler_weights/{snapshot_name(step)}"
            for step in range(1, result.steps_completed + 1)
        }
        if model_id is not None
        else {},
    )


def run_engine(
    config: EngineConfig, task: Task | None = None
) -> tuple[RunResult, str | None, EngineConfig, list[float]]:
    """The run's result, its training client's model id (the per-version sampler
    snapshots live under it, named by ``engine.session.mint.snapshot_name``), its resolved
    config and the wall time of each step's end, counted from right before the step-0
    checkpoint (as ``benchmarks.throughput`` counts)."""
    ends: list[float] = []

    async def go() -> tuple[RunResult, str | None, EngineConfig]:
        async with Engine(config, task) as engine:
            start = time.perf_counter()
            engine.add_step_hook(lambda _: ends.append(time.perf_counter() - start))
            result = await engine.run()
            return result, engine.session.model_id, engine.config

    result, model_id, resolved = anyio.run(go)
    return result, model_id, resolved, ends


def _quickstart_timing(
    server: LocalServer, profile: Profile, task: ArithmeticTask, steps: int, batch: int
) -> dict[str, Any] | None:
    """The quickstart loop's wall time per step on this server (``steps`` steps of
    ``task``): it learns what K=0 importance sampling learns, datum for datum
    (tests/test_engine_parity), so its time to a gain is K=0's steps at this pace."""
    if not steps:
        return None
    assert profile.lora_rank is not None and profile.learning_rate is not None
    run = run_quickstart_loop(
        base_url=server.base_url,
        api_key=API_KEY,
        base_model=server.model_name,
        rank=profile.lora_rank,
        steps=steps,
        batch=batch,
        lr=profile.learning_rate,
        op=task.op,
        min_operand=task.min_operand,
        max_operand=task.max_operand,
    )
    ends = [s.end - run.started for s in run.steps]
    return {
        "steps": steps,
        "first_step_s": ends[0],
        "step_s": statistics.median(b - a for a, b in itertools.pairwise(ends))
        if len(ends) > 1
        else ends[0],
    }


def _curve(
    service: Any,
    tokenizer: Any,
    problems: Sequence[Problem2],
    stop: list[int] | None,
    snapshots: Mapping[int, str],
    steps: int,
    every: int,
) -> dict[int, float]:
    """Held-out greedy exact rate after every ``every``-th step (from the run's sampler
    weights of that step); empty with ``every`` 0."""
    if not every:
        return {}
    out: dict[int, float] = {}
    for step in range(every, steps, every):
        if step in snapshots:
            sampler = service.create_sampling_client(model_path=snapshots[step])
            out[step] = evaluate(sampler, tokenizer, problems, stop)
    return out


def measure_run(
    args: argparse.Namespace,
    server: LocalServer,
    base: HeldOut,
    before: float,
    spec: RunSpec,
    seed: int,
    run_dir: Path,
) -> dict[str, Any]:
    """One run of ``spec`` with ``seed`` and its held-out figures (``before``: the base
    model's exact rate): the row a report holds, with the load average at its start."""
    load = load_average()
    start = time.perf_counter()
    trained = _train(args, server, spec, seed, run_dir, base.task)
    wall_s = time.perf_counter() - start
    service, tokenizer, problems, stop = base.service, base.tokenizer, base.problems, base.stop
    curve = _curve(
        service, tokenizer, problems, stop, trained.snapshots, args.steps, args.curve_every
    )
    sampler = service.create_sampling_client(model_path=trained.final_path)
    after = evaluate(sampler, tokenizer, problems, stop)
    curve[trained.steps_completed] = after
    metrics = trained.metrics
    last = metrics[-1] if metrics else {}
    print(
        f"{spec.name} seed {seed}: {before:.1%} -> {after:.1%} "
        f"({after - before:+.1%}) in {wall_s:.0f} s (load {load})",
        flush=True,
    )
    return {
        "config": spec.name,
        "loss": spec.loss,
        "max_steps_off_policy": spec.max_steps_off_policy,
        "settings": dict(spec.settings),
        "seed": seed,
        "random_rewards": spec.random_rewards,
        "steps": trained.steps_completed,
        "exact_before": before,
        "exact_after": after,
        "delta": after - before,
        "curve": {str(k): v for k, v in sorted(curve.items())},
        "wall_s": round(wall_s, 1),
        "load_before": load,
        "step_end_s": [round(t, 3) for t in trained.step_ends],
        "learning_rate": trained.learning_rate,
        "lora_rank": trained.lora_rank,
        "final_path": trained.final_path,
        "train_exact_rate_first": metrics[0].get("exact_rate") if metrics else None,
        "train_exact_rate_last": last.get("exact_rate"),
        "train_avg_reward_first": metrics[0].get("avg_reward") if metrics else None,
        "train_avg_reward_last": last.get("avg_reward"),
        "kl_sample_train_v2_mean": _mean_metric(metrics, "optim/kl_sample_train_v2"),
    }


def _mean_metric(metrics: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [m[key] for m in metrics if m.get(key) is not None]
    return statistics.fmean(values) if values else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    specs = [(name, CONFIGS[name]) for name in args.configs]
    rows: list[dict[str, Any]] = []
    with (
        LocalServer(api_key=API_KEY, latency=args.latency) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        base = held_out(server, args.heldout, args.seeds, args.steps, args.batch)
        profile, task, problems, stop = base.profile, base.task, base.problems, base.stop
        start = time.perf_counter()
        before = evaluate(base.base_sampler, base.tokenizer, problems, stop)
        eval_s = time.perf_counter() - start
        print(f"base model: greedy exact {before:.1%} on {len(problems)} held-out ({eval_s:.0f} s)")
        for key, spec in specs:
            for seed in args.seeds:
                run_dir = Path(tmp) / f"{key}-s{seed}"
                rows.append(measure_run(args, server, base, before, spec, seed, run_dir))
        quickstart = _quickstart_timing(server, profile, task, args.quickstart_steps, args.batch)
    return {
        "benchmark": "learning",
        "model": "local default (engine/local/default_model)",
        "task": f"addition, operands {task.min_operand}..{task.max_operand}, "
        "'Question: What is {a} + {b}?\\nAnswer:'",
        "eval": {
            "heldout": len(problems),
            "heldout_seed": HELDOUT_SEED,
            "disjoint_from_training": True,
            "excluded_training_prefix_per_seed": _TRAIN_PREFIX_FACTOR * args.steps * args.batch,
            "temperature": 0.0,
            "max_tokens": MAX_TOKENS,
            "stop_at_eos": stop is not None,
            "metric": "exact_bonus > 0 of the arithmetic reward",
        },
        "train": {
            "steps": args.steps,
            "batch": args.batch,
            "group": DEFAULTS.pipeline.group,
            "max_tokens": DEFAULTS.sampling.max_tokens,
            "temperature": LOCAL_TEMPERATURE,  # what the local service recommends
            "seeds": list(args.seeds),
        },
        "latency": args.latency,
        "sdk": args.sdk,
        "base_eval_s": round(eval_s, 1),
        "runs": rows,
        "quickstart_timing": quickstart,
        "summary": _summary(rows, args.target_gain, quickstart),
    }


def _summary(
    rows: Sequence[dict[str, Any]], target_gain: float, quickstart: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Per configuration: mean exact rate after and mean delta over the seeds, how many
    seeds improved, the mean held-out curve, the first evaluated step where its mean
    gain reaches ``target_gain`` (None if it never does) and the mean wall time to that
    step's end. With ``quickstart`` timings, a ``quickstart loop`` row: K=0's steps at
    the quickstart loop's measured pace."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        steps = sorted({int(k) for r in mine for k in r["curve"]})
        curve = {
            step: statistics.fmean(
                r["curve"][str(step)] - r["exact_before"] for r in mine if str(step) in r["curve"]
            )
            for step in steps
        }
        reached = next((step for step in steps if curve[step] >= target_gain), None)
        ends = [r["step_end_s"][reached - 1] for r in mine if reached and r["step_end_s"]]
        out.append(
            {
                "config": name,
                "seeds": len(mine),
                "mean_exact_after": statistics.fmean(r["exact_after"] for r in mine),
                "mean_delta": statistics.fmean(r["delta"] for r in mine),
                "min_delta": min(r["delta"] for r in mine),
                "seeds_improved": sum(r["delta"] > 0 for r in mine),
                "mean_gain_by_step": {str(k): v for k, v in curve.items()},
                "target_gain": target_gain,
                "steps_to_target_gain": reached,
                "wall_s_to_target_gain": statistics.fmean(ends) if ends else None,
            }
        )
    k0 = next((r for r in out if r["config"] == CONFIGS["k0"].name), None)
    if quickstart is not None and k0 is not None:
        reached = k0["steps_to_target_gain"]
        out.append(
            {
                "config": "quickstart loop",
                "seeds": 0,
                "target_gain": target_gain,
                "steps_to_target_gain": reached,
                "wall_s_to_target_gain": quickstart["first_step_s"]
                + (reached - 1) * quickstart["step_s"]
                if reached
                else None,
                "derived": "K=0 importance sampling's steps at the quickstart loop's pace",
            }
        )
    return out


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        "| config | seed | steps | exact before | exact after | delta | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['config']} | {r['seed']} | {r['steps']} | {r['exact_before']:.1%} | "
            f"{r['exact_after']:.1%} | {r['delta']:+.1%} | {r['wall_s']:.0f} s |"
        )
    measured = [r for r in report["summary"] if r["seeds"]]
    if any(r["seeds"] > 1 for r in measured):
        lines += ["", "| config | seeds | mean exact after | mean delta | min delta | improved |"]
        lines.append("|---|---|---|---|---|---|")
        for r in measured:
            lines.append(
                f"| {r['config']} | {r['seeds']} | {r['mean_exact_after']:.1%} | "
                f"{r['mean_delta']:+.1%} | {r['min_delta']:+.1%} | "
                f"{r['seeds_improved']}/{r['seeds']} |"
            )
    lines += [
        "",
        f"| config | mean gain by step | steps to the target gain | wall time to it "
        f"(latency {report['latency']}) |",
        "|---|---|---|---|",
    ]
    for r in report["summary"]:
        by_step = ", ".join(f"{k}: {v:+.1%}" for k, v in r.get("mean_gain_by_step", {}).items())
        reached = r["steps_to_target_gain"]
        wall = r["wall_s_to_target_gain"]
        lines.append(
            f"| {r['config']} | {by_step or r.get('derived', '')} | "
            f"{'not reached' if reached is None else reached} (+{r['target_gain']:.0%}) | "
            f"{'n/a' if wall is None else f'{wall:.1f} s'} |"
        )
    return "\n".join(lines)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("at least one seed is needed")
    if HELDOUT_SEED in seeds:
        raise argparse.ArgumentTypeError(f"{HELDOUT_SEED} is the held-out seed")
    return seeds


def _configs(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown config {', '.join(bad) or '(none)'}; choose from {', '.join(CONFIGS)}"
        )
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--heldout", type=positive_int, default=200, help="held-out problems")
    parser.add_argument("--seeds", type=_seeds, default=[42], help="training seeds, e.g. 42,7")
    parser.add_argument("--batch", type=positive_int, default=8, help="problems per step")
    parser.add_argument(
        "--configs",
        type=_configs,
        default=None,
        help=f"from {', '.join(CONFIGS)} (default: "
        + "; ".join(f"{','.join(v)} with --sdk {k}" for k, v in DEFAULT_CONFIGS.items())
        + ")",
    )
    parser.add_argument(
        "--sdk",
        choices=("mint", "tinker"),
        default="mint",
        help="mint: the engine in this process; tinker: python -m engine.run in the tinker "
        "0.38 environment (--tinker-python), no curve and no quickstart timing",
    )
    parser.add_argument(
        "--tinker-python",
        type=Path,
        default=TINKER_PYTHON,
        help=f"the tinker 0.38 environment's python (default {TINKER_PYTHON})",
    )
    parser.add_argument(
        "--curve-every",
        type=int,
        default=5,
        help="also evaluate every N steps' snapshot (0: only before/after; default 5)",
    )
    parser.add_argument(
        "--target-gain",
        type=float,
        default=0.08,
        help="report the first evaluated step whose mean gain reaches this (default 0.08)",
    )
    parser.add_argument(
        "--latency",
        default="off",
        help="the server's latency profile, as `python -m engine.local --latency` takes it "
        "(default off; mint: wall times on the hosted-like clock)",
    )
    parser.add_argument(
        "--quickstart-steps",
        type=int,
        default=3,
        help="also time this many steps of the quickstart loop (0: skip; default 3)",
    )
    parser.add_argument("--quick", action="store_true", help="2 steps, 20 held-out, K=0 only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS[args.sdk]
    if args.quick:
        args.steps, args.heldout, args.configs, args.curve_every = 2, 20, ["k0"], 1
        args.quickstart_steps = min(args.quickstart_steps, 2)
    if args.sdk == "mint" and "gspo" in args.configs:
        parser.error("--configs gspo needs --sdk tinker (the mint SDK cannot send gspo)")
    if args.sdk == "tinker":
        if "control" in args.configs:
            parser.error("--configs control needs --sdk mint (its task runs in this process)")
        if not args.tinker_python.is_file():
            parser.error(
                f"--sdk tinker needs the tinker 0.38 environment: no {args.tinker_python} "
                "(scripts/bootstrap_tinker.sh makes .venv-tinker)"
            )
        args.curve_every, args.quickstart_steps = 0, 0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
