"""Running episodes: one group of environments from ``make_envs`` to ``cleanup``.

Each episode is one anyio task that alternates sampling and environment steps; the
episodes of a group run concurrently, and when every environment of a group opens with
the same observation (one problem, ``--group`` attempts) their first turn is one sample
request for the whole group (as a single-turn task samples). Sampling goes through a
:class:`TurnSampler`, which picks the sampler version (the newest the run has) and
bounds the requests in flight; each turn records the version that sampled it.

Limits (:class:`~engine.envs.types.EpisodeLimits`), and what ends an episode:

* the environment says ``done`` (outcome ``"done"``, or its own ``outcome``);
* ``max_turns`` actions were taken (``"max_turns"``);
* the next observation leaves no room for one more token within ``max_tokens``
  (``"max_tokens"``; each action is also capped to the room left);
* the episode ran longer than ``episode_timeout`` seconds from its group's start
  (``"timeout"``: the action being sampled or stepped then is lost, the turns before it
  are kept);
* ``env.step`` raised (``"env_error"``: the action is kept as a last turn with reward 0).

A limit or an environment error yields ``on_limit`` (zero reward, or masked); a parse
error ``on_parse_error``. A failing ``make_envs``, ``initial_observation`` or
``compute_group_rewards`` fails the group like a failing reward function
(:class:`~engine.envs.scoring.RewardError`, handled by ``--on-reward-error``); a failing
sample request propagates (the run stops after the steps in flight). ``cleanup`` always
runs, shielded from cancellation for at most :data:`CLEANUP_TIMEOUT_S`. A builder that is
also an async context manager is entered around its whole group (make_envs to cleanup):
the scope in which it may own tasks, e.g. an agent task's agents (:mod:`engine.agents`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio

from engine.common.clock import Stopwatch
from engine.core.datums import Completion
from engine.core.problems import Problem
from engine.core.seeds import ALL_EPISODES
from engine.core.trajectory import Action, EpisodeLimits, Observation, Outcome, Trajectory, Turn
from engine.envs.scoring import RewardError, check_rewards
from engine.envs.types import Env, EnvGroupBuilder, EnvStepResult
from engine.errors import EngineError, primary_error
from engine.session.api import SamplingParams

__all__ = ["EpisodeRunner", "GroupRollout", "SampledAction", "TurnSampler", "turn_settings"]


CLEANUP_TIMEOUT_S = 60.0
"""How long a group's ``cleanup`` may take (it runs shielded from cancellation)."""
T = TypeVar("T")


@dataclass(frozen=True)
class SampledAction:
    """One sampled response, the sampler version that produced it, and the retries
    of its request (counted on the first response of a request only)."""

    completion: Completion
    version: int
    retries: int = 0


class TurnSampler(Protocol):
    """Samples ``n`` actions for one observation. ``room`` caps the action's length
    (the context left under ``max_tokens``; None: no cap beyond the stop condition).
    ``episode`` and ``turn`` say which request of the group it is (``episode`` is
    :data:`~engine.core.seeds.ALL_EPISODES` for the group's shared first turn): what a
    request's seed is derived from."""

    async def __call__(
        self, observation: Observation, n: int, room: int | None, *, episode: int, turn: int
    ) -> Sequence[SampledAction]: ...


def turn_settings(
    observation: Observation,
    room: int | None,
    *,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
) -> SamplingParams:
    """The sample request of one turn: the observation's stop condition, its action
    capped by its own ``max_tokens`` (else the run's) and by the ``room`` left."""
    stop = observation.stop
    limit = stop.max_tokens or max_tokens
    return SamplingParams(
        max_tokens=limit if room is None else max(1, min(limit, room)),
        temperature=temperature,
        seed=seed,
        stop_token_ids=stop.stop_token_ids,
        stop_strings=stop.stop_strings,
    )


