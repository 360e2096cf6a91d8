"""ASGI middleware: request counting, fault injection, authentication, body limit.

Pure ASGI (not BaseHTTPMiddleware) because the "drop" fault must be able to break the
connection mid-response and the "after" faults must run the request and then throw the
answer away, which needs control over ``send``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.local.faults import FaultInjector, FaultRule
from engine.local.http.auth import Authenticator
from engine.local.stats import Stats

API_PREFIX = "/api/v1/"
UNAUTHENTICATED = frozenset({"healthz"})
TOKEN_ENDPOINT = "auth/token"
_COLLECTIONS = ("samplers", "training_runs", "sessions", "checkpoints")


def endpoint_name(path: str) -> str:
    """The endpoint a path addresses, without ids: "/api/v1/samplers/abc" -> "samplers"."""
    rest = path[len(API_PREFIX) :] if path.startswith(API_PREFIX) else path.lstrip("/")
    head = rest.split("/", 1)[0]
    return head if head in _COLLECTIONS else rest.rstrip("/")


class InjectedDrop(Exception):
    """Raised after a response has started so the server closes the connection."""


class _HideInjectedDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, InjectedDrop)


def hide_injected_drop_tracebacks() -> None:
    """uvicorn logs every exception from the app; injected drops are intentional."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _HideInjectedDrops) for f in logger.filters):
        logger.addFilter(_HideInjectedDrops())


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    raw = json.dumps(body).encode()
    header_list = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
    ]
    header_list += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": header_list})
    await send({"type": "http.response.body", "body": raw})


class FaultMiddleware:
    """Counts requests per endpoint and injects the configured HTTP-level faults."""

    def __init__(self, app: ASGIApp, injector: FaultInjector, stats: Stats) -> None:
        self.app = app
        self.injector = injector
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_name(scope["path"])
        self.stats.requests[endpoint] += 1
        rule = self.injector.http_fault(endpoint)
        if rule is None:
            await self.app(scope, receive, send)
            return
        if rule.kind == "slow":
            await self._slow(rule, scope, receive, send)
            return
        if rule.phase == "after":
            await self.app(scope, receive, _discard)
        if rule.kind == "drop":
            await self._drop(send)
        else:
            await self._status(rule, endpoint, send)

    async def _slow(self, rule: FaultRule, scope: Scope, receive: Receive, send: Send) -> None:
        delay = self.injector.spec.slow_s
        if rule.phase == "before":
            await anyio.sleep(delay)
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        await anyio.sleep(delay)
        for message in held:
            await send(message)

    async def _drop(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"request', "more_body": True})
        raise InjectedDrop("injected fault: connection dropped")

    async def _status(self, rule: FaultRule, endpoint: str, send: Send) -> None:
        status = int(rule.kind)
        body: dict[str, Any] = {
            "error": f"injected fault: HTTP {status} on {endpoint} (fault injection)",
            "category": "server",
        }
        headers: dict[str, str] = {}
        if status == 429:
            wait = self.injector.spec.retry_after_s
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
            headers["retry-after-ms"] = str(int(wait * 1000))
        if status == 408:
            body["queue_state"] = "paused_capacity"
            body["queue_state_reason"] = "injected fault: request timed out in the queue"
        await send_json(send, status, body, headers)


async def _discard(message: Message) -> None:
    """The answer of a request whose response an "after" fault replaces."""


class AuthMiddleware:
    """Requires the API key (raw or as an issued JWT) on every API path but healthz;
    only the API key itself may fetch a JWT."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if (
            scope["type"] != "http"
            or not self.auth.required
            or not path.startswith(API_PREFIX)
            or endpoint_name(path) in UNAUTHENTICATED
        ):
            await self.app(scope, receive, send)
            return
        credential = _header(scope, b"x-api-key")
        if credential is None:
            bearer = _header(scope, b"authorization")
            if bearer is not None and bearer.lower().startswith("bearer "):
                credential = bearer[7:].strip()
        problem = self.auth.check(credential)
        status = 401
        minting = endpoint_name(path) == TOKEN_ENDPOINT
        if problem is None and minting and not self.auth.may_issue(credential):
            status, problem = 403, "a JWT cannot fetch another JWT: send the API key"
        if problem is None:
            await self.app(scope, receive, send)
            return
        # Connection: close, so an unauthenticated body is never read (it is not drained).
        await send_json(
            send,
            status,
            {"error": f"unauthorized: {problem}", "category": "user"},
            {"Connection": "close"},
        )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None
