"""Exactly-once train steps: outcome classification and the restore plan."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from engine.errors import CircuitOpen, OpTimeout, PermanentServiceError, StepOutcomeUnknown
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.session.breaker import CircuitBreaker
from engine.session.train_step import StepOutcome, run_train_step, step_outcome
from engine.supervision.recovery import plan_recovery
from tests import sdk_errors as sdk

pytestmark = pytest.mark.anyio


def test_step_outcomes() -> None:
    assert step_outcome(None) is StepOutcome.APPLIED
    for unknown in (
        sdk.timeout_error("retrieve_future"),
        sdk.connection_refused("optim_step"),
        sdk.status_error(503, path="forward_backward"),
        sdk.request_failed("worker died", "server"),
        sdk.request_failed("?", "unknown"),
        sdk.expired_future(),
        OpTimeout("train step 3", 60),
    ):
        assert step_outcome(unknown) is StepOutcome.UNKNOWN, unknown
    for rejected in (
        sdk.request_failed("target_tokens has length 5, expected 6", "user"),
        sdk.status_error(400, path="forward_backward"),
        sdk.future_fatal(404),
    ):
        assert step_outcome(rejected) is StepOutcome.REJECTED, rejected


async def test_a_step_that_returns_is_applied_and_resets_the_breaker() -> None:
    breaker = CircuitBreaker(3)
    breaker.record_failure("train_step", sdk.status_error(500))

    async def step() -> dict[str, Any]:
        return {"loss:sum": 1.0}

    assert await run_train_step(step, step=1, deadline_s=5, breaker=breaker) == {"loss:sum": 1.0}
    assert breaker.failures("train_step") == 0


async def test_an_unknown_outcome_asks_for_a_restore() -> None:
    async def step() -> None:
        raise sdk.expired_future()

    with pytest.raises(StepOutcomeUnknown) as info:
        await run_train_step(step, step=7, deadline_s=5, breaker=CircuitBreaker(3))
    assert info.value.step == 7
    assert str(info.value) == (
        "the outcome of train step 7 is unknown (the server lost the result of a request "
        "(expired future)); restoring the last checkpoint"
    )


async def test_a_stuck_step_times_out_into_an_unknown_outcome() -> None:
    async def step() -> None:
        await anyio.sleep_forever()

    with pytest.raises(
        StepOutcomeUnknown, match=r"timed out after 0\.05s waiting for train step 2"
    ):
        await run_train_step(step, step=2, deadline_s=0.05)


async def test_a_rejected_step_stops_the_run() -> None:
    async def step() -> None:
        raise sdk.request_failed("loss_fn 'nope' is not supported", "user")

    with pytest.raises(PermanentServiceError) as info:
        await run_train_step(step, step=3, deadline_s=5)
    assert str(info.value) == (
        "train step 3 failed: the server refused the request: loss_fn 'nope' is not supported"
    )


async def test_repeated_recoveries_trip_the_breaker() -> None:
    breaker = CircuitBreaker({"train_step": 2})

    async def step() -> None:
        raise sdk.status_error(500, path="optim_step")

    with pytest.raises(StepOutcomeUnknown):
        await run_train_step(step, step=4, deadline_s=5, breaker=breaker)
    with pytest.raises(CircuitOpen, match="2 consecutive train_step failures"):
        await run_train_step(step, step=4, deadline_s=5, breaker=breaker)


def test_plan_without_a_checkpoint_restarts_from_the_base_model() -> None:
    plan = plan_recovery(None, completed_steps=3)
    assert plan.state_path is None and plan.loop_state is None
    assert plan.resume_step == 0 and plan.redo_steps == 3


def test_plan_restores_the_latest_checkpoint(tmp_path: Any) -> None:
    log = CheckpointLog(tmp_path)
    log.append(CheckpointRecord(step=4, state_path="tinker://m/weights/4", reason="periodic"))
    log.append(
        CheckpointRecord(
            step=8,
            state_path="tinker://m/weights/8",
            sampler_path="tinker://m/sampler_weights/8",
            reason="periodic",
            loop_state={"cursor": 64},
        )
    )
    plan = plan_recovery(log.latest(), completed_steps=10)
    assert plan.state_path == "tinker://m/weights/8"
    assert plan.sampler_path == "tinker://m/sampler_weights/8"
    assert plan.resume_step == 8 and plan.redo_steps == 2
    assert plan.loop_state == {"cursor": 64}
    with pytest.raises(ValueError, match="does not belong to this run"):
        plan_recovery(log.latest(), completed_steps=5)
