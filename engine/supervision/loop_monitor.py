"""The last resort against a blocked event loop (the CLI only; a library never does this).

Why: every stop -- the watchdog, SIGINT/SIGTERM, the breaker -- runs ON the event loop.
User code that blocks the loop (an ``async def`` reward that busy-loops, a hook that
never awaits) silences all of them: the process would run forever. This monitor is a
daemon thread that only watches: the loop beats once a second (:meth:`LoopMonitor.beat`,
a task on the loop); a signal is noted by a plain handler that runs even while the loop
is blocked (Python runs signal handlers between bytecodes of the main thread, and
asyncio's own dispatch, through the wakeup fd, is unaffected). The process exits with
one line on stderr when

* a signal arrived and the loop has not run for ``after_signal`` seconds since (exit
  128 + signal: the graceful stop cannot happen), or a second signal arrives while it is
  blocked (at once), or
* the loop has not run for ``blocked_limit`` seconds (the watchdog's own bound; exit 1).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import anyio

from engine.common.clock import Stopwatch

__all__ = ["AFTER_SIGNAL_S", "LoopMonitor"]

AFTER_SIGNAL_S = 10.0
"""How long a signal may wait for a blocked event loop before the process exits."""


def _exit_now(message: str, code: int) -> None:  # pragma: no cover - replaced in tests
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(code)


class LoopMonitor:
    """Watches that the event loop still runs; see the module doc."""

    def __init__(
        self,
        *,
        blocked_limit: float,
        after_signal: float = AFTER_SIGNAL_S,
        clock: Stopwatch = time.monotonic,
        exit_now: Callable[[str, int], None] = _exit_now,
    ) -> None:
        self._blocked_limit = blocked_limit
        self._after_signal = after_signal
        self._clock = clock
        self._exit_now = exit_now
        self._last_beat = clock()
        self._signals: list[tuple[int, float]] = []
        self._stop = threading.Event()

    async def beat(self) -> None:
        """Runs on the event loop until cancelled: proof that the loop runs."""
        while True:
            self._last_beat = self._clock()
            await anyio.sleep(1.0)

    def note_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """A plain signal handler (``signal.signal``): records the signal."""
        self._signals.append((signum, self._clock()))

    def check(self) -> tuple[str, int] | None:
        """``(message, exit code)`` when the process must exit now, else None."""
        now = self._clock()
        blocked = now - self._last_beat
        blocked_signals = [(n, at) for n, at in self._signals if at > self._last_beat]
        if blocked_signals:
            signum, first = blocked_signals[0]
            waited = now - first
            if len(blocked_signals) > 1 or waited >= self._after_signal:
                name = signal.Signals(signum).name
                return (
                    f"Error: {name} received but the event loop has been blocked for "
                    f"{blocked:.0f} s (an async reward or hook that never awaits?); exiting "
                    "without a stop checkpoint",
                    128 + signum,
                )
        if blocked >= self._blocked_limit:
            return (
                f"Error: the event loop has been blocked for {blocked:.0f} s (an async reward "
                "or hook that never awaits?); exiting without a stop checkpoint",
                1,
            )
        return None

    def start(self, signals: tuple[signal.Signals, ...]) -> None:
        """Note ``signals`` (replacing their Python-level handlers, which asyncio leaves
        as no-ops) and start the watching thread. Call on the main thread, after the event
        loop installed its own handlers."""
        for sig in signals:
            signal.signal(sig, self.note_signal)
        threading.Thread(target=self._watch, name="engine-loop-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            verdict = self.check()
            if verdict is not None:
                self._exit_now(*verdict)
                return
