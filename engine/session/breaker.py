"""Bounded waits on the service: a deadline on each await and a circuit breaker.

* :func:`deadline` -- every await on the service gets a timeout and a message that names
  the operation (``timed out after 30s waiting for sample``).
* :class:`CircuitBreaker` -- N consecutive failures of one operation kind raise
  :class:`~engine.errors.CircuitOpen` (checkpoint reason ``breaker``).

Both wait through a :class:`~engine.common.clock.Clock`, so tests drive them with a
manual clock instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog

from engine.common.clock import LOOP_CLOCK, Clock
from engine.errors import CircuitOpen, OpTimeout, classify

__all__ = ["CircuitBreaker", "deadline"]

_log = structlog.get_logger("engine.session.breaker")


@contextmanager
def deadline(seconds: float | None, op: str, clock: Clock = LOOP_CLOCK) -> Iterator[None]:
    """Run the body for at most ``seconds`` on ``clock``; on expiry raise
    :class:`~engine.errors.OpTimeout` naming ``op``. ``None`` means no limit (use only
    where another layer bounds the wait). A ``TimeoutError`` raised by the body itself
    (not by this deadline) passes through unchanged."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise ValueError(f"deadline for {op} must be positive, got {seconds}")
    with clock.cancel_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        raise OpTimeout(op, seconds)


class CircuitBreaker:
    """Counts consecutive failures per operation kind; the N-th raises CircuitOpen.

    ``threshold`` is one number for every kind or a mapping kind -> number (kinds not in
    the mapping use ``default``). A success of a kind resets its count. Owned by one
    event loop; no locking needed.
    """

    def __init__(
        self, threshold: int | Mapping[str, int], *, default: int = 5, log: Any = None
    ) -> None:
        self._log = log if log is not None else _log
        self._thresholds: dict[str, int] = {}
        if isinstance(threshold, int):
            default = threshold
        else:
            self._thresholds = {str(k): v for k, v in threshold.items()}
        for kind, value in [*self._thresholds.items(), ("default", default)]:
            if value < 1:
                raise ValueError(f"breaker threshold for {kind} must be >= 1, got {value}")
        self._default = default
        self._failures: dict[str, int] = {}

    def threshold(self, kind: str) -> int:
        return self._thresholds.get(str(kind), self._default)

    def failures(self, kind: str) -> int:
        """Current run of consecutive failures of ``kind``."""
        return self._failures.get(str(kind), 0)

    def record_success(self, kind: str) -> None:
        self._failures[str(kind)] = 0

    def record_failure(self, kind: str, exc: BaseException) -> None:
        """Count one failure; raise CircuitOpen (chained to ``exc``) at the threshold."""
        key = str(kind)
        count = self._failures.get(key, 0) + 1
        self._failures[key] = count
        if count >= self.threshold(key):
            self._log.error("breaker.open", kind=key, failures=count, error=classify(exc).message)
            raise CircuitOpen(key, count, classify(exc).message) from exc
