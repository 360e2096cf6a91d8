"""Held-out evaluation: greedy responses to a task's ``eval_problems()``, scored by the
task, as ``eval/*`` metrics; optionally also ``samples`` sampled responses per problem
(``eval/sampled/*``: their mean reward, pass@1, pass@n and pass@k for a list of k).

Why greedy first: the figure should move only when the policy does, not with sampling
noise; the sampled figures say what a group of the training sampler sees. A response
*passes* when its total reward reaches ``pass_reward`` (1.0: every preset's correct
answer, and the arithmetic task's exact one); pass@k is the unbiased estimate
1 - C(n-c, k) / C(n, k) from ``n`` samples with ``c`` passing, averaged over problems.
A reward that raises on a held-out problem follows ``--on-reward-error``: ``fail``
stops the run; ``skip`` leaves that problem out of the means, counts it in
``eval/reward_errors`` and says so once per problem.
:func:`evaluate` is a standalone coroutine (a session, a sampler snapshot, the task);
:func:`evaluate_problems` also returns each problem's episodes, which
:func:`problem_records` writes out for a person (``python -m engine.eval``'s JSON).
:class:`Evaluator` decides when it runs (``--eval-every`` steps, at the start and after
the last step) and appends each result to ``eval.jsonl`` in the run dir.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from engine.config import EngineConfig
from engine.config.values import pass_k_problem
from engine.core.problems import Problem, RewardBreakdown
from engine.core.seeds import EVAL_STEP, sampling_seed
from engine.core.trajectory import Observation, Trajectory
from engine.envs.rollout import EpisodeRunner, SampledAction, turn_settings
from engine.envs.scoring import RewardError
from engine.envs.types import AnyTask
from engine.errors import ConfigError, EngineError
from engine.loop.groups import GroupPlan, NotSampled
from engine.session.api import SamplerHandle, Session
from engine.tasks.render import PromptRenderer

__all__ = [
    "EVAL_FILE",
    "PASS_REWARD",
    "Evaluation",
    "Evaluator",
    "HeldOutLog",
    "ProblemEpisodes",
    "eval_problems_of",
    "evaluate",
    "evaluate_problems",
    "pass_at_k",
    "problem_records",
]

EVAL_FILE = "eval.jsonl"
PASS_REWARD = 1.0
"""A response whose total reward reaches this passes (pass rate, pass@k)."""
_PASS_SLACK = 1e-9  # rewards summed from components (0.2 + 0.5 + 0.3) may land below 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``n`` samples with ``c`` passing (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_problems_of(
    task: AnyTask, needs: str = "--eval-every needs held-out problems"
) -> list[Problem]:
    """The task's held-out problems (``eval_problems()``); ConfigError when it has none,
    saying what ``needs`` them."""
    method = getattr(task, "eval_problems", None)
    problems = list(method()) if callable(method) else []
    if not problems:
        raise ConfigError(
            f"{needs}, and task {task.name!r} has none "
            "(jsonl tasks: --task-arg eval_size=N or eval_path=FILE; your own task: an "
            "eval_problems() method)"
        )
    return problems


@dataclass(frozen=True)
class ProblemEpisodes:
    """One held-out problem's greedy episode and sampled ones; a problem left out of the
    means (``on_reward_error``) has no greedy episode and says why in ``error``."""

    problem: Problem
    greedy: Trajectory | None
    samples: tuple[Trajectory, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate_problems` measured: the ``eval/*`` metrics and, in the
    problems' order, each problem's episodes."""

    metrics: dict[str, float]
    problems: tuple[ProblemEpisodes, ...]


