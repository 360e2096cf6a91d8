"""A manual :class:`engine.common.clock.Clock`: time moves only when a test says so, so the
deadlines, the watchdog and the liveness probes of a run are driven without sleeping."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import anyio.lowlevel


class ManualClock:
    """Sleepers wake and deadlines expire when :meth:`advance` moves time past them.
    Use it from the event loop that runs the code under test."""

    def __init__(self) -> None:
        self._now = 0.0
        self._sleepers: dict[object, tuple[float, anyio.Event]] = {}
        self._deadlines: dict[object, tuple[float, anyio.CancelScope]] = {}

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        key, woken = object(), anyio.Event()
        self._sleepers[key] = (self._now + seconds, woken)
        try:
            await woken.wait()
        finally:
            self._sleepers.pop(key, None)

    @contextmanager
    def cancel_after(self, seconds: float) -> Iterator[anyio.CancelScope]:
        key = object()
        with anyio.CancelScope() as scope:
            self._deadlines[key] = (self._now + seconds, scope)
            try:
                yield scope
            finally:
                del self._deadlines[key]

    def deadlines(self) -> list[float]:
        """Seconds left of each deadline whose body is still running."""
        return sorted(due - self._now for due, _ in self._deadlines.values())

    def sleepers(self) -> int:
        return len(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time on: wake the sleepers and cancel the deadlines now due."""
        self._now += seconds
        for due, woken in list(self._sleepers.values()):
            if due <= self._now:
                woken.set()
        for due, scope in list(self._deadlines.values()):
            if due <= self._now:
                scope.cancel()


async def expire_deadlines(clock: ManualClock) -> None:
    """Forever: once every task waits, move time to the next deadline (run it as a task
    beside code whose deadlines should all expire)."""
    while True:
        await anyio.wait_all_tasks_blocked()
        pending = clock.deadlines()
        if pending:
            clock.advance(pending[0])
        else:
            await anyio.lowlevel.checkpoint()


class SetTime:
    """A :data:`engine.common.clock.Stopwatch` (or wall clock) that reads ``now``, which
    only a test moves."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
