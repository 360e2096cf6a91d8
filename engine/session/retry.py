"""The engine's retry layer: what is safe to retry, how long, and who already retried.

The pinned SDK already retries in four places, some without end; the engine must
neither multiply those retries nor retry what is unsafe (a train step). So this module
retries only above the SDK, only idempotent operations, each attempt under a deadline,
counted per kind (``retries/<kind>``). docs/reliability.md, "Who retries what", has the
SDK's layers and the reasoning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import anyio
import structlog
import tenacity

from engine.common.clock import LOOP_CLOCK, Clock
from engine.config import EngineConfig
from engine.config.values import UNREACHABLE_AFTER_S
from engine.errors import (
    EngineError,
    PermanentServiceError,
    RetriesExhausted,
    ServerUnreachable,
    ServiceError,
    StepOutcomeUnknown,
    classify,
    retry_after,
)
from engine.session.breaker import CircuitBreaker, deadline
from engine.session.liveness import ServerLiveness
from engine.session.queue_watch import QueueObserver
from engine.session.train_step import run_train_step

__all__ = [
    "SDK_MAX_RETRIES",
    "OpKind",
    "RetryCounter",
    "RetryPolicy",
    "ServiceGuard",
    "call_with_retry",
    "retry_policies",
    "retrying",
    "should_retry",
    "tally_retries",
]

T = TypeVar("T")

SDK_MAX_RETRIES = 3
"""``max_retries`` for ``ServiceClient(...)``: the HTTP layer's per-call retries."""


class OpKind(StrEnum):
    """Kinds of service operations; the value names the ``retries/<kind>`` metric."""

    SESSION = "session"  # ServiceClient(), create_*_client, get_server_capabilities
    SAMPLE = "sample"  # SamplingClient.sample_async (stateless)
    SAMPLER_SNAPSHOT = "save_sampler"  # save_weights_for_sampler / ..._get_sampling_client
    SAVE_STATE = "save_state"  # TrainingClient.save_state
    TRAIN_STEP = "train_step"  # fwd_bwd + optim_step: never retried; counts restores


class _Log(Protocol):
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...


@dataclass(frozen=True)
class RetryPolicy:
    """How one kind of operation is retried.

    ``max_attempts`` counts the first try; ``initial_wait``/``max_wait``/``jitter`` shape
    the exponential backoff (``initial * 2^n + uniform(0, jitter)``, capped); a server's
    Retry-After replaces the backoff, capped at ``max_retry_after``; ``max_elapsed``
    stops retrying once a wait would end past it (seconds since the first attempt);
    ``attempt_timeout`` is the deadline of each attempt (None: unbounded -- only for
    calls another layer bounds).
    """

    max_attempts: int = 4
    initial_wait: float = 1.0
    max_wait: float = 30.0
    jitter: float = 1.0
    max_elapsed: float | None = 900.0
    attempt_timeout: float | None = 300.0
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("initial_wait", "max_wait", "jitter", "max_retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_elapsed", "attempt_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")

    def scaled(self, **changes: Any) -> RetryPolicy:
        """A copy with some fields changed (``policy.scaled(attempt_timeout=60)``)."""
        return replace(self, **changes)


def retry_policies(
    *, attempts: int, backoff: float, request_timeout: float
) -> dict[OpKind, RetryPolicy]:
    """The policy of each kind of call from the run's ``--retry-attempts``,
    ``--retry-backoff`` and ``--request-timeout``; a train step is never retried."""
    base = RetryPolicy(
        max_attempts=attempts,
        initial_wait=backoff,
        max_wait=max(30.0, backoff),
        jitter=backoff,
        attempt_timeout=request_timeout,
    )
    policies = {kind: base for kind in OpKind}
    policies[OpKind.TRAIN_STEP] = base.scaled(max_attempts=1)
    return policies


@dataclass
class RetryTally:
    """Retries made by one piece of work (see :func:`tally_retries`)."""

    count: int = 0


