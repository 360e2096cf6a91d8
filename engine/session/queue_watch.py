"""What a busy server's sampling queue tells the engine (docs/reliability.md, "A busy
hosted server: the sampling queue").

A sample request sent with ``X-Tinker-Sampling-Backpressure: 1`` (the SDK sends it) is
answered 408 by ``retrieve_future`` while it waits in the server's queue, with its place
in the headers (``X-Queue-Position``, ``X-Queue-Depth``, ``X-Queue-ETA-S``,
``X-Queue-Status``). The SDK re-polls those 408s itself, so no engine retry sees them;
:class:`QueueObserver` reads them on the SDK's HTTP client (an httpx response hook) so
the step metrics and the console can show the queue. Where the engine cannot hook the
SDK's HTTP client (a remote server, the tinker SDK), :func:`follow_queue_states` counts
the queue answers the SDK reports to its sampling client instead (no place or ETA then).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import httpx

__all__ = ["QueueObserver", "follow_queue_states"]

ACTIVE = "active"
"""The queue state (``QueueState.value``) of a request that is no longer waiting."""


def _number(headers: httpx.Headers, name: str) -> float | None:
    try:
        value = float(headers.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


class QueueObserver:
    """Queue answers seen since the last :meth:`take`: how many, the farthest place and
    the longest estimated wait. The hook runs on the SDK's own event loop thread, the
    reader on the engine's: a lock guards the few numbers it keeps (its memory is
    constant)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits = 0
        self._position_max: int | None = None
        self._depth_max: int | None = None
        self._eta_max: float | None = None

    def observe(self, response: httpx.Response) -> None:
        """Count ``response`` if it is a queue answer (a 408 with ``X-Queue-Status``);
        a bare 408 (a proxy's timeout) is not the queue's."""
        if response.status_code != 408 or "x-queue-status" not in response.headers:
            return
        position = _number(response.headers, "x-queue-position")
        depth = _number(response.headers, "x-queue-depth")
        eta = _number(response.headers, "x-queue-eta-s")
        with self._lock:
            self._waits += 1
            if position is not None:
                self._position_max = max(self._position_max or 0, int(position))
            if depth is not None:
                self._depth_max = max(self._depth_max or 0, int(depth))
            if eta is not None:
                self._eta_max = max(self._eta_max or 0.0, eta)

    def observe_state(self, state: object) -> None:
        """Count a queue state the SDK reports (a ``QueueState``); an active one is not
        a wait."""
        if getattr(state, "value", state) == ACTIVE:
            return
        with self._lock:
            self._waits += 1

    async def hook(self, response: httpx.Response) -> None:
        """The httpx ``event_hooks["response"]`` entry (reads headers only)."""
        self.observe(response)

    def take(self) -> dict[str, int | float | None]:
        """``queue/waits`` (queue answers), ``queue/position_max``, ``queue/depth_max``
        and ``queue/eta_s_max`` since the previous take (None: no answer); resets."""
        with self._lock:
            taken: dict[str, int | float | None] = {
                "queue/waits": self._waits,
                "queue/position_max": self._position_max,
                "queue/depth_max": self._depth_max,
                "queue/eta_s_max": self._eta_max,
            }
            self._waits = 0
            self._position_max = self._depth_max = None
            self._eta_max = None
        return taken


def follow_queue_states(sampling_client: Any, queue: QueueObserver) -> None:
    """Show ``queue`` every queue state the SDK reports to ``sampling_client`` (both SDK
    generations call its ``on_queue_state_change(state, reason)`` on each queue answer,
    whatever the transport), then let the SDK's own method run (it logs the wait). Only
    this client's method is wrapped, nothing process-wide."""
    report = sampling_client.on_queue_state_change

    def on_queue_state_change(state: Any, reason: str | None) -> None:
        queue.observe_state(state)
        report(state, reason)

    sampling_client.on_queue_state_change = on_queue_state_change
