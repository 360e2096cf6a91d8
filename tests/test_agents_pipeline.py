"""Agent tasks through the pipeline on the fake session (tests/fake_session.py, with a
chat template over bytes): each call of an agent samples the newest weights and the
staleness bound K holds per call (a trajectory is as old as its oldest call); an agent
whose requests are refused (bad key, unknown episode, bad body, over-long body, a call
after its episode ended) gets each documented status and the run trains on. No server,
no sleeps."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from env_support import ChatBytes
from fake_session import FakeSession
from test_pipeline_stages import config, run_pipeline

from engine import Engine, rollouts
from engine.agents import AgentTask, EndpointLimits
from engine.core.problems import Problem, SeededSource
from engine.loop.results import StepResult
from engine.observe.idle import NO_TRAINING_STEPS

pytestmark = pytest.mark.anyio


class ChatSession(FakeSession):
    """The fake session with a chat template (the endpoint renders messages with it)."""

    @property
    def tokenizer(self) -> Any:
        return ChatBytes()


class Problems:
    """Problem ``i`` asks ``p<i>``."""

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"p{i}", i), seed, state)


async def two_calls(
    client: openai.AsyncOpenAI, problem: Problem, between: Any = None
) -> tuple[float, list[Any]]:
    """Ask, then ask again on the extended history (after ``between()``, if given)."""
    messages: list[Any] = [{"role": "user", "content": problem.question}]
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "again"}]
    if between is not None:
        await between()
    await client.chat.completions.create(model="m", messages=messages)
    return 1.0, messages


async def test_each_call_samples_the_newest_weights_and_staleness_is_the_oldest_call() -> None:
    # Step 2's agent makes its first call under version 0 (K=1), then waits until step 1
    # is trained: its second call samples version 1 (as environment turns do,
    # tests/test_envs_pipeline.py).
    step1_trained, step2_started = anyio.Event(), anyio.Event()

    async def between_0() -> None:
        await step2_started.wait()  # step 1 cannot be trained before step 2 started

    async def between_1() -> None:
        step2_started.set()
        await step1_trained.wait()

    async def agent(client: openai.AsyncOpenAI, problem: Problem) -> float:
        reward, _ = await two_calls(client, problem, between_0 if problem.id == 0 else between_1)
        return reward

    async def on_step(result: StepResult) -> None:
        if result.step == 1:
            step1_trained.set()

    cfg = config(steps=2, batch=1, group=2, max_steps_off_policy=1)
    _, results = await run_pipeline(
        ChatSession(), cfg, task=AgentTask(agent, Problems()), on_step=on_step
    )
    (first,), (second,) = (r.groups for r in results)
    assert [t.version for t in first.trajectories[0].turns] == [0, 0]
    assert [t.version for t in second.trajectories[0].turns] == [0, 1]
    assert second.version == 0  # the oldest call
    assert results[1].staleness == 1
    episode = second.trajectories[0].turns
    prefix = (*episode[0].observation, *episode[0].action)
    assert episode[1].observation[: len(prefix)] == prefix  # one datum, across versions


@pytest.mark.parametrize("k", [0, 1])
async def test_no_call_is_more_than_k_versions_old(k: int) -> None:
    async def agent(client: openai.AsyncOpenAI, problem: Problem) -> float:
        reward, _ = await two_calls(client, problem)
        return reward

    cfg = config(steps=4, batch=2, group=2, max_steps_off_policy=k)
    _, results = await run_pipeline(ChatSession(), cfg, task=AgentTask(agent, Problems()))
    assert [r.step for r in results] == [1, 2, 3, 4]
    for r in results:
        turns = [t for g in r.groups for e in g.trajectories for t in e.turns]
        assert len(turns) == 2 * 2 * 2
        assert all(0 <= (r.step - 1) - t.version <= k for t in turns)
        assert r.staleness == max((r.step - 1) - t.version for t in turns)


async def test_refused_requests_get_their_status_and_the_run_trains_on() -> None:
    """Each agent sends what the endpoint must refuse -- through its own client (the
    in-process transport) and over loopback HTTP -- before and after its one good call;
    the second agent of a group then calls its sibling's ended episode (409)."""
    seen: dict[str, list[int]] = {}
    sibling_done: dict[int, anyio.Event] = {}

    async def status(name: str, call: Any) -> None:
        try:
            await call
        except openai.APIStatusError as exc:
            seen.setdefault(name, []).append(exc.status_code)
        else:
            seen.setdefault(name, []).append(200)

    async def rude(client: openai.AsyncOpenAI, problem: Problem) -> float:
        user: list[Any] = [{"role": "user", "content": problem.question}]
        url = str(client.base_url).rstrip("/")  # .../e/<episode>/v1
        episode = url.split("/")[-2]
        elsewhere = url.replace(episode, "no-such-episode")
        chat = client.chat.completions
        await status(
            "key",
            client.with_options(api_key="sk-wrong").chat.completions.create(
                model="m", messages=user
            ),
        )
        await status(
            "episode",
            client.with_options(base_url=elsewhere).chat.completions.create(
                model="m", messages=user
            ),
        )
        await status("schema", chat.create(model="m", messages=[]))
        await status("n", chat.create(model="m", messages=user, n=2))
        long: list[Any] = [{"role": "user", "content": "x" * 5000}]
        await status("size", chat.create(model="m", messages=long))
        async with httpx.AsyncClient() as raw:  # over loopback HTTP
            headers = {"authorization": f"Bearer {client.api_key}"}
            bad = await raw.post(url + "/chat/completions", content=b"{no", headers=headers)
            seen.setdefault("json", []).append(bad.status_code)
            assert bad.json()["error"]["type"] == "invalid_request_error"
        reward, _ = await two_calls(client, problem)
        done = sibling_done.setdefault(problem.id, anyio.Event())
        if episode.endswith("-0"):
            done.set()  # (its episode ends as it returns)
        else:
            await done.wait()
            ended = elsewhere.replace("no-such-episode", episode[:-1] + "0")
            await status(
                "ended",
                client.with_options(base_url=ended).chat.completions.create(
                    model="m", messages=user
                ),
            )
        return reward

    task = AgentTask(rude, Problems(), limits=EndpointLimits(max_body_bytes=4096))
    cfg = config(steps=2, batch=2, group=2, max_steps_off_policy=1)
    _, results = await run_pipeline(ChatSession(), cfg, task=task)
    assert [r.step for r in results] == [1, 2]
    episodes = [e for r in results for g in r.groups for e in g.trajectories]
    assert len(episodes) == 8
    assert all(e.outcome == "done" and len(e.turns) == 2 for e in episodes)
    assert seen == {
        "key": [401] * 8,
        "episode": [404] * 8,
        "schema": [400] * 8,
        "n": [400] * 8,
        "size": [413] * 8,
        "json": [400] * 8,
        "ended": [401] * 4,  # the sibling episode's URL with this episode's key (#45 finding 13)
    }