_TALLY: ContextVar[RetryTally | None] = ContextVar("engine_retry_tally", default=None)


@contextlib.contextmanager
def tally_retries() -> Iterator[RetryTally]:
    """Count the retries made inside the block by this task (and the tasks it starts),
    whichever stage it belongs to: a step's metrics report its own retries, not those
    of the steps sampled meanwhile."""
    tally = RetryTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


class RetryCounter:
    """Retries per kind: cumulative (:meth:`totals`) and since the last :meth:`take`
    (what one step's metrics report). One event loop owns it; no locking."""

    def __init__(self) -> None:
        self._total: dict[str, int] = {}
        self._since_take: dict[str, int] = {}

    def increment(self, kind: str) -> None:
        key = str(kind)
        self._total[key] = self._total.get(key, 0) + 1
        self._since_take[key] = self._since_take.get(key, 0) + 1

    def total(self, kind: str) -> int:
        return self._total.get(str(kind), 0)

    def totals(self) -> dict[str, int]:
        """``{"retries/<kind>": n}`` since the start, every OpKind present."""
        return _as_metrics(self._total)

    def take(self) -> dict[str, int]:
        """``{"retries/<kind>": n}`` since the previous take (per-step metrics); resets."""
        out = _as_metrics(self._since_take)
        self._since_take = {}
        return out


def _as_metrics(counts: Mapping[str, int]) -> dict[str, int]:
    keys = [k.value for k in OpKind] + sorted(set(counts) - {k.value for k in OpKind})
    return {f"retries/{k}": counts.get(k, 0) for k in keys}


def should_retry(kind: str, exc: BaseException) -> bool:
    """True when ``exc`` is a transient failure and ``kind`` is safe to repeat."""
    if kind == OpKind.TRAIN_STEP or not isinstance(exc, Exception):
        return False
    if isinstance(exc, EngineError) and not isinstance(exc, TimeoutError | ServiceError):
        return False  # RunStopped, StepOutcomeUnknown, ConfigError: never retried
    return classify(exc).transient


def _wait(policy: RetryPolicy) -> Callable[[tenacity.RetryCallState], float]:
    backoff = tenacity.wait_exponential_jitter(
        multiplier=policy.initial_wait, max=policy.max_wait, jitter=policy.jitter
    )

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        hint = retry_after(exc) if exc is not None else None
        if hint is not None:
            return min(hint, policy.max_retry_after)
        return float(backoff(state))

    return wait