async def evaluate(
    session: Session,
    sampler: SamplerHandle,
    plan: GroupPlan,
    problems: Sequence[Problem],
    *,
    max_tokens: int,
    concurrency: int = 64,
    samples: int = 0,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    pass_reward: float = PASS_REWARD,
    on_reward_error: Callable[[RewardError], None] | None = None,
    seed: int | None = None,
) -> dict[str, float]:
    """The metrics of :func:`evaluate_problems` (which says what each argument does)."""
    evaluation = await evaluate_problems(
        session,
        sampler,
        plan,
        problems,
        max_tokens=max_tokens,
        concurrency=concurrency,
        samples=samples,
        ks=ks,
        temperature=temperature,
        pass_reward=pass_reward,
        on_reward_error=on_reward_error,
        seed=seed,
    )
    return evaluation.metrics


async def evaluate_problems(
    session: Session,
    sampler: SamplerHandle,
    plan: GroupPlan,
    problems: Sequence[Problem],
    *,
    max_tokens: int,
    concurrency: int = 64,
    samples: int = 0,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    pass_reward: float = PASS_REWARD,
    on_reward_error: Callable[[RewardError], None] | None = None,
    seed: int | None = None,
) -> Evaluation:
    """One greedy episode per held-out problem (a group of one from ``plan``, run by the
    training's episode runner under its limits), scored as in training: ``eval/reward/total``
    (mean total reward), ``eval/<component>`` (mean), ``eval/<component>/rate`` (fraction
    > 0), ``eval/pass_rate`` (fraction passing), ``eval/problems`` (how many were scored)
    and ``eval/reward_errors``; an environment task's also ``eval/success_rate`` (episodes
    with a total reward > 0) and ``eval/turns_per_episode``. With ``samples`` = n > 0 also
    one group of n episodes per problem at ``temperature``: ``eval/sampled/reward/total``
    (mean over all), ``eval/sampled/pass@1``, ``eval/sampled/pass@n`` and
    ``eval/sampled/pass@k`` for each of ``ks`` (each k <= n; ValueError otherwise). A
    group that cannot be built, sampled or scored ends the evaluation with its
    RewardError, unless ``on_reward_error`` is given: it is then called with the error and
    the problem is left out of the means (none left: no means). ``seed`` (a run's
    ``--seed``) seeds each request by the problem's index
    (:data:`~engine.core.seeds.EVAL_STEP`); None sends none."""
    unfit = pass_k_problem(ks, samples)
    if unfit:
        raise ValueError(unfit)
    limiter = anyio.CapacityLimiter(concurrency)

    def runner(temperature: float, problem: int) -> EpisodeRunner:
        async def sample(
            observation: Observation, n: int, room: int | None, *, episode: int, turn: int
        ) -> list[SampledAction]:
            request_seed = (
                None if seed is None else sampling_seed(seed, EVAL_STEP, problem, episode, turn)
            )
            settings = turn_settings(
                observation, room, max_tokens=max_tokens, temperature=temperature, seed=request_seed
            )
            async with limiter:
                result = await session.sample(sampler, observation.tokens, n, settings)
            return [SampledAction(c, result.version) for c in result.completions]

        return EpisodeRunner(sample, plan.limits)

    outcomes = [ProblemEpisodes(p, None) for p in problems]

    async def play(episode_runner: EpisodeRunner, problem: Problem, n: int) -> list[Trajectory]:
        builder = plan.build(problem, n, in_workers=False)
        if isinstance(builder, NotSampled):
            raise RewardError(problem, EngineError(builder.reason))
        rollout = await episode_runner.run_group(builder, problem)
        if rollout.error is not None:
            raise rollout.error
        return list(rollout.trajectories)

    async def one(i: int, problem: Problem) -> None:
        try:
            (episode,) = await play(runner(0.0, i), problem, 1)
            rest = await play(runner(temperature, i), problem, samples) if samples else []
        except RewardError as error:
            if on_reward_error is None:
                raise
            on_reward_error(error)
            outcomes[i] = ProblemEpisodes(problem, None, error=str(error))
            return
        outcomes[i] = ProblemEpisodes(problem, episode, tuple(rest))

    async with anyio.create_task_group() as tg:
        for i, problem in enumerate(problems):
            tg.start_soon(one, i, problem)
    scored = [None if o.greedy is None else _reward(o.greedy) for o in outcomes]
    scored_samples = [
        [_reward(t) for t in o.samples] if o.greedy is not None else None for o in outcomes
    ]
    out = _summary(scored, scored_samples, samples, pass_reward, ks)
    played = [o.greedy for o in outcomes if o.greedy is not None]
    if plan.episodic and played:
        out["eval/success_rate"] = sum(1 for e in played if e.total_reward > 0) / len(played)
        out["eval/turns_per_episode"] = sum(len(e.turns) for e in played) / len(played)
    return Evaluation(out, tuple(outcomes))


