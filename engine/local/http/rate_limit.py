"""``--rate-limit``: a token bucket per credential, 429 with ``Retry-After`` past it.

Each credential (the ``X-API-Key`` or bearer value a request carries: an API key, or a JWT
issued for one, so each SDK client counts on its own) gets ``rate`` requests per second
with bursts of ``max(1, ceil(rate))``. Polls, heartbeats, telemetry and the SDK's startup
calls are not counted: a hosted limit meters work, and a client must always be able to
collect results it already paid for.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.local.http.middleware import API_PREFIX, _header, endpoint_name, send_json

EXEMPT = frozenset(
    {"retrieve_future", "session_heartbeat", "telemetry", "healthz", "client/config", "auth/token"}
)
MAX_BUCKETS = 4096
"""Credentials tracked at once; the least recently seen are forgotten first (a forgotten
one starts again with a full bucket)."""


class TokenBuckets:
    def __init__(self, rate: float, *, clock: Callable[[], float] = anyio.current_time) -> None:
        self.rate = rate
        self.burst = float(max(1, math.ceil(rate)))
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.refused = 0

    def take(self, key: str) -> float:
        """0 when the request may go ahead, else the seconds until it may."""
        now = self._clock()
        tokens, then = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate
            self.refused += 1
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return wait


class RateLimitMiddleware:
    def __init__(self, app: ASGIApp, buckets: TokenBuckets) -> None:
        self.app = app
        self.buckets = buckets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if (
            scope["type"] != "http"
            or not path.startswith(API_PREFIX)
            or endpoint_name(path) in EXEMPT
        ):
            await self.app(scope, receive, send)
            return
        credential = _header(scope, b"x-api-key") or _header(scope, b"authorization") or ""
        wait = self.buckets.take(credential)
        if wait <= 0:
            await self.app(scope, receive, send)
            return
        await send_json(
            send,
            429,
            {
                "error": f"rate limit: at most {self.buckets.rate:g} requests per second per "
                f"API key; retry in {wait:.2f} s",
                "category": "server",
            },
            {
                "Retry-After": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(int(wait * 1000)),
                # its body is not read: the connection cannot carry another request
                "Connection": "close",
            },
        )
