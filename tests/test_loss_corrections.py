"""Off-policy corrections as settings (``--tis-cap``, ``--mask-low``/``--mask-high``,
``--loss-temperature``): what each forward_backward sends (fake session), the invalid
combinations refused in one line, a server that is not the engine's local server refused
before anything is sampled, and a run with the corrections training on the real local
server (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_session import FakeSession
from test_engine_fake_session import fake_config, run
from test_pipeline_stages import ToyTask
from test_profile import hosted_like_server

from engine import EngineConfig
from engine.basemodels.recommended import model_entry
from engine.config import HOSTED_PROFILE, server_profile, with_stored_settings
from engine.errors import ConfigError
from engine.local import LocalServer
from engine.objectives import checked_objective
from engine.run import main
from engine.session.api import LossSpec
from engine.session.preflight import local_server_profile
from tests.engine_support import API_KEY, run_engine, small_config

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("settings", "sent"),
    [
        (
            {"loss": "importance_sampling", "tis_cap": 2.0, "loss_temperature": "sampling"},
            {"tis_cap": 2.0, "temperature": 0.7},
        ),
        (
            {"loss": "ppo", "mask_low": 0.5, "mask_high": 2.0, "loss_temperature": "off"},
            {
                "clip_low_threshold": 0.8,
                "clip_high_threshold": 1.2,
                "mask_low": 0.5,
                "mask_high": 2.0,
            },
        ),
        (
            {"loss": "ppo", "loss_temperature": "sampling"},
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "temperature": 0.7},
        ),
        (
            {"loss": "importance_sampling", "mask_high": 3.0},
            {"mask_low": 0.0, "mask_high": 3.0, "temperature": 0.7},
        ),
        ({"loss": "dro", "loss_temperature": "sampling"}, {"beta": 0.05, "temperature": 0.7}),
        ({"loss": "importance_sampling", "loss_temperature": "off"}, None),
        # unset: the local server's recommendation
        ({"loss": "importance_sampling"}, {"temperature": 0.7}),
    ],
)
async def test_every_forward_backward_sends_the_corrections(
    tmp_path: Path, settings: dict[str, Any], sent: dict[str, float] | None
) -> None:
    session = FakeSession()
    cfg = fake_config(tmp_path / "run", temperature=0.7, **settings)
    steps = await run(cfg, ToyTask(), session)
    assert len(steps) == 4
    assert session.losses == [LossSpec(settings["loss"], sent)] * len(session.losses)
    assert len(session.losses) >= 4


async def test_the_summary_names_the_loss_with_its_corrections(tmp_path: Path) -> None:
    settings = {
        "loss": "importance_sampling",
        "tis_cap": 2.0,
        "mask_low": 0.5,
        "mask_high": 2.0,
        "loss_temperature": "sampling",
    }
    for name, extra in (("corrected", settings), ("plain", {"loss_temperature": "off"})):
        await run(fake_config(tmp_path / name, temperature=0.7, **extra), ToyTask(), FakeSession())
    corrected = (tmp_path / "corrected" / "summary.md").read_text()
    plain = (tmp_path / "plain" / "summary.md").read_text()
    assert (
        "loss: importance_sampling (scored at temperature 0.7, TIS cap 2, mask [0.5, 2]);"
        in corrected
    )
    assert "loss: ppo;" in plain


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss": "ppo", "tis_cap": 2.0}, "--tis-cap is for --loss importance_sampling, not ppo"),
        ({"loss": "cispo", "mask_high": 2.0}, "--mask-low/--mask-high are for --loss"),
        ({"loss": "ppo", "mask_low": 0.5}, "--mask-low needs --mask-high"),
        ({"loss": "ppo", "mask_low": 2.0, "mask_high": 0.5}, r"--mask-low \(2.0\) must be below"),
        ({"loss": "ppo", "mask_low": 1.0, "mask_high": 1.0}, "must be below"),
        (
            {"objective": "sft", "loss": "importance_sampling", "tis_cap": 2.0},
            "apply to the RL losses; --objective sft",
        ),
    ],
)
def test_invalid_combinations_are_refused_in_one_line(
    settings: dict[str, Any], message: str
) -> None:
    """The loss's own rules on construction, the objective's before a run."""
    with pytest.raises(ConfigError, match=message) as caught:
        checked_objective(EngineConfig(**settings))
    assert "\n" not in str(caught.value)


def test_the_local_server_recommends_the_loss_temperature_and_hosted_mint_off(
    tmp_path: Path,
) -> None:
    local = local_server_profile(None)
    assert local.loss_temperature == "sampling"
    assert HOSTED_PROFILE.loss_temperature == "off"
    hosted = EngineConfig(api_key="sk-k").resolved(server_profile({"supported_models": []}))
    assert hosted.training.loss_temperature == "off"
    assert hosted.training.loss_fn_config(0.8) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert EngineConfig(local=True).resolved(local).training.loss_fn_config(0.8) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
        "temperature": 0.8,
    }
    # a server that reports untempered sampling logprobs recommends off
    untempered = model_entry(None, tempered_logprobs=False)
    assert server_profile({"supported_models": [untempered]}).loss_temperature == "off"
    # sft sends no loss config, whatever the recommendation
    assert EngineConfig(objective="sft").resolved(local).training.loss_temperature == "sampling"
    # a run dir recorded before the setting existed resumes at the model's logits
    stored = {"training": {"loss": "ppo", "learning_rate": 1e-3}}
    resumed = with_stored_settings(EngineConfig(local=True), stored, "config.json")
    assert resumed.resolved(local).training.loss_temperature == "off"


@pytest.mark.parametrize("setting", ["--tis-cap=-1", "--mask-high=nan"])
def test_a_bad_value_is_exit_2(setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--loss", "importance_sampling", setting]) == 2
    assert "must be a number >= 0" in capsys.readouterr().err


def test_a_server_that_is_not_the_engines_local_server_is_refused_before_sampling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with hosted_like_server(200) as url:
        monkeypatch.setenv("MINT_BASE_URL", url)
        monkeypatch.setenv("MINT_API_KEY", "sk-key")
        code = main(
            ["--loss-temperature", "sampling", "--lr", "1e-4", "--run-dir", str(tmp_path / "r")]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert "--loss-temperature sampling: loss options of the engine's local server" in err
    assert url in err


@pytest.mark.slow
def test_a_run_with_the_corrections_trains_on_the_local_server(tmp_path: Path) -> None:
    """TIS, MIS and the loss temperature over the wire of a separately started local
    server: the run trains, its trainer scores the sampled tokens at the sampling
    temperature (at K=0 the sampler-trainer gap is float noise), and without the loss
    temperature the same run's gap is that of the untempered model (issue 34: 0.27)."""
    corrected: dict[str, Any] = {
        "loss": "importance_sampling",
        "tis_cap": 2.0,
        "mask_low": 0.5,
        "mask_high": 2.0,
        "loss_temperature": "sampling",
    }
    gaps: dict[str, list[float]] = {}
    with LocalServer(api_key=API_KEY) as server:
        runs: dict[str, dict[str, Any]] = {
            "corrected": corrected,
            "plain": {"loss": "ppo", "loss_temperature": "off"},
        }
        for name, settings in runs.items():
            config = small_config(
                server,
                tmp_path / name,
                temperature=0.8,
                max_steps_off_policy=0,
                seed=3,
                **settings,
            )
            steps, result = run_engine(config)
            assert result.steps_completed == 3
            assert result.final_path is not None
            gaps[name] = [s.metrics["optim/kl_sample_train_v2"] for s in steps]
            stored = json.loads((tmp_path / name / "config.json").read_text())["training"]
            assert {k: stored[k] for k in settings} == settings
    assert max(gaps["corrected"]) < 1e-4, gaps
    assert min(gaps["plain"]) > 1e-3, gaps
