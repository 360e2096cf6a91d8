"""How a task's problems become groups of episodes, for training and held-out eval alike.

A single-turn task's group is ``size`` one-turn episodes of its prompt, rewarded by the
run's :class:`~engine.envs.scoring.Scorer` (:mod:`engine.envs.single_turn`); an
environment task builds its own (in worker processes or on Ray with
``--score-workers``). Either way the pipeline runs :class:`EnvGroupBuilder`\\ s and gets
trajectories back: this module is the one place that tells the kinds apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.problems import Problem
from engine.core.trajectory import EpisodeLimits, Observation, StopCondition
from engine.envs.executors import Workers, env_workers, on_workers
from engine.envs.scoring import Scorer
from engine.envs.single_turn import TaskGroupBuilder
from engine.envs.types import AnyTask, EnvContext, EnvGroupBuilder, EnvTask, is_env_task
from engine.tasks.render import PromptRenderer

__all__ = ["GroupPlan", "NotSampled"]


@dataclass(frozen=True)
class NotSampled:
    """A problem whose group cannot be sampled: its prompt plus ``--max-tokens`` exceeds
    the model's context (the server would refuse it, and one refusal stops the run)."""

    reason: str


class GroupPlan:
    """Builds each problem's group for ``task`` under ``config``: the builder, the limits
    its episodes run under (None: single-turn, one turn ended by the environment) and
    the worker pool an environment's steps run in (entered once per run). The task is
    checked against ``--score-workers`` once, by whoever loads it
    (:func:`~engine.envs.scoring.check_score_workers`)."""

    def __init__(
        self,
        config: EngineConfig,
        task: AnyTask,
        renderer: PromptRenderer,
        max_context: int | None,
    ) -> None:
        self._renderer = renderer
        self._max_tokens = config.sampling.max_tokens
        self._max_context = max_context
        self.stop = StopCondition(*renderer.stops(stop_at_eos=config.sampling.stop_at_eos))
        workers = config.scoring.score_workers
        self.workers: Workers | None = None
        self._env_task: EnvTask | None = None
        self._scorer: Scorer | None = None
        self.limits: EpisodeLimits | None = None
        if is_env_task(task):
            self._env_task = task
            self.workers = env_workers(workers, task)
            self.limits = config.environment.episode_limits().within(max_context)
            self.context = EnvContext(renderer.context, self.stop, self.limits)
        else:
            self._scorer = Scorer(
                task, concurrency=config.scoring.score_concurrency, workers=workers
            )
            self.context = EnvContext(renderer.context, self.stop)

    @property
    def episodic(self) -> bool:
        """Whether the task is an environment task (episodes of any length)."""
        return self._env_task is not None

    def build(
        self, problem: Problem, size: int, *, in_workers: bool = True
    ) -> EnvGroupBuilder | NotSampled:
        """The builder of ``problem``'s group of ``size`` episodes; an environment's
        steps run in :attr:`workers` (entered by the caller) unless ``in_workers`` is
        False (held-out episodes run in this process)."""
        if self._env_task is not None:
            builder = self._env_task.group_builder(problem, size, self.context)
            if self.workers is None or not in_workers:
                return builder
            return on_workers(builder, self.workers)
        assert self._scorer is not None
        prompt = tuple(self._renderer.prompt_tokens(problem))
        if self._max_context is not None and len(prompt) > self._max_context - self._max_tokens:
            return NotSampled(
                f"problem {problem.id}'s prompt of {len(prompt)} tokens plus --max-tokens "
                f"{self._max_tokens} exceeds the model's context of {self._max_context} tokens"
            )
        observation = Observation(prompt, self.stop)
        return TaskGroupBuilder(problem, observation, size, self._scorer, self._renderer)
