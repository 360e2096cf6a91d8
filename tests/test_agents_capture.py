"""Agent episodes captured through the endpoint, on a scripted sampler below the runner:
real HTTP over loopback, the real ``openai`` client. Each call is a turn; a prompt that
extends the last call is built on the sampled tokens (never the reply re-tokenized); a
rewritten history starts afresh and is counted; failing agents yield what the
environment settings say."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import openai
import pytest
from agent_support import (
    ALT,
    MULTIPLY,
    AltSampler,
    agent_context,
    alt_tokens,
    calculator_agent,
)

from engine.agents import AgentResult, AgentTask
from engine.core.datums import trajectory_datums
from engine.envs.rollout import EpisodeRunner
from engine.tasks import ArithmeticTask, Problem

pytestmark = pytest.mark.anyio

PROBLEM = Problem(0, "What is 6 * 7?", 42)
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


def task(agent: Any, **kwargs: Any) -> AgentTask:
    return AgentTask(agent, ArithmeticTask(), **kwargs)


async def run(agent: Any, replies: list[str], group: int = 2, **limits: Any) -> Any:
    sampler = AltSampler(replies)
    context = agent_context(**limits)
    runner = EpisodeRunner(sampler, context.limits)
    builder = task(agent).group_builder(PROBLEM, group, context)
    return await runner.run_group(builder, PROBLEM), sampler


async def test_a_tool_calling_agent_is_captured_turn_by_turn_on_the_sampled_tokens() -> None:
    rollout, sampler = await run(calculator_agent, [CALL, "42"], group=1)
    assert rollout.error is None
    (episode,) = rollout.trajectories
    assert episode.outcome == "done" and episode.total_reward == 1.0
    first, second = episode.turns
    assert first.logs["tool_calls"] == [
        {"name": "multiply", "arguments": {"a": 6, "b": 7}, "result": ["42"]}
    ]
    assert second.logs["assistant"] == "42"
    assert first.metrics["tool_calls"] == 1.0  # (env/all/tool_calls: the report's panel)
    # The second prompt is the first prompt + the sampled tokens (in their second
    # spelling, which no re-tokenization of the reply's text produces) + the tool result.
    prefix = (*first.observation, *first.action)
    assert second.observation[: len(prefix)] == prefix
    assert any(t >= ALT for t in second.observation)
    bridge = bytes(second.observation[len(prefix) :]).decode()
    assert bridge == "\n<tool>42\n<assistant>"
    assert first.metrics["agent/history_rewrites"] == 0.0  # (counted by the step before)
    assert len(trajectory_datums(episode, 1.0)) == 1
    assert [o.tokens for o in sampler.calls] == [first.observation, second.observation]


async def test_the_given_client_and_its_base_url_reach_the_same_episode() -> None:
    """The agent's client calls the endpoint's app in process; its base URL is the same
    endpoint over loopback: a conversation that moves from one to the other stays one
    episode, the second prompt built on the first call's sampled tokens."""

    async def two_clients(client: openai.AsyncOpenAI, problem: Problem) -> float:
        messages: list[Any] = [{"role": "user", "content": problem.question}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[MULTIPLY])
        reply = first.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        assert reply.tool_calls
        messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "42"})
        async with openai.AsyncOpenAI(
            base_url=str(client.base_url), api_key=client.api_key, max_retries=0
        ) as loopback:
            second = await loopback.chat.completions.create(
                model="m", messages=messages, tools=[MULTIPLY]
            )
        return float(second.choices[0].message.content == "42")

    rollout, _ = await run(two_clients, [CALL, "42"], group=1)
    (episode,) = rollout.trajectories
    assert episode.outcome == "done" and episode.total_reward == 1.0
    first, second = episode.turns
    prefix = (*first.observation, *first.action)
    assert second.observation[: len(prefix)] == prefix
    assert bytes(second.observation[len(prefix) :]).decode() == "\n<tool>42\n<assistant>"


async def test_a_rewritten_history_renders_afresh_and_is_counted() -> None:
    async def forgetful(client: openai.AsyncOpenAI, problem: Problem) -> float:
        messages = [{"role": "user", "content": problem.question}]
        await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        # The reply is dropped: the history is not an extension of the last call.
        again = [{"role": "user", "content": "Once more: " + problem.question}]
        await client.chat.completions.create(model="m", messages=again)  # type: ignore[arg-type]
        return 0.5

    rollout, _ = await run(forgetful, ["41", "42"], group=1)
    (episode,) = rollout.trajectories
    first, second = episode.turns
    assert first.metrics["agent/history_rewrites"] == 1.0
    assert bytes(second.observation).decode() == "<user>Once more: What is 6 * 7?\n<assistant>"
    assert len(trajectory_datums(episode, 1.0)) == 2
    assert episode.total_reward == 0.5


async def test_an_agent_that_raises_after_a_call_ends_its_episode_as_an_env_error() -> None:
    async def broken(client: openai.AsyncOpenAI, problem: Problem) -> float:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": problem.question}]
        )
        raise RuntimeError("agent bug")

    rollout, _ = await run(broken, ["41"], group=2, on_limit="mask")
    assert [t.outcome for t in rollout.trajectories] == ["env_error", "env_error"]
    assert all(t.masked for t in rollout.trajectories)
    assert "agent bug" in (rollout.trajectories[0].error or "")


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), AgentResult(float("-inf"))])
async def test_a_non_finite_agent_reward_is_its_episodes_error_never_an_advantage(
    reward: Any,
) -> None:
    async def poisoned(client: openai.AsyncOpenAI, problem: Problem) -> Any:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": problem.question}]
        )
        return reward

    rollout, _ = await run(poisoned, ["41"], group=2)
    for episode in rollout.trajectories:
        assert episode.outcome == "env_error" and episode.zeroed
        assert episode.total_reward == 0.0
        assert "non-finite" in (episode.error or "")


