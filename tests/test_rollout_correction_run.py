"""``--rollout-correction``: MinT's session-level correction sent with create_model, through
the unmodified mint SDK to the local server's ``mint`` service profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.common.protocol import ROLLOUT_CORRECTIONS
from engine.errors import ConfigError, EngineError
from engine.local.compute.rollout_correction import parse
from tests.engine_support import API_KEY
from tests.test_local_server_service import serving


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_setting_needs_importance_sampling_and_no_second_correction() -> None:
    with pytest.raises(ConfigError, match="needs --loss importance_sampling"):
        EngineConfig(loss="ppo", rollout_correction="mis")
    with pytest.raises(ConfigError, match="correct a second time"):
        EngineConfig(loss="importance_sampling", rollout_correction="mis", tis_cap=2.0)
    config = EngineConfig(loss="importance_sampling", rollout_correction="mis")
    assert config.training.rollout_correction == "mis"
    assert EngineConfig().training.rollout_correction == "off"
    # what is sent is what the server's parser takes
    parse(ROLLOUT_CORRECTIONS["mis"])


def _config(base_url: str, run_dir: Path) -> EngineConfig:
    return EngineConfig(
        base_url=base_url,
        api_key=API_KEY,
        lora_rank=8,
        steps=2,
        batch=2,
        group=2,
        max_tokens=6,
        temperature=1.0,
        loss="importance_sampling",
        rollout_correction="mis",
        run_dir=run_dir,
        progress=False,
    )


@pytest.mark.anyio
async def test_a_run_creates_and_restores_its_model_with_the_correction(tmp_path: Path) -> None:
    async with serving("mint") as (server, _):
        models = server.service.core.registry.models
        async with Engine(_config(server.base_url, tmp_path / "run")) as engine:
            result = await engine.run()
            assert result.steps_completed == 2
            first = engine.session.model_id
            assert first is not None
            assert models[first].rollout_correction == parse(ROLLOUT_CORRECTIONS["mis"])
            path, _ = await engine.session.save_checkpoint("rc-test", "rc-test-sampler")
            await engine.session.restore(path)
            restored = engine.session.model_id
            assert restored not in (None, first)
            assert models[restored].rollout_correction == parse(ROLLOUT_CORRECTIONS["mis"])


@pytest.mark.anyio
async def test_a_service_without_it_refuses_before_sampling(tmp_path: Path) -> None:
    async with serving("tinker") as (server, _):
        with pytest.raises(EngineError) as refused:
            async with Engine(_config(server.base_url, tmp_path / "run")) as engine:
                await engine.run()
        message = str(refused.value)
        assert "\n" not in message
        assert "rollout_correction_config" in message and "--rollout-correction mis" in message
        assert server.stats.sample_requests == 0
