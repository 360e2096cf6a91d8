"""Is the server still there? Noticing a dead server while calls wait on it.

Why: when the server dies (``kill -9``, a crash, the network gone), nothing tells the
engine. The SDK retries connection errors inside its own loops (sampling for up to the
request timeout, futures forever), so a call just waits out its deadline -- 600 s per
attempt by default -- and the run ends minutes later blaming "no progress". A server
that *answers* slowly (a long queue, a busy compute thread) must not be mistaken for a
dead one, so only a failure to *connect* counts.

:class:`ServerLiveness` probes ``GET <base_url>/api/v1/healthz`` while calls wait:

* a call that has waited ``interval`` seconds starts probing (a quick call never
  probes; concurrent calls share one probe per interval);
* any HTTP answer, even an error status, means the server is there; a connection
  refused, a connect timeout or an unknown host count as a failed probe;
* once probes have failed for ``unreachable_after`` seconds in a row, every waiting
  call ends with :class:`~engine.errors.ServerUnreachable` (one line naming the URL)
  and later calls fail at once until a probe succeeds again;
* a call that fails while the probes fail (the SDK gave up on a refused connection)
  waits for the verdict instead of being retried or counted by the breaker:
  :meth:`ServerLiveness.verdict_after_failure`.

Time runs on an injectable :class:`~engine.common.clock.Clock`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import httpx

from engine.common.clock import LOOP_CLOCK, Clock
from engine.config.values import PROBE_INTERVAL_S
from engine.errors import ServerUnreachable, os_reason

__all__ = ["Probe", "ServerLiveness", "http_probe"]

T = TypeVar("T")


Probe = Callable[[], Awaitable[str | None]]
"""One liveness probe: None when the server answered, else why it could not be reached."""


async def http_probe(base_url: str, connect_s: float) -> str | None:
    """``GET <base_url>/api/v1/healthz``: None on any HTTP answer, else the reason the
    connection failed (``connection refused``, ``name or service not known``...)."""
    url = base_url.rstrip("/") + "/api/v1/healthz"
    try:
        async with httpx.AsyncClient(timeout=connect_s) as client:
            await client.get(url)
    except httpx.ConnectTimeout:
        return f"no connection within {connect_s:g}s"
    except httpx.ConnectError as exc:
        return os_reason(exc)
    except httpx.HTTPError:
        return None  # connected, then slow or cut off: a busy server, not a dead one
    return None


class ServerLiveness:
    """Probes one server while calls wait on it; see the module doc. Owned by one event
    loop."""

    def __init__(
        self,
        base_url: str,
        *,
        unreachable_after: float,
        probe: Probe | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        if unreachable_after <= 0:
            raise ValueError(f"unreachable_after must be positive, got {unreachable_after}")
        self.base_url = base_url
        self.unreachable_after = unreachable_after
        self.interval = min(PROBE_INTERVAL_S, unreachable_after / 3)
        self._probe: Probe = probe or (lambda: http_probe(base_url, self.interval))
        self._clock = clock
        self._lock = anyio.Lock()
        self._probed_at: float | None = None
        self._failing_since: float | None = None
        self._failed_at: float | None = None
        self._reason = ""

    @property
    def failing(self) -> bool:
        """True when the latest probe could not connect."""
        return self._failing_since is not None

    def gone(self) -> ServerUnreachable | None:
        """The error to stop with when probes have failed for ``unreachable_after``."""
        if self._failing_since is None or self._failed_at is None:
            return None
        failing_for = self._failed_at - self._failing_since
        if failing_for < self.unreachable_after:
            return None
        return ServerUnreachable(self.base_url, failing_for, self._reason)

    async def refresh(self) -> None:
        """Probe, unless another caller probed less than ``interval`` ago."""
        async with self._lock:
            if self._probed_at is not None and self._clock.now() - self._probed_at < self.interval:
                return
            reason = await self._probe()
            now = self._clock.now()
            self._probed_at = now
            if reason is None:
                self._failing_since = self._failed_at = None
                return
            if self._failing_since is None:
                self._failing_since = now
            self._failed_at = now
            self._reason = reason

    async def watch(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``, or raise ServerUnreachable once the server is gone (at once
        when it is already known to be gone)."""
        known = self.gone()
        if known is not None:
            raise known
        verdict: ServerUnreachable | None = None
        outcome: list[T] = []
        failure: Exception | None = None  # raised after the group, not wrapped in one
        async with anyio.create_task_group() as tg:
            work = anyio.CancelScope()

            async def probe_while_waiting() -> None:
                nonlocal verdict
                await self._clock.sleep(self.interval)
                while (verdict := self.gone()) is None:
                    await self.refresh()
                    if self.gone() is None:
                        await self._clock.sleep(self.interval)
                work.cancel()

            tg.start_soon(probe_while_waiting)
            with work:
                try:
                    outcome.append(await fn())
                except Exception as exc:
                    failure = exc
                finally:
                    tg.cancel_scope.cancel()
        if verdict is not None:
            raise verdict
        if failure is not None:
            raise failure
        return outcome[0]

    async def verdict_after_failure(self) -> ServerUnreachable | None:
        """After a call failed: None when the server answers (retry as usual), else wait
        while probes keep failing and return ServerUnreachable once it is gone."""
        await self.refresh()
        while self.failing:
            verdict = self.gone()
            if verdict is not None:
                return verdict
            await self._clock.sleep(self.interval)
            await self.refresh()
        return None
