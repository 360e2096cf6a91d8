"""The one clock that timers run on, on the client and in the local server alike.

Every wait on time (deadlines, the watchdog, liveness probes, the server's sequencer
gaps) goes through a :class:`Clock`, by default :data:`LOOP_CLOCK` (anyio's event-loop
clock), so tests drive them with a manual clock instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, TypeAlias

import anyio

__all__ = ["LOOP_CLOCK", "Clock", "LoopClock", "Stopwatch"]

# Seconds for measuring how long something took (metrics), never for waiting: waits
# go through a Clock.
Stopwatch: TypeAlias = Callable[[], float]


class Clock(Protocol):
    """Monotonic time as a timer sees it."""

    def now(self) -> float:
        """Seconds on this clock (only differences mean something)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...

    def cancel_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        """Enter a cancel scope that cancels itself ``seconds`` from now on this clock."""
        ...


class LoopClock:
    """anyio's event-loop clock: real time."""

    def now(self) -> float:
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def cancel_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        return anyio.CancelScope(deadline=anyio.current_time() + seconds)


LOOP_CLOCK: Clock = LoopClock()
