"""Deadlines, circuit breaker, progress watchdog and signal handling."""

from __future__ import annotations

import os
import signal

import anyio
import anyio.lowlevel
import pytest

from engine.errors import CircuitOpen, Interrupted, OpTimeout, RunStopped, Stalled, find_error
from engine.session.breaker import CircuitBreaker, deadline
from engine.supervision.watchdog import LOOP_CLOCK, SignalInterrupt, Watchdog
from tests import sdk_errors as sdk
from tests.clock import ManualClock

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- deadline


async def test_deadline_names_the_operation() -> None:
    clock = ManualClock()

    async def expire() -> None:
        await anyio.wait_all_tasks_blocked()
        assert clock.deadlines() == [30]
        clock.advance(29.9)  # not yet
        await anyio.wait_all_tasks_blocked()
        clock.advance(0.1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(expire)
        with pytest.raises(OpTimeout) as info, deadline(30, "sample", clock):
            await anyio.sleep_forever()
    assert str(info.value) == "timed out after 30s waiting for sample"
    assert info.value.op == "sample" and info.value.seconds == 30
    assert clock.deadlines() == []


async def test_the_loop_clock_deadline_expires_in_real_time() -> None:
    with pytest.raises(OpTimeout, match=r"after 0\.01s"), deadline(0.01, "sample", LOOP_CLOCK):
        await anyio.sleep_forever()


async def test_deadline_lets_fast_work_and_foreign_timeouts_through() -> None:
    with deadline(5, "sample"):
        await anyio.lowlevel.checkpoint()
    with pytest.raises(TimeoutError) as info, deadline(5, "sample"):
        raise TimeoutError("the SDK's own timeout")
    assert not isinstance(info.value, OpTimeout)
    with deadline(None, "unbounded"):
        await anyio.lowlevel.checkpoint()
    with pytest.raises(ValueError, match="must be positive"), deadline(0, "x"):
        pass


# --------------------------------------------------------------------------- breaker


def test_breaker_trips_on_the_nth_consecutive_failure() -> None:
    breaker = CircuitBreaker(3)
    err = sdk.status_error(503)
    breaker.record_failure("sample", err)
    breaker.record_failure("sample", err)
    with pytest.raises(CircuitOpen) as info:
        breaker.record_failure("sample", err)
    assert info.value.__cause__ is err
    assert info.value.reason == "breaker"
    assert info.value.kind == "sample" and info.value.failures == 3
    assert str(info.value) == (
        "stopping the run: 3 consecutive sample failures "
        "(last: the server answered 503 for /api/v1/create_model: detail for 503)"
    )


def test_breaker_resets_on_success_and_counts_kinds_apart() -> None:
    breaker = CircuitBreaker({"train_step": 1}, default=2)
    err = sdk.status_error(500)
    breaker.record_failure("sample", err)
    breaker.record_success("sample")
    breaker.record_failure("sample", err)
    breaker.record_failure("save_state", err)
    assert breaker.failures("sample") == 1 and breaker.failures("save_state") == 1
    with pytest.raises(CircuitOpen):
        breaker.record_failure("train_step", err)
    with pytest.raises(ValueError, match="must be >= 1"):
        CircuitBreaker(0)


# --------------------------------------------------------------------------- watchdog


def test_watchdog_check_follows_progress() -> None:
    clock = ManualClock()
    dog = Watchdog(10, clock=clock)
    assert dog.check() == 10
    clock.advance(8)
    assert dog.check() == 2
    dog.progress("step 1 trained")
    clock.advance(9)
    assert dog.check() == 1
    clock.advance(1)
    with pytest.raises(Stalled) as info:
        dog.check()
    assert info.value.reason == "watchdog"
    assert str(info.value) == (
        "stopping the run: no progress for 10s (last progress: step 1 trained)"
    )


async def test_watchdog_task_stops_a_stuck_run() -> None:
    clock = ManualClock()
    dog = Watchdog(600, clock=clock)

    async def stuck_engine() -> None:
        dog.progress("step 1 trained")
        await anyio.wait_all_tasks_blocked()
        clock.advance(599)
        dog.progress("step 2 trained")
        clock.advance(599)  # the watchdog wakes at 600 and sleeps again: 1 s left
        await anyio.wait_all_tasks_blocked()
        clock.advance(1)
        await anyio.sleep_forever()

    with pytest.raises(BaseExceptionGroup) as info:
        async with anyio.create_task_group() as tg:
            tg.start_soon(dog.run)
            tg.start_soon(stuck_engine)
    stop = find_error(info.value, RunStopped)
    assert isinstance(stop, Stalled)
    assert str(stop) == "stopping the run: no progress for 600s (last progress: step 2 trained)"


async def test_watchdog_task_is_cancelled_cleanly() -> None:
    dog = Watchdog(3600)
    async with anyio.create_task_group() as tg:
        tg.start_soon(dog.run)
        dog.progress("step 1 trained")
        tg.cancel_scope.cancel()
    assert tg.cancel_scope.cancelled_caught


def test_watchdog_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Watchdog(0)


# --------------------------------------------------------------------------- signals


async def test_first_signal_cancels_the_run_second_exits() -> None:
    exited = anyio.Event()
    codes: list[int] = []

    def hard_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    interrupt = SignalInterrupt(hard_exit=hard_exit)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as run_scope:
                await tg.start(interrupt.watch, run_scope)
                os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep_forever()  # the run; only the signal ends it
            assert run_scope.cancelled_caught
            assert interrupt.requested is signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)  # during the interrupt checkpoint
            await exited.wait()
            tg.cancel_scope.cancel()
    assert codes == [128 + signal.SIGINT]
    error = interrupt.error()
    assert isinstance(error, Interrupted)
    assert error.reason == "interrupt" and error.exit_code == 130
    assert str(error) == "interrupted by SIGTERM; stopping after a checkpoint"


async def test_handlers_are_removed_after_the_watch() -> None:
    before = signal.getsignal(signal.SIGINT)
    interrupt = SignalInterrupt()
    async with anyio.create_task_group() as tg:
        await tg.start(interrupt.watch, anyio.CancelScope())
        assert signal.getsignal(signal.SIGINT) is not before
        tg.cancel_scope.cancel()
    assert signal.getsignal(signal.SIGINT) is before
    assert interrupt.requested is None


async def test_interrupt_can_call_the_engine_instead_of_cancelling() -> None:
    stopped = anyio.Event()
    reported: list[Interrupted] = []

    def on_interrupt(error: Interrupted) -> None:
        reported.append(error)
        stopped.set()

    interrupt = SignalInterrupt(on_interrupt=on_interrupt)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(interrupt.watch)
            os.kill(os.getpid(), signal.SIGINT)
            await stopped.wait()
            tg.cancel_scope.cancel()
    assert [str(e) for e in reported] == ["interrupted by SIGINT; stopping after a checkpoint"]
