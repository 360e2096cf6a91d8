"""The OpenAI-compatible HTTP endpoint: a Starlette app served by uvicorn in-process, on
the caller's event loop, on a loopback port picked or given.

Routes: ``POST /v1/chat/completions`` (``stream: true`` answers as server-sent events,
in one piece once the reply is sampled), ``POST /v1/completions``, ``GET /v1/models``,
each also under ``/e/{episode}/v1/...`` (the path that names a training episode). A
:class:`EndpointBackend` says who may call (``Authorization: Bearer KEY``) and samples. Errors
come in OpenAI's format: 400 bad body, 401 bad key, 404 unknown episode or route, 408 a
body not sent within ``body_timeout_s``, 409 a call after its episode ended, 413 a body
over ``max_body_bytes``, 429 over ``max_concurrency`` calls in flight (or a second
concurrent call of one episode), 503 once the endpoint is stopping.

A call is checked (key, episode) before its body is read, and counts in flight only once
its whole body has arrived and parsed: a slow client holds a connection, never a slot.
A connection whose request headers are not in within ``header_timeout_s`` is closed.

Shutdown never hangs: leaving :func:`serve_endpoint` refuses new calls (503), closes
the listener and the connections, waits at most ``shutdown_grace_s`` for the calls in
flight, then answers those still running with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import pydantic
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.agents.chat import Answer, Choice
from engine.agents.openai_wire import ChatRequest, CompletionRequest, EndpointError, error_body
from engine.common.http11 import with_header_timeout

__all__ = [
    "Caller",
    "Dispatch",
    "Endpoint",
    "EndpointBackend",
    "EndpointLimits",
    "Reply",
    "bearer_key",
    "serve_endpoint",
]

M = TypeVar("M", bound=pydantic.BaseModel)


class Caller(Protocol):
    """Whoever a request speaks for (an episode, or a served model's user)."""

    async def chat(self, request: ChatRequest) -> Answer: ...

    async def complete(self, request: CompletionRequest) -> Answer: ...


class EndpointBackend(Protocol):
    """What the endpoint serves: the model's name and the callers."""

    @property
    def model(self) -> str: ...

    def caller(self, episode: str | None, api_key: str | None) -> Caller:
        """The caller of a request (``episode``: the path's, None for ``/v1/...``);
        raises :class:`EndpointError` (401, 404, 409)."""
        ...


@dataclass(frozen=True)
class EndpointLimits:
    """The endpoint's bounds (docs/reliability.md, "The endpoint's limits")."""

    max_body_bytes: int = 8 * 1024 * 1024
    """A request body's bytes (413 beyond)."""
    max_concurrency: int = 256
    """Calls in flight, counted from a whole body to the answer (429 beyond)."""
    header_timeout_s: float = 10.0
    """From a connection's opening (or a request's first byte) to its whole headers."""
    body_timeout_s: float = 60.0
    """From a request's headers to its whole body (408 after)."""
    shutdown_grace_s: float = 5.0
    """How long a stopping endpoint waits for the calls in flight (then 503s them)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrency"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")


@dataclass(frozen=True)
class Reply:
    """A request's answer: its status, media type and body."""

    status: int
    media_type: str
    content: bytes


Dispatch = Callable[[str, str, "str | None", bytes], Awaitable[Reply]]
"""``dispatch(method, path, api_key, body)``: a request answered without HTTP."""


@dataclass
class Endpoint:
    """A running endpoint: ``base_url`` (ends in ``/v1``), its in-flight count, its ASGI
    ``app`` (what HTTP clients reach) and ``dispatch`` (the same routes, checks and
    limits without HTTP: what the clients of agent functions call, in process or from
    a worker process)."""

    base_url: str
    in_flight: int = 0
    stopping: bool = False
    calls: set[anyio.CancelScope] = field(default_factory=set, repr=False)
    """The calls in flight (cancelled, and answered 503, when the grace period ends)."""
    app: Starlette = field(init=False, repr=False)
    dispatch: Dispatch = field(init=False, repr=False)

    def episode_url(self, episode: str) -> str:
        """The base URL that names ``episode`` (what its agent is given)."""
        return self.base_url.removesuffix("/v1") + f"/e/{episode}/v1"


_ROUTES = {"/models": "GET", "/chat/completions": "POST", "/completions": "POST"}
BodyReader = Callable[[], Awaitable[bytes]]


class _Handlers:
    """The routes' handling, shared by the ASGI app and :attr:`Endpoint.dispatch`: each
    takes the path's episode, the key and a body reader, and raises
    :class:`EndpointError` for an error."""

    def __init__(
        self, backend: EndpointBackend, endpoint: Endpoint, limits: EndpointLimits
    ) -> None:
        self._backend = backend
        self._endpoint = endpoint
        self._limits = limits

    def models(self) -> Reply:
        card = {"id": self._backend.model, "object": "model", "created": 0, "owned_by": "engine"}
        return _json({"object": "list", "data": [card]})

    async def chat(self, episode: str | None, api_key: str | None, read: BodyReader) -> Reply:
        model = self._backend.model
        caller = self._caller(episode, api_key)
        body = _parse(ChatRequest, await read())
        with _admitted(self._endpoint, self._limits):
            answer = await caller.chat(body)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_chunks(answer, model, body, include_usage))
        return _json(_chat_response(answer, model, body))

    async def completions(
        self, episode: str | None, api_key: str | None, read: BodyReader
    ) -> Reply:
        caller = self._caller(episode, api_key)
        body = _parse(CompletionRequest, await read())
        with _admitted(self._endpoint, self._limits):
            answer = await caller.complete(body)
        response = _completion_response(answer, self._backend.model, body)
        return _sse(iter([response])) if body.stream else _json(response)

    def _caller(self, episode: str | None, api_key: str | None) -> Caller:
        """Who calls (401, 404), decided before the body is read."""
        if self._endpoint.stopping:
            raise EndpointError(503, "the endpoint is stopping")
        return self._backend.caller(episode, api_key)

    async def dispatch(self, method: str, path: str, api_key: str | None, body: bytes) -> Reply:
        limit = self._limits.max_body_bytes

        async def read() -> bytes:
            if len(body) > limit:
                raise EndpointError(413, f"the request body is over {limit} bytes")
            return body

        try:
            episode, route = _route(method, path)
            if route == "/models":
                return self.models()
            if route == "/chat/completions":
                return await self.chat(episode, api_key, read)
            return await self.completions(episode, api_key, read)
        except EndpointError as exc:
            return _json(exc.body(), exc.status)
        except Exception as exc:  # what the app answers for a failing handler: a 500
            return _json(error_body(f"internal error: {type(exc).__name__}", "api_error"), 500)


