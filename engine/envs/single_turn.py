"""A single-turn :class:`~engine.core.problems.Task` as a group of one-turn environments.

Every built-in and user task (arithmetic, JSONL, Hugging Face datasets, ``--task
module:attr``) runs through this adapter: each episode opens with the task's prompt,
the first action ends it, and the group reward is the task's reward of each decoded
response, computed by the run's :class:`~engine.envs.scoring.Scorer` (``score`` or
``score_group``, ``--score-workers``, ``--score-concurrency``). The group's episodes
open alike, so they are sampled in one request of ``--group`` responses, as before:
the same requests, rewards and datums, datum for datum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.problems import Problem, RewardBreakdown
from engine.core.trajectory import Action, Observation, Trajectory
from engine.envs.scoring import Scorer
from engine.envs.types import Env, EnvStepResult
from engine.tasks.render import PromptRenderer

__all__ = ["PromptEnv", "TaskGroupBuilder"]


@dataclass(frozen=True)
class PromptEnv:
    """One prompt, one response: the first action ends the episode."""

    observation: Observation

    async def initial_observation(self) -> Observation:
        return self.observation

    async def step(self, action: Action) -> EnvStepResult:
        return EnvStepResult(done=True)


@dataclass(frozen=True)
class TaskGroupBuilder:
    """The group of one problem of a single-turn task."""

    problem: Problem
    observation: Observation
    size: int
    scorer: Scorer
    renderer: PromptRenderer

    async def make_envs(self) -> Sequence[Env]:
        return [PromptEnv(self.observation)] * self.size

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        responses = [self.renderer.decode(t.turns[0].action) for t in trajectories]
        return await self.scorer.score(self.problem, responses)

    async def cleanup(self) -> None:
        return None
