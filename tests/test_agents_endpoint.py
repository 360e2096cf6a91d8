"""The endpoint's HTTP surface with the real ``openai`` client over loopback: every
documented error status in OpenAI's error format, streaming, text completions and the
model list. The environment side of each episode is driven by the test itself."""

from __future__ import annotations

import logging
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

KEYS = {"ep-0": "sk-test-0", "ep-1": "sk-test-1"}
"""Each episode's own key."""
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Any, list[Episode]]]:
    context = agent_context()
    chat = ChatFormat(context.task)
    episodes = [Episode(f"ep-{i}", chat, context) for i in range(2)]
    backend = _GroupBackend({e.id: e for e in episodes}, KEYS)
    limits = EndpointLimits(max_body_bytes=4096, max_concurrency=8)
    async with serve_endpoint(backend, limits=limits) as endpoint:
        yield endpoint, episodes
        for c in _clients:
            await c.close()
        _clients.clear()


_clients: list[openai.AsyncOpenAI] = []


def client(endpoint: Any, episode: str = "ep-0", key: str | None = None) -> openai.AsyncOpenAI:
    """A client of ``episode`` with its key unless given (closed with the endpoint)."""
    key = key or KEYS.get(episode, "sk-none")
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
        await client(endpoint, "ep-9", KEYS["ep-0"]).chat.completions.create(
            model="m", messages=USER
        )
    with pytest.raises(openai.BadRequestError, match="seed") as seed:
        await c.chat.completions.create(model="m", messages=USER, seed=2**64)
    assert seed.value.param == "seed"  # a 400 naming it, not a 500 the client retries
    with pytest.raises(openai.BadRequestError, match="at most 4 stop strings"):
        await c.chat.completions.create(model="m", messages=USER, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(openai.BadRequestError, match="at most 1024 characters"):
        await c.completions.create(model="m", prompt="1", stop="x" * 1025)
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
        bad = await raw.post(
            url, content=b"{not json", headers={"authorization": f"Bearer {KEYS['ep-0']}"}
        )
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
    backend = _GroupBackend({e.id: e for e in episodes}, KEYS)
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


async def test_an_agent_cannot_call_a_sibling_episode_with_its_own_key(served: Any) -> None:
    """Episode URLs differ only in their index: each episode's key opens its own."""
    endpoint, _ = served
    sibling = client(endpoint, "ep-1", KEYS["ep-0"])
    with anyio.fail_after(60):  # it was accepted and hung, waiting on the sibling's runner
        with pytest.raises(openai.AuthenticationError, match="not episode 'ep-1'"):
            await sibling.chat.completions.create(model="m", messages=USER)
    async with httpx.AsyncClient() as raw:  # a non-ASCII key: a 401, not a 500
        url = endpoint.episode_url("ep-0") + "/completions"
        bad = await raw.post(url, json={"model": "m"}, headers={b"authorization": b"Bearer \xe9"})
        assert bad.status_code == 401


def _request(episode: str, body_size: int, *, expect: bool = False) -> bytes:
    """A completion request's head announcing ``body_size`` bytes of body."""
    head = (
        f"POST /e/{episode}/v1/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {KEYS[episode]}\r\ncontent-type: application/json\r\n"
        f"content-length: {body_size}\r\n"
    )
    return (head + ("expect: 100-continue\r\n" if expect else "") + "\r\n").encode()


async def _read_until(stream: Any, marker: bytes) -> bytes:
    """What ``stream`` sends up to ``marker`` or its end."""
    data = b""
    while marker not in data:
        try:
            data += await stream.receive()
        except anyio.EndOfStream:
            break
    return data


async def test_slow_bodies_hold_no_slot_a_valid_call_is_answered() -> None:
    """Connections trickling their bodies are not calls in flight: with every slot's
    worth of them open, a whole call is still answered (it was a 429)."""
    context = agent_context()
    chat = ChatFormat(context.task)
    episodes = [Episode(f"ep-{i}", chat, context) for i in range(2)]
    backend = _GroupBackend({e.id: e for e in episodes}, KEYS)
    limits = EndpointLimits(max_concurrency=3)
    async with serve_endpoint(backend, limits=limits) as endpoint:
        host, port = endpoint.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        slow = []
        with anyio.fail_after(60):
            for _ in range(limits.max_concurrency):
                stream = await anyio.connect_tcp(host, int(port))
                slow.append(stream)
                await stream.send(_request("ep-1", 100, expect=True))
                # "100 Continue": the app has taken the call and is reading its body.
                assert b"100 Continue" in await _read_until(stream, b"\r\n\r\n")
                await stream.send(b"{")
            assert endpoint.in_flight == 0
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer, episodes[0], " 42")
                done = await client(endpoint).completions.create(model="m", prompt="6*7=")
                await episodes[0].finish(AgentResult(1.0))
            assert done.choices[0].text == " 42"
        for stream in slow:
            await stream.aclose()
        for c in _clients:
            await c.close()
        _clients.clear()