def problem_records(
    evaluation: Evaluation,
    renderer: PromptRenderer,
    *,
    texts: int,
    pass_reward: float = PASS_REWARD,
) -> list[dict[str, Any]]:
    """Each problem of ``evaluation`` for a person, JSON-able: its prompt as the model saw
    it, the greedy response and the sampled ones (text as the task read it, reward,
    components, whether it passed; an environment's also its outcome and turns). Bounded:
    the text of the first ``texts`` sampled responses per problem (the others: reward and
    components only)."""

    def response(episode: Trajectory, with_text: bool) -> dict[str, Any]:
        record: dict[str, Any] = {
            "reward": episode.total_reward,
            "components": dict(episode.group_reward.components),
            "passed": _passes(episode.total_reward, pass_reward),
        }
        if with_text:
            record["response"] = _response_text(episode, renderer)
        if len(episode.turns) != 1 or episode.outcome != "done":
            record.update(outcome=episode.outcome, turns=len(episode.turns))
        return record

    out = []
    for index, outcome in enumerate(evaluation.problems):
        greedy = outcome.greedy
        out.append(
            {
                "index": index,
                "problem_id": outcome.problem.id,
                "question": outcome.problem.question,
                "answer": outcome.problem.answer,
                "prompt": None
                if greedy is None
                else renderer.decode_prompt(greedy.turns[0].observation),
                "greedy": None if greedy is None else response(greedy, True),
                "samples": [response(t, i < texts) for i, t in enumerate(outcome.samples)],
                "reward_error": outcome.error,
            }
        )
    return out


def _response_text(episode: Trajectory, renderer: PromptRenderer) -> str:
    """The episode after its prompt: each action as the task read it, and what the
    environment appended between actions (a single turn's: its response)."""
    parts: list[str] = []
    context = episode.turns[0].observation
    for turn in episode.turns:
        extends = turn.observation[: len(context)] == context
        parts.append(
            renderer.decode_prompt(
                turn.observation[len(context) :] if extends else turn.observation
            )
        )
        parts.append(renderer.decode(turn.action))
        context = (*turn.observation, *turn.action)
    return "".join(parts)


def _reward(episode: Trajectory) -> RewardBreakdown:
    return RewardBreakdown(episode.total_reward, episode.group_reward.components)


def _passes(total: float, pass_reward: float) -> bool:
    return total >= pass_reward - _PASS_SLACK


def _summary(
    scored: Sequence[RewardBreakdown | None],
    scored_samples: Sequence[Sequence[RewardBreakdown] | None],
    samples: int,
    pass_reward: float,
    ks: Sequence[int] = (),
) -> dict[str, float]:
    """The ``eval/*`` means of per-problem greedy rewards (None: left out) and sampled
    ones."""
    rewards = [r for r in scored if r is not None]
    n = len(rewards)
    out: dict[str, float] = {
        "eval/problems": float(n),
        "eval/reward_errors": float(len(scored) - n),
    }
    if not rewards:
        return out

    def passes(r: RewardBreakdown) -> bool:
        return _passes(r.total, pass_reward)

    out["eval/reward/total"] = sum(r.total for r in rewards) / n
    out["eval/pass_rate"] = sum(1 for r in rewards if passes(r)) / n
    for name in sorted({k for r in rewards for k in r.components}):
        values = [float(r.components.get(name, 0.0)) for r in rewards]
        out[f"eval/{name}"] = sum(values) / n
        out[f"eval/{name}/rate"] = sum(1 for v in values if v > 0) / n
    groups = [g for g in scored_samples if g]
    if samples and groups:
        out["eval/sampled/reward/total"] = sum(r.total for g in groups for r in g) / (
            len(groups) * samples
        )
        for k in sorted({1, samples, *ks}):
            estimates = [pass_at_k(samples, sum(1 for r in g if passes(r)), k) for g in groups]
            out[f"eval/sampled/pass@{k}"] = sum(estimates) / len(groups)
    return out