def retrying(
    kind: OpKind | str,
    policy: RetryPolicy,
    counter: RetryCounter,
    log: _Log | None = None,
    *,
    op: str | None = None,
) -> tenacity.AsyncRetrying:
    """A tenacity ``AsyncRetrying`` for ``kind``: retries transient failures only, waits
    with jittered exponential backoff or the server's Retry-After, stops at
    ``max_attempts``/``max_elapsed``, logs and counts every retry, re-raises the last
    error. Uses ``anyio.sleep`` so it runs under any anyio backend.

    Prefer :func:`call_with_retry`, which adds the per-attempt deadline, the breaker and
    a clear final error; use this for ``async for attempt in retrying(...)`` loops."""
    logger = log if log is not None else structlog.get_logger("engine.session.retry")
    name = op or str(kind)
    stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(policy.max_attempts)
    if policy.max_elapsed is not None:
        stop = stop | tenacity.stop_before_delay(policy.max_elapsed)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        verdict = classify(exc) if exc is not None else None
        counter.increment(str(kind))
        tally = _TALLY.get()
        if tally is not None:
            tally.count += 1
        logger.warning(
            "retry",
            kind=str(kind),
            op=name,
            attempt=state.attempt_number,
            max_attempts=policy.max_attempts,
            wait_s=round(state.next_action.sleep, 3) if state.next_action else None,
            retry_after_s=verdict.retry_after if verdict else None,
            error=verdict.message if verdict else None,
        )

    return tenacity.AsyncRetrying(
        sleep=anyio.sleep,
        stop=stop,
        wait=_wait(policy),
        retry=tenacity.retry_if_exception(lambda e: should_retry(str(kind), e)),
        before_sleep=before_sleep,
        reraise=True,
    )


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    kind: OpKind | str,
    policy: RetryPolicy,
    counter: RetryCounter,
    breaker: CircuitBreaker | None = None,
    log: _Log | None = None,
    op: str | None = None,
    liveness: ServerLiveness | None = None,
    clock: Clock = LOOP_CLOCK,
) -> T:
    """Await ``fn()`` with the retry policy of ``kind``; return its result.

    Each attempt runs under ``deadline(policy.attempt_timeout, op)`` on ``clock`` and,
    with ``liveness``, ends with ServerUnreachable once the server is gone. Each failed attempt
    is reported to ``breaker`` (which may raise CircuitOpen, stopping the retries), each
    success resets it. On failure raises :class:`~engine.errors.PermanentServiceError`
    (failed fast) or :class:`~engine.errors.RetriesExhausted`, whose message says what
    happened in one sentence and whose ``__cause__`` is the SDK's exception; RunStopped
    and other engine errors propagate unchanged. Cancellation is never retried.

    ``fn`` must be safe to call again (create a new request each time). A blocking SDK
    call (the ServiceClient constructor) goes through
    ``lambda: anyio.to_thread.run_sync(make_client, abandon_on_cancel=True)``.
    """
    name = op or str(kind)
    logger = log if log is not None else structlog.get_logger("engine.session.retry")
    attempts = 0

    async def attempt() -> T:
        nonlocal attempts
        attempts += 1
        try:
            with deadline(policy.attempt_timeout, name, clock):
                result = await (fn() if liveness is None else liveness.watch(fn))
        except ServerUnreachable:
            raise
        except Exception as exc:
            if liveness is not None and classify(exc).transient:
                verdict = await liveness.verdict_after_failure()
                if verdict is not None:
                    raise verdict from exc
            if breaker is not None:
                breaker.record_failure(str(kind), exc)
            raise
        if breaker is not None:
            breaker.record_success(str(kind))
        return result

    try:
        return await retrying(kind, policy, counter, logger, op=name)(attempt)
    except EngineError as exc:
        if not isinstance(exc, TimeoutError | ServiceError):
            raise
        failure: Exception = exc
    except Exception as exc:
        failure = exc
    verdict = classify(failure)
    fields = {"kind": str(kind), "op": name, "attempts": attempts, "error": verdict.message}
    if verdict.transient and should_retry(str(kind), failure):
        logger.error("retry.gave_up", **fields)
        raise RetriesExhausted(
            f"{name} failed after {attempts} attempt{'s' if attempts != 1 else ''}: "
            f"{verdict.message}",
            kind=str(kind),
            attempts=attempts,
            transient=True,
        ) from failure
    logger.error("retry.permanent", **fields)
    error_cls = PermanentServiceError if not verdict.transient else RetriesExhausted
    raise error_cls(
        f"{name} failed: {verdict.message}",
        kind=str(kind),
        attempts=attempts,
        transient=verdict.transient,
    ) from failure


