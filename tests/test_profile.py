"""The server decides the defaults: the local server sends its model's recommended RL
settings with its capabilities, hosted MinT sends none (the quickstart's defaults apply),
explicit settings always win, and a resumed run keeps its stored ones."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.common.protocol import RECOMMENDED_FIELD
from engine.config import HOSTED_PROFILE, EngineConfig, server_profile, with_stored_settings
from engine.local import LocalServer
from engine.run import main
from engine.session.preflight import local_server_profile, read_server_profile
from scripts.make_model import RL_DEFAULTS

KEY = "tml-profile-tests"


def test_a_server_without_recommendations_gets_the_hosted_profile() -> None:
    hosted = {
        "supported_models": [
            {"model_name": "Qwen/Qwen3-0.6B", "max_context_length": 32768},
            {"model_name": "Qwen/Qwen3-8B"},
        ]
    }
    answers: list[dict[str, Any] | None] = [hosted, {"supported_models": []}, {}, None]
    for answer in answers:
        assert server_profile(answer) == HOSTED_PROFILE
    resolved = EngineConfig(api_key="sk-k").resolved(server_profile(hosted))
    assert (
        resolved.model.base_model,
        resolved.model.lora_rank,
        resolved.training.learning_rate,
    ) == (
        "Qwen/Qwen3-0.6B",
        16,
        2e-5,
    )
    assert resolved.task.args == {"op": "*", "min_operand": "10", "max_operand": "199"}


@contextmanager
def hosted_like_server(capabilities_status: int) -> Iterator[str]:
    """A server that accepts the key at client/config and answers
    get_server_capabilities with ``capabilities_status`` and no recommendations, like
    hosted MinT (which may want the SDK's session token there)."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer(200, {"pjwt_auth_enabled": True})

        def do_GET(self) -> None:
            models = {"supported_models": [{"model_name": "Qwen/Qwen3-0.6B"}]}
            self._answer(capabilities_status, models if capabilities_status == 200 else {})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("status", [200, 401])
def test_a_hosted_like_server_over_the_wire_gets_the_hosted_profile(status: int) -> None:
    with hosted_like_server(status) as url:
        assert anyio.run(read_server_profile, url, "sk-key") == HOSTED_PROFILE


def test_recommendations_name_the_model_and_the_hosted_profile_fills_the_rest() -> None:
    answer = {
        "supported_models": [
            {"model_name": "other"},
            {
                "model_name": "served",
                RECOMMENDED_FIELD: {
                    "learning_rate": 1e-3,
                    "task_args": {"arithmetic": {"op": "+", "max_operand": 50}},
                },
            },
        ]
    }
    profile = server_profile(answer)
    assert (profile.base_model, profile.learning_rate, profile.lora_rank) == (
        "served",
        1e-3,
        HOSTED_PROFILE.lora_rank,
    )
    resolved = EngineConfig(api_key="sk-k").resolved(profile)
    assert resolved.task.args == {"op": "+", "min_operand": "10", "max_operand": "50"}
    assert resolved.unresolved == ()


@pytest.mark.parametrize(
    ("recommended", "message"),
    [
        ("fast", "are malformed"),
        ({"learning_rate": -1}, "learning_rate in the recommended settings of srv must be"),
        ({"lora_rank": "x"}, "lora_rank in the recommended settings of srv must be an integer"),
        ({"task_args": {"arithmetic": 3}}, "task_args must map task specs to arguments"),
    ],
)
def test_malformed_recommendations_are_one_clear_error(recommended: Any, message: str) -> None:
    answer = {"supported_models": [{"model_name": "m", RECOMMENDED_FIELD: recommended}]}
    with pytest.raises(ValueError, match=message):
        server_profile(answer, "srv")


def test_explicit_settings_win_and_a_resume_keeps_its_stored_ones() -> None:
    local = local_server_profile(None)
    config = EngineConfig(local=True, learning_rate=1e-3, op="-", task_args={"max_operand": "20"})
    assert config.unresolved == (
        "base_model",
        "lora_rank",
        "temperature",
        "loss_temperature",
        "min_operand",
    )
    resolved = config.resolved(local)
    assert (resolved.training.learning_rate, resolved.model.lora_rank) == (1e-3, local.lora_rank)
    assert resolved.task.args == {"op": "-", "min_operand": "10", "max_operand": "20"}
    stored = {
        "base_model": "stored/model",
        "lora_rank": 4,
        "learning_rate": 0.01,
        "task": "arithmetic",
        "task_args": {"op": "*", "min_operand": "1", "max_operand": "9"},
    }
    given = EngineConfig(local=True, lora_rank=8, op="+")
    resumed = with_stored_settings(given, stored, "config.json").resolved(local)
    assert (resumed.model.base_model, resumed.model.lora_rank, resumed.training.learning_rate) == (
        "stored/model",
        8,
        0.01,
    )
    assert resumed.task.args == {"op": "+", "min_operand": "1", "max_operand": "9"}


def test_the_packaged_model_records_what_its_server_recommends() -> None:
    local = local_server_profile(None)
    assert (local.lora_rank, local.learning_rate) == (
        RL_DEFAULTS["lora_rank"],
        RL_DEFAULTS["learning_rate"],
    )
    assert local.base_model == "engine-local/tiny-arith"
    assert local.task_args["arithmetic"] == {"op": "+", "min_operand": "10", "max_operand": "99"}


def test_a_run_against_a_separately_started_local_server_gets_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["--steps", "1", "--batch", "2", "--group", "2", "--max-tokens", "4"]
    local = local_server_profile(None)
    with LocalServer(api_key=KEY) as server:
        monkeypatch.setenv("MINT_BASE_URL", server.base_url)
        monkeypatch.setenv("MINT_API_KEY", KEY)
        model = server.model_name
        assert main([*small, "--run-dir", str(tmp_path / "a")]) == 0
        left = capsys.readouterr().out
        assert main([*small, "--run-dir", str(tmp_path / "b"), "--lr", "1e-3", "--op", "-"]) == 0
        given = capsys.readouterr().out
    # The console names what the server chose, and only what the command left to it.
    assert (
        f"Recommended by the server: --base-model {model}, --lora-rank {local.lora_rank}, "
        f"--temperature 0.8, --lr {local.learning_rate}, --loss-temperature sampling, "
        "--task-arg op=+," in left
    )
    (named,) = [line for line in given.splitlines() if line.startswith("Recommended by")]
    assert "--lr" not in named and "op=" not in named and "--lora-rank" in named
    served = json.loads((tmp_path / "a" / "config.json").read_text())
    assert served["server"] == "remote"
    model_settings = served["model"]
    assert (model_settings["base_model"], model_settings["lora_rank"]) == (model, local.lora_rank)
    assert served["training"]["learning_rate"] == local.learning_rate
    assert served["task"]["args"].items() >= local.task_args["arithmetic"].items()
    explicit = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (explicit["training"]["learning_rate"], explicit["model"]["lora_rank"]) == (
        1e-3,
        local.lora_rank,
    )
    assert explicit["task"]["args"] == {**served["task"]["args"], "op": "-"}


@pytest.mark.parametrize(
    ("service", "temperature"), [("local", 0.8), ("mint", 1.0), ("tinker", 1.0)]
)
def test_the_sampling_temperature_follows_what_the_service_scores(
    service: str, temperature: float
) -> None:
    """The local service scores the loss at the sampling temperature and recommends the
    quickstart's 0.8; a hosted profile recommends none, so a run samples at the hosted
    default, 1, where the sampler's tempered logprobs are the model's own."""
    from engine.basemodels.recommended import model_entry

    profile = server_profile({"supported_models": [model_entry(None, service=service)]}, "srv")
    assert profile.temperature == temperature
    assert HOSTED_PROFILE.temperature == 1.0
    resolved = EngineConfig(local=True).resolved(profile)
    assert resolved.sampling.temperature == temperature
    assert EngineConfig(local=True, temperature=0.6).resolved(profile).sampling.temperature == 0.6