def _route(method: str, path: str) -> tuple[str | None, str]:
    """The episode (None: ``/v1/...``) and route of ``path``; 404 or 405 otherwise."""
    episode: str | None = None
    rest = path
    if path.startswith("/e/"):
        episode, _, rest = path[3:].partition("/")
        rest = "/" + rest
    route = rest.removeprefix("/v1") if rest.startswith("/v1/") else ""
    if route not in _ROUTES or episode == "":
        raise EndpointError(404, f"no route {method} {path}")
    if _ROUTES[route] != method:
        raise EndpointError(405, f"{method} is not allowed on {path}")
    return episode, route


def build_app(backend: EndpointBackend, endpoint: Endpoint, limits: EndpointLimits) -> Starlette:
    """The routes (Starlette's: built in microseconds, once per group); sets the
    endpoint's :attr:`~Endpoint.dispatch` too."""
    handlers = _Handlers(backend, endpoint, limits)
    endpoint.dispatch = handlers.dispatch

    async def endpoint_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, EndpointError)
        # A body left unread (408, 413) ends the connection with the answer.
        close = {"Connection": "close"} if exc.status in (408, 413) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=close)

    async def not_found(request: Request, _: Exception) -> Response:
        body = error_body(f"no route {request.method} {request.url.path}", "not_found_error")
        return JSONResponse(body, 404)

    async def not_allowed(request: Request, _: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(message, "invalid_request_error"), 405)

    async def models(_: Request) -> Response:
        return _response(handlers.models())

    async def chat(request: Request) -> Response:
        read = functools.partial(_body, request, limits)
        episode = request.path_params.get("episode")
        return _response(await handlers.chat(episode, _bearer(request), read))

    async def completions(request: Request) -> Response:
        read = functools.partial(_body, request, limits)
        episode = request.path_params.get("episode")
        return _response(await handlers.completions(episode, _bearer(request), read))

    by_route = {"/models": models, "/chat/completions": chat, "/completions": completions}
    routes = [
        Route(prefix + path, by_route[path], methods=[method])
        for prefix in ("/v1", "/e/{episode}/v1")
        for path, method in _ROUTES.items()
    ]
    errors = {EndpointError: endpoint_error, 404: not_found, 405: not_allowed}
    return Starlette(routes=routes, exception_handlers=errors)  # type: ignore[arg-type]


@asynccontextmanager
async def serve_endpoint(
    backend: EndpointBackend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: EndpointLimits | None = None,
) -> AsyncIterator[Endpoint]:
    """Serve ``backend`` until the block exits (on this event loop, no task of its own:
    uvicorn's protocol handles each connection)."""
    limits = limits or EndpointLimits()
    sock = _bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    endpoint = Endpoint(f"http://{url_host}:{bound_port}/v1")
    endpoint.app = build_app(backend, endpoint, limits)
    server = uvicorn.Server(
        uvicorn.Config(
            endpoint.app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=75,
            http=with_header_timeout(limits.header_timeout_s),
        )
    )
    server.config.load()
    server.lifespan = server.config.lifespan_class(server.config)
    try:
        await server.startup(sockets=[sock])
        yield endpoint
    finally:
        endpoint.stopping = True
        with anyio.move_on_after(limits.shutdown_grace_s + 2 * _ANSWER_S, shield=True):
            await _shutdown(server, endpoint, limits.shutdown_grace_s)
        sock.close()


