"""Never a silent hang: deadlines on awaits, a circuit breaker, a progress watchdog, and
graceful interrupts.

Why: the failures users of RL loops report most are hangs (a stuck request, a dead
worker, a server in a 500 storm) that leave the trainer waiting forever. Each tool here
turns "waiting forever" into an exception that carries a clear reason, so the engine can
write a checkpoint and exit:

* :func:`~engine.session.breaker.deadline` and
  :class:`~engine.session.breaker.CircuitBreaker` bound every await on the service and
  count its consecutive failures (they live with the session, which uses them);
* :class:`Watchdog` -- a task in the engine's task group that raises
  :class:`~engine.errors.Stalled` (reason ``watchdog``) when nothing progressed for a
  configurable time; cancelling the task group stops it cleanly.
* :class:`SignalInterrupt` -- installed ONLY by the CLI: the first SIGINT/SIGTERM cancels
  the run's scope (the engine then writes an ``interrupt`` checkpoint and exits); a
  second one exits the process at once.

Every wait on time here goes through a :class:`~engine.common.clock.Clock`, so tests
drive deadlines and the watchdog with a manual clock instead of sleeping.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from engine.common.clock import LOOP_CLOCK, Clock
from engine.errors import Interrupted, Stalled

__all__ = ["SignalInterrupt", "Watchdog"]

_log = structlog.get_logger("engine.supervision.watchdog")


class Watchdog:
    """Raises Stalled when :meth:`progress` was not called for ``timeout`` seconds.

    Run :meth:`run` as a task in the task group whose work it guards (``tg.start_soon(
    watchdog.run)``); its exception cancels the siblings and propagates out of the group
    (find it with :func:`engine.errors.find_error`). Cancelling the group stops it.
    """

    def __init__(self, timeout: float, *, clock: Clock = LOOP_CLOCK, log: Any = None) -> None:
        if timeout <= 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._clock = clock
        self._log = log if log is not None else _log
        self._last: float | None = None
        self._what = "run started"

    def progress(self, what: str) -> None:
        """Record progress (``what`` says which, e.g. ``"step 12 trained"``)."""
        self._last = self._clock.now()
        self._what = what

    def check(self) -> float:
        """Raise Stalled if the timeout passed; else return seconds left."""
        now = self._clock.now()
        if self._last is None:
            self._last = now
        left = self._last + self.timeout - now
        if left <= 0:
            self._log.error("watchdog.stalled", seconds=self.timeout, last_progress=self._what)
            raise Stalled(self.timeout, self._what)
        return left

    async def run(self) -> None:
        """Sleep until the next possible deadline, forever, until stalled or cancelled."""
        if self._last is None:
            self._last = self._clock.now()
        while True:
            left = self.check()  # raises Stalled once the deadline has passed
            await self._clock.sleep(left)


def _hard_exit(code: int) -> None:  # pragma: no cover - replaced in tests
    sys.stderr.write("second interrupt: exiting immediately\n")
    sys.stderr.flush()
    os._exit(code)


class SignalInterrupt:
    """SIGINT/SIGTERM handling for the CLI only (a library never installs handlers).

    On the first signal it records it (``requested``), calls ``on_interrupt`` with the
    :class:`~engine.errors.Interrupted` to report (e.g. the engine's "stop gracefully"
    method) and cancels ``scope`` if one was given; a second signal calls
    ``hard_exit(128 + signum)`` (``os._exit``) so a stuck shutdown can always be killed
    from the keyboard. Usage (run.py)::

        interrupt = SignalInterrupt()
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as run_scope:
                await tg.start(interrupt.watch, run_scope)
                await engine.run()
            if interrupt.requested:  # the run was cancelled by a signal
                await engine.write_checkpoint("interrupt")  # bounded by a deadline
            tg.cancel_scope.cancel()  # stop watching
        if interrupt.requested:
            raise interrupt.error()
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
        *,
        on_interrupt: Callable[[Interrupted], None] | None = None,
        hard_exit: Callable[[int], None] = _hard_exit,
        log: Any = None,
    ) -> None:
        self._log = log if log is not None else _log
        self._signals = signals
        self._on_interrupt = on_interrupt
        self._hard_exit = hard_exit
        self.requested: signal.Signals | None = None

    def error(self) -> Interrupted:
        """The exception that reports the interrupt (exit code 130)."""
        name = self.requested.name if self.requested is not None else "SIGINT"
        return Interrupted(name)

    async def watch(
        self,
        scope: anyio.CancelScope | None = None,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Receive signals until cancelled; the handlers are installed before
        ``task_status.started()`` so ``await tg.start(...)`` returns only once a signal
        can no longer kill the process abruptly."""
        with anyio.open_signal_receiver(*self._signals) as received:
            task_status.started()
            async for signum in received:
                sig = signal.Signals(signum)
                if self.requested is None:
                    self.requested = sig
                    self._log.warning("interrupt", signal=sig.name, action="checkpoint and exit")
                    if self._on_interrupt is not None:
                        self._on_interrupt(self.error())
                    if scope is not None:
                        scope.cancel()
                else:
                    self._log.error("interrupt.again", signal=sig.name, action="exit now")
                    self._hard_exit(128 + int(sig))
