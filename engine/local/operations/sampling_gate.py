"""The backpressure queue of a hosted profile: at most ``slots`` sample requests run at a
time (from admission until their result is due, simulated latency included); the rest
wait in a bounded FIFO (past its bound a new one is refused, 429).

A request sent with ``X-Tinker-Sampling-Backpressure: 1`` (every sample request of the
unmodified SDK) gets, while it waits, a 408 from ``retrieve_future`` carrying its place in
the queue (:meth:`SamplingGate.status`, the fields of MinT's ``advanced/queue_status.py``);
without the header a poll long-waits as before. Event-loop only (no locking).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

BACKPRESSURE_HEADER = "x-tinker-sampling-backpressure"
POLL_HOLD_S = 1.0
"""Longest a poll of a waiting request is held before its 408 (an SDK re-polls a 408 at
once; a request that starts meanwhile goes on long-polling)."""
DEFAULT_SAMPLE_S = 1.0
"""What one request is assumed to take before any has finished (the ETA's unit)."""
_SMOOTHING = 0.2
"""Weight of the newest finished request in the running mean of request times."""


class QueueFull(Exception):
    """The FIFO holds as many waiting requests as it may (answered 429)."""


@dataclass
class _Waiting:
    start: Callable[[], None]
    backpressure: bool
    first_position: int
    left: anyio.Event = field(default_factory=anyio.Event)


@dataclass(frozen=True)
class QueueStatus:
    depth: int
    position: int
    """1-based: 1 runs next."""
    eta_s: float
    progress: float
    """Share of the requests ahead of it at admission that have left the queue since."""
    retry_after_s: int

    def headers(self) -> dict[str, str]:
        return {
            "Retry-After": str(self.retry_after_s),
            "X-Queue-Depth": str(self.depth),
            "X-Queue-Position": str(self.position),
            "X-Queue-ETA-S": f"{self.eta_s:.3f}",
            "X-Queue-Status": "queued",
        }

    def body(self, request_id: str) -> dict[str, object]:
        return {
            "type": "try_again",
            "request_id": request_id,
            "status": "queued",
            "queue_state": "paused_capacity",
            "queue_state_reason": f"waiting for a sampling slot ({self.position} of "
            f"{self.depth} in the queue)",
            "queue_depth": self.depth,
            "queue_position": self.position,
            "estimated_wait_s": round(self.eta_s, 3),
            "progress": round(self.progress, 4),
            "retry_after_s": self.retry_after_s,
        }


class SamplingGate:
    def __init__(
        self,
        slots: int | None,
        max_queued: int,
        *,
        max_retry_after_s: float,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        """``slots`` None: no limit (every request starts at once, nothing queues)."""
        self.slots = slots
        self._max_queued = max_queued
        self._max_retry_after_s = max_retry_after_s
        self._clock = clock
        self._queue: OrderedDict[str, _Waiting] = OrderedDict()
        self._started: dict[str, float] = {}
        self._mean_s = DEFAULT_SAMPLE_S
        self.queued_total = 0
        """Requests that had to wait (stats)."""
        self.told_to_wait = 0
        """408s answered to polls of waiting requests (stats)."""

    @property
    def running(self) -> int:
        return len(self._started)

    @property
    def depth(self) -> int:
        return len(self._queue)

    def admit(self, request_id: str, start: Callable[[], None], *, backpressure: bool) -> None:
        """Start the request now (``start()``) if a slot is free, else queue it."""
        if self.slots is None or (self.running < self.slots and not self._queue):
            self._start(request_id, start)
            return
        if len(self._queue) >= self._max_queued:
            raise QueueFull(
                f"the sampling queue is full ({len(self._queue)} requests wait for "
                f"{self.slots} slots); back off and retry the sample"
            )
        self._queue[request_id] = _Waiting(start, backpressure, len(self._queue) + 1)
        self.queued_total += 1

    def release(self, request_id: str) -> None:
        """The request's result is due: its slot goes to the first waiting one."""
        began = self._started.pop(request_id, None)
        if began is None:
            return
        took = max(0.0, self._clock() - began)
        self._mean_s += _SMOOTHING * (took - self._mean_s)
        while self._queue and (self.slots is None or self.running < self.slots):
            next_id, waiting = self._queue.popitem(last=False)
            waiting.left.set()
            self._start(next_id, waiting.start)

    def _start(self, request_id: str, start: Callable[[], None]) -> None:
        self._started[request_id] = self._clock()
        try:
            start()
        except BaseException:
            del self._started[request_id]
            raise

    def started_at(self, request_id: str) -> float | None:
        """When the request got its slot (the clock of ``anyio.current_time``)."""
        return self._started.get(request_id)

    def stats(self) -> dict[str, int]:
        return {
            "slots": self.slots or 0,
            "running": self.running,
            "waiting": self.depth,
            "waited_total": self.queued_total,
            "told_to_wait": self.told_to_wait,
        }

    def backpressured(self, request_id: str) -> bool:
        """Whether the request waits in the queue and asked for 408s while it does."""
        waiting = self._queue.get(request_id)
        return waiting is not None and waiting.backpressure

    def status(self, request_id: str) -> QueueStatus | None:
        """Its place in the queue, or None once it left."""
        if request_id not in self._queue:
            return None
        position = list(self._queue).index(request_id) + 1
        waiting = self._queue[request_id]
        rounds = math.ceil(position / (self.slots or 1))
        eta = rounds * self._mean_s
        ahead = waiting.first_position - 1
        progress = (ahead - (position - 1)) / ahead if ahead else 0.0
        retry = max(1, min(math.ceil(eta), math.ceil(self._max_retry_after_s)))
        return QueueStatus(len(self._queue), position, eta, progress, retry)

    async def wait_left(self, request_id: str, timeout_s: float) -> None:
        """Return once the request left the queue, or after ``timeout_s``."""
        waiting = self._queue.get(request_id)
        if waiting is not None:
            with anyio.move_on_after(timeout_s):
                await waiting.left.wait()
