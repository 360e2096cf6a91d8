"""The endpoint's HTTP surface with the real ``openai`` client over loopback: every
documented error status in OpenAI's error format, streaming, text completions and the
model list. The environment side of each episode is driven by the test itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from agent_support import agent_context, alt_tokens
from openai.types.chat import ChatCompletionMessageParam

from engine.agents import AgentResult, EndpointLimits, Episode, serve_endpoint
from engine.agents.chat import ChatFormat
from engine.agents.task import _GroupBackend
from engine.envs import Action

pytestmark = pytest.mark.anyio

KEY = "sk-test"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Any, list[Episode]]]:
    context = agent_context()
    chat = ChatFormat(context.task)
    episodes = [Episode(f"ep-{i}", chat, context) for i in range(2)]
    backend = _GroupBackend(KEY, {e.id: e for e in episodes})
    limits = EndpointLimits(max_body_bytes=4096, max_concurrency=8)
    async with serve_endpoint(backend, limits=limits) as endpoint:
        yield endpoint, episodes
        for c in _clients:
            await c.close()
        _clients.clear()


_clients: list[openai.AsyncOpenAI] = []


def client(endpoint: Any, episode: str = "ep-0", key: str = KEY) -> openai.AsyncOpenAI:
    """A client of ``episode`` (closed with the endpoint)."""
    c = openai.AsyncOpenAI(base_url=endpoint.episode_url(episode), api_key=key, max_retries=0)
    _clients.append(c)
    return c


async def answer(episode: Episode, reply: str) -> None:
    """Play the runner: take the pending call, answer it with ``reply`` and wait for
    the episode's end (the test finishes it)."""
    await episode.env.initial_observation()
    result = await episode.env.step(Action(alt_tokens(reply)))
    assert result.done and result.reward == 1.0


async def test_a_call_answered_by_the_runner_streams_and_counts_usage(served: Any) -> None:
    endpoint, (episode, _) = served
    async with anyio.create_task_group() as tg:
        tg.start_soon(answer, episode, "42")
        stream = await client(endpoint).chat.completions.create(
            model="m",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await episode.finish(AgentResult(1.0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "42"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3  # "42" and EOS


async def test_text_completions_and_the_model_list(served: Any) -> None:
    endpoint, (_, episode) = served
    async with anyio.create_task_group() as tg:
        tg.start_soon(answer, episode, " 42")
        done = await client(endpoint, "ep-1").completions.create(model="m", prompt="6*7=")
        await episode.finish(AgentResult(1.0))
    assert done.choices[0].text == " 42" and done.usage is not None
    assert done.usage.prompt_tokens == len(b"6*7=")
    models = await client(endpoint).models.list()
    assert [m.id for m in models.data] == ["policy"]


async def test_each_error_has_its_status_in_openais_format(served: Any) -> None:
    endpoint, (episode, other) = served
    c = client(endpoint)
    with pytest.raises(openai.AuthenticationError):
        await client(endpoint, key="sk-wrong").chat.completions.create(model="m", messages=USER)
    with pytest.raises(openai.NotFoundError, match="unknown episode"):
        await client(endpoint, "ep-9").chat.completions.create(model="m", messages=USER)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        await c.chat.completions.create(model="m", messages=USER, n=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        await c.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError, match="token ids in"):
        await c.completions.create(model="m", prompt=[5, 1000])  # out of the vocabulary
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.APIStatusError) as too_long:
        await c.chat.completions.create(model="m", messages=long)
    assert too_long.value.status_code == 413
    async with httpx.AsyncClient() as raw:
        url = endpoint.episode_url("ep-0") + "/chat/completions"
        bad = await raw.post(url, content=b"{not json", headers={"authorization": f"Bearer {KEY}"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        route = await raw.get(endpoint.base_url + "/nothing")
        assert route.status_code == 404 and "error" in route.json()
    # A second call of an episode while its first is in flight: 429.
    async with anyio.create_task_group() as tg:
        results: list[Any] = []

        async def call() -> None:
            results.append(await c.chat.completions.create(model="m", messages=USER))

        tg.start_soon(call)  # waits for the runner's answer
        await _until(lambda: episode._busy)
        with pytest.raises(openai.RateLimitError, match="already has a call in flight"):
            await c.chat.completions.create(model="m", messages=USER)
        tg.start_soon(answer, episode, "42")
        await _until(lambda: results)
        await episode.finish(AgentResult(1.0))
    # After the episode ended: 409.
    other.close("the runner ended the episode")
    with pytest.raises(openai.ConflictError, match="has ended"):
        await client(endpoint, "ep-1").chat.completions.create(model="m", messages=USER)
    # While stopping: 503.
    endpoint.stopping = True
    with pytest.raises(openai.InternalServerError) as stopping:
        await c.chat.completions.create(model="m", messages=USER)
    assert stopping.value.status_code == 503


async def _until(condition: Any) -> None:
    """Poll ``condition`` while loopback HTTP makes progress (generously bounded)."""
    with anyio.fail_after(60):
        while not condition():  # noqa: ASYNC110 (the state polled has no event)
            await anyio.sleep(0.001)


async def test_calls_over_the_concurrency_bound_get_a_429() -> None:
    context = agent_context()
    chat = ChatFormat(context.task)
    episodes = [Episode(f"ep-{i}", chat, context) for i in range(2)]
    backend = _GroupBackend(KEY, {e.id: e for e in episodes})
    async with serve_endpoint(backend, limits=EndpointLimits(max_concurrency=1)) as endpoint:
        first, second = client(endpoint, "ep-0"), client(endpoint, "ep-1")
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def call() -> None:
                results.append(await first.chat.completions.create(model="m", messages=USER))

            tg.start_soon(call)  # in flight until the runner answers it
            await _until(lambda: endpoint.in_flight == 1)
            with pytest.raises(openai.RateLimitError, match="over 1 calls in flight"):
                await second.chat.completions.create(model="m", messages=USER)
            tg.start_soon(answer, episodes[0], "42")
            await _until(lambda: results)
            await episodes[0].finish(AgentResult(1.0))
        assert endpoint.in_flight == 0
        for c in _clients:
            await c.close()
        _clients.clear()