@dataclass
class ServiceGuard:
    """The reliability layer in one object, for the service seam (``MintSession._call``).

    ``call`` retries idempotent kinds with their policy and bounds a train-step
    submission by its deadline without retrying it; ``train_step`` awaits a whole step
    under :func:`engine.supervision.recovery.run_train_step` (StepOutcomeUnknown on an unknown
    outcome); all share one counter and one breaker, and the deadlines run on ``clock``.
    Once :meth:`watch_server` is called, every call also ends with ServerUnreachable when
    the server stops accepting connections for ``unreachable_after`` seconds.
    """

    policies: Mapping[OpKind, RetryPolicy]
    breaker: CircuitBreaker
    counter: RetryCounter = field(default_factory=RetryCounter)
    log: _Log | None = None
    clock: Clock = LOOP_CLOCK
    unreachable_after: float = UNREACHABLE_AFTER_S
    liveness: ServerLiveness | None = None
    queue: QueueObserver = field(default_factory=QueueObserver)
    """The sampling queue's 408s: the SDK re-polls them, so they spend no retry."""

    def watch_server(self, base_url: str) -> None:
        """Probe ``base_url`` while calls wait on it (see :mod:`engine.session.liveness`)."""
        self.liveness = ServerLiveness(
            base_url, unreachable_after=self.unreachable_after, clock=self.clock
        )

    async def _watched(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await (fn() if self.liveness is None else self.liveness.watch(fn))

    async def once(self, op: str, fn: Callable[[], Awaitable[T]], *, within: float | None) -> T:
        """One attempt of ``fn``, no retry: bounded by ``within`` and by the server's
        liveness (a stop checkpoint: the server may be why the run stops)."""
        with deadline(within, op, self.clock):
            return await self._watched(fn)

    def policy(self, kind: OpKind | str) -> RetryPolicy:
        try:
            return self.policies[OpKind(kind)]
        except (KeyError, ValueError):
            raise ValueError(f"no retry policy for operation kind {kind!r}") from None

    async def call(self, kind: OpKind | str, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One SDK operation of ``kind``; see :func:`call_with_retry`."""
        policy = self.policy(kind)
        if kind == OpKind.TRAIN_STEP:
            with deadline(policy.attempt_timeout, op, self.clock):
                return await self._watched(fn)  # a submission: never repeated here
        return await call_with_retry(
            fn,
            kind=kind,
            policy=policy,
            counter=self.counter,
            breaker=self.breaker,
            log=self.log,
            op=op,
            liveness=self.liveness,
            clock=self.clock,
        )

    async def train_step(
        self, step: int, fn: Callable[[], Awaitable[T]], *, completes: bool = True
    ) -> T:
        """Await train step ``step`` (1-based) exactly once; see
        :func:`engine.supervision.recovery.run_train_step`. An unknown outcome counts as one
        ``retries/train_step`` (the step will be redone after a restore).

        ``completes=False`` is for one PART of a step (a submission): its failure counts
        in the breaker like a failed step, but its success does not reset the breaker --
        only a whole step does, so a step that always fails after its submissions
        succeed still trips the breaker instead of being restored forever."""
        try:
            return await run_train_step(
                lambda: self._watched(fn),
                step=step,
                deadline_s=self.policy(OpKind.TRAIN_STEP).attempt_timeout,
                breaker=self.breaker if completes else None,
                log=self.log,
                clock=self.clock,
            )
        except (StepOutcomeUnknown, PermanentServiceError) as exc:
            if not completes:
                self.breaker.record_failure(OpKind.TRAIN_STEP, exc.__cause__ or exc)
            if isinstance(exc, StepOutcomeUnknown):
                self.counter.increment(OpKind.TRAIN_STEP)
            raise


def service_guard(
    config: EngineConfig, *, log: Any = None, clock: Clock = LOOP_CLOCK
) -> ServiceGuard:
    """The retries, deadlines and breaker of every service call of a run with
    ``config`` (``--retry-attempts``, ``--retry-backoff``, ``--request-timeout``,
    ``--max-consecutive-failures``, ``--unreachable-timeout``), timed by ``clock``."""
    return ServiceGuard(
        policies=retry_policies(
            attempts=config.session.retry_attempts,
            backoff=config.session.retry_backoff,
            request_timeout=config.session.request_timeout,
        ),
        breaker=CircuitBreaker(config.session.max_consecutive_failures, log=log),
        counter=RetryCounter(),
        log=log,
        clock=clock,
        unreachable_after=config.session.unreachable_timeout,
    )
