"""Choosing the SDK adapter, what each adapter relies on in its SDK, and the engine
without any SDK installed. The end-to-end runs on both generations are
tests/test_sdk_matrix.py."""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path

import anyio
import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.internal_client_holder import InternalClientHolder

from engine.common import sdks
from engine.config import EngineConfig, check_installed
from engine.engine import prepare_run
from engine.errors import ConfigError, classify, retry_after
from engine.local import LocalServer
from engine.session.mint import (
    LOOPBACK_IDLE_CONNECTIONS,
    MintSession,
    loopback_http_client,
    reserve_sampler_snapshot,
)
from engine.session.opening import adapter_class, open_session
from engine.session.retry import service_guard
from engine.session.sdk_calls import settled
from tests.hosted_env import run_without
from tests.test_install import clean_env, one_error_line


def installed(monkeypatch: pytest.MonkeyPatch, tinker_version: str | None, mint: bool) -> None:
    monkeypatch.setattr(sdks, "installed_tinker_version", lambda: tinker_version)
    specs = {"tinker": tinker_version is not None, "mint": mint}
    monkeypatch.setattr(sdks.importlib.util, "find_spec", lambda name: specs.get(name) or None)


@pytest.mark.parametrize(
    ("tinker_version", "mint", "auto"),
    [("0.22.0", True, "mint"), ("0.38.0", False, "tinker"), ("0.39.1", False, "tinker")],
)
def test_auto_picks_the_installed_generation(
    monkeypatch: pytest.MonkeyPatch, tinker_version: str, mint: bool, auto: str
) -> None:
    installed(monkeypatch, tinker_version, mint)
    assert sdks.choose_sdk("auto") == auto
    assert sdks.choose_sdk(auto) == auto


def test_a_generation_that_is_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, "0.22.0", True)
    with pytest.raises(ConfigError) as info:
        sdks.choose_sdk("tinker")
    assert str(info.value) == (
        "--sdk tinker is not installed (this environment has tinker 0.22.0; the two SDK "
        "generations cannot share an environment): pip install 'engine[tinker]' (tinker >= 0.38)"
    )
    installed(monkeypatch, "0.22.0", False)  # tinker 0.22 without mindlab-toolkit
    with pytest.raises(ConfigError, match="no SDK is installed: pip install 'engine\\[mint\\]'"):
        sdks.choose_sdk("auto")


def test_a_tinker_only_loss_is_refused_with_the_mint_sdk() -> None:
    config = EngineConfig(loss="gspo")  # a value: what is installed is the run's check
    for check in (check_installed, lambda c: prepare_run(c, None)):
        with pytest.raises(ConfigError) as info:
            check(config)
        assert str(info.value) == (
            "--loss gspo needs the tinker SDK (>= 0.38) and this environment has mint (tinker "
            "0.22): pip install 'engine[tinker]' in an environment of its own"
        )


def test_this_environment_runs_the_mint_adapter() -> None:
    assert sdks.choose_sdk("auto") == "mint"
    assert adapter_class("mint").sdk == "mint"


def test_the_mint_adapters_private_sdk_calls_still_exist() -> None:
    """tinker 0.22 has no public way to reserve a sampler snapshot's place in the
    model's sequence, nor to stop a ServiceClient's heartbeat: the mint adapter uses
    ``TrainingClient._save_weights_for_sampler_impl(name, ttl_seconds)`` and
    ``ServiceClient.holder.close()``. An SDK that changes them fails here."""
    impl = inspect.signature(tinker.TrainingClient._save_weights_for_sampler_impl)
    assert list(impl.parameters) == ["self", "name", "ttl_seconds"]
    assert "self.holder = InternalClientHolder(" in inspect.getsource(tinker.ServiceClient.__init__)
    assert list(inspect.signature(InternalClientHolder.close).parameters) == ["self"]


