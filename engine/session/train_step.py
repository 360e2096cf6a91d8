"""A train step is applied once or its outcome is unknown: never retried in place.

Once submitted, ``forward_backward`` + ``optim_step`` are not idempotent (re-sending an
applied step doubles the update), so :func:`run_train_step` turns any failure after
submission into :class:`~engine.errors.StepOutcomeUnknown` (the engine restores a
checkpoint: :mod:`engine.supervision.recovery`) or, for a request the server refused as
invalid, :class:`~engine.errors.PermanentServiceError`; docs/reliability.md has the
whole story.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, TypeVar

import structlog

from engine.common.clock import LOOP_CLOCK, Clock
from engine.errors import (
    EngineError,
    PermanentServiceError,
    RunStopped,
    StepOutcomeUnknown,
    classify,
)
from engine.session.breaker import CircuitBreaker, deadline

__all__ = ["StepOutcome", "run_train_step", "step_outcome"]

T = TypeVar("T")

TRAIN_STEP_KIND = "train_step"  # == engine.session.retry.OpKind.TRAIN_STEP

_log = structlog.get_logger("engine.session.train_step")


class StepOutcome(StrEnum):
    """What a train step did to the weights."""

    APPLIED = "applied"  # both results came back
    UNKNOWN = "unknown"  # may or may not have been applied: restore and redo
    REJECTED = "rejected"  # the server refused it as invalid: stop, redoing cannot help


def step_outcome(exc: BaseException | None) -> StepOutcome:
    """Outcome of a train step given the exception of awaiting it (None: success).

    Permanent failures (a ``user`` RequestFailedError, 4xx) are REJECTED; everything
    else -- transient errors, timeouts, expired futures, unknown exceptions after
    submission -- is UNKNOWN. Either way the weights are untrusted afterwards."""
    if exc is None:
        return StepOutcome.APPLIED
    if isinstance(exc, EngineError) and not isinstance(exc, TimeoutError):
        return StepOutcome.UNKNOWN
    return StepOutcome.UNKNOWN if classify(exc).transient else StepOutcome.REJECTED


async def run_train_step(
    step_fn: Callable[[], Awaitable[T]],
    *,
    step: int,
    deadline_s: float | None,
    breaker: CircuitBreaker | None = None,
    log: Any = None,
    clock: Clock = LOOP_CLOCK,
) -> T:
    """Await one train step (``step_fn`` submits forward_backward + optim_step and
    awaits both) under a deadline; never retries it.

    Returns the result, or raises StepOutcomeUnknown (restore with
    :func:`plan_recovery`) / PermanentServiceError (stop the run, do not checkpoint);
    the breaker may raise CircuitOpen first; a RunStopped (the server is gone) passes
    through. ``step`` is the 1-based number of this optimizer step (= completed steps
    after it); the deadline runs on ``clock``."""
    try:
        with deadline(deadline_s, f"train step {step}", clock):
            result = await step_fn()
    except RunStopped:
        raise
    except Exception as exc:
        outcome = step_outcome(exc)
        message = classify(exc).message
        (log if log is not None else _log).error(
            "train_step.failed", step=step, outcome=str(outcome), error=message
        )
        if breaker is not None:
            breaker.record_failure(TRAIN_STEP_KIND, exc)
        if outcome is StepOutcome.REJECTED:
            raise PermanentServiceError(
                f"train step {step} failed: {message}",
                kind=TRAIN_STEP_KIND,
                attempts=1,
                transient=False,
            ) from exc
        raise StepOutcomeUnknown(step, message) from exc
    if breaker is not None:
        breaker.record_success(TRAIN_STEP_KIND)
    return result