class HeldOutLog:
    """When a held-out evaluation is due (step 0, every ``--eval-every`` steps, the last
    step) and where its result goes: a line of ``<run dir>/eval.jsonl``, and the step-0
    one to ``track`` (later ones ride in their step's metrics). Every evaluator has one."""

    def __init__(
        self,
        config: EngineConfig,
        run_dir: Path,
        track: Callable[[int, dict[str, float]], None],
    ) -> None:
        self._path = run_dir / EVAL_FILE
        self._every = config.evaluation.eval_every
        self._last_step = config.pipeline.steps
        self._track = track

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` train steps are evaluated."""
        return step == 0 or step % self._every == 0 or step == self._last_step

    def write(self, step: int, sampler: SamplerHandle, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, "sampler_version": sampler.version, **metrics}
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if step == 0:
            self._track(0, metrics)


class Evaluator:
    """Runs :func:`evaluate` on the task's held-out problems every ``--eval-every``
    steps, at step 0 and after the last step; each result is appended to
    ``<run dir>/eval.jsonl`` (``held_out``) and said on the console; with
    ``--on-reward-error skip`` each reward error is one ``warn`` line."""

    def __init__(
        self,
        session: Session,
        plan: GroupPlan,
        problems: Sequence[Problem],
        config: EngineConfig,
        held_out: HeldOutLog,
        *,
        say: Callable[[str], None] = lambda line: None,
        warn: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._session = session
        self._plan = plan
        self._problems = problems
        self._held_out = held_out
        self._max_tokens = config.sampling.max_tokens
        self._concurrency = config.pipeline.concurrency
        self._samples = config.evaluation.samples_drawn
        self._ks = config.evaluation.eval_k
        self._temperature = config.sampling.resolved_temperature
        self._skip_reward_errors = config.scoring.on_reward_error == "skip"
        self._seed = config.task.seed
        self._say = say
        self._warn = warn

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` train steps are evaluated."""
        return self._held_out.due(step)

    async def __call__(self, step: int, sampler: SamplerHandle) -> dict[str, float]:
        def skip(error: RewardError) -> None:
            self._warn(
                f"eval after step {step}: {error}; the problem was left out of the eval "
                "metrics (--on-reward-error skip)"
            )

        metrics = await evaluate(
            self._session,
            sampler,
            self._plan,
            self._problems,
            max_tokens=self._max_tokens,
            concurrency=self._concurrency,
            samples=self._samples,
            ks=self._ks,
            temperature=self._temperature,
            on_reward_error=skip if self._skip_reward_errors else None,
            seed=self._seed,
        )
        self._held_out.write(step, sampler, metrics)
        rates = ", ".join(
            f"{k}={v:.1%}"
            for k, v in metrics.items()
            if k.endswith(("/rate", "/success_rate")) or "pass@" in k
        )
        reward = metrics.get("eval/reward/total")
        errors = int(metrics["eval/reward_errors"])
        self._say(
            f"Eval after step {step}: reward="
            + ("n/a" if reward is None else f"{reward:.3f}")
            + (f", {rates}" if rates else "")
            + f" ({int(metrics['eval/problems'])} held-out problems, greedy"
            + (f"; {errors} left out: reward errors" if errors else "")
            + ")"
        )
        return metrics