_ANSWER_S = 1.0
"""How long a cancelled call has to send its 503 before its task is cancelled."""


async def _shutdown(server: uvicorn.Server, endpoint: Endpoint, grace_s: float) -> None:
    """uvicorn's shutdown without its fixed sleeps: stop accepting, end the connections,
    give the calls in flight the grace period, then cancel them: each answers a 503
    (cancelling uvicorn's tasks instead would log a traceback per call)."""
    for listener in getattr(server, "servers", []):
        listener.close()
    for connection in list(server.server_state.connections):
        connection.shutdown()
    tasks = server.server_state.tasks
    try:
        if tasks:
            await asyncio.wait(list(tasks), timeout=grace_s)
        for scope in list(endpoint.calls):
            scope.cancel()
        if tasks:
            await asyncio.wait(list(tasks), timeout=_ANSWER_S)
    finally:
        for task in tasks:
            task.cancel()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the agent endpoint to {host}:{port}: {exc.strerror}") from None
    sock.listen(512)
    return sock


@contextlib.contextmanager
def _admitted(endpoint: Endpoint, limits: EndpointLimits) -> Iterator[None]:
    """A call in flight: counted, and cancelled with a 503 when a stopping endpoint's
    grace period ends."""
    if endpoint.stopping:
        raise EndpointError(503, "the endpoint is stopping")
    if endpoint.in_flight >= limits.max_concurrency:
        raise EndpointError(429, f"over {limits.max_concurrency} calls in flight; retry later")
    endpoint.in_flight += 1
    scope = anyio.CancelScope()
    endpoint.calls.add(scope)
    try:
        with scope:
            yield
    finally:
        endpoint.in_flight -= 1
        endpoint.calls.discard(scope)
    if scope.cancelled_caught:
        raise EndpointError(503, "the endpoint stopped before the call was answered")


def _bearer(request: Request) -> str | None:
    return bearer_key(request.headers.get("authorization", ""))


def bearer_key(header: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (None: no bearer key)."""
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


async def _body(request: Request, limits: EndpointLimits) -> bytes:
    """The whole body within ``max_body_bytes`` (413) and ``body_timeout_s`` (408)."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise EndpointError(413, f"the request body is over {limit} bytes")
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise EndpointError(413, f"the request body is over {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer; a plain error logs nothing
        raise EndpointError(400, "the client disconnected before sending the whole body") from None
    except TimeoutError:
        raise EndpointError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s"
        ) from None
    return b"".join(chunks)


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise EndpointError(
            400, f"invalid request body: {where or 'body'}: {first.get('msg')}", param=where
        ) from None


def _usage(answer: Answer) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in answer.choices)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": answer.prompt_tokens + completion,
    }


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
            }
            for call in choice.tool_calls
        ]
    return message


def _logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(choice.token_texts, choice.logprobs, strict=False)
        ]
    }


def _chat_response(answer: Answer, model: str, body: ChatRequest) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": _message(c),
                "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c) if body.logprobs else None,
            }
            for i, c in enumerate(answer.choices)
        ],
        "usage": _usage(answer),
    }


def _chat_chunks(
    answer: Answer, model: str, body: ChatRequest, include_usage: bool
) -> Iterator[dict[str, Any]]:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    for i, c in enumerate(answer.choices):
        delta: dict[str, Any] = {"role": "assistant", "content": c.content or ""}
        if c.tool_calls:
            delta["tool_calls"] = [
                {"index": k, **call} for k, call in enumerate(_message(c)["tool_calls"])
            ]
        yield {
            **head,
            "choices": [
                {
                    "index": i,
                    "delta": delta,
                    "finish_reason": None,
                    "logprobs": _logprobs(c) if body.logprobs else None,
                }
            ],
        }
        yield {**head, "choices": [{"index": i, "delta": {}, "finish_reason": c.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(answer)}


def _completion_response(answer: Answer, model: str, body: CompletionRequest) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "logprobs": (
                    {"tokens": list(c.token_texts), "token_logprobs": list(c.logprobs)}
                    if body.logprobs is not None and c.logprobs is not None
                    else None
                ),
            }
            for i, c in enumerate(answer.choices)
        ],
        "usage": _usage(answer),
    }


def _json(body: Any, status: int = 200) -> Reply:
    """A JSON reply, encoded as Starlette's JSONResponse encodes."""
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Reply(status, "application/json", text.encode())


def _sse(chunks: Iterator[dict[str, Any]]) -> Reply:
    """Server-sent events, in one piece (the reply is sampled whole)."""
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return Reply(200, "text/event-stream", ("".join(events) + "data: [DONE]\n\n").encode())


def _response(reply: Reply) -> Response:
    return Response(reply.content, reply.status, media_type=reply.media_type)