def test_delivered_returns_once_the_server_has_answered_every_call_submitted_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's three calls, submitted back to back, reach the server a round trip apart
    (the SDK posts each once the one before it is answered); ``delivered`` waits for the
    last, here the snapshot, whose answer the server holds back for a second."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    key = "tml-delivered"
    with LocalServer(api_key=key, faults="slow_s=1,slow@save_weights_for_sampler:at=1") as server:

        async def check() -> None:
            config = EngineConfig(base_url=server.base_url, api_key=key, lora_rank=8)
            async with open_session(config, guard=service_guard(config)) as session:
                training = session._training
                datum = types.Datum(
                    model_input=types.ModelInput.from_ints([1, 40, 41]),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData(
                            data=[40, 41, 42], dtype="int64", shape=[3]
                        ),
                        "weights": types.TensorData(
                            data=[0.0, 1.0, 1.0], dtype="float32", shape=[3]
                        ),
                    },
                )
                submitted = time.monotonic()
                results = [
                    await training.forward_backward_async([datum], "cross_entropy"),
                    await training.optim_step_async(types.AdamParams(learning_rate=1e-3)),
                    reserve_sampler_snapshot(training, "delivered"),
                ]
                await session.delivered(1)
                assert time.monotonic() - submitted >= 1.0
                faults = server.stats.faults_injected
                assert faults == {"slow": 1, "slow@save_weights_for_sampler": 1}
                for result in results:
                    await settled(result)
                await session.delivered(1)  # nothing pending: at once

        anyio.run(check)


def connections_to(port: int) -> set[int]:
    """The local ports of this process's ESTABLISHED TCP connections to ``port``."""
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


def test_against_a_server_on_this_machine_the_mint_sdk_reuses_connections_and_sees_redirects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 samples at once open up to 32 connections; on loopback the session keeps them
    open for the next bursts (httpx kept 4 and opened the rest anew every time, so even
    the 4 it kept were new ones after each burst: CPU on both sides). A later burst may
    still open a few more, when more of its requests are in flight at once. The
    transport follows no redirects itself, so the archive URL request still sees its
    302 (the SDK's telemetry is off here)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    assert loopback_http_client("https://mint.example.com") is None
    key = "tml-idle-connections"
    with LocalServer(api_key=key) as server:
        service = MintSession._sdk_service(server.base_url, key)
        try:
            training = service.create_lora_training_client(base_model=server.model_name, rank=8)
            sampler = training.save_weights_and_get_sampling_client()
            prompt = types.ModelInput.from_ints([1, 40, 41, 42])
            params = types.SamplingParams(max_tokens=4)

            async def burst() -> None:
                await asyncio.gather(*(sampler.sample_async(prompt, 2, params) for _ in range(32)))

            port = httpx.URL(server.base_url).port
            assert port is not None
            service.holder.run_coroutine_threadsafe(burst()).result()
            kept = connections_to(port)
            assert 1 < len(kept) <= LOOPBACK_IDLE_CONNECTIONS + 1
            for _ in range(2):
                service.holder.run_coroutine_threadsafe(burst()).result()
                assert kept <= connections_to(port)  # still open: the later bursts used them
            state = training.save_state("archived").result().path
            rest = service.create_rest_client()
            url = rest.get_checkpoint_archive_url_from_tinker_path(state).result().url
            assert "/archives/" in url
        finally:
            service.holder.close()


def test_httpx_status_errors_are_classified_like_the_sdks() -> None:
    request = httpx.Request("POST", "http://127.0.0.1:1/api/v1/client/config")
    busy = httpx.Response(503, json={"detail": "warming up"}, headers={"Retry-After": "2"})
    busy.request = request
    error = httpx.HTTPStatusError("HTTP 503", request=request, response=busy)
    verdict = classify(error)
    assert verdict.transient and verdict.retry_after == 2.0
    assert verdict.message == "the server answered 503 for /api/v1/client/config: warming up"
    assert retry_after(error) == 2.0
    unpaid = httpx.Response(402, json={"detail": "set up billing"}, request=request)
    verdict = classify(httpx.HTTPStatusError("402", request=request, response=unpaid))
    assert not verdict.transient
    assert verdict.message == "the account cannot be billed (402 Payment Required): set up billing"


def test_without_an_sdk_the_engine_imports_and_a_run_says_what_to_install(
    tmp_path: Path,
) -> None:
    hidden = ["mint", "tinker"]
    done = run_without(hidden, "engine.run", ["--help"], env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    env = clean_env(MINT_API_KEY="sk-never-used", MINT_BASE_URL="http://127.0.0.1:9")
    line = one_error_line(
        run_without(hidden, "engine.run", ["--run-dir", str(tmp_path / "r")], env=env)
    )
    assert line == (
        "Error: no SDK is installed: pip install 'engine[mint]' (MinT: mindlab-toolkit on "
        "tinker 0.22) or pip install 'engine[tinker]' (tinker >= 0.38)"
    )
    assert not (tmp_path / "r").exists()