MULTIPLY: Any = {
    "type": "function",
    "function": {"name": "multiply", "parameters": {"type": "object", "properties": {}}},
}


async def run_engine_on(
    tmp_path: Path, agent: Any, steps: int
) -> tuple[list[StepResult], str, list[dict[str, Any]]]:
    """``agent`` trained through the Engine on the fake session: its steps, what the
    console said and the run's events."""
    cfg = config(steps=steps, batch=1, group=2).replace(run_dir=tmp_path / "run", progress=False)
    console = io.StringIO()
    results: list[StepResult] = []
    task = AgentTask(agent, Problems())
    async with Engine(
        cfg, task=task, session=ChatSession(), on_step=results.append, console=console
    ) as engine:
        await engine.run()
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    return results, console.getvalue(), [json.loads(line) for line in lines]


async def test_a_run_whose_agent_calls_never_parse_as_tool_calls_says_so(
    tmp_path: Path,
) -> None:
    """The fake sampler never writes a tool call (as a model that does not know the
    format would not): the agent offers a tool in every call, and after
    NO_TRAINING_STEPS steps the run says that none was read as one, and what to do."""

    async def offers_a_tool(client: openai.AsyncOpenAI, problem: Problem) -> float:
        messages: Any = [{"role": "user", "content": problem.question}]
        await client.chat.completions.create(model="m", messages=messages, tools=[MULTIPLY])
        return 0.0

    results, said, events = await run_engine_on(tmp_path, offers_a_tool, NO_TRAINING_STEPS)
    assert len(results) == NO_TRAINING_STEPS
    assert said.count("no reply was read as a tool call") == 1, said
    assert "--local-model" in said
    assert [e["step"] for e in events if e["event"] == "run.no_tool_calls"] == [NO_TRAINING_STEPS]


async def test_a_step_whose_episodes_all_failed_says_so_with_the_first_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(client: openai.AsyncOpenAI, problem: Problem) -> float:
        messages: Any = [{"role": "user", "content": problem.question}]
        await client.chat.completions.create(model="m", messages=messages)
        raise RuntimeError("the tool server is down")

    results, said, events = await run_engine_on(tmp_path, broken, 1)
    assert all(e.error for r in results for g in r.groups for e in g.trajectories)
    (warning,) = [line for line in said.splitlines() if "episodes failed" in line] or [said]
    assert "step 1: all 2 episodes failed" in warning
    assert "RuntimeError: the tool server is down" in warning
    (event,) = [e for e in events if e["event"] == "step.episodes_failed"]
    assert event["step"] == 1 and "the tool server is down" in event["first_error"]
    # engine.rollouts shows each episode's error (one-turn episodes print one line each)
    assert rollouts.main([str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r"\n +error: .*RuntimeError: the tool server is down", printed)) == 2
