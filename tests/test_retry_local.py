"""The reliability layer against the real local server, real SDK and injected faults.

Each test starts its own server (about 0.3 s) with the faults it needs and drives the
unmodified ``mint`` SDK through :class:`engine.session.retry.ServiceGuard` -- the object the
service seam uses -- with tiny backoffs so nothing waits for long.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import mint
import pytest
import tinker
from structlog.testing import capture_logs
from tinker import types

from engine.common.clock import LOOP_CLOCK, Clock
from engine.errors import CircuitOpen, PermanentServiceError, StepOutcomeUnknown
from engine.local import LocalServer
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.session.breaker import CircuitBreaker
from engine.session.retry import SDK_MAX_RETRIES, OpKind, RetryPolicy, ServiceGuard
from engine.session.sdk_calls import sdk_sampling_retry_config
from engine.supervision.recovery import plan_recovery
from tests.clock import ManualClock, expire_deadlines

pytestmark = pytest.mark.anyio

KEY = "tml-local-test-key-0123456789"


def guard(
    attempt_timeout: float = 60.0, breaker: int = 5, clock: Clock = LOOP_CLOCK
) -> ServiceGuard:
    policy = RetryPolicy(
        max_attempts=4,
        initial_wait=0.01,
        max_wait=0.05,
        jitter=0.01,
        attempt_timeout=attempt_timeout,
    )
    policies = {kind: policy for kind in OpKind}
    policies[OpKind.TRAIN_STEP] = policy.scaled(max_attempts=1)
    return ServiceGuard(policies=policies, breaker=CircuitBreaker(breaker), clock=clock)


def client_factory(base_url: str, api_key: str) -> Callable[[], Awaitable[tinker.ServiceClient]]:
    """The engine's way to open a session: the blocking constructor in a worker thread
    (to be run under the SESSION policy)."""

    def make() -> tinker.ServiceClient:
        return mint.ServiceClient(api_key=api_key, base_url=base_url, max_retries=SDK_MAX_RETRIES)

    return lambda: anyio.to_thread.run_sync(make, abandon_on_cancel=True)


@asynccontextmanager
async def session(server: LocalServer, g: ServiceGuard) -> AsyncIterator[tinker.ServiceClient]:
    service = await g.call(OpKind.SESSION, "connect", client_factory(server.base_url, KEY))
    try:
        yield service
    finally:
        service.holder.close()  # stop the SDK's heartbeat before the server goes


def datum() -> types.Datum:
    tokens = [5, 6, 7, 8, 9]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[4]),
            "weights": types.TensorData(data=[1.0] * 4, dtype="float32", shape=[4]),
        },
    )


def train_step(training: tinker.TrainingClient) -> Callable[[], Awaitable[float]]:
    """forward_backward + optim_step submitted back to back, then both awaited."""

    async def step() -> float:
        fwd = await training.forward_backward_async([datum()], "cross_entropy")
        opt = await training.optim_step_async(types.AdamParams(learning_rate=1e-3))
        result = await fwd
        await opt
        return float(result.metrics["loss:sum"])

    return step


async def test_429_with_retry_after_is_honoured_and_counted() -> None:
    # Four 429s on create_session: the SDK's HTTP layer (SDK_MAX_RETRIES=3) absorbs
    # three, the engine's SESSION policy takes the fourth and waits the Retry-After.
    faults = "retry_after_s=0.05,429@create_session:at=1+2+3+4"
    g = guard()
    with LocalServer(faults=faults) as server, capture_logs() as logs:
        async with session(server, g):
            pass
        stats = server.stats
    retries = [e for e in logs if e["event"] == "retry"]
    assert len(retries) == 1
    assert retries[0]["retry_after_s"] == 0.05
    assert retries[0]["wait_s"] == 0.05
    assert "429" in retries[0]["error"]
    assert g.counter.totals()["retries/session"] == 1
    assert stats.faults_injected["429@create_session"] == 4
    assert stats.requests["create_session"] == 5


async def test_a_rejected_key_fails_fast_with_one_clear_line() -> None:
    g = guard()
    calls = 0
    with LocalServer(api_key=KEY) as server:
        base_url = server.base_url
        make = client_factory(base_url, "tml-wrong-key-9876543210")

        async def counted() -> tinker.ServiceClient:
            nonlocal calls
            calls += 1
            return await make()

        with pytest.raises(PermanentServiceError) as info:
            await g.call(OpKind.SESSION, "connect", counted)
    assert calls == 1
    assert str(info.value) == (
        f"connect failed: the MinT server at {base_url} rejected the API key "
        "(401 Unauthorized); check MINT_API_KEY"
    )
    assert "tml-wrong-key-9876543210" not in str(info.value)
    assert g.counter.totals()["retries/session"] == 0


async def test_a_failed_sample_is_sampled_again() -> None:
    # A future failing with category "server": the SDK's sampling retry loop does not
    # retry RequestFailedError; the engine's SAMPLE policy does.
    g = guard()
    with LocalServer(faults="fail@asample:at=1") as server:
        async with session(server, g) as service:
            sampler = await g.call(
                OpKind.SESSION,
                "create_sampling_client",
                lambda: service.create_sampling_client_async(
                    base_model=server.model_name,
                    retry_config=sdk_sampling_retry_config(g.policy(OpKind.SAMPLE)),
                ),
            )
            prompt = types.ModelInput.from_ints([5, 6, 7])
            params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
            response = await g.call(
                OpKind.SAMPLE,
                "sample",
                lambda: sampler.sample_async(prompt=prompt, num_samples=2, sampling_params=params),
            )
        stats = server.stats
    assert len(response.sequences) == 2
    assert g.counter.totals()["retries/sample"] == 1
    assert stats.faults_injected["fail@asample"] == 1


async def test_a_failed_save_state_is_saved_again() -> None:
    g = guard()
    with LocalServer(faults="fail@save_weights:at=1") as server:
        async with session(server, g) as service:
            training = await g.call(
                OpKind.SESSION,
                "create_training_client",
                lambda: service.create_lora_training_client_async(
                    base_model=server.model_name, rank=4
                ),
            )

            async def save() -> str:
                return str((await (await training.save_state_async("ckpt"))).path)

            path = await g.call(OpKind.SAVE_STATE, "save_state", save)
        stats = server.stats
    assert path.startswith("tinker://")
    assert g.counter.totals()["retries/save_state"] == 1
    assert stats.faults_injected["fail@save_weights"] == 1


async def test_a_500_storm_trips_the_breaker_instead_of_hanging() -> None:
    clock = ManualClock()
    g = guard(attempt_timeout=600, breaker=2, clock=clock)
    with LocalServer(faults="500@asample:1.0") as server:
        async with session(server, g) as service:
            sampler = await service.create_sampling_client_async(
                base_model=server.model_name,
                retry_config=sdk_sampling_retry_config(g.policy(OpKind.SAMPLE)),
            )
            prompt = types.ModelInput.from_ints([5, 6, 7])
            params = types.SamplingParams(max_tokens=3)
            async with anyio.create_task_group() as tg:
                tg.start_soon(expire_deadlines, clock)  # the SDK retries the 500s forever
                with pytest.raises(CircuitOpen) as info:
                    await g.call(
                        OpKind.SAMPLE,
                        "sample",
                        lambda: sampler.sample_async(
                            prompt=prompt, num_samples=1, sampling_params=params
                        ),
                    )
                tg.cancel_scope.cancel()
    assert info.value.reason == "breaker"
    assert str(info.value) == (
        "stopping the run: 2 consecutive sample failures "
        "(last: timed out after 600s waiting for sample)"
    )
    assert g.counter.totals()["retries/sample"] == 1


async def test_an_unknown_step_is_restored_and_redone_exactly_once(tmp_path: Path) -> None:
    """410 on optim_step's future: the step WAS applied on the server, but the client
    cannot know. The engine restores the last checkpoint and redoes the step, so the
    restored model carries exactly one optimizer step."""
    g = guard()
    log = CheckpointLog(tmp_path)
    with LocalServer(faults="410@optim_step:at=1") as server:
        async with session(server, g) as service:
            training = await service.create_lora_training_client_async(
                base_model=server.model_name, rank=4, seed=0
            )
            saved = await (await training.save_state_async("step-0"))
            log.append(
                CheckpointRecord(
                    step=0, state_path=saved.path, reason="periodic", loop_state={"cursor": 0}
                )
            )

            with pytest.raises(StepOutcomeUnknown):
                await g.train_step(1, train_step(training))
            first_model = training.model_id
            assert first_model is not None
            assert server.stats.optimizer_steps[first_model] == 1  # applied, result lost

            plan = plan_recovery(log.latest(), completed_steps=0)
            assert plan.state_path == saved.path
            assert plan.state_path is not None
            assert plan.loop_state == {"cursor": 0}
            restored = await service.create_training_client_from_state_with_optimizer_async(
                plan.state_path
            )
            loss = await g.train_step(1, train_step(restored))
            stats = server.stats
    assert loss > 0
    assert restored.model_id is not None
    assert stats.optimizer_steps[restored.model_id] == 1
    assert g.breaker.failures("train_step") == 0
