"""Held-out evaluation: greedy responses to a task's ``eval_problems()``, scored by the
task, as ``eval/*`` metrics.

Why greedy and one sample per problem: the figure should move only when the policy
does, not with sampling noise. A reward that raises on a held-out problem follows
``--on-reward-error``: ``fail`` stops the run; ``skip`` leaves that problem out of the
means, counts it in ``eval/reward_errors`` and says so once per problem.
:func:`evaluate` is a standalone coroutine (a session, a sampler snapshot, the task);
:class:`Evaluator` decides when it runs (``--eval-every`` steps, at the start and after
the last step) and appends each result to ``eval.jsonl`` in the run dir.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from engine.config import OnRewardError
from engine.envs.types import is_env_task
from engine.errors import ConfigError
from engine.loop.scoring import RewardError, Scorer
from engine.rundir.checkpoints import truncate_metrics
from engine.session.api import SamplerHandle, SamplingSettings, Session
from engine.tasks.base import Problem, RewardBreakdown, Task
from engine.tasks.render import PromptRenderer

__all__ = ["EVAL_FILE", "Evaluator", "eval_problems_of", "evaluate"]

EVAL_FILE = "eval.jsonl"


def eval_problems_of(task: Task) -> list[Problem]:
    """The task's held-out problems (``eval_problems()``); ConfigError when it has none
    or is an environment task (held-out episodes are not evaluated yet)."""
    if is_env_task(task):
        raise ConfigError(
            f"--eval-every evaluates single-turn tasks only, and {task.name!r} is an "
            "environment task; run without --eval-every"
        )
    method = getattr(task, "eval_problems", None)
    problems = list(method()) if callable(method) else []
    if not problems:
        raise ConfigError(
            f"--eval-every needs held-out problems, and task {task.name!r} has none "
            "(jsonl tasks: --task-arg eval_size=N or eval_path=FILE; your own task: an "
            "eval_problems() method)"
        )
    return problems


async def evaluate(
    session: Session,
    sampler: SamplerHandle,
    renderer: PromptRenderer,
    scorer: Scorer,
    problems: Sequence[Problem],
    *,
    max_tokens: int,
    stop_at_eos: bool = False,
    concurrency: int = 64,
    on_reward_error: Callable[[RewardError], None] | None = None,
) -> dict[str, float]:
    """Sample one greedy response per problem from ``sampler`` and score it with the
    task's ``scorer``: ``eval/reward/total`` (mean), ``eval/<component>`` (mean),
    ``eval/<component>/rate`` (fraction > 0), ``eval/problems`` (how many were scored)
    and ``eval/reward_errors``. A reward that raises ends the evaluation with its
    RewardError, unless ``on_reward_error`` is given: it is then called with the error
    and the problem is left out of the means (none left: no means)."""
    stop_strings, stop_token_ids = renderer.stops(stop_at_eos=stop_at_eos)
    settings = SamplingSettings(
        max_tokens=max_tokens,
        temperature=0.0,
        stop_token_ids=stop_token_ids,
        stop_strings=stop_strings,
    )
    limiter = anyio.CapacityLimiter(concurrency)
    scored: list[RewardBreakdown | None] = [None] * len(problems)

    async def one(i: int, problem: Problem) -> None:
        async with limiter:
            result = await session.sample(sampler, renderer.prompt_tokens(problem), 1, settings)
        text = renderer.decode(result.completions[0].tokens)
        try:
            (scored[i],) = await scorer.score(problem, [text])
        except RewardError as error:
            if on_reward_error is None:
                raise
            on_reward_error(error)

    async with anyio.create_task_group() as tg:
        for i, problem in enumerate(problems):
            tg.start_soon(one, i, problem)
    rewards = [r for r in scored if r is not None]
    n = len(rewards)
    out: dict[str, float] = {
        "eval/problems": float(n),
        "eval/reward_errors": float(len(problems) - n),
    }
    if not rewards:
        return out
    out["eval/reward/total"] = sum(r.total for r in rewards) / n
    for name in sorted({k for r in rewards for k in r.components}):
        values = [float(r.components.get(name, 0.0)) for r in rewards]
        out[f"eval/{name}"] = sum(values) / n
        out[f"eval/{name}/rate"] = sum(1 for v in values if v > 0) / n
    return out


class Evaluator:
    """Runs :func:`evaluate` every ``every`` steps, at step 0 and after ``last_step``;
    each result is appended to ``<run dir>/eval.jsonl`` and said on the console; with
    ``on_reward_error="skip"`` each reward error is one ``warn`` line."""

    def __init__(
        self,
        session: Session,
        task: Task,
        renderer: PromptRenderer,
        scorer: Scorer,
        run_dir: Path,
        *,
        every: int,
        last_step: int,
        max_tokens: int,
        stop_at_eos: bool,
        concurrency: int,
        on_reward_error: OnRewardError = "fail",
        say: Callable[[str], None] = lambda line: None,
        warn: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._session = session
        self._renderer = renderer
        self._scorer = scorer
        self._problems = eval_problems_of(task)
        self._path = run_dir / EVAL_FILE
        self._every = every
        self._last_step = last_step
        self._max_tokens = max_tokens
        self._stop_at_eos = stop_at_eos
        self._concurrency = concurrency
        self._skip_reward_errors = on_reward_error == "skip"
        self._say = say
        self._warn = warn

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` train steps are evaluated."""
        return step == 0 or step % self._every == 0 or step == self._last_step

    def rewind(self, keep_through_step: int) -> None:
        """Drop the results of steps after ``keep_through_step`` (they are redone)."""
        truncate_metrics(self._path, keep_through_step)

    async def __call__(self, step: int, sampler: SamplerHandle) -> dict[str, float]:
        def skip(error: RewardError) -> None:
            self._warn(
                f"eval after step {step}: {error}; the problem was left out of the eval "
                "metrics (--on-reward-error skip)"
            )

        metrics = await evaluate(
            self._session,
            sampler,
            self._renderer,
            self._scorer,
            self._problems,
            max_tokens=self._max_tokens,
            stop_at_eos=self._stop_at_eos,
            concurrency=self._concurrency,
            on_reward_error=skip if self._skip_reward_errors else None,
        )
        record: dict[str, Any] = {"step": step, "sampler_version": sampler.version, **metrics}
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        rates = ", ".join(f"{k}={v:.1%}" for k, v in metrics.items() if k.endswith("/rate"))
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
