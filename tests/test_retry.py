"""The retry layer and error classification, with real tinker exception objects."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import tinker
from structlog.testing import capture_logs

from engine.common.clock import LOOP_CLOCK, Clock
from engine.config import EngineConfig
from engine.errors import (
    CircuitOpen,
    Classified,
    ConfigError,
    Interrupted,
    OpTimeout,
    PermanentServiceError,
    RetriesExhausted,
    RunStopped,
    Stalled,
    StepOutcomeUnknown,
    classify,
    exit_code,
    find_error,
    format_error,
    retry_after,
)
from engine.redact import clear_registered_secrets, register_secret
from engine.session.breaker import CircuitBreaker
from engine.session.retry import (
    OpKind,
    RetryCounter,
    RetryPolicy,
    ServiceGuard,
    call_with_retry,
    retry_policies,
    retrying,
    should_retry,
)
from engine.session.sdk_calls import sdk_sampling_retry_config
from tests import sdk_errors as sdk
from tests.clock import ManualClock, expire_deadlines

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(
    max_attempts=4, initial_wait=0.001, max_wait=0.002, jitter=0.001, attempt_timeout=5.0
)


def flaky(
    errors: list[BaseException], result: Any = "ok"
) -> tuple[Callable[[], Awaitable[Any]], list[int]]:
    """An async fn raising ``errors`` in turn, then returning ``result``; counts calls."""
    calls = [0]

    async def fn() -> Any:
        calls[0] += 1
        if calls[0] <= len(errors):
            raise errors[calls[0] - 1]
        return result

    return fn, calls


# --------------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("code", "transient"),
    [
        (400, False),
        (401, False),
        (403, False),
        (404, False),
        (422, False),
        (408, True),
        (409, True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (501, False),
    ],
)
def test_status_codes_are_classified(code: int, transient: bool) -> None:
    verdict = classify(sdk.status_error(code))
    assert verdict.transient is transient
    assert "\n" not in verdict.message
    assert verdict.message


def test_401_says_the_key_was_rejected_and_where() -> None:
    verdict = classify(sdk.status_error(401, {"detail": "invalid api key"}))
    assert verdict.message == (
        f"the MinT server at {sdk.BASE} rejected the API key (401 Unauthorized); check MINT_API_KEY"
    )


def test_bad_request_shows_the_server_detail() -> None:
    err = sdk.status_error(422, {"detail": "unknown base_model 'Qwen/Nope'"})
    assert classify(err).message == (
        "the server rejected the request to /api/v1/create_model (422): "
        "unknown base_model 'Qwen/Nope'"
    )


def test_an_html_error_page_is_a_short_tag_free_excerpt() -> None:
    page = (
        "<!DOCTYPE html>\n<html><head><title>502</title><script>var x = 1;</script></head>\n"
        "<body><h1>Bad Gateway</h1>\n<p>"
        + "the upstream is down &amp; out " * 100
        + "</p></body></html>"
    )
    verdict = classify(sdk.status_error(502, page))
    assert verdict.transient
    assert verdict.message.startswith(
        "the server answered 502 for /api/v1/create_model: Bad Gateway the upstream is down & out"
    )
    assert "<" not in verdict.message and "var x" not in verdict.message
    assert len(verdict.message.split(": ", 1)[1]) <= 200


def test_501_says_the_server_does_not_implement_the_call() -> None:
    verdict = classify(sdk.status_error(501, "<html><body>Not Implemented</body></html>"))
    assert verdict == Classified(
        False,
        f"the server at {sdk.BASE} does not implement /api/v1/create_model "
        "(501 Not Implemented): Not Implemented",
    )


def test_retry_after_seconds_ms_and_date() -> None:
    assert retry_after(sdk.status_error(429, headers={"Retry-After": "2.5"})) == 2.5
    assert retry_after(sdk.status_error(503, headers={"Retry-After-Ms": "250"})) == 0.25
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    hint = retry_after(sdk.status_error(429, headers={"Retry-After": future}))
    assert hint is not None and 25 <= hint <= 31
    assert retry_after(sdk.status_error(429)) is None
    assert retry_after(sdk.status_error(429, headers={"Retry-After": "soon"})) is None
    assert classify(sdk.status_error(429, headers={"Retry-After": "3"})).retry_after == 3.0


def test_connection_refused_names_the_server() -> None:
    verdict = classify(sdk.connection_refused())
    assert verdict.transient
    assert verdict.message == f"cannot reach the MinT server at {sdk.BASE}: connection refused"


def test_timeout_is_transient() -> None:
    verdict = classify(sdk.timeout_error())
    assert verdict.transient
    assert verdict.message == f"the MinT server at {sdk.BASE} did not answer in time"


@pytest.mark.parametrize(
    ("category", "transient"), [("user", False), ("server", True), ("unknown", True)]
)
def test_request_failed_by_category(category: str, transient: bool) -> None:
    verdict = classify(sdk.request_failed("loss_fn 'nope' is not supported", category))
    assert verdict.transient is transient
    assert "loss_fn 'nope' is not supported" in verdict.message
    assert "request_id" not in verdict.message  # the SDK's suffix is cut


def test_expired_future_is_transient() -> None:
    verdict = classify(sdk.expired_future())
    assert verdict.transient
    assert "expired" in verdict.message


def test_fatal_future_error_is_classified_by_its_http_cause() -> None:
    # The SDK turns a 401 on retrieve_future into a bare ValueError: the cause decides.
    verdict = classify(sdk.future_fatal(401))
    assert not verdict.transient
    assert "rejected the API key" in verdict.message


def test_bad_key_prefix_is_permanent() -> None:
    verdict = classify(tinker.TinkerError("The api_key must start with the 'tml-' prefix"))
    assert not verdict.transient
    assert verdict.message.startswith("the API key is not usable")


def test_unknown_exceptions_fail_fast_with_their_text() -> None:
    verdict = classify(KeyError("datum"))
    assert not verdict.transient
    assert verdict.message == "KeyError: 'datum'"
    assert classify(OpTimeout("sample", 3)).transient
    assert not classify(ConfigError("--steps must be positive")).transient


def test_should_retry_never_retries_a_train_step_or_a_stop() -> None:
    assert should_retry(OpKind.SAMPLE, sdk.status_error(503))
    assert not should_retry(OpKind.TRAIN_STEP, sdk.status_error(503))
    assert not should_retry(OpKind.SAMPLE, sdk.status_error(401))
    assert not should_retry(OpKind.SAMPLE, CircuitOpen("sample", 3, "x"))
    assert not should_retry(OpKind.SAMPLE, StepOutcomeUnknown(3, "x"))
    assert should_retry(OpKind.SAVE_STATE, OpTimeout("save_state", 1))


# --------------------------------------------------------------------- format / exit


def test_format_error_is_one_redacted_line() -> None:
    register_secret("tml-my-very-secret-key-123")
    try:
        exc = RuntimeError("boom with tml-my-very-secret-key-123\nand a second line")
        line = format_error(exc)
    finally:
        clear_registered_secrets()
    assert line == "Error: RuntimeError: boom with [REDACTED] and a second line"


def test_format_error_unwraps_task_group_errors() -> None:
    group = BaseExceptionGroup("x", [ValueError("other"), Stalled(30, "step 3 trained")])
    assert format_error(group) == (
        "Error: stopping the run: no progress for 30s (last progress: step 3 trained)"
    )
    assert isinstance(find_error(group, RunStopped), Stalled)
    assert find_error(ValueError("x"), RunStopped) is None
    assert format_error(ExceptionGroup("x", [sdk.connection_refused()])) == (
        f"Error: cannot reach the MinT server at {sdk.BASE}: connection refused"
    )


def test_exit_codes() -> None:
    assert exit_code(ConfigError("bad flag")) == 2
    assert exit_code(Interrupted("SIGTERM")) == 130
    assert exit_code(ExceptionGroup("x", [ConfigError("bad")])) == 2
    assert exit_code(RuntimeError("bug")) == 1
    assert exit_code(CircuitOpen("sample", 5, "boom")) == 1


# --------------------------------------------------------------------- call_with_retry


async def test_transient_errors_are_retried_logged_and_counted() -> None:
    counter = RetryCounter()
    fn, calls = flaky([sdk.status_error(503), sdk.connection_refused()])
    with capture_logs() as logs:
        result = await call_with_retry(fn, kind=OpKind.SAMPLE, policy=FAST, counter=counter)
    assert result == "ok"
    assert calls[0] == 3
    assert counter.total(OpKind.SAMPLE) == 2
    retries = [e for e in logs if e["event"] == "retry"]
    assert [e["attempt"] for e in retries] == [1, 2]
    assert retries[0]["kind"] == "sample"
    assert "503" in retries[0]["error"]
    assert "connection refused" in retries[1]["error"]


async def test_permanent_error_fails_fast_with_a_clear_message() -> None:
    counter = RetryCounter()
    fn, calls = flaky([sdk.status_error(401)] * 5)
    with pytest.raises(PermanentServiceError) as info:
        await call_with_retry(
            fn, kind=OpKind.SESSION, policy=FAST, counter=counter, op="create_session"
        )
    assert calls[0] == 1
    assert counter.total(OpKind.SESSION) == 0
    assert str(info.value) == (
        f"create_session failed: the MinT server at {sdk.BASE} rejected the API key "
        "(401 Unauthorized); check MINT_API_KEY"
    )
    assert isinstance(info.value.__cause__, tinker.AuthenticationError)
    assert info.value.attempts == 1 and not info.value.transient


async def test_retries_stop_at_max_attempts() -> None:
    counter = RetryCounter()
    fn, calls = flaky([sdk.request_failed("worker crashed", "server")] * 10)
    policy = FAST.scaled(max_attempts=3)
    with pytest.raises(RetriesExhausted) as info:
        await call_with_retry(fn, kind=OpKind.SAVE_STATE, policy=policy, counter=counter)
    assert calls[0] == 3
    assert counter.total(OpKind.SAVE_STATE) == 2
    assert str(info.value) == (
        "save_state failed after 3 attempts: the server failed the request (server): worker crashed"
    )


async def test_retry_after_replaces_the_backoff() -> None:
    # Backoff would wait 100 s; the server asks for 0.02 s and that is what is waited.
    policy = RetryPolicy(max_attempts=2, initial_wait=100, max_wait=100, jitter=0)
    fn, calls = flaky([sdk.status_error(429, headers={"Retry-After": "0.02"})])
    with capture_logs() as logs:
        assert (
            await call_with_retry(fn, kind=OpKind.SESSION, policy=policy, counter=RetryCounter())
            == "ok"
        )
    (event,) = [e for e in logs if e["event"] == "retry"]
    assert event["wait_s"] == 0.02
    assert event["retry_after_s"] == 0.02
    assert calls[0] == 2


async def test_retry_after_is_capped() -> None:
    policy = FAST.scaled(max_attempts=2, max_retry_after=0.01)
    fn, _ = flaky([sdk.status_error(503, headers={"Retry-After": "3600"})])
    with capture_logs() as logs:
        await call_with_retry(fn, kind=OpKind.SAMPLE, policy=policy, counter=RetryCounter())
    assert [e["wait_s"] for e in logs if e["event"] == "retry"] == [0.01]


async def test_time_budget_stops_before_a_long_wait() -> None:
    # The next wait (>= 50 s) would end past max_elapsed: give up after one attempt.
    policy = RetryPolicy(max_attempts=10, initial_wait=50, max_wait=50, jitter=0, max_elapsed=1)
    fn, calls = flaky([sdk.status_error(500)] * 10)
    with pytest.raises(RetriesExhausted):
        await call_with_retry(fn, kind=OpKind.SAMPLE, policy=policy, counter=RetryCounter())
    assert calls[0] == 1


async def test_each_attempt_has_a_deadline() -> None:
    calls = [0]

    async def stuck() -> None:
        calls[0] += 1
        await anyio.sleep_forever()

    policy = FAST.scaled(max_attempts=2, attempt_timeout=600)
    clock = ManualClock()
    async with anyio.create_task_group() as tg:
        tg.start_soon(expire_deadlines, clock)
        with pytest.raises(RetriesExhausted) as info:
            await call_with_retry(
                stuck, kind=OpKind.SAMPLE, policy=policy, counter=RetryCounter(), clock=clock
            )
        tg.cancel_scope.cancel()
    assert calls[0] == 2 and clock.now() == 1200
    assert (
        str(info.value) == "sample failed after 2 attempts: timed out after 600s waiting for sample"
    )
    assert isinstance(info.value.__cause__, OpTimeout)


async def test_train_steps_are_never_retried_here() -> None:
    fn, calls = flaky([sdk.status_error(503)] * 3)
    with pytest.raises(RetriesExhausted):
        await call_with_retry(fn, kind=OpKind.TRAIN_STEP, policy=FAST, counter=RetryCounter())
    assert calls[0] == 1


async def test_breaker_stops_retrying() -> None:
    breaker = CircuitBreaker(2)
    counter = RetryCounter()
    fn, calls = flaky([sdk.status_error(500)] * 10)
    with pytest.raises(CircuitOpen) as info:
        await call_with_retry(
            fn,
            kind=OpKind.SAMPLE,
            policy=FAST.scaled(max_attempts=10),
            counter=counter,
            breaker=breaker,
        )
    assert calls[0] == 2
    assert info.value.reason == "breaker"
    assert "2 consecutive sample failures" in str(info.value)


async def test_success_resets_the_breaker() -> None:
    breaker = CircuitBreaker(3)
    for _ in range(3):
        fn, _ = flaky([sdk.status_error(500)] * 2)
        await call_with_retry(
            fn, kind=OpKind.SAMPLE, policy=FAST, counter=RetryCounter(), breaker=breaker
        )
    assert breaker.failures(OpKind.SAMPLE) == 0


async def test_cancellation_is_not_retried() -> None:
    calls = [0]
    counter = RetryCounter()

    async def slow() -> None:
        calls[0] += 1
        await anyio.sleep_forever()

    with anyio.move_on_after(0.05) as scope:
        await call_with_retry(
            slow, kind=OpKind.SAMPLE, policy=FAST.scaled(attempt_timeout=None), counter=counter
        )
    assert scope.cancelled_caught
    assert calls[0] == 1
    assert counter.total(OpKind.SAMPLE) == 0


async def test_retrying_can_drive_an_attempt_loop() -> None:
    counter = RetryCounter()
    attempts = 0
    async for attempt in retrying(OpKind.SAMPLER_SNAPSHOT, FAST, counter):
        with attempt:
            attempts += 1
            if attempts < 2:
                raise sdk.expired_future()
    assert attempts == 2
    assert counter.total(OpKind.SAMPLER_SNAPSHOT) == 1


def test_counter_reports_per_step_and_total() -> None:
    counter = RetryCounter()
    counter.increment(OpKind.SAMPLE)
    counter.increment(OpKind.SAMPLE)
    counter.increment(OpKind.SAVE_STATE)
    step1 = counter.take()
    assert step1["retries/sample"] == 2 and step1["retries/save_state"] == 1
    assert set(step1) == {f"retries/{k.value}" for k in OpKind}
    counter.increment(OpKind.SAMPLE)
    assert counter.take()["retries/sample"] == 1
    assert counter.totals()["retries/sample"] == 3


def test_policies_validate_and_bound_the_sdk() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="attempt_timeout"):
        RetryPolicy(attempt_timeout=0)
    defaults = EngineConfig()
    policies = retry_policies(
        attempts=defaults.session.retry_attempts,
        backoff=defaults.session.retry_backoff,
        request_timeout=defaults.session.request_timeout,
    )
    assert set(policies) == set(OpKind)
    assert policies[OpKind.SAMPLE].max_attempts == defaults.session.retry_attempts
    assert policies[OpKind.TRAIN_STEP].max_attempts == 1
    config = sdk_sampling_retry_config(policies[OpKind.SAMPLE])
    assert config.progress_timeout == policies[OpKind.SAMPLE].attempt_timeout
    assert config.progress_timeout < 7200  # the SDK default: 2 h without progress


# --------------------------------------------------------------------- ServiceGuard


def fast_guard(clock: Clock = LOOP_CLOCK, **changes: Any) -> ServiceGuard:
    policies = {kind: FAST.scaled(**changes) for kind in OpKind}
    policies[OpKind.TRAIN_STEP] = FAST.scaled(max_attempts=1, **changes)
    return ServiceGuard(policies=policies, breaker=CircuitBreaker(3), clock=clock)


async def test_guard_retries_idempotent_kinds_and_shares_the_counter() -> None:
    guard = fast_guard()
    fn, calls = flaky([sdk.request_failed("oom", "server")])
    assert await guard.call(OpKind.SAMPLE, "sample", fn) == "ok"
    assert calls[0] == 2
    assert guard.counter.take()["retries/sample"] == 1
    assert guard.breaker.failures(OpKind.SAMPLE) == 0


async def test_guard_bounds_but_never_repeats_a_train_step() -> None:
    clock = ManualClock()
    guard = fast_guard(clock, attempt_timeout=900)
    fn, calls = flaky([sdk.status_error(503, path="forward_backward")] * 3)
    with pytest.raises(tinker.InternalServerError):
        await guard.call(OpKind.TRAIN_STEP, "forward_backward", fn)
    assert calls[0] == 1

    async def stuck() -> None:
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(expire_deadlines, clock)
        with pytest.raises(OpTimeout, match="waiting for optim_step"):
            await guard.call(OpKind.TRAIN_STEP, "optim_step", stuck)
        with pytest.raises(StepOutcomeUnknown, match="train step 5"):
            await guard.train_step(5, stuck)
        tg.cancel_scope.cancel()
    assert guard.breaker.failures("train_step") == 1
    assert guard.counter.take()["retries/train_step"] == 1  # one step to redo


def test_guard_knows_its_kinds_and_bounds_sdk_sampling() -> None:
    guard = fast_guard(attempt_timeout=42.0)
    assert sdk_sampling_retry_config(guard.policy(OpKind.SAMPLE)).progress_timeout == 42.0
    with pytest.raises(ValueError, match="no retry policy for operation kind 'nope'"):
        guard.policy("nope")
