"""Where environment steps and group rewards run: the event loop, worker processes, or a
Ray cluster.

By default environments run on the event loop (they are ``async``: I/O-bound work such
as a sandbox call or a judge overlaps freely; blocking work belongs in
``anyio.to_thread.run_sync``). With ``--score-workers processes:N`` (a pool of ``N``
worker processes on this machine: CPU-bound Python environments) or ``ray:N`` (Ray
tasks, at most ``N`` in flight, on a Ray cluster: environments that need more CPU than
one machine, see :mod:`engine.envs.ray_workers`) an environment task's
``initial_observation``, ``step`` and ``compute_group_rewards`` run remotely instead:
the environment (or builder) is pickled to a worker, run there on its own event loop,
and pickled back with its new state, so it must be picklable -- checked on the task
before the run starts (one clear line otherwise), and per group (a group whose builder
cannot be pickled fails like a failing reward). Remote calls are cancelled (their
workers killed) on cancellation.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

import anyio
import anyio.to_process

from engine.config.values import ScoreWorkers
from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Action, Observation, Trajectory
from engine.envs.ray_workers import RayWorkers
from engine.envs.types import Env, EnvGroupBuilder, EnvStepResult
from engine.envs.worker_calls import call_in_worker, outcome_of

__all__ = [
    "ProcessWorkers",
    "RemoteEnv",
    "RemoteGroup",
    "Workers",
    "env_workers",
    "on_workers",
]


class Workers(Protocol):
    """Runs ``target.method(*args)`` elsewhere and returns ``target`` as it is after the
    call (its new state) with the call's value; what the call raises is raised here.
    Entered once per run (a pool or a cluster connection lives that long)."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    async def call(self, target: Any, method: str, *args: Any) -> tuple[Any, Any]: ...


class ProcessWorkers:
    """At most ``processes`` worker processes on this machine (anyio's process pool)."""

    def __init__(self, processes: int) -> None:
        self._limiter = anyio.CapacityLimiter(processes)

    async def __aenter__(self) -> ProcessWorkers:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    async def call(self, target: Any, method: str, *args: Any) -> tuple[Any, Any]:
        outcome: tuple[Any, Any, BaseException | None] = await anyio.to_process.run_sync(
            call_in_worker, target, method, *args, cancellable=True, limiter=self._limiter
        )
        return outcome_of(outcome)


def env_workers(spec: ScoreWorkers, task: object = None) -> Workers | None:
    """Where ``--score-workers`` runs an environment task's calls (None: the event loop):
    the task's own choice when it has one (``own_workers(spec)``: an agent task runs its
    agents in processes that each run many at once)."""
    own = getattr(task, "own_workers", None)
    if callable(own):
        return own(spec)  # type: ignore[no-any-return]
    if spec.kind == "processes":
        return ProcessWorkers(spec.count)
    if spec.kind == "ray":
        return RayWorkers(spec.count)
    return None


def on_workers(builder: EnvGroupBuilder, workers: Workers) -> EnvGroupBuilder:
    """``builder`` with its work on ``workers``: placed by itself when it can be
    (``on_workers(workers)``: an agent group runs its agents there and serves them
    here), else as a :class:`RemoteGroup`."""
    place = getattr(builder, "on_workers", None)
    if callable(place):
        return place(workers)  # type: ignore[no-any-return]
    return RemoteGroup(builder, workers)


class RemoteEnv:
    """An environment whose calls run on ``workers`` (its state travels along)."""

    def __init__(self, env: Env, workers: Workers) -> None:
        self.env = env
        self._workers = workers

    async def initial_observation(self) -> Observation:
        self.env, observation = await self._workers.call(self.env, "initial_observation")
        return observation  # type: ignore[no-any-return]

    async def step(self, action: Action) -> EnvStepResult:
        self.env, result = await self._workers.call(self.env, "step", action)
        return result  # type: ignore[no-any-return]


class RemoteGroup:
    """A group builder whose environments and group rewards run on ``workers``;
    ``make_envs`` and ``cleanup`` stay on the event loop (they own resources)."""

    def __init__(self, builder: EnvGroupBuilder, workers: Workers) -> None:
        self.builder = builder
        self._workers = workers

    async def make_envs(self) -> Sequence[Env]:
        return [RemoteEnv(env, self._workers) for env in await self.builder.make_envs()]

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        inner = [e.env if isinstance(e, RemoteEnv) else e for e in envs]
        self.builder, rewards = await self._workers.call(
            self.builder, "compute_group_rewards", tuple(trajectories), inner
        )
        return rewards  # type: ignore[no-any-return]

    async def cleanup(self) -> None:
        await self.builder.cleanup()