async def test_a_late_body_gets_a_408_and_late_headers_close_the_connection() -> None:
    context = agent_context()
    episodes = [Episode("ep-1", ChatFormat(context.task), context)]
    backend = _GroupBackend({e.id: e for e in episodes}, KEYS)
    limits = EndpointLimits(header_timeout_s=0.1, body_timeout_s=0.1)
    async with serve_endpoint(backend, limits=limits) as endpoint:
        host, port = endpoint.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        with anyio.fail_after(60):  # hang guards: the deadlines are 0.1 s
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(_request("ep-1", 100) + b"{")
                reply = await _read_until(stream, b"did not arrive")
                assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within" in reply
                assert await _read_until(stream, b"never") == b""  # then closed
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # no end
                assert await _read_until(stream, b"never") == b""  # closed, nothing sent


async def test_calls_in_flight_when_it_stops_get_a_503_and_log_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The grace period over, a call still running is answered 503 (uvicorn's task was
    cancelled instead: a traceback per call on stderr)."""
    context = agent_context()
    episodes = [Episode("ep-0", ChatFormat(context.task), context)]
    backend = _GroupBackend({e.id: e for e in episodes}, KEYS)
    replies: list[httpx.Response] = []
    caplog.set_level(logging.INFO)
    limits = EndpointLimits(shutdown_grace_s=0)
    async with (
        anyio.create_task_group() as tg,
        httpx.AsyncClient(timeout=60) as raw,
        serve_endpoint(backend, limits=limits) as endpoint,
    ):
        url = endpoint.episode_url("ep-0") + "/completions"

        async def call() -> None:
            headers = {"authorization": f"Bearer {KEYS['ep-0']}"}
            replies.append(await raw.post(url, json={"model": "m", "prompt": "1"}, headers=headers))

        tg.start_soon(call)  # nobody answers it
        await _until(lambda: endpoint.in_flight == 1)
    assert replies[0].status_code == 503
    assert "stopped before the call was answered" in replies[0].json()["error"]["message"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_chat_reply_leaves_out_what_the_template_writes_before_it() -> None:
    """The packaged model's template writes an assistant turn as ``Answer: {content}``
    but prompts with ``Answer:``: the model samples the space, and replies read ' 58'.
    The sampled tokens keep it; the message's content does not (a text completion,
    which has no template, keeps what the model wrote)."""
    from transformers import AutoTokenizer

    from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
    from engine.tasks import TaskContext

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    chat = ChatFormat(TaskContext(tokenizer))
    tokens = (*tokenizer.encode(" 58", add_special_tokens=False), tokenizer.eos_token_id)
    reply = chat.choice(tokens, "stop", (), tools=False)
    assert reply.content == "58" and reply.text == " 58" and reply.tokens == tokens
    assert reply.message()["content"] == "58"