async def test_an_agent_that_never_calls_fails_its_group_like_a_reward_error() -> None:
    async def silent(client: openai.AsyncOpenAI, problem: Problem) -> float:
        return 1.0

    rollout, sampler = await run(silent, ["41"])
    assert rollout.error is not None and "before its first call" in str(rollout.error)
    assert sampler.calls == []


async def test_a_hanging_agent_is_cut_at_the_episode_timeout_and_cancelled() -> None:
    cancelled = anyio.Event()

    async def hangs(client: openai.AsyncOpenAI, problem: Problem) -> float:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": problem.question}]
        )
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return 1.0

    rollout, _ = await run(hangs, ["41"], group=1, episode_timeout=4.0)
    (episode,) = rollout.trajectories
    assert episode.outcome in ("timeout", "env_error") and episode.zeroed
    assert len(episode.turns) in (0, 1)
    assert cancelled.is_set()  # the agent did not outlive its group


async def test_calls_past_max_turns_get_a_409_and_the_agent_result_is_unused() -> None:
    seen: list[int] = []

    async def chatty(client: openai.AsyncOpenAI, problem: Problem) -> AgentResult:
        messages: list[Any] = [{"role": "user", "content": problem.question}]
        try:
            for _ in range(5):
                r = await client.chat.completions.create(model="m", messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True)]
                messages += [{"role": "user", "content": "again"}]
        except openai.APIStatusError as exc:
            seen.append(exc.status_code)
            raise
        return AgentResult(1.0)

    rollout, _ = await run(chatty, ["41"], group=1, max_turns=2)
    (episode,) = rollout.trajectories
    assert episode.outcome == "max_turns" and len(episode.turns) == 2
    assert seen in ([], [409])  # cancelled at the group's end, or told it ended first


def test_the_responses_are_the_openai_packages_types() -> None:
    from openai.types.chat import ChatCompletion

    from engine.agents.chat import Answer, Choice
    from engine.agents.endpoint import _chat_response
    from engine.agents.openai_wire import ChatRequest
    from engine.envs.tools import ToolCall

    choice = Choice((1, 2), "x", None, (ToolCall("f", {"a": 1}, "call_0"),), "tool_calls")
    body = ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    )
    parsed = ChatCompletion.model_validate(_chat_response(Answer(3, (choice,)), "m", body))
    call = parsed.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert json.loads(call.function.arguments) == {"a": 1}  # type: ignore[union-attr]
    assert parsed.usage is not None and parsed.usage.total_tokens == 5
    assert alt_tokens("a", eos=False) == (ALT + ord("a"),)


def test_the_request_fields_are_named_as_in_the_openai_package() -> None:
    from openai.types import completion_create_params as text_params
    from openai.types.chat import completion_create_params as chat_params

    from engine.agents.openai_wire import ChatRequest, CompletionRequest

    chat = chat_params.CompletionCreateParamsBase.__annotations__
    text = text_params.CompletionCreateParamsBase.__annotations__
    # ("stream" is in the streaming variants' params)
    streaming = set(chat_params.CompletionCreateParamsStreaming.__annotations__)
    assert set(ChatRequest.model_fields) <= set(chat) | streaming
    assert set(CompletionRequest.model_fields) <= set(text) | {"stream"}


async def test_a_stop_mid_call_cancels_the_agents_and_closes_the_endpoint() -> None:
    in_call, cancelled = anyio.Event(), anyio.Event()

    class Stalled(AltSampler):
        async def __call__(self, observation: Any, n: int, room: Any, **where: int) -> Any:
            in_call.set()
            await anyio.sleep_forever()

    async def agent(client: openai.AsyncOpenAI, problem: Problem) -> float:
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": problem.question}]
            )
        finally:
            cancelled.set()
        return 1.0

    context = agent_context()
    builder = task(agent).group_builder(PROBLEM, 2, context)
    runner = EpisodeRunner(Stalled(["41"]), context.limits)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run_group, builder, PROBLEM)
        await in_call.wait()
        assert builder.endpoint is not None
        url = builder.endpoint.base_url
        tg.cancel_scope.cancel()  # a stop while every agent waits for its reply
    assert cancelled.is_set()
    with pytest.raises(httpx.ConnectError):  # the endpoint is gone with its group
        async with httpx.AsyncClient() as raw:
            await raw.get(url + "/models")


async def test_a_call_over_the_episode_token_limit_ends_it_and_gets_a_409() -> None:
    seen: list[int] = []

    async def verbose(client: openai.AsyncOpenAI, problem: Problem) -> float:
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 100}]
            )
        except openai.APIStatusError as exc:
            seen.append(exc.status_code)
            raise
        return 1.0

    rollout, sampler = await run(verbose, ["41"], group=1, max_tokens=50)
    (episode,) = rollout.trajectories
    assert episode.outcome == "max_tokens" and episode.turns == ()
    assert sampler.calls == []  # nothing was sampled for it
    assert seen in ([], [409])  # told it ended, or cancelled at the group's end first