@dataclass(frozen=True)
class GroupRollout:
    """A finished group: its trajectories (group rewards applied), when its episodes
    started and ended, when its group rewards were computed, and the retries of its
    sample requests."""

    trajectories: tuple[Trajectory, ...]
    started: float
    episodes_finished: float
    rewards_finished: float
    retries: int = 0
    error: RewardError | None = None
    """Set when the group could not be built, scored or cleaned up (its group rewards
    are then zero): the pipeline applies ``--on-reward-error``."""


@dataclass
class _Tally:
    retries: int = 0


class EpisodeRunner:
    """Runs groups of episodes with one sampler and one set of limits. ``limits=None``
    runs without any (single-turn tasks: one turn, ended by the environment)."""

    def __init__(
        self,
        sample: TurnSampler,
        limits: EpisodeLimits | None,
        *,
        clock: Stopwatch = time.monotonic,
    ) -> None:
        self._sample = sample
        self._limits = limits
        self._clock = clock

    async def run_group(self, builder: EnvGroupBuilder, problem: Problem) -> GroupRollout:
        """Every episode of ``builder``'s group, then its group rewards, then its
        cleanup. A group that cannot be built, scored or cleaned up comes back with
        ``error`` set (its group rewards zero); a failing sample request raises."""
        started = self._clock()
        async with contextlib.AsyncExitStack() as scope:
            if isinstance(builder, contextlib.AbstractAsyncContextManager):
                # A builder that owns tasks for its group (an agent task's agents) holds
                # them in its own scope, entered here so that it spans the whole group.
                try:
                    await scope.enter_async_context(builder)
                except Exception as exc:
                    now = self._clock()
                    return GroupRollout((), started, now, now, 0, _reward_error(problem, exc))
            try:
                rollout = await self._rollout(builder, problem, started)
            finally:
                # Shielded (a stop must not leak the group's resources) but bounded (a
                # stop must not hang on a cleanup that never returns).
                cleanup_error: Exception | None = TimeoutError(
                    f"cleanup did not return within {CLEANUP_TIMEOUT_S:g} s"
                )
                with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                    cleanup_error = await _cleanup(builder)
        if cleanup_error is not None and rollout.error is None:
            rollout = dataclasses.replace(rollout, error=_reward_error(problem, cleanup_error))
        return rollout

    async def _rollout(
        self, builder: EnvGroupBuilder, problem: Problem, started: float
    ) -> GroupRollout:
        tally = _Tally()
        timeout = self._limits.episode_timeout if self._limits is not None else None
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        try:
            envs = list(await builder.make_envs())
            if not envs:
                raise EngineError("make_envs returned no environments")
            observations = [await env.initial_observation() for env in envs]
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            now = self._clock()
            return GroupRollout((), started, now, now, 0, _reward_error(problem, exc))
        results: list[Trajectory] = [Trajectory(())] * len(envs)
        try:
            firsts = await self._first_actions(observations, tally)
            episodes = [
                (env, observations[i], firsts[i], tally, started, deadline)
                for i, env in enumerate(envs)
            ]
            if self._limits is None and all(first is not None for first in firsts):
                # Single-turn: each episode is one step on an action already sampled,
                # nothing to overlap; a task each cost the event loop ~0.1 ms apiece.
                for i, episode in enumerate(episodes):
                    await self._episode_into(results, i, *episode)
            else:
                async with anyio.create_task_group() as tg:
                    for i, episode in enumerate(episodes):
                        tg.start_soon(self._episode_into, results, i, *episode)
        except BaseExceptionGroup as group:
            raise primary_error(group) from None
        episodes_finished = self._clock()
        try:
            raw = await builder.compute_group_rewards(tuple(results), envs)
            rewards = check_rewards(raw, len(results), "compute_group_rewards", "episodes")
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            return GroupRollout(
                tuple(results),
                started,
                episodes_finished,
                self._clock(),
                tally.retries,
                _reward_error(problem, exc),
            )
        trajectories = tuple(
            dataclasses.replace(t, group_reward=r) for t, r in zip(results, rewards, strict=True)
        )
        return GroupRollout(trajectories, started, episodes_finished, self._clock(), tally.retries)

    async def _first_actions(
        self, observations: Sequence[Observation], tally: _Tally
    ) -> list[SampledAction | None]:
        """One request for the whole group when every episode opens alike."""
        first, room = observations[0], self._room(observations[0])
        if any(o != first for o in observations) or (room is not None and room < 1):
            return [None] * len(observations)
        actions = await self._sample(first, len(observations), room, episode=ALL_EPISODES, turn=0)
        tally.retries += sum(a.retries for a in actions)
        if len(actions) != len(observations):
            raise EngineError(
                f"the sampler returned {len(actions)} responses, {len(observations)} were asked"
            )
        return list(actions)

    async def _episode_into(
        self,
        out: list[Trajectory],
        i: int,
        env: Env,
        observation: Observation,
        first: SampledAction | None,
        tally: _Tally,
        group_started: float,
        deadline: float,
    ) -> None:
        """One episode into ``out[i]``; its time counts from the group's start (its
        first turn may be the group's shared request)."""
        turns: list[Turn] = []
        outcome: Outcome = "timeout"
        error: str | None = None
        with anyio.CancelScope(deadline=deadline):
            outcome, error = await self._turns(i, env, observation, first, turns, tally)
        out[i] = self._finished(tuple(turns), outcome, error, self._clock() - group_started)

    async def _turns(
        self,
        i: int,
        env: Env,
        observation: Observation,
        action: SampledAction | None,
        turns: list[Turn],
        tally: _Tally,
    ) -> tuple[Outcome, str | None]:
        limits = self._limits
        while True:
            if action is None:
                room = self._room(observation)
                if room is not None and room < 1:
                    return "max_tokens", None
                sampled = await self._sample(observation, 1, room, episode=i, turn=len(turns))
                action = sampled[0]
                tally.retries += action.retries
            completion = action.completion
            result: EnvStepResult
            error: str | None = None
            try:
                result = await env.step(Action(completion.tokens, completion.stop_reason))
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                kept = getattr(exc, "logs", None)  # (an agent error's: its process's output)
                logs = {**(kept if isinstance(kept, Mapping) else {}), "error": error}
                result = EnvStepResult(done=True, logs=logs, outcome="env_error")
            turns.append(
                Turn(
                    observation=observation.tokens,
                    action=completion.tokens,
                    logprobs=completion.logprobs,
                    version=action.version,
                    stop_reason=completion.stop_reason,
                    reward=result.reward,
                    metrics=dict(result.metrics),
                    logs=dict(result.logs),
                )
            )
            if result.done:
                return result.outcome, error
            if limits is not None and len(turns) >= limits.max_turns:
                return "max_turns", None
            if result.next_observation is None:
                return "env_error", "step returned done=False without a next observation"
            observation, action = result.next_observation, None

    def _room(self, observation: Observation) -> int | None:
        if self._limits is None:
            return None
        return self._limits.max_tokens - len(observation.tokens)

    def _finished(
        self, turns: tuple[Turn, ...], outcome: Outcome, error: str | None, elapsed: float
    ) -> Trajectory:
        limits = self._limits
        policy = "zero"
        if limits is not None and outcome != "done":
            policy = limits.on_parse_error if outcome == "parse_error" else limits.on_limit
        cut = outcome != "done"
        return Trajectory(
            turns=turns,
            outcome=outcome,
            masked=cut and policy == "mask",
            zeroed=cut and policy != "mask",
            elapsed=elapsed,
            error=error,
        )


async def _cleanup(builder: EnvGroupBuilder) -> Exception | None:
    try:
        await builder.cleanup()
    except Exception as exc:
        return exc
    return None


def _reward_error(problem: Problem, exc: Exception) -> RewardError:
    return exc if isinstance(exc, RewardError) else RewardError(problem, exc)
