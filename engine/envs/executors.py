"""Where environment steps and group rewards run: the event loop, or worker processes.

By default environments run on the event loop (they are ``async``: I/O-bound work such
as a sandbox call or a judge overlaps freely; blocking work belongs in
``anyio.to_thread.run_sync``). With ``--score-workers processes:N`` an environment
task's ``initial_observation``, ``step`` and ``compute_group_rewards`` run in a pool of
``N`` worker processes instead (CPU-bound Python environments): the environment (or
builder) is pickled to a worker, run there on its own event loop, and pickled back with
its new state, so it must be picklable -- checked on the task before the run starts
(one clear line otherwise), and per group (a group whose builder cannot be pickled
fails like a failing reward). Workers are killed on cancellation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_process

from engine.envs.types import Action, Env, EnvGroupBuilder, EnvStepResult, Observation, Trajectory
from engine.tasks.base import RewardBreakdown

__all__ = ["ProcessEnv", "ProcessGroup"]


class ProcessEnv:
    """An environment whose calls run in a worker process (its state travels along)."""

    def __init__(self, env: Env, limiter: anyio.CapacityLimiter) -> None:
        self.env = env
        self._limiter = limiter

    async def initial_observation(self) -> Observation:
        self.env, observation = await _in_worker(self._limiter, self.env, "initial_observation")
        return observation  # type: ignore[no-any-return]

    async def step(self, action: Action) -> EnvStepResult:
        self.env, result = await _in_worker(self._limiter, self.env, "step", action)
        return result  # type: ignore[no-any-return]


class ProcessGroup:
    """A group builder whose environments and group rewards run in worker processes;
    ``make_envs`` and ``cleanup`` stay on the event loop (they own resources)."""

    def __init__(self, builder: EnvGroupBuilder, limiter: anyio.CapacityLimiter) -> None:
        self.builder = builder
        self._limiter = limiter

    async def make_envs(self) -> Sequence[Env]:
        return [ProcessEnv(env, self._limiter) for env in await self.builder.make_envs()]

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        inner = [e.env if isinstance(e, ProcessEnv) else e for e in envs]
        self.builder, rewards = await _in_worker(
            self._limiter, self.builder, "compute_group_rewards", tuple(trajectories), inner
        )
        return rewards  # type: ignore[no-any-return]

    async def cleanup(self) -> None:
        await self.builder.cleanup()


async def _in_worker(
    limiter: anyio.CapacityLimiter, target: Any, method: str, *args: Any
) -> tuple[Any, Any]:
    outcome: tuple[Any, Any, BaseException | None] = await anyio.to_process.run_sync(
        _call, target, method, *args, cancellable=True, limiter=limiter
    )
    target_after, value, error = outcome
    if error is not None:
        raise error
    return target_after, value


def _call(target: Any, method: str, *args: Any) -> tuple[Any, Any, BaseException | None]:
    """In the worker: run ``target.method(*args)`` on a fresh event loop; what it raises
    comes back as a value."""

    async def run() -> Any:
        return await getattr(target, method)(*args)

    try:
        return target, anyio.run(run), None
    except Exception as exc:
        return target, None, exc
