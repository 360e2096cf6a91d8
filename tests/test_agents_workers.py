"""Agent functions on workers (``--score-workers processes:N`` / ``ray:N``): agent worker
processes that each run many agents at once and reach the group's endpoint over their
pipe, on a scripted sampler below the runner. The capture is the same as on the event
loop (a prompt built on the sampled tokens); the agents run in other processes; a
hanging agent is cut, a dying worker fails its episodes in one line and the next call
gets a fresh one; an agent that cannot be pickled is one clear line before the run."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import openai
import pytest
from agent_support import AltSampler, agent_context, calculator_agent, calculator_reply

from engine.agents import AgentResult, AgentTask
from engine.agents.workers import AgentWorkers
from engine.common import extras
from engine.config.values import parse_score_workers
from engine.envs.executors import Workers, on_workers
from engine.envs.rollout import EpisodeRunner
from engine.envs.scoring import check_score_workers
from engine.errors import ConfigError
from engine.tasks import ArithmeticTask, Problem

pytestmark = pytest.mark.anyio

PROBLEM = Problem(0, "What is 6 * 7?", 42)


async def agent_with_pid(client: openai.AsyncOpenAI, problem: Problem) -> AgentResult:
    """The calculator loop, reporting the process it ran in."""
    return AgentResult(await calculator_agent(client, problem), {"pid": float(os.getpid())})


async def hangs_after_a_call(client: openai.AsyncOpenAI, problem: Problem) -> float:
    import anyio

    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": problem.question}]
    )
    await anyio.sleep_forever()
    return 1.0


async def kills_its_worker(client: openai.AsyncOpenAI, problem: Problem) -> float:
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": problem.question}]
    )
    os._exit(3)


async def run_on(workers: Workers, agent: Callable[..., Any], group: int = 2, **limits: Any) -> Any:
    context = agent_context(**limits)
    runner = EpisodeRunner(AltSampler(calculator_reply), context.limits)
    builder = AgentTask(agent, ArithmeticTask()).group_builder(PROBLEM, group, context)
    return await runner.run_group(on_workers(builder, workers), PROBLEM)


async def test_agents_run_in_worker_processes_and_are_captured_on_the_sampled_tokens() -> None:
    async with AgentWorkers(2) as workers:
        rollouts = [await run_on(workers, agent_with_pid, group=3) for _ in range(2)]
        pids = set(workers.pids)
    episodes = [e for r in rollouts for e in r.trajectories]
    assert all(r.error is None for r in rollouts)
    assert [e.outcome for e in episodes] == ["done"] * 6
    assert all(e.total_reward == 1.0 for e in episodes)
    ran_in = {e.turns[-1].metrics["pid"] for e in episodes}
    assert ran_in <= {float(p) for p in pids} and os.getpid() not in ran_in
    for episode in episodes:
        first, second = episode.turns
        assert first.logs["tool_calls"] == [
            {"name": "multiply", "arguments": {"a": 6, "b": 7}, "result": ["42"]}
        ]
        prefix = (*first.observation, *first.action)
        assert second.observation[: len(prefix)] == prefix  # built on the sampled tokens


async def test_a_hanging_agent_in_a_worker_is_cut_at_the_episode_timeout() -> None:
    async with AgentWorkers(1) as workers:
        rollout = await run_on(workers, hangs_after_a_call, group=2, episode_timeout=3.0)
        assert workers.pids  # the worker outlived the agents it cut
        again = await run_on(workers, agent_with_pid, group=1)
    assert [e.outcome for e in rollout.trajectories] == ["timeout", "timeout"]
    assert [e.total_reward for e in again.trajectories] == [1.0]


async def test_a_dying_worker_fails_its_episodes_in_one_line_and_a_fresh_one_follows() -> None:
    async with AgentWorkers(1) as workers:
        rollout = await run_on(workers, kills_its_worker, group=2, on_limit="zero")
        again = await run_on(workers, agent_with_pid, group=1)
    errors = [e.error or "" for e in rollout.trajectories]
    assert [e.outcome for e in rollout.trajectories] == ["env_error", "env_error"]
    assert all("exited with code 3" in error and "\n" not in error for error in errors)
    assert [e.total_reward for e in again.trajectories] == [1.0]


def test_an_agent_that_cannot_be_pickled_is_one_line_before_the_run() -> None:
    async def local_agent(client: Any, problem: Problem) -> float:
        return 0.0

    task = AgentTask(local_agent, ArithmeticTask())
    with pytest.raises(ConfigError, match="--score-workers processes:2 needs a picklable") as e:
        check_score_workers(task, parse_score_workers("processes:2"))
    assert "local_agent" in str(e.value) and "\n" not in str(e.value)
    check_score_workers(
        AgentTask(agent_with_pid, ArithmeticTask()), parse_score_workers("processes:2")
    )
    check_score_workers(task, parse_score_workers("threads"))  # on the event loop: any agent


@pytest.mark.slow
@pytest.mark.skipif(bool(extras.missing("ray")), reason="ray is not installed")
async def test_agents_run_as_ray_tasks_over_loopback_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from test_envs_ray import WORKER_PATH

    from engine.envs.ray_workers import RayWorkers

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", WORKER_PATH)
    async with RayWorkers(2) as workers:
        rollout = await run_on(workers, agent_with_pid, group=2)
    assert [e.total_reward for e in rollout.trajectories] == [1.0, 1.0]
    assert os.getpid() not in {e.turns[-1].metrics["pid"] for e in rollout.trajectories}
